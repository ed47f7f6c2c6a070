"""What examples/run_clm.py and examples/run_lora_clm.py share besides their data: argument parsing (one ``error:``
line, exit code 2), the output folder (polyfuse/training/run_dir.py), training with Ctrl-C handling, evaluation with
``eval_loss`` and ``perplexity``, and the results files in optimum-habana's shape (``train_results.json``,
``eval_results.json``, ``all_results.json``, ``trainer_state.json``)."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field, fields

from polyfuse.training.arguments import PolyfuseTrainingArguments
from polyfuse.training.run_dir import RunDirError, StopOnInterrupt, check_output_dir, clear_earlier_run, resume_path


@dataclass
class OutputArguments:
    """transformers 5 dropped TrainingArguments' overwrite_output_dir; its examples' meaning is kept here."""

    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Train into a non-empty --output_dir, removing an earlier run's files."}
    )


# transformers 4.x TrainingArguments has overwrite_output_dir itself; 5.x gets it from OutputArguments. 5.x has its own
# use_cache; 4.x gets optimum-habana's from CacheArguments.
_TRAINING_FIELDS = {f.name for f in fields(PolyfuseTrainingArguments)}
HAS_OVERWRITE = "overwrite_output_dir" in _TRAINING_FIELDS
HAS_USE_CACHE = "use_cache" in _TRAINING_FIELDS


class Script:
    """One script's name (for its error lines) and helpers bound to it."""

    def __init__(self, prog: str):
        self.prog = prog

    def fail(self, msg: str) -> None:
        print(f"{self.prog}: error: {msg}", file=sys.stderr)
        raise SystemExit(2)

    def parse(self, classes: tuple, argv=None) -> tuple:
        """(dataclasses in ``classes`` order, the training arguments, overwrite_output_dir); the first class (the
        model's) gets ``use_cache`` from wherever this transformers has it."""
        from transformers import HfArgumentParser

        from polyfuse.training.clm_args import CacheArguments

        extra = (() if HAS_USE_CACHE else (CacheArguments,)) + (() if HAS_OVERWRITE else (OutputArguments,))
        all_classes = (*classes, PolyfuseTrainingArguments, *extra)
        parser = HfArgumentParser(all_classes, prog=self.prog)
        parser.error = self.fail  # one line, exit code 2 (argparse prints the usage too)
        try:
            parsed = parser.parse_args_into_dataclasses(args=argv)
        except ValueError as e:
            self.fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
        targs = parsed[len(classes)]
        overwrite = parsed[-1].overwrite_output_dir if not HAS_OVERWRITE else targs.overwrite_output_dir
        parsed[0].use_cache = targs.use_cache if HAS_USE_CACHE else parsed[len(classes) + 1].use_cache
        return parsed[: len(classes)], targs, overwrite

    def check_steps(self, targs) -> None:
        if targs.max_steps == 0:
            # transformers gives 0 no meaning of its own (> 0: that many steps, < 0: --num_train_epochs decides), and
            # Trainer then runs one step and writes a full checkpoint.
            self.fail("--max_steps must be > 0 (or -1 to train for --num_train_epochs)")
        if targs.max_steps < 0 and not targs.num_train_epochs > 0:
            self.fail(f"--num_train_epochs must be > 0 when --max_steps is not set, got {targs.num_train_epochs}")

    def check_output(self, targs, overwrite: bool, training: bool) -> None:
        try:
            targs.resume_from_checkpoint = resume_path(targs.resume_from_checkpoint, targs.output_dir)
            if training:
                check_output_dir(targs.output_dir, overwrite, targs.resume_from_checkpoint is not None)
        except RunDirError as e:
            self.fail(str(e))

    def warn(self, targs, notes) -> None:
        """One ``warning:`` line per note, on the first process only."""
        if targs.process_index == 0:
            for note in notes:
                print(f"warning: {note}", file=sys.stderr)
        targs.gaudi_notes_shown = True  # PolyfuseTrainer does not log them again


def clear_output(prog: str, targs, overwrite: bool) -> None:
    if overwrite and targs.resume_from_checkpoint is None and targs.process_index == 0:
        note = clear_earlier_run(targs.output_dir)
        if note:
            print(f"{prog}: {note}", file=sys.stderr)


def train(prog: str, trainer, targs) -> tuple:
    """(metrics, interrupted): Trainer.train with Ctrl-C saving the finished steps (one process)."""
    stop = StopOnInterrupt() if targs.world_size == 1 else None  # torchrun: ranks could stop at different steps
    if stop is not None:
        trainer.add_callback(stop)
    try:
        result = trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    finally:
        if stop is not None:
            stop.on_train_end(targs, None, None)  # the previous Ctrl-C handler back, also after an error
    if stop is not None and stop.interrupted and trainer.state.global_step < trainer.state.max_steps:
        last = os.path.join(targs.output_dir, f"checkpoint-{trainer.state.global_step}")
        print(f"{prog}: interrupted at step {trainer.state.global_step} of {trainer.state.max_steps}: saved {last} "
              "(continue with --resume_from_checkpoint true)", file=sys.stderr)  # fmt: skip
        return None, True
    return result.metrics, False


def save_train(trainer, targs, tokenizer, metrics: dict, info: dict, save: bool = True) -> None:
    """The trained model (and tokenizer) in --output_dir, train_results.json / all_results.json and
    trainer_state.json."""
    if save:
        trainer.save_model(targs.output_dir)
    if trainer.is_world_process_zero():
        if save:
            tokenizer.save_pretrained(targs.output_dir)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", {**metrics, **info})
        trainer.save_state()


def evaluate(trainer, eval_samples: int) -> dict:
    """trainer.evaluate() with ``eval_samples`` and ``perplexity`` = exp(eval_loss), as optimum-habana's scripts add
    them; eval_results.json / all_results.json written."""
    metrics = trainer.evaluate()
    metrics["eval_samples"] = eval_samples
    try:
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
    except OverflowError:
        metrics["perplexity"] = float("inf")
    if trainer.is_world_process_zero():
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    return metrics


def run_info(model, targs, path_name: tuple, extra: dict, polyfuse_version: str) -> dict:
    """What train_results.json says about the run besides its metrics: the model, device, flags and versions (the
    script passes polyfuse's own: this layer does not import the package)."""
    import platform

    import torch
    import transformers

    path, gguf, name = path_name
    return {
        "model_name_or_path": name, "model_path": path, "gguf_file": gguf, "model_impl": model.model_impl, **extra,
        "device": str(targs.device), "polyfuse_flags": targs.polyfuse_flags(), "polyfuse_ops": targs.polyfuse_overrides(),
        "versions": {"polyfuse": polyfuse_version, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
    }  # fmt: skip
