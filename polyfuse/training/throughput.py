"""Throughput metrics as optimum-habana's GaudiTrainer computes them (its ``speed_metrics``): with
``throughput_warmup_steps=N`` the first N steps are left out of the samples, the steps and the time, and with
``adjust_throughput`` the time spent logging, evaluating and saving is left out of the time too. ``*_runtime`` stays
the whole wall time. A run with no more steps than the warm-up keeps them in (optimum-habana does so for evaluation;
for training its numbers would turn negative)."""

from __future__ import annotations

import math
import time
from typing import Optional

from transformers import TrainerCallback


def warmup_throughput(
    split: str, runtime: float, num_samples: float, num_steps: float, warmup_steps: int, total_batch: int,
    after_warmup_s: Optional[float] = None, excluded_s: Optional[float] = None,
) -> dict:  # fmt: skip  # size: optimum-habana's speed_metrics arguments, one for one
    """``{split}_samples_per_second`` / ``{split}_steps_per_second`` of a run that took ``runtime`` seconds for
    ``num_samples`` samples in ``num_steps`` steps of ``total_batch`` samples: the first ``warmup_steps`` steps'
    samples and steps are left out, and their time (``after_warmup_s``: seconds from the start to the end of the
    warm-up, None when it was never reached, then the time is not reduced, as optimum-habana's), and
    ``excluded_s`` seconds of logging, evaluating and saving (``adjust_throughput``)."""
    if runtime <= 0:
        return {}
    samples = num_samples - warmup_steps * total_batch
    steps = num_steps - warmup_steps
    if excluded_s is not None:
        runtime -= excluded_s
    if after_warmup_s is not None:
        runtime -= after_warmup_s
    return {
        f"{split}_samples_per_second": round(samples / runtime, 3),
        f"{split}_steps_per_second": round(steps / runtime, 3),
    }


def eval_counts(num_samples: int, total_batch: int, warmup_steps: int) -> tuple:
    """(samples, steps, warm-up steps to leave out) of an evaluation: optimum-habana keeps the warm-up steps in when
    the evaluation has no more steps than that."""
    steps = math.ceil(num_samples / total_batch) if total_batch else 0
    return num_samples, steps, (warmup_steps if steps > warmup_steps else 0)


class ThroughputClock(TrainerCallback):
    """Times a training run for :func:`warmup_throughput`: its start, the start of step ``warmup_steps + 1``
    (where optimum-habana's loop takes ``start_time_after_warmup``) and the tokens fed until then."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.reset()

    def reset(self) -> None:
        self.start = self.after_warmup = None
        self.first_step = 0
        self.tokens_at_warmup = 0
        self.excluded_s = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.reset()
        self.start, self.first_step = time.time(), state.global_step

    def on_step_begin(self, args, state, control, **kwargs):
        n = args.throughput_warmup_steps
        if n > 0 and self.after_warmup is None and state.global_step - self.first_step == n:
            self.after_warmup = time.time()
            self.tokens_at_warmup = self.trainer._tokens_total

    def warmup_seconds(self) -> Optional[float]:
        return None if self.after_warmup is None else self.after_warmup - self.start
