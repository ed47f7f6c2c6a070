"""``--profiling_steps`` / ``--profiling_steps_eval``: torch.profiler over a window of steps, as optimum-habana's
``HabanaProfile`` runs it (schedule wait 0, warm-up N, active M, one repeat; the trace written by
``tensorboard_trace_handler`` into ``./hpu_profile/<name>``). The activities are the host's plus the run's device
(HPU on Gaudi, CUDA on NVIDIA)."""

from __future__ import annotations

import os

import torch
from transformers import TrainerCallback


PROFILE_DIR = "./hpu_profile"


class StepProfile:
    """start() / step() / stop(); all three do nothing when ``active`` is 0."""

    def __init__(self, warmup: int, active: int, record_shapes: bool, with_stack: bool, name: str, device_type: str):
        self.profiler = None
        self.running = False
        if active <= 0:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        extra = {"hpu": "HPU", "cuda": "CUDA"}.get(device_type)
        if extra and hasattr(torch.profiler.ProfilerActivity, extra):
            activities.append(getattr(torch.profiler.ProfilerActivity, extra))
        self.profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=active, repeat=1),
            activities=activities,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(os.path.join(PROFILE_DIR, name)),
            record_shapes=record_shapes,
            with_stack=with_stack,
        )

    def start(self) -> None:
        if self.profiler is not None and not self.running:
            self.profiler.start()
            self.running = True

    def step(self) -> None:
        if self.running:
            self.profiler.step()

    def stop(self) -> None:
        if self.running:
            self.profiler.stop()
            self.running = False


def profile_for(args, name: str, device_type: str, evaluation: bool = False) -> StepProfile:
    warmup = args.profiling_warmup_steps_eval if evaluation else args.profiling_warmup_steps
    active = args.profiling_steps_eval if evaluation else args.profiling_steps
    return StepProfile(warmup, active, args.profiling_record_shapes, args.profiling_with_stack, name, device_type)


class TrainProfile(TrainerCallback):
    """The training window: one profiler step per batch (optimum-habana steps it after every micro-batch)."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.profile = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.profile = profile_for(args, "train", self.device_type)
        self.profile.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profile is not None:
            self.profile.step()

    on_substep_end = on_step_end

    def on_train_end(self, args, state, control, **kwargs):
        if self.profile is not None:
            self.profile.stop()
