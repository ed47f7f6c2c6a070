#!/usr/bin/env python
"""Fine-tune a causal language model with a PEFT adapter (LoRA by default) through polyfuse's fused ops, with the
arguments of optimum-habana 1.21's examples/language-modeling/run_lora_clm.py (names, types, defaults and meaning;
docs/training.md has the table):

    python examples/run_lora_clm.py --dataset_name ./alpaca_like --output_dir out --max_steps 20 \\
        --lora_rank 8 --lora_alpha 16 --lora_dropout 0.05 --lora_target_modules q_proj v_proj \\
        --dataset_concatenation --max_seq_length 512 --do_train --do_eval --validation_split_percentage 4

The model: --model_name_or_path (a local folder or .gguf file; default the built-in SmolLM2-135M-Instruct GGUF) on
transformers' Llama patched by polyfuse, or polyfuse's Llama with --model_impl polyfuse. The data, offline: an
instruction data set (instruction / input / output columns, Alpaca's prompt; --sql_prompt, --chat_prompt, the
*_column_name renames) or one text column (each text an answer with an empty prompt), by --dataset_name or
--train_file / --validation_file (without any, the bundled tiny corpus). --peft_type lora, ia3, vera (either
--model_impl), adalora, llama-adapter, ln_tuning (transformers' Llama). Training saves PEFT's adapter in
--output_dir; evaluation reports eval_loss and perplexity (eval_results.json, all_results.json).

On Gaudi (--use_habana) the trainer uses Habana's FusedAdamW and FusedClipNorm, as optimum-habana's script does.
Ctrl-C, the output folder and errors behave as in examples/run_clm.py.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:  # torch and transformers take seconds to import: Ctrl-C meanwhile exits 130 without a traceback
    import torch
    from transformers import DataCollatorForLanguageModeling

    import polyfuse
    from polyfuse.distributed.launch import distributed_entry
    from polyfuse.training import GaudiConfig, PolyfuseTrainer
    from polyfuse.training import clm_script as common
    from polyfuse.training.clm_args import DataArguments, FinetuneArguments, LoraModelArguments, source_notes
    from polyfuse.training.clm_data import load_raw, train_and_eval
    from polyfuse.training.clm_model import check_source, checkpoint_of, load_model_and_tokenizer
    from polyfuse.training.fsdp import agree_ranks
    from polyfuse.training.lora_tokens import lora_examples
    from polyfuse.training.peft_setup import AdaLoraSteps, add_peft, check_finetune, peft_config
    from polyfuse.training.run_dir import after_interrupt
except KeyboardInterrupt:
    print("run_lora_clm.py: interrupted", file=sys.stderr)
    raise SystemExit(130) from None


PROG = "run_lora_clm.py"
SCRIPT = common.Script(PROG)
DEFAULT_DATA = str(Path(__file__).resolve().parent / "data" / "tiny_corpus.txt")


def parse_args(argv=None) -> SimpleNamespace:
    (model, data, finetune), targs, overwrite = SCRIPT.parse((LoraModelArguments, DataArguments, FinetuneArguments),
                                                             argv)  # fmt: skip
    run = SimpleNamespace(model=model, data=data, finetune=finetune, targs=targs, overwrite=overwrite)
    run.training = bool(targs.do_train or not targs.do_eval)  # with neither flag it trains (polyfuse's default)
    if run.training:
        SCRIPT.check_steps(targs)
    if data.max_seq_length is None or data.max_seq_length < 2:
        SCRIPT.fail(f"--max_seq_length must be at least 2, got {data.max_seq_length}")
    try:
        check_source(model)
        check_finetune(finetune, model.model_impl)
    except ValueError as e:
        SCRIPT.fail(str(e))
    SCRIPT.check_output(targs, overwrite, run.training)
    SCRIPT.warn(targs, [*targs.gaudi_notes, *source_notes(model, data, finetune)])
    return run


def build_dataset(tokenizer, run) -> tuple:
    """(train examples or None, eval examples or None), as optimum-habana's run_lora_clm.py builds them."""
    data, targs = run.data, run.targs
    raw = load_raw(data, run.model.cache_dir, targs.do_eval, default_file=DEFAULT_DATA,
                   keep_in_memory=data.keep_in_memory)  # fmt: skip
    examples = lora_examples(raw, tokenizer, data, run.finetune, targs, run.training, targs.do_eval)
    why = (f"has no example (with --dataset_concatenation: fewer tokens than one --max_seq_length "
           f"{data.max_seq_length} block)")  # fmt: skip
    return train_and_eval(examples, run, why)


