"""A training run's output folder, as transformers' examples keep it (examples/run_clm.py uses these): a folder that
holds an earlier run's files is refused unless --overwrite_output_dir (then that run's checkpoints and weights are
removed first, so no stale checkpoint-N sits beside the new ones) or --resume_from_checkpoint (``true``: the last
checkpoint-N in it); Ctrl-C between steps saves a checkpoint of the finished steps and stops, and after an
interruption no half-written checkpoint and no empty folder this run created are left behind."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from typing import Optional

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint


# Files a run writes into its output folder besides checkpoint-N: --overwrite_output_dir removes them first, so an
# old full model never sits beside a new adapter (or the other way round). Config and tokenizer files are rewritten.
RUN_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "model.safetensors",
             "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "training_args.bin",
             "trainer_state.json", "train_results.json", "all_results.json", "eval_results.json")  # fmt: skip
TRUE, FALSE = ("true", "1", "yes", "last"), ("false", "0", "no", "none", "")
# Written last into a checkpoint by transformers' Trainer: a checkpoint-N without it was cut off while saving.
STATE_FILE = "trainer_state.json"


class RunDirError(ValueError):
    """The output folder or the checkpoint to resume from cannot be used (one line)."""


def _checkpoints(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    names = [n for n in os.listdir(folder) if n.startswith(PREFIX_CHECKPOINT_DIR + "-")]
    return [n for n in names if os.path.isdir(os.path.join(folder, n))]


def resume_path(value: Optional[str], output_dir: str) -> Optional[str]:
    """--resume_from_checkpoint as transformers' examples read it: true -> the last checkpoint-N in --output_dir,
    false -> none, else a checkpoint folder."""
    if value is None or str(value).strip().lower() in FALSE:
        return None
    if str(value).strip().lower() in TRUE:
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise RunDirError(f"--resume_from_checkpoint {value}: {output_dir} holds no {PREFIX_CHECKPOINT_DIR}-N "
                              "folder to resume from")  # fmt: skip
        return last
    if not os.path.isdir(value):
        raise RunDirError(f"--resume_from_checkpoint {value}: no such checkpoint folder")
    return value


def check_output_dir(output_dir: str, overwrite: bool, resuming: bool) -> None:
    """Refuse a non-empty output folder unless the run overwrites it or resumes from it."""
    if resuming or overwrite or not os.path.isdir(output_dir):
        return
    names = sorted(os.listdir(output_dir))
    if not names:
        return
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    raise RunDirError(f"--output_dir {output_dir} is not empty (it holds {shown}): pass --overwrite_output_dir to "
                      "replace an earlier run's files, or --resume_from_checkpoint true to continue from its last "
                      "checkpoint")  # fmt: skip


def clear_earlier_run(output_dir: str) -> Optional[str]:
    """--overwrite_output_dir: remove an earlier run's checkpoint-N folders and weight / state files; a one-line
    note of what went, or None when there was nothing."""
    gone = _checkpoints(output_dir)
    for name in gone:
        shutil.rmtree(os.path.join(output_dir, name))
    files = [n for n in RUN_FILES if os.path.isfile(os.path.join(output_dir, n))]
    for name in files:
        os.remove(os.path.join(output_dir, name))
    if not gone and not files:
        return None
    return (f"--overwrite_output_dir: removed {len(gone)} checkpoint folder(s) and {len(files)} file(s) of an "
            f"earlier run from {output_dir}")  # fmt: skip


def after_interrupt(output_dir: str, created: bool) -> Optional[str]:
    """After Ctrl-C: remove checkpoint-N folders cut off while saving (no trainer_state.json yet) and the output
    folder when this run created it and left it empty; return the last complete checkpoint, if any."""
    for name in _checkpoints(output_dir):
        path = os.path.join(output_dir, name)
        if not os.path.isfile(os.path.join(path, STATE_FILE)):
            shutil.rmtree(path, ignore_errors=True)
    if created and os.path.isdir(output_dir) and not os.listdir(output_dir):
        os.rmdir(output_dir)
    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


class StopOnInterrupt(TrainerCallback):
    """The first Ctrl-C ends training at the end of the step under way, with a checkpoint of the finished steps
    (whatever --save_strategy says); a second one interrupts at once. One process only: under torchrun the ranks
    could see it at different steps and one would wait in a collective for the others."""

    def __init__(self):
        self.interrupted = False
        self.previous = None

    def _handler(self, signum, frame):
        self.interrupted = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C raises KeyboardInterrupt

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handler)

    def on_step_end(self, args, state, control, **kwargs):
        if self.interrupted:
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None
