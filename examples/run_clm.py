#!/usr/bin/env python
"""Train a causal language model (the built-in SmolLM2-135M-Instruct by default) with polyfuse's fused ops, with the
arguments of optimum-habana 1.21's examples/language-modeling/run_clm.py (their names, types, defaults and meaning;
docs/training.md has the table) and polyfuse's own:

    python examples/run_clm.py --output_dir out --max_steps 20 --per_device_train_batch_size 2 --block_size 128
    python examples/run_clm.py --dataset_name ./my_dataset --dataset_config_name wikitext-2-raw-v1 \\
        --do_train --do_eval --output_dir out --block_size 128 --throughput_warmup_steps 3
    python examples/run_clm.py --model_name_or_path ./my-llama --attn_implementation gaudi_fused_sdpa --bf16 ...
    python examples/run_clm.py --config_overrides hidden_size=64,num_hidden_layers=2 ...   # random weights

Data through the ``datasets`` library, offline: --dataset_name (a local folder of data files, a save_to_disk folder,
or a Hub data set already in the datasets cache) with --dataset_config_name, or --train_file / --validation_file
(.txt, .json, .jsonl, .csv); without any, the bundled tiny corpus. Without a validation split,
--validation_split_percentage (5) of the training split is held out. --do_train / --do_eval as in optimum-habana's
script (with neither, it trains); evaluation reports eval_loss and perplexity (eval_results.json, all_results.json).

All of transformers' TrainingArguments and optimum-habana's GaudiTrainingArguments work, plus polyfuse's
--use_flash_attention, --use_fused_* (default on; pass False to turn off), --polyfuse_ops and --model_impl. The saved
folder loads with transformers.AutoModelForCausalLM.from_pretrained.

LoRA through PEFT (pip install peft, or pip install -e '.[lora]' in a clone), with either --model_impl (or use
examples/run_lora_clm.py, optimum-habana's LoRA script):

    python examples/run_clm.py --lora_rank 8 --lora_alpha 16 --lora_dropout 0.05 \\
        --lora_target_modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj --output_dir out ...

The output folder then holds PEFT's adapter, whose base_model_name_or_path is the folder trained from, or for the
built-in model the Hub model its GGUF was made from (HuggingFaceTB/SmolLM2-135M-Instruct), so that
peft.AutoPeftModelForCausalLM.from_pretrained(out) loads it. For another GGUF it is the .gguf file.

The output folder, as transformers' examples keep it: one that holds files is refused unless --overwrite_output_dir
(an earlier run's checkpoints and weights are removed first) or --resume_from_checkpoint (true: its last
checkpoint-N). Ctrl-C stops at the end of the step under way and saves a checkpoint of the finished steps (exit code
130); resume with --resume_from_checkpoint true.

Several devices, FSDP2 through the Trainer's arguments (docs/training.md, "FSDP2"; rank 0 prints, one error line):

    torchrun --nproc-per-node 8 examples/run_clm.py --fsdp "full_shard auto_wrap" --fsdp_config fsdp2.json ...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:  # torch and transformers take seconds to import: Ctrl-C meanwhile exits 130 without a traceback
    from transformers import default_data_collator

    import polyfuse
    from polyfuse.distributed.launch import distributed_entry
    from polyfuse.training import PolyfuseTrainer
    from polyfuse.training import clm_script as common
    from polyfuse.training.clm_args import DataTrainingArguments, LoraArguments, ModelArguments, source_notes
    from polyfuse.training.clm_data import load_raw, train_and_eval
    from polyfuse.training.clm_model import check_source, checkpoint_of, load_model_and_tokenizer, resize_embeddings
    from polyfuse.training.clm_tokens import block_size_for, clm_blocks
    from polyfuse.training.fsdp import agree_ranks
    from polyfuse.training.peft_setup import add_peft, check_lora_modules, run_clm_lora_config
    from polyfuse.training.run_dir import after_interrupt
except KeyboardInterrupt:
    print("run_clm.py: interrupted", file=sys.stderr)
    raise SystemExit(130) from None


PROG = "run_clm.py"
SCRIPT = common.Script(PROG)
DEFAULT_DATA = str(Path(__file__).resolve().parent / "data" / "tiny_corpus.txt")


def parse_args(argv=None) -> SimpleNamespace:
    (model, data, lora), targs, overwrite = SCRIPT.parse((ModelArguments, DataTrainingArguments, LoraArguments), argv)
    run = SimpleNamespace(model=model, data=data, lora=lora, targs=targs, overwrite=overwrite)
    run.training = bool(targs.do_train or not targs.do_eval)  # with neither flag it trains (polyfuse's default)
    if run.training:
        SCRIPT.check_steps(targs)
    if data.streaming and targs.max_steps <= 0:
        SCRIPT.fail("--streaming needs --max_steps (a streamed data set has no length)")
    if data.block_size is not None and data.block_size < 2:
        SCRIPT.fail("--block_size must be at least 2")
    try:
        check_source(model)
        check_lora_modules(lora)
    except ValueError as e:
        SCRIPT.fail(str(e))
    SCRIPT.check_output(targs, overwrite, run.training)
    SCRIPT.warn(targs, [*targs.gaudi_notes, *source_notes(model)])
    return run


def build_dataset(tokenizer, run, config) -> tuple:
    """(train blocks or None, eval blocks or None), as optimum-habana's run_clm.py builds them."""
    data, targs = run.data, run.targs
    raw = load_raw(data, run.model.cache_dir, True, data.streaming, DEFAULT_DATA)
    block = block_size_for(data.block_size, tokenizer, config)
    blocks = clm_blocks(raw, tokenizer, block, data, targs, run.training)
    return train_and_eval(blocks, run, f"has fewer tokens than one --block_size ({block}) block", data.streaming)


