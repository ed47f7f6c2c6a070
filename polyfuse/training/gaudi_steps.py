"""``GaudiSteps``: PolyfuseTrainer's hooks for optimum-habana's GaudiTrainingArguments fields, placed where
GaudiTrainer does the same (gaudi_arguments.py has the table):

* ``use_hpu_graphs_for_training``: the runtime's ``training_graphs`` (Habana's ModuleCacher) in ``_wrap_model``;
  ``use_hpu_graphs_for_inference``: the runtime's ``inference_graphs`` (``wrap_in_hpu_graph`` with
  ``disable_tensor_cache_hpu_graphs`` / ``max_hpu_graphs``) on the model before an evaluation outside training;
* ``pipelining_fwd_bwd``: ``mark_step`` between the forward and the backward (Gaudi, lazy mode); in lazy mode a
  ``mark_step`` after every evaluation batch too;
* ``non_blocking_data_copy``: batches copied with ``non_blocking=True``;
* ``compile_from_sec_iteration``: the first micro-batch of each epoch under ``torch.compiler.set_stance("force_eager")``;
  ``compile_dynamic`` / ``use_regional_compilation``: accelerate's dynamo plugin;
* ``throughput_warmup_steps`` / ``adjust_throughput``: the speed metrics of training and evaluation (throughput.py);
* ``profiling_*``: torch.profiler windows (profiling.py);
* ``distribution_strategy ddp`` on Gaudi: DDP with ``gradient_as_bucket_view`` as GaudiTrainer passes it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from transformers import TrainerCallback

from polyfuse.training.profiling import TrainProfile, profile_for
from polyfuse.training.throughput import ThroughputClock, eval_counts, warmup_throughput


class _EpochStart(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.trainer._eager_next = True


class GaudiSteps:
    """Mixed into PolyfuseTrainer before transformers' Trainer; ``_init_gaudi_steps()`` after Trainer's __init__."""

    def _init_gaudi_steps(self) -> None:
        args = self.args
        self._device_type = "hpu" if args.use_habana else args.device.type
        self.throughput = ThroughputClock(self)
        self.add_callback(self.throughput)
        self.add_callback(TrainProfile(self._device_type))
        self.add_callback(_EpochStart(self))
        self._eager_next = False
        self._eval_clock = None
        self._inference_graphs = False
        self._training_graphs = False
        self._in_training_step = False
        self._num_train_samples = None

    def _hpu_lazy(self) -> bool:
        return bool(self.args.use_habana and self.args.use_lazy_mode)

    # -- training step ---------------------------------------------------------------------------------------------
    def set_initial_training_values(self, *args, **kwargs):
        out = super().set_initial_training_values(*args, **kwargs)
        self._num_train_samples = out[3]  # (epochs, updates per epoch, examples, samples, ...) on 4.55 and 5.x
        return out

    def _stance(self) -> None:
        if self.args.compile_from_sec_iteration and self.args.torch_compile:
            torch.compiler.set_stance("force_eager" if self._eager_next else "default")
        self._eager_next = False

    def compute_loss(self, model, inputs, *args, **kwargs):
        out = super().compute_loss(model, inputs, *args, **kwargs)
        if self._in_training_step and self.args.pipelining_fwd_bwd and self._hpu_lazy():
            self.runtime.mark_step()  # the host builds the backward while the device runs the forward
        return out

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._stance()
        self._in_training_step = True
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._in_training_step = False

    def _prepare_input(self, data):
        if self.args.non_blocking_data_copy and isinstance(data, torch.Tensor) and not self.is_deepspeed_enabled:
            return data.to(device=self.args.device, non_blocking=True)
        return super()._prepare_input(data)

    def _wrap_model(self, model, training=True, dataloader=None):
        model = super()._wrap_model(model, training, dataloader)
        if not training:
            return model
        handler = getattr(self.accelerator, "ddp_handler", None)
        if self.args.use_habana and handler is not None:
            handler.gradient_as_bucket_view = True  # as GaudiTrainer's DDP kwargs on Gaudi
        if self.args.use_hpu_graphs_for_training and not self._training_graphs:
            self.runtime.training_graphs(self.accelerator.unwrap_model(model))
            self._training_graphs = True
        return model

    def _set_dynamo_plugin(self) -> None:
        plugin = getattr(self.accelerator.state, "dynamo_plugin", None)
        if plugin is None or not self.args.torch_compile:
            return
        if self.args.compile_dynamic is not None:
            plugin.dynamic = self.args.compile_dynamic
        if self.args.use_regional_compilation:
            plugin.use_regional_compilation = True

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        if not self.args.adjust_throughput:
            return super()._maybe_log_save_evaluate(*args, **kwargs)
        start = time.time()
        try:
            return super()._maybe_log_save_evaluate(*args, **kwargs)
        finally:
            self.throughput.excluded_s += time.time() - start

    # -- evaluation ------------------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        args = self.args
        if args.use_hpu_graphs_for_inference and not self.is_in_train and not self._inference_graphs:
            # not while training: graphs would detach the gradients (GaudiTrainer's rule too)
            self.runtime.inference_graphs(
                self.accelerator.unwrap_model(self.model), args.disable_tensor_cache_hpu_graphs, args.max_hpu_graphs
            )
            self._inference_graphs = True
        clock = {"start": time.time(), "steps": 0, "samples": 0, "after": None}
        clock["profile"] = profile_for(args, "evaluation", self._device_type, evaluation=True)
        outer, self._eval_clock = self._eval_clock, clock
        clock["profile"].start()
        try:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            clock["profile"].stop()
            self._eval_clock = outer

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        clock = self._eval_clock
        if clock is not None:
            n = self.args.throughput_warmup_steps
            if n > 0 and not self.is_in_train and clock["steps"] == n:
                clock["after"] = time.time()
            clock["steps"] += 1
            ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
            clock["samples"] += 0 if ids is None else ids.shape[0]
        out = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if self._hpu_lazy():
            self.runtime.mark_step()
        if clock is not None:
            clock["profile"].step()
        return out

    # -- speed metrics ---------------------------------------------------------------------------------------------
    def _speed_metrics(self, logs: dict, tokens: int) -> None:
        """optimum-habana's throughput in place of transformers' in a final train log or an evaluation log (and
        polyfuse's train_tokens_per_second over the same time, warm-up tokens left out)."""
        args = self.args
        n, excluded = args.throughput_warmup_steps, self.throughput.excluded_s if args.adjust_throughput else None
        if "train_runtime" in logs:
            runtime = logs["train_runtime"]
            steps = self.state.global_step - self.throughput.first_step
            if steps <= n:  # a run no longer than its warm-up keeps it in (optimum-habana's rule for evaluation)
                n = 0
            if n or excluded is not None:
                samples = (self._num_train_samples or 0) * steps / max(self.state.max_steps, 1)
                total = self.get_total_train_batch_size(args)
                after = self.throughput.warmup_seconds()
                logs.update(warmup_throughput("train", runtime, samples, steps, n, total, after, excluded))
                runtime -= (after or 0.0) + (excluded or 0.0)
                tokens -= self.throughput.tokens_at_warmup if after is not None else 0
            logs.setdefault("train_tokens_per_second", round(tokens / max(runtime, 1e-9), 2))
            return
        key = next((k for k in logs if k.endswith("_runtime")), None)
        clock = self._eval_clock
        if key is None or clock is None or n <= 0:
            return
        total = args.eval_batch_size * args.world_size
        samples, steps, warm = eval_counts(clock["samples"] * args.world_size, total, n)
        after = clock["after"] - clock["start"] if (warm and clock["after"] is not None) else None
        logs.update(warmup_throughput(key[: -len("_runtime")], logs[key], samples, steps, warm, total, after))
