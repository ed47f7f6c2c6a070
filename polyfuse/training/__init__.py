"""Fine-tuning: ``PolyfuseTrainingArguments`` / ``PolyfuseTrainer`` (transformers' Trainer with registry-chosen fused
ops, fused optimizers and per-device step boundaries), with optimum-habana's argument names and meanings."""

from polyfuse.training.arguments import PolyfuseTrainingArguments
from polyfuse.training.gaudi_config import GaudiConfig
from polyfuse.training.trainer import PolyfuseTrainer


__all__ = ["GaudiConfig", "PolyfuseTrainer", "PolyfuseTrainingArguments"]
