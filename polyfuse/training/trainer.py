"""``PolyfuseTrainer``: transformers' Trainer whose model runs through the op registry in training mode.

* a polyfuse ``LlamaForCausalLM`` (plain, or PEFT-wrapped: LoRA, saved as PEFT's adapter) gets its kernels resolved
  with ``training=True``; a transformers Llama (plain or PEFT-wrapped) is patched in place with ``polyfuse.patch``;
  anything else trains unchanged (with a warning);
* optimizer: torch's fused AdamW on CUDA (transformers' ``adamw_torch_fused``, the default with torch >= 2.8);
  on Gaudi, Habana's FusedAdamW / FusedClipNorm when the gaudi config asks for them (``use_fused_adam``,
  ``use_fused_clip_norm``) and ``use_torch_autocast``/``--bf16`` as HPU autocast, like optimum-habana's GaudiTrainer;
* HPU lazy mode: ``runtime.mark_step()`` after the backward and after the optimizer step;
* optimum-habana's GaudiTrainingArguments fields (HPU graphs, throughput without the warm-up steps, profiling,
  mark_step between forward and backward, ...) through ``GaudiSteps`` (gaudi_steps.py);
* logs ``train_tokens_per_second`` and the device's memory stats (``runtime.memory_stats()``) with each loss log;
* prints the kernels report once when training starts.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import time
from collections.abc import Mapping
from typing import Optional

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from polyfuse.core.registry import Kernels
from polyfuse.core.runtime import get_runtime
from polyfuse.training import fsdp as _fsdp
from polyfuse.training.arguments import PolyfuseTrainingArguments
from polyfuse.training.gaudi_config import GaudiConfig
from polyfuse.training.gaudi_steps import GaudiSteps


logger = logging.getLogger("polyfuse")
# transformers 5: Trainer.create_optimizer(model=None) and a _clip_grad_norm(model) hook. transformers 4.x (4.55, what
# optimum-habana pins): create_optimizer(self), and the training loop calls accelerator.clip_grad_norm_ directly.
_CREATE_OPTIMIZER_TAKES_MODEL = "model" in inspect.signature(Trainer.create_optimizer).parameters
_TRAINER_HAS_CLIP_HOOK = hasattr(Trainer, "_clip_grad_norm")


def _polyfuse_base(model: nn.Module):
    """polyfuse's model: ``model`` itself, or the model inside a PEFT wrapper (``get_base_model()``); else None."""
    from polyfuse.models.decoder import DecoderForCausalLM

    if not isinstance(model, DecoderForCausalLM) and callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    return model if isinstance(model, DecoderForCausalLM) else None


def _is_polyfuse_model(model: nn.Module) -> bool:
    return _polyfuse_base(model) is not None


