#!/usr/bin/env python
"""Fine-tune a Llama (the built-in SmolLM2-135M-Instruct by default) on a plain-text file with polyfuse's fused ops.

    python examples/run_clm.py --output_dir out --max_steps 20 --per_device_train_batch_size 2 --block_size 128
    python examples/run_clm.py --model_name_or_path ./my-llama --use_flash_attention --bf16 ...
    python examples/run_clm.py --config_overrides hidden_size=64,num_hidden_layers=2 ...   # random weights

All of transformers' TrainingArguments work, plus polyfuse's: --use_flash_attention, --flash_attention_recompute,
--flash_attention_causal_mask, --use_fused_rms_norm/--use_fused_rope/--use_fused_swiglu/--use_fused_linear_cross_entropy
(default on; pass False to turn off), --polyfuse_ops, --use_habana, --use_lazy_mode, --gaudi_config_name.
The saved folder loads with transformers.AutoModelForCausalLM.from_pretrained.

LoRA through PEFT (pip install peft, or pip install -e '.[lora]' in a clone), with either --model_impl, as
optimum-habana's run_lora_clm.py:

    python examples/run_clm.py --lora_rank 8 --lora_alpha 16 --lora_dropout 0.05 \
        --lora_target_modules q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --output_dir out ...

The output folder then holds PEFT's adapter (adapter_config.json, adapter_model.safetensors), which
peft.PeftModel.from_pretrained loads onto the base model (transformers' or polyfuse's). Its base_model_name_or_path
is the folder trained from, or for the built-in model the Hub model its GGUF was made from
(HuggingFaceTB/SmolLM2-135M-Instruct), so that peft.AutoPeftModelForCausalLM.from_pretrained(out) loads it. For
another GGUF it is the .gguf file: load that base with transformers' AutoModelForCausalLM.from_pretrained(folder,
gguf_file=name), then the adapter onto it with peft.PeftModel.from_pretrained(base, out).

The output folder, as transformers' examples keep it: one that holds files is refused unless --overwrite_output_dir
(an earlier run's checkpoints and weights are removed first) or --resume_from_checkpoint (true: its last
checkpoint-N). Ctrl-C stops at the end of the step under way and saves a checkpoint of the finished steps (exit code
130); resume with --resume_from_checkpoint true.

Several devices, FSDP2 through the Trainer's arguments (docs/training.md, "FSDP2"; rank 0 prints, one error line):

    torchrun --nproc-per-node 8 examples/run_clm.py --fsdp "full_shard auto_wrap" --fsdp_config fsdp2.json ...
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:  # torch and transformers take seconds to import: Ctrl-C meanwhile exits 130 without a traceback
    import torch
    from transformers import HfArgumentParser, default_data_collator

    from polyfuse.distributed.launch import distributed_entry
    from polyfuse.training import PolyfuseTrainer, PolyfuseTrainingArguments
    from polyfuse.training.fsdp import agree_ranks
    from polyfuse.training.run_dir import (
        RunDirError,
        StopOnInterrupt,
        after_interrupt,
        check_output_dir,
        clear_earlier_run,
        resume_path,
    )
except KeyboardInterrupt:
    print("run_clm.py: interrupted", file=sys.stderr)
    raise SystemExit(130) from None


PROG = "run_clm.py"
DEFAULT_DATA = str(Path(__file__).resolve().parent / "data" / "tiny_corpus.txt")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# transformers' Llama projection names: PEFT's target_modules on both --model_impl (polyfuse's fused qkv_proj and
# gate_up_proj expose q/k/v_proj and gate/up_proj as slices, polyfuse/models/projection_slice.py)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ScriptArguments:
    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Local model folder (default: the built-in SmolLM2-135M-Instruct GGUF)."}
    )
    gguf_file: Optional[str] = field(default=None, metadata={"help": "GGUF file name inside the model folder."})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "Tokenizer folder (default: the model's)."})
    train_file: str = field(default=DEFAULT_DATA, metadata={"help": "Plain-text training file."})
    block_size: int = field(default=128, metadata={"help": "Tokens per training sequence."})
    config_overrides: Optional[str] = field(
        default=None,
        metadata={"help": "Train from random weights with the model's config changed, e.g. 'hidden_size=64,...'."},
    )
    torch_dtype: str = field(default="float32", metadata={"help": "Weights dtype: float32, bfloat16 or float16."})
    model_impl: str = field(
        default="transformers",
        metadata={"help": "'transformers' (patched in place with polyfuse.patch) or 'polyfuse' (polyfuse's Llama)."},
    )
    lora_rank: int = field(default=0, metadata={"help": "LoRA rank through PEFT (0: no LoRA, full fine-tuning)."})
    lora_alpha: float = field(default=16, metadata={"help": "LoRA alpha (the adapter is scaled by alpha / rank)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA adapters' input."})
    lora_target_modules: str = field(
        default="q_proj,v_proj",
        metadata={"help": f"Comma list of the projections LoRA adapts, from: {', '.join(LORA_MODULES)}."},
    )


@dataclass
class OutputArguments:
    """transformers 5 dropped TrainingArguments' overwrite_output_dir; its examples' meaning is kept here."""

    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Train into a non-empty --output_dir, removing an earlier run's files."}
    )


# transformers 4.x TrainingArguments has the flag itself; 5.x gets it from OutputArguments.
HAS_OVERWRITE = any(f.name == "overwrite_output_dir" for f in fields(PolyfuseTrainingArguments))


def _fail(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv=None):
    classes = (ScriptArguments, PolyfuseTrainingArguments) + (() if HAS_OVERWRITE else (OutputArguments,))
    parser = HfArgumentParser(classes, prog=PROG)
    parser.error = _fail  # one line, exit code 2 (argparse prints the usage too)
    try:
        script, targs, *extra = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    script.overwrite_output_dir = extra[0].overwrite_output_dir if extra else targs.overwrite_output_dir
    if script.torch_dtype not in DTYPES:
        _fail(f"--torch_dtype must be one of {', '.join(DTYPES)}, got {script.torch_dtype!r}")
    if script.model_impl not in ("transformers", "polyfuse"):
        _fail(f"--model_impl must be 'transformers' or 'polyfuse', got {script.model_impl!r}")
    if script.block_size < 2:
        _fail("--block_size must be at least 2")
    if targs.max_steps == 0:
        # transformers gives 0 no meaning of its own (> 0: that many steps, < 0: --num_train_epochs decides), and
        # Trainer then runs one step and writes a full checkpoint.
        _fail("--max_steps must be > 0 (or -1 to train for --num_train_epochs)")
    if targs.max_steps < 0 and not targs.num_train_epochs > 0:
        _fail(f"--num_train_epochs must be > 0 when --max_steps is not set, got {targs.num_train_epochs}")
    if not os.path.isfile(script.train_file):
        _fail(f"--train_file {script.train_file!r} does not exist")
    path = script.model_name_or_path
    if path is not None and not os.path.isdir(path) and not (path.endswith(".gguf") and os.path.isfile(path)):
        _fail(f"--model_name_or_path {path!r} is not a local folder or .gguf file (no hub downloads)")
    _check_lora(script)
    try:
        targs.resume_from_checkpoint = resume_path(targs.resume_from_checkpoint, targs.output_dir)
        check_output_dir(targs.output_dir, script.overwrite_output_dir, targs.resume_from_checkpoint is not None)
    except RunDirError as e:
        _fail(str(e))
    return script, targs


def lora_targets(script: ScriptArguments) -> list:
    return [m.strip() for m in script.lora_target_modules.split(",") if m.strip()]


def _check_lora(script: ScriptArguments) -> None:
    if script.lora_rank < 0:
        _fail(f"--lora_rank must be >= 0 (0: no LoRA), got {script.lora_rank}")
    if script.lora_rank == 0:
        return
    if not 0 <= script.lora_dropout < 1:
        _fail(f"--lora_dropout must be in [0, 1), got {script.lora_dropout}")
    targets = lora_targets(script)
    unknown = [m for m in targets if m not in LORA_MODULES]
    if unknown or not targets:
        _fail(f"--lora_target_modules: unknown module {', '.join(map(repr, unknown)) or 'list (empty)'}; "
              f"choose from {', '.join(LORA_MODULES)}")  # fmt: skip
    try:
        import peft  # noqa: F401
    except ImportError:
        _fail("--lora_rank needs peft: pip install peft (or pip install -e '.[lora]' in a polyfuse clone)")


def add_lora(model, script: ScriptArguments, targs: PolyfuseTrainingArguments):
    """The model wrapped by PEFT's LoRA (its base weights frozen), as optimum-habana's run_lora_clm.py does."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import set_seed

    if targs.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        # transformers' reentrant checkpointing (the 4.x default) needs an input that requires grad, and the frozen
        # embedding gives none (run_lora_clm.py does the same); polyfuse's checkpointing is non-reentrant.
        model.enable_input_require_grads()
    config = LoraConfig(
        r=script.lora_rank, lora_alpha=script.lora_alpha, lora_dropout=script.lora_dropout,
        target_modules=lora_targets(script), bias="none", task_type=TaskType.CAUSAL_LM,
    )  # fmt: skip
    # lora_A starts random (torch's default generator is seeded at random per process, and Trainer seeds only after
    # this): --seed makes it the same on every run and every rank; FSDP2 shards each rank's own copy unsynchronized,
    # so ranks drawing different adapters would train a mix of them.
    set_seed(targs.seed)
    model.name_or_path = checkpoint_of(script)[2]  # adapter_config.json's base_model_name_or_path (PEFT reads it)
    model = get_peft_model(model, config)
    model.print_trainable_parameters()
    return model