@distributed_entry(tensor_parallel=False)  # under torchrun: rank 0 speaks, every rank exits promptly on an error
def main(argv=None) -> int:
    run = parse_args(argv)
    created = not os.path.exists(run.targs.output_dir)
    try:
        return train(run)
    except (ValueError, OSError) as e:  # bad checkpoints, data and arguments found late: one line, no traceback
        from polyfuse.core.errors import one_line

        after_interrupt(run.targs.output_dir, created)  # no empty folder left by a run that failed
        SCRIPT.fail(one_line(e) or type(e).__name__)
    except KeyboardInterrupt:
        last = after_interrupt(run.targs.output_dir, created)
        kept = f"{last} is the last complete checkpoint" if last else "nothing saved"
        print(f"{PROG}: interrupted: {kept}", file=sys.stderr)
        return 130


def _load(run):
    model = tokenizer = error = None
    try:
        model, tokenizer = load_model_and_tokenizer(run.model, run.targs, run.model.torch_dtype)
    except (ValueError, OSError) as e:
        error = e
    # Several processes (torchrun): one rank's load error, or ranks given different models or arguments, become the
    # same error on every rank (printed by rank 0) instead of a peer waiting in a collective. One process: re-raised.
    agree_ranks(run.targs, error, model)
    if run.model.model_impl == "transformers":
        resize_embeddings(model, tokenizer)
    return model, tokenizer


def train(run) -> int:
    targs, data = run.targs, run.data
    model, tokenizer = _load(run)
    config = model.config
    source = checkpoint_of(run.model)
    if run.lora.lora_rank > 0:
        model = add_peft(model, run_clm_lora_config(run.lora), targs, source[2])
    train_ds, eval_ds = build_dataset(tokenizer, run, config)
    if run.training:
        common.clear_output(PROG, targs, run.overwrite)
    trainer = PolyfuseTrainer(
        model=model, args=targs, train_dataset=train_ds, eval_dataset=eval_ds, data_collator=default_data_collator,
        processing_class=tokenizer,  # every checkpoint-N folder gets the tokenizer too
    )  # fmt: skip
    if run.training:
        metrics, interrupted = common.train(PROG, trainer, targs)
        if interrupted:
            return 130
        streamed = targs.max_steps * targs.per_device_train_batch_size
        metrics["train_samples"] = streamed if data.streaming else len(train_ds)
        info = {"lora_rank": run.lora.lora_rank, "torch_dtype": run.model.torch_dtype}
        info = common.run_info(run.model, targs, source, info, polyfuse.__version__)
        common.save_train(trainer, targs, tokenizer, metrics, info, save=data.save_last_ckpt)
    if targs.do_eval:
        streamed = targs.max_steps * targs.per_device_eval_batch_size  # what optimum-habana's script reports
        common.evaluate(trainer, streamed if data.streaming else len(eval_ds))
    if trainer.is_world_process_zero() and run.training and data.save_last_ckpt:
        print(f"saved to {targs.output_dir}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        sys.exit(130)