class _StepBoundary(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.runtime.mark_step()


class PolyfuseTrainer(GaudiSteps, Trainer):
    def __init__(self, model: Optional[nn.Module] = None, args: Optional[PolyfuseTrainingArguments] = None, *a, **kw):
        gaudi_config = kw.pop("gaudi_config", None)
        if args is None:
            args = PolyfuseTrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, PolyfuseTrainingArguments):
            raise TypeError("PolyfuseTrainer needs PolyfuseTrainingArguments (a TrainingArguments subclass)")
        if model is None:
            raise ValueError("PolyfuseTrainer needs a model (model_init is not supported)")
        self.gaudi_config = None
        if args.use_habana:
            if gaudi_config is None and args.gaudi_config_name:
                gaudi_config = GaudiConfig.from_pretrained(args.gaudi_config_name)
            self.gaudi_config = gaudi_config or GaudiConfig()
        self._hpu_autocast = bool(
            args.use_habana and (args.bf16 or (self.gaudi_config and self.gaudi_config.use_torch_autocast))
        )
        if self._hpu_autocast:
            args.bf16 = False  # like GaudiTrainer: bf16 becomes HPU autocast, not accelerate's mixed precision
        self.runtime = get_runtime(args.device)
        self.polyfuse_kernels: Optional[Kernels] = None
        self._polyfuse_model = False  # polyfuse's bare model: saved and loaded through polyfuse (_save_polyfuse)
        self._polyfuse_peft = False  # polyfuse's model in a PEFT wrapper: Trainer saves/loads PEFT's adapter
        self._polyfuse_report = self._prepare_model(model, args)
        self._report_printed = False
        self._fused_clip = None
        self._tokens_total = 0
        self._tokens_since_log = 0
        self._last_log_time = None
        self._train_start_time = None
        _fsdp.check_model(model, args)  # FSDP2: more processes than decoder layers is refused before sharding
        _fsdp.prepare_zero3(model, args)  # --deepspeed with ZeRO-3: the fused paths' weight reads get gathered
        super().__init__(model, args, *a, **kw)
        if self._polyfuse_model or self._polyfuse_peft:
            # polyfuse's forward returns a mean loss and ignores num_items_in_batch: let the Trainer scale it.
            self.model_accepts_loss_kwargs = False
        if args.use_habana and args.use_lazy_mode:
            self.add_callback(_StepBoundary(self))
        self._init_gaudi_steps()
        if not getattr(args, "gaudi_notes_shown", False):
            for note in getattr(args, "gaudi_notes", ()):  # fields that change nothing here (the scripts print them)
                logger.warning("warning: %s", note)

    # ------------------------------------------------------------------------------------------ model preparation

    def _prepare_model(self, model: nn.Module, args: PolyfuseTrainingArguments) -> str:
        flags, overrides = args.polyfuse_flags(), args.polyfuse_overrides()
        device = args.device
        base = _polyfuse_base(model)
        if base is not None:
            from polyfuse.loader.load import set_kernels

            self._polyfuse_model, self._polyfuse_peft = base is model, base is not model
            # for the training device: the model may still be in host memory (FSDP2 moves each rank's shard there)
            kernels = self.polyfuse_kernels = set_kernels(base, flags, overrides, training=True, device=device)
            return kernels.report()
        from polyfuse.patch.families import find_family

        if find_family(model) is not None:
            from polyfuse.patch import patch

            handle = patch(model, device=device, flags=flags, overrides=overrides, training=True)
            self.polyfuse_kernels = handle.kernels
            return handle.report()
        logger.warning("polyfuse: %s is not a supported family; training it without fused ops", type(model).__name__)
        return f"polyfuse: {type(model).__name__} is not a supported family; no fused ops"

    # ------------------------------------------------------------------------------------------ training loop hooks

    def train(self, *args, **kwargs):
        if not self._report_printed and self.is_world_process_zero():
            print(self._polyfuse_report, flush=True)
            self._report_printed = True
        self._train_start_time = self._last_log_time = time.perf_counter()
        self._tokens_total = self._tokens_since_log = 0
        self.runtime.reset_peak_memory()
        if self._fsdp():  # ranks whose trainable weights differ (an unseeded PEFT adapter) get rank 0's, as under DDP
            _fsdp.sync_trainable(self.model, self.args)
        return super().train(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        if ids is None and isinstance(inputs, Mapping):
            ids = inputs.get("inputs_embeds")
            n = 0 if ids is None else ids.shape[0] * ids.shape[1]
        else:
            n = 0 if ids is None else ids.numel()
        self._tokens_total += n
        self._tokens_since_log += n
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.args.use_habana and self.args.use_lazy_mode:
            self.runtime.mark_step()  # after the backward (GaudiTrainer does the same)
        return loss

    def autocast_smart_context_manager(self, cache_enabled: Optional[bool] = True):
        if self._hpu_autocast:
            return torch.autocast(device_type="hpu", dtype=torch.bfloat16, cache_enabled=cache_enabled)
        return super().autocast_smart_context_manager(cache_enabled)

    def compute_loss_context_manager(self):
        if self._hpu_autocast:
            stack = contextlib.ExitStack()
            stack.enter_context(self.autocast_smart_context_manager())
            return stack
        return super().compute_loss_context_manager()

    def _fsdp(self) -> bool:
        """FSDP2 shards the parameters: each rank holds its part as a DTensor."""
        return bool(getattr(self, "is_fsdp_enabled", False))

    def create_optimizer(self, model=None):
        fused_adam = self.args.use_habana and self.gaudi_config and self.gaudi_config.use_fused_adam
        if self.optimizer is None and fused_adam and self._fsdp():
            # FSDP2's parameters are DTensors (a rank's shard) and Habana's fused kernels take plain tensors (not
            # verified on a Gaudi); torch's AdamW steps DTensors.
            logger.warning("polyfuse: use_fused_adam is not used with FSDP2; using %s", self.args.optim)
        elif self.optimizer is None and fused_adam:
            fused = self.runtime.fused_optimizer
            model = model if model is not None else self.model
            decay = set(self.get_decay_parameter_names(model))
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in params if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
            ]
            groups = [g for g in groups if g["params"]]  # empty groups crash FusedAdamW (optimum-habana drops them)
            # GaudiTrainingArguments' adam_epsilon default is 1e-6 ("consistent with Habana FusedAdamW"), not 1e-8.
            eps = self.args.adam_epsilon
            if eps == type(self.args).__dataclass_fields__["adam_epsilon"].default:
                eps = 1e-6
            opt = fused(
                groups, lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2), eps=eps,
            )  # fmt: skip
            if opt is not None:
                self.optimizer = opt
                return opt
            logger.warning(
                "polyfuse: use_fused_adam asked for but Habana FusedAdamW is unavailable; using %s", self.args.optim
            )
        return super().create_optimizer(model) if _CREATE_OPTIMIZER_TAKES_MODEL else super().create_optimizer()

    def _fused_clip_grad_norm(self, parameters):
        """Habana FusedClipNorm's clip (the pre-clip norm) when the gaudi config asks for it and it exists; else
        None."""
        if self.args.use_habana and self.gaudi_config and self.gaudi_config.use_fused_clip_norm:
            if self._fsdp():  # its norm would be this rank's shard's; accelerate's clip reduces over the ranks
                return None
            parameters = list(parameters)
            if self._fused_clip is None:
                clip = self.runtime.fused_clip_norm(parameters, self.args.max_grad_norm)
                self._fused_clip = clip or False
            if self._fused_clip:
                clip = self._fused_clip
                return clip.clip_norm(parameters) if hasattr(clip, "clip_norm") else clip(parameters)
        return None

    def _clip_grad_norm(self, model):
        norm = self._fused_clip_grad_norm(model.parameters())
        return norm if norm is not None else super()._clip_grad_norm(model)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self._set_dynamo_plugin()  # compile_dynamic, use_regional_compilation
        _fsdp.enable_on_cpu(self)  # FSDP on a CPU (gloo) run: accelerate enables it on accelerators only
        if not _TRAINER_HAS_CLIP_HOOK:
            # transformers 4.x has no _clip_grad_norm hook: its loop calls accelerator.clip_grad_norm_(params,
            # max_grad_norm) itself, so the fused clip goes there (the loop's own call only; other norms pass by).
            accelerate_clip = self.accelerator.clip_grad_norm_

            def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
                if max_norm == self.args.max_grad_norm and not args and not kwargs:
                    parameters = list(parameters)
                    norm = self._fused_clip_grad_norm(parameters)
                    if norm is not None:
                        return norm
                return accelerate_clip(parameters, max_norm, *args, **kwargs)

            self.accelerator.clip_grad_norm_ = clip_grad_norm_

    # ------------------------------------------------------------------------------------------ logging, saving

    def log(self, logs: dict, start_time: Optional[float] = None) -> None:
        now = time.perf_counter()
        if "loss" in logs and self._last_log_time is not None:
            dt = max(now - self._last_log_time, 1e-9)
            logs["train_tokens_per_second"] = round(self._tokens_since_log / dt, 2)
            self._tokens_since_log, self._last_log_time = 0, now
            self._add_memory(logs)
        elif "train_runtime" in logs and self._train_start_time is not None:
            self._speed_metrics(logs, self._tokens_total)  # throughput_warmup_steps / adjust_throughput
            self._add_memory(logs)
        else:
            self._speed_metrics(logs, 0)  # an evaluation's, with throughput_warmup_steps
        super().log(logs, start_time)

    def _add_memory(self, logs: dict) -> None:
        try:
            stats = self.runtime.memory_stats()
        except Exception:  # pragma: no cover - a runtime without stats must not break training
            return
        logs.update({k: v for k, v in stats.items() if v is not None})

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Trainer's, except that under FSDP2 a call from outside the training loop (the final save) always writes a
        consolidated transformers checkpoint: with ``state_dict_type`` SHARDED_STATE_DICT transformers would write
        no weights there (its ``checkpoint-N`` folders keep accelerate's sharded model and optimizer for resuming).
        Every rank must call it."""
        if getattr(self, "is_fsdp_enabled", False) and not _internal_call and _fsdp.sharded_state_dict_type(self):
            self._save(output_dir or self.args.output_dir, state_dict=_fsdp.full_state_dict(self.model))
            return
        super().save_model(output_dir, _internal_call)

    def _save(self, output_dir: Optional[str] = None, state_dict=None):
        if self._polyfuse_model:
            self._save_polyfuse(output_dir or self.args.output_dir, state_dict)
        else:
            super()._save(output_dir, state_dict)
        if self.gaudi_config is not None and self.args.should_save:
            self.gaudi_config.save_pretrained(output_dir or self.args.output_dir)

    def _save_polyfuse(self, output_dir: str, state_dict: Optional[dict] = None) -> None:
        """What ``Trainer._save`` does for a ``PreTrainedModel``, for polyfuse's model: a transformers checkpoint
        (config.json + safetensors in transformers' names, the fused projections split back, a tied lm_head left
        out) through the model's ``save_pretrained``, then the tokenizer and the training arguments. Under FSDP2
        ``state_dict`` is the full state dict the Trainer gathered on every rank (rank 0 writes it)."""
        if not self.args.should_save:
            return
        from transformers.trainer import TRAINING_ARGS_NAME

        os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if state_dict is None and _fsdp.is_sharded(model):
            raise RuntimeError("polyfuse: saving an FSDP2-sharded model needs its gathered full state dict")
        model.save_pretrained(
            output_dir, params=None if state_dict is None else _fsdp.parameters_of(model, state_dict)
        )
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_polyfuse(self, folder: str) -> None:
        """Load a checkpoint written by ``_save_polyfuse`` (transformers' names) into polyfuse's model in place.
        Trainer's own loader would call ``load_state_dict(strict=False)`` with those names and silently load
        nothing."""
        from polyfuse.checkpoint.readers import iter_safetensors
        from polyfuse.loader.load import LOAD_WORKERS, load_weights

        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        with torch.no_grad():
            load_weights(model, iter_safetensors(folder), workers=LOAD_WORKERS)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self._polyfuse_model and not self.is_fsdp_enabled:  # under FSDP, accelerate reads its own checkpoint
            return self._load_polyfuse(resume_from_checkpoint)
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        if self._polyfuse_model and not self.is_fsdp_enabled:
            logger.info("polyfuse: loading the best model from %s", self.state.best_model_checkpoint)
            return self._load_polyfuse(self.state.best_model_checkpoint)
        return super()._load_best_model()