def _align_tokenizer(model, tokenizer) -> None:
    """The tokenizer's pad / eos / bos ids from the model's generation config (a Llama without a pad id pads with
    EOS), then pad = eos where there still is none: optimum-habana's run_lora_clm.py."""
    gen = getattr(model, "generation_config", None)
    if gen is not None and model.config.model_type == "llama" and gen.pad_token_id is None:
        eos = gen.eos_token_id
        gen.pad_token_id = eos[0] if isinstance(eos, list) and eos else eos
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(gen, name, None) if gen is not None else None
        if value is not None:
            setattr(tokenizer, name, value[0] if isinstance(value, list) else value)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id


def total_steps(targs, n_train: int) -> int:
    """The optimizer steps the run will take (AdaLoRA's schedule needs it up front)."""
    if targs.max_steps > 0:
        return targs.max_steps
    per_step = targs.per_device_train_batch_size * max(targs.world_size, 1) * targs.gradient_accumulation_steps
    return max(1, math.ceil(n_train / per_step) * math.ceil(targs.num_train_epochs))


@distributed_entry(tensor_parallel=False)  # under torchrun: rank 0 speaks, every rank exits promptly on an error
def main(argv=None) -> int:
    run = parse_args(argv)
    created = not os.path.exists(run.targs.output_dir)
    try:
        return train(run)
    except (ValueError, OSError) as e:  # bad checkpoints, data and arguments found late: one line, no traceback
        from polyfuse.core.errors import one_line

        after_interrupt(run.targs.output_dir, created)
        SCRIPT.fail(one_line(e) or type(e).__name__)
    except KeyboardInterrupt:
        last = after_interrupt(run.targs.output_dir, created)
        kept = f"{last} is the last complete checkpoint" if last else "nothing saved"
        print(f"{PROG}: interrupted: {kept}", file=sys.stderr)
        return 130


def _adapted(run, model, n_train: int):
    """The model under its PEFT adapter, cast to bf16 with --bf16 (not IA3), as optimum-habana's script does."""
    finetune, targs = run.finetune, run.targs
    config = peft_config(finetune, total_steps(targs, n_train))
    if finetune.peft_type == "adalora" and config.total_step < config.tfinal:
        config.tfinal = 0  # optimum-habana's GaudiTrainer does the same for a run shorter than tfinal
    model = add_peft(model, config, targs, checkpoint_of(run.model)[2])
    if targs.bf16 and finetune.peft_type != "ia3":
        model = model.to(torch.bfloat16)
    return model


def train(run) -> int:
    targs, data = run.targs, run.data
    model = tokenizer = error = None
    try:
        dtype = "bfloat16" if targs.bf16 else "float32"
        model, tokenizer = load_model_and_tokenizer(
            run.model, targs, dtype, tokenizer_kwargs={"padding_side": "right"}
        )
    except (ValueError, OSError) as e:
        error = e
    agree_ranks(targs, error, model)
    _align_tokenizer(model, tokenizer)
    train_ds, eval_ds = build_dataset(tokenizer, run)
    model = _adapted(run, model, len(train_ds) if train_ds is not None else 0)
    if run.training:
        common.clear_output(PROG, targs, run.overwrite)
    collator = DataCollatorForLanguageModeling(tokenizer, pad_to_multiple_of=8, return_tensors="pt", mlm=False)
    trainer = PolyfuseTrainer(
        model=model, args=targs, train_dataset=train_ds, eval_dataset=eval_ds, data_collator=collator,
        processing_class=tokenizer, gaudi_config=GaudiConfig(use_fused_adam=True, use_fused_clip_norm=True),
    )  # fmt: skip
    if run.finetune.peft_type == "adalora":
        trainer.add_callback(AdaLoraSteps(model))
    if run.training:
        metrics, interrupted = common.train(PROG, trainer, targs)
        if interrupted:
            return 130
        info = {"peft_type": run.finetune.peft_type, "lora_rank": run.finetune.lora_rank}
        info = common.run_info(run.model, targs, checkpoint_of(run.model), info, polyfuse.__version__)
        common.save_train(trainer, targs, tokenizer, metrics, info, save=data.save_last_ckpt)
    if targs.do_eval:
        common.evaluate(trainer, len(eval_ds))
    if trainer.is_world_process_zero() and run.training and data.save_last_ckpt:
        print(f"saved to {targs.output_dir}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        sys.exit(130)