def _parse_overrides(text: str) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            _fail(f"--config_overrides entry {item!r} is not key=value")
        k, v = (s.strip() for s in item.split("=", 1))
        for conv in (int, float):
            try:
                v = conv(v)
                break
            except ValueError:
                continue
        else:
            v = {"true": True, "false": False}.get(v.lower(), v)
        out[k] = v
    return out


def checkpoint_of(script: ScriptArguments) -> tuple:
    """(folder, GGUF file or None, name to record as the base model): the built-in model (recorded as the Hub model
    its GGUF was made from, which peft's AutoPeftModelForCausalLM can load), a folder (a folder holding exactly
    one .gguf and no config.json is that GGUF) or a .gguf file."""
    from polyfuse.loader.load import checkpoint_source

    path, gguf = script.model_name_or_path, script.gguf_file
    if path is None:
        from polyfuse.models.builtin import BUILTIN_HUB_ID, builtin_model

        try:
            path, gguf = builtin_model()
        except FileNotFoundError as e:
            _fail(str(e))
        return path, gguf, BUILTIN_HUB_ID
    path, gguf = checkpoint_source(path, gguf)
    from polyfuse.models.builtin import BUILTIN_HUB_ID, builtin_model

    with contextlib.suppress(FileNotFoundError):
        if gguf is not None and (os.path.realpath(path), gguf) == (
            os.path.realpath(builtin_model()[0]),
            builtin_model()[1],
        ):
            return path, gguf, BUILTIN_HUB_ID  # the built-in model given by its path
    return path, gguf, os.path.abspath(os.path.join(path, gguf) if gguf else path)


def load_model_and_tokenizer(script: ScriptArguments, targs: PolyfuseTrainingArguments):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from polyfuse.compat import DTYPE_KW  # dtype= from transformers 4.56 on, torch_dtype= before

    path, gguf, _ = checkpoint_of(script)
    kw = {"gguf_file": gguf} if gguf else {}
    tokenizer = AutoTokenizer.from_pretrained(script.tokenizer_name or path, **({} if script.tokenizer_name else kw))
    dtype = DTYPES[script.torch_dtype]
    if script.config_overrides:
        config = AutoConfig.from_pretrained(path, **kw)
        for k, v in _parse_overrides(script.config_overrides).items():
            if not hasattr(config, k):
                _fail(f"--config_overrides: {type(config).__name__} has no field {k!r}")
            setattr(config, k, v)
        if script.model_impl == "polyfuse":
            from polyfuse.models import AutoModelForCausalLM as PolyfuseAuto

            return PolyfuseAuto.from_config(
                config, dtype=dtype, device=targs.device, flags=targs.polyfuse_flags(),
                overrides=targs.polyfuse_overrides(), training=True,
            ), tokenizer  # fmt: skip
        from transformers import set_seed

        set_seed(targs.seed)  # the same random weights on every rank (FSDP2 shards each rank's own copy)
        with _rope_checked(config):
            return AutoModelForCausalLM.from_config(config, **{DTYPE_KW: dtype}), tokenizer
    if script.model_impl == "polyfuse":
        from polyfuse.models import AutoModelForCausalLM as PolyfuseAuto

        model = PolyfuseAuto.from_pretrained(
            path, gguf_file=gguf, dtype=dtype, device=targs.device, flags=targs.polyfuse_flags(),
            overrides=targs.polyfuse_overrides(), training=True,
        )  # fmt: skip
        return model, tokenizer
    with _rope_checked(lambda: AutoConfig.from_pretrained(path, **kw)):
        model = AutoModelForCausalLM.from_pretrained(path, **{DTYPE_KW: dtype}, **kw)
    if gguf:
        # transformers dequantizes GGUF weights into ordinary parameters but still tags the model as quantized,
        # which Trainer refuses to fine-tune; nothing is quantized any more, so drop the tag (and from the config,
        # so the saved checkpoint is a plain one).
        model.hf_quantizer = None
        if "is_quantized" in vars(model):
            model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    return model, tokenizer


@contextlib.contextmanager
def _rope_checked(config):
    """transformers' models look the rope type up in ROPE_INIT_FUNCTIONS when built: an unknown one is a bare
    KeyError. Turn it into polyfuse's one-line ValueError naming the known types (``config``: a config, or a
    callable loading it, called only then)."""
    try:
        yield
    except KeyError:
        from polyfuse.models.rope import check_rope_type

        check_rope_type(config() if callable(config) else config)
        raise


def build_dataset(tokenizer, train_file: str, block_size: int) -> list:
    text = Path(train_file).read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // block_size
    if n == 0:
        _fail(f"{train_file} has {len(ids)} tokens, fewer than one --block_size ({block_size}) block")
    blocks = [ids[i * block_size : (i + 1) * block_size] for i in range(n)]
    return [{"input_ids": b, "attention_mask": [1] * block_size, "labels": list(b)} for b in blocks]


@distributed_entry(tensor_parallel=False)  # under torchrun: rank 0 speaks, every rank exits promptly on an error
def main(argv=None) -> int:
    script, targs = parse_args(argv)
    created = not os.path.exists(targs.output_dir)
    try:
        return train(script, targs)
    except (ValueError, OSError) as e:  # bad checkpoints and arguments found late: one line, no traceback
        from polyfuse.core.errors import one_line

        after_interrupt(targs.output_dir, created)  # no empty folder left by a run that failed
        _fail(one_line(e) or type(e).__name__)
    except KeyboardInterrupt:
        last = after_interrupt(targs.output_dir, created)
        kept = f"{last} is the last complete checkpoint" if last else "nothing saved"
        print(f"{PROG}: interrupted: {kept}", file=sys.stderr)
        return 130


def run_info(script, targs) -> dict:
    """What train_results.json says about the run besides its metrics: the model, device, flags and versions."""
    import platform

    import transformers

    import polyfuse

    path, gguf, name = checkpoint_of(script)
    return {
        "model_name_or_path": name, "model_path": path, "gguf_file": gguf, "model_impl": script.model_impl,
        "lora_rank": script.lora_rank, "device": str(targs.device), "polyfuse_flags": targs.polyfuse_flags(),
        "polyfuse_ops": targs.polyfuse_overrides(), "torch_dtype": script.torch_dtype, "versions": {
            "polyfuse": polyfuse.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()},
    }  # fmt: skip


def train(script, targs) -> int:
    model = tokenizer = error = None
    try:
        model, tokenizer = load_model_and_tokenizer(script, targs)
    except (ValueError, OSError) as e:
        error = e
    # Several processes (torchrun): one rank's load error, or ranks given different models or arguments, become the
    # same error on every rank (printed by rank 0) instead of a peer waiting in a collective. One process: re-raised.
    agree_ranks(targs, error, model)
    if script.lora_rank > 0:
        model = add_lora(model, script, targs)
    train_dataset = build_dataset(tokenizer, script.train_file, script.block_size)
    if script.overwrite_output_dir and targs.resume_from_checkpoint is None and targs.process_index == 0:
        note = clear_earlier_run(targs.output_dir)
        if note:
            print(f"{PROG}: {note}", file=sys.stderr)
    stop = StopOnInterrupt() if targs.world_size == 1 else None  # torchrun: ranks could stop at different steps
    trainer = PolyfuseTrainer(
        model=model, args=targs, train_dataset=train_dataset, data_collator=default_data_collator,
        processing_class=tokenizer,  # every checkpoint-N folder gets the tokenizer too
        callbacks=[stop] if stop else None,
    )  # fmt: skip
    try:
        result = trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    finally:
        if stop is not None:
            stop.on_train_end(targs, None, None)  # the previous Ctrl-C handler back, also after an error
    if stop is not None and stop.interrupted and trainer.state.global_step < trainer.state.max_steps:
        last = os.path.join(targs.output_dir, f"checkpoint-{trainer.state.global_step}")
        print(f"{PROG}: interrupted at step {trainer.state.global_step} of {trainer.state.max_steps}: saved {last} "
              "(continue with --resume_from_checkpoint true)", file=sys.stderr)  # fmt: skip
        return 130
    trainer.save_model(targs.output_dir)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(targs.output_dir)
        metrics = result.metrics
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", {**metrics, **run_info(script, targs)})
        trainer.save_state()
        print(f"saved to {targs.output_dir}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        sys.exit(130)
