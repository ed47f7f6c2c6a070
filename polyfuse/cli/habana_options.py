"""The rest of optimum-habana 1.21's examples/text-generation/run_generation.py flags, with its spelling, types and
defaults, so its command lines run unchanged (the flags polyfuse implements with the same meaning are in args.py).
Each flag here is one of:

* implemented: ``--sdp_on_bf16``, ``--cache_size_limit``, ``--dynamo_specialize_float``,
  ``--dynamo_allow_unspec_int_on_nn_module`` (torch's settings, as optimum-habana sets them), ``--parallel_strategy
  tp|none`` (under a launcher polyfuse shards the model by tensor parallelism), ``--local_rank`` (launchers pass it;
  the rank comes from the environment), ``--model_revision main``, data-set prompts (``--dataset_name``,
  ``--column_name``, ``--dataset_max_samples``, ``--run_partial_dataset``: cli/dataset.py), ``--peft_model``
  (cli/peft_adapter.py), ``--bad_words``, ``--simulate_dyn_prompt`` (cli/dyn_prompt.py);
* warned (one ``warning:`` line, the run goes on): a flag that changes nothing here, e.g. ``--bucket_internal``
  (polyfuse's --bucket_size always attends KV buckets of one preallocated cache), ``--reduce_recompile``,
  ``--load_quantized_model_with_autogptq`` (GPTQ checkpoints load natively), profiling and graph-count options;
* refused (one ``error:`` line naming the flag): what polyfuse cannot honour yet (MLCommons' pickle, forced words,
  other quantization toolkits, INC checkpoints, flex attention, ...).

``HABANA_FLAGS`` is the table (docs/hpu.md shows it; tests/test_habana_options.py checks it against optimum-habana's
argparse definitions). :func:`apply_habana_options` runs after parsing.
"""

from __future__ import annotations

import argparse


def _bool(value):
    v = str(value).lower()
    if v in ("1", "true", "yes", "y", "on", "t"):
        return True
    if v in ("0", "false", "no", "n", "off", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


ATTN_IMPLEMENTATIONS = ["flash_attention_3", "flash_attention_2", "flex_attention", "paged_attention", "sdpa",
                        "sdpa_paged", "eager", "eager_paged"]  # fmt: skip
# flag -> (status, note): "implemented", "warned" (when given / not at its default) or "refused" (likewise).
HABANA_FLAGS = {
    "--local_rank": ("implemented", "launchers pass it; the rank is read from the environment"),
    "--model_revision": ("implemented", "main only; another revision is refused"),
    "--parallel_strategy": (
        "implemented",
        "tp / none: under a launcher polyfuse shards by tensor parallelism; ep refused",
    ),
    "--sdp_on_bf16": ("implemented", "torch._C._set_math_sdp_allow_fp16_bf16_reduction(True)"),
    "--cache_size_limit": ("implemented", "torch._dynamo.config.cache_size_limit"),
    "--dynamo_specialize_float": ("implemented", "torch._dynamo.config.specialize_float"),
    "--dynamo_allow_unspec_int_on_nn_module": ("implemented", "torch._dynamo.config.allow_unspec_int_on_nn_module"),
    "--pt2e_quant_dtype": ("implemented", "used only with --pt2e_path (refused)"),
    "--saved_model_path": ("implemented", "used only with --save_quantized_model_with_inc (refused)"),
    "--bucket_internal": (
        "implemented",
        "polyfuse always buckets internally: one preallocated KV cache, each "
        "decode step attends its bucket; needs --use_kv_cache and --bucket_size >= 0",
    ),
    "--reduce_recompile": (
        "implemented",
        "prompts prepared on the host, only whole-bucket shapes reach the device; needs --bucket_size > 0",
    ),
    "--clear_hpu_graphs_cache": ("warned", "graphs are dropped when the KV cache is reallocated"),
    "--show_graphs_count": ("warned", "no graph dump count is kept"),
    "--verbose_workers": ("warned", "ranks other than 0 stay silent"),
    "--profiling_warmup_steps": ("warned", "no Habana profiler is run"),
    "--profiling_steps": ("warned", "no Habana profiler is run"),
    "--profiling_record_shapes": ("warned", "no Habana profiler is run"),
    "--profile_whole_sequences": ("warned", "no Habana profiler is run"),
    "--attn_batch_split": ("warned", "attention runs unsplit"),
    "--decode_attn_batch_split": ("warned", "attention runs unsplit"),
    "--regional_compile": (
        "implemented",
        "with --torch_compile: each decoder layer compiled, not the whole decoder (CUDA: the ops, with a warning)",
    ),
    "--force_static_compile": (
        "implemented",
        "with --torch_compile: dynamic=False, a graph per shape (Gaudi: and hpu_backend's force_static_compile)",
    ),
    "--attn_implementation": ("warned", "eager unless --use_flash_attention (its default, eager, changes nothing)"),
    "--trust_remote_code_tokenizer": ("warned", "the tokenizer is read without code from the checkpoint"),
    "--load_quantized_model_with_autogptq": ("warned", "polyfuse loads GPTQ checkpoints itself"),
    "--dataset_name": (
        "implemented",
        "prompts from a datasets data set: local folder or file, or a Hub id (cache when offline); cli/dataset.py",
    ),
    "--mlcommons_dataset": ("refused", "MLCommons' pickled OpenOrca is not supported: give --dataset_name"),
    "--column_name": ("implemented", "with --dataset_name: the column of prompts (default: its first of strings)"),
    "--dataset_max_samples": ("implemented", "with --dataset_name: >0: only that many (shuffled) rows"),
    "--run_partial_dataset": ("implemented", "with --dataset_name: stop after --n_iterations batches"),
    "--penalty_alpha": ("refused", "contrastive search is not supported"),
    "--bad_words": ("implemented", "words never generated (transformers' bad_words_ids)"),
    "--force_words": (
        "refused",
        "needs transformers' constrained beam search (force_words_ids), which polyfuse's beam search does not run",
    ),
    "--peft_model": (
        "implemented",
        "a PEFT adapter merged into the weights before generation (its base: the "
        "adapter's, else --model_name_or_path)",
    ),
    "--simulate_dyn_prompt": (
        "implemented",
        "prompt lengths: warm-up on each (or on every bucket), then one per timed run, cycling",
    ),
    "--use_flex_attention": ("refused", "flex attention is not supported"),
    "--book_source": ("refused", "downloads books from the network; give --prompt"),
    "--const_serialization_path": ("refused", "const serialization is Habana-specific and not supported"),
    "--input_embeds": ("refused", "generation from input embeddings is not supported"),
    "--save_quantized_model_with_inc": (
        "refused",
        "INC's save() writes transformers' per-projection modules and "
        "scales; polyfuse's fused qkv/gate_up projections have one each, so INC's "
        "load() could not read the file",
    ),
    "--load_quantized_model_with_inc": (
        "refused",
        "INC's load() builds a transformers model from its fp8 "
        "checkpoint, not a polyfuse one; polyfuse does not read that format",
    ),
    "--local_quantized_inc_model_path": (
        "refused",
        "INC's load(format='default', original_model=...) returns a "
        "transformers model (weight-only checkpoints); not supported",
    ),
    "--pt2e_save": ("refused", "PT2E quantization is not supported"),
    "--pt2e_path": ("refused", "PT2E quantization is not supported"),
    "--load_quantized_model_with_autoawq": ("refused", "AWQ checkpoints are not supported"),
    "--quantize_with_bnb": ("refused", "bitsandbytes NF4 is not supported"),
    "--disk_offload": ("refused", "offloading weights to disk is not supported"),
}


# One line each in --help (the table's longer reasons are for docs/hpu.md).
SHORT_HELP = {
    "--bucket_internal": "decode attends its KV bucket (polyfuse always does)",
    "--reduce_recompile": "prompts stay on the host: only bucket shapes reach the device",
    "--regional_compile": "--torch_compile per decoder layer, not the whole decoder",
    "--force_static_compile": "--torch_compile with dynamic=False",
    "--run_partial_dataset": "with --dataset_name: stop after --n_iterations batches",
    "--dataset_max_samples": "with --dataset_name: at most N rows (-1: all)",
    "--dataset_name": "prompts from a data set (folder, file or Hub id)",
    "--column_name": "with --dataset_name: the prompts' column",
    "--peft_model": "a PEFT adapter merged into the weights first",
    "--bad_words": "words never generated",
    "--simulate_dyn_prompt": "prompt lengths to warm up on and cycle through",
}
METAVARS = {"--dataset_name": "NAME", "--column_name": "NAME", "--peft_model": "PATH", "--bad_words": "WORD",
            "--simulate_dyn_prompt": "N"}  # fmt: skip


def add_habana_options(p: argparse.ArgumentParser) -> None:
    """optimum-habana's flags polyfuse's own groups do not define, with its spelling, types and defaults."""
    g = p.add_argument_group("more optimum-habana run_generation.py flags (docs/hpu.md: every flag, with its status)")
    raw = g.add_argument

    def a(*names, **kw):  # warned and refused flags parse but stay out of --help
        if HABANA_FLAGS.get(names[0], ("implemented",))[0] != "implemented":
            kw["help"] = argparse.SUPPRESS
        elif names[0] in SHORT_HELP:
            kw["help"] = SHORT_HELP[names[0]]
        if names[0] in METAVARS:
            kw["metavar"] = METAVARS[names[0]]
        return raw(*names, **kw)

    a("--local_rank", type=int, default=0, metavar="N", help="from launchers (ignored)")
    a("--model_revision", default="main", metavar="REV", help="Hub revision (main only)")
    a("--parallel_strategy", choices=["tp", "ep", "none"], default="none", metavar="S",
      help="tp (tensor parallel), ep or none")  # fmt: skip
    a("--sdp_on_bf16", action="store_true", help="reduced precision in torch's SDPA math backend")
    a("--cache_size_limit", type=int, default=None, metavar="N", help="torch._dynamo's cache size limit")
    a("--dynamo_specialize_float", action="store_true", help="torch._dynamo.config.specialize_float = True")
    a("--dynamo_allow_unspec_int_on_nn_module", action="store_true", default=True,
      help="dynamo's allow_unspec_int_on_nn_module (default: True)")  # fmt: skip
    a("--attn_implementation", default="eager", choices=ATTN_IMPLEMENTATIONS, metavar="NAME",
      help="eager (the default; --use_flash_attention picks the fused kernels)")  # fmt: skip
    for flag in ("--bucket_internal", "--reduce_recompile", "--clear_hpu_graphs_cache", "--show_graphs_count",
                 "--verbose_workers", "--profiling_record_shapes", "--profile_whole_sequences", "--regional_compile",
                 "--force_static_compile", "--trust_remote_code_tokenizer", "--load_quantized_model_with_autogptq",
                 "--run_partial_dataset", "--use_flex_attention", "--book_source", "--input_embeds",
                 "--save_quantized_model_with_inc", "--pt2e_save", "--load_quantized_model_with_autoawq",
                 "--quantize_with_bnb", "--disk_offload", "--load_quantized_model_with_inc"):  # fmt: skip
        a(flag, action="store_true", help=HABANA_FLAGS[flag][1])
    for flag in ("--profiling_warmup_steps", "--profiling_steps"):
        a(flag, type=int, default=0, metavar="N", help=HABANA_FLAGS[flag][1])
    for flag in ("--attn_batch_split", "--decode_attn_batch_split"):
        a(flag, type=int, default=1, metavar="N", help=HABANA_FLAGS[flag][1])
    a("--dataset_max_samples", type=int, default=-1, metavar="N", help=HABANA_FLAGS["--dataset_max_samples"][1])
    for flag in ("--dataset_name", "--mlcommons_dataset", "--column_name", "--peft_model", "--pt2e_path",
                 "--local_quantized_inc_model_path"):  # fmt: skip
        a(flag, default=None, help=HABANA_FLAGS[flag][1])
    a("--penalty_alpha", type=float, default=None, help=HABANA_FLAGS["--penalty_alpha"][1])
    for flag in ("--bad_words", "--force_words"):
        a(flag, type=str, nargs="+", default=None, help=HABANA_FLAGS[flag][1])
    a("--simulate_dyn_prompt", type=int, nargs="*", default=None, help=HABANA_FLAGS["--simulate_dyn_prompt"][1])
    a("--const_serialization_path", "--csp", default=None, help=HABANA_FLAGS["--const_serialization_path"][1])
    # Used only with flags that are refused: listed in docs/hpu.md, not in --help.
    a("--saved_model_path", default="inc_quantized_model", help=argparse.SUPPRESS)
    a("--pt2e_quant_dtype", choices=["int8", "fp8_143", "fp8_152"], default="fp8_143", help=argparse.SUPPRESS)


_DEFAULTS = {"profiling_warmup_steps": 0, "profiling_steps": 0, "attn_batch_split": 1, "decode_attn_batch_split": 1,
             "attn_implementation": "eager", "dataset_max_samples": -1}  # fmt: skip


def _given(args, flag: str) -> bool:
    name = flag.lstrip("-")
    value = getattr(args, name, None)
    if name in _DEFAULTS:
        return value != _DEFAULTS[name]
    return value not in (None, False)


def apply_habana_options(args) -> list[str]:
    """Refuse (ValueError, one line naming the flag) what cannot run, apply what is implemented, and return the
    warning lines for flags that change nothing here."""
    for flag, (status, note) in HABANA_FLAGS.items():
        if status == "refused" and _given(args, flag):
            raise ValueError(f"{flag}: {note}")
    if args.parallel_strategy == "ep":
        raise ValueError("--parallel_strategy ep: expert parallelism is not supported (tp or none)")
    if args.model_revision != "main":
        raise ValueError(f"--model_revision {args.model_revision}: only main is supported")
    if args.simulate_dyn_prompt == []:  # given without lengths: the static prompt (optimum-habana's help says)
        args.simulate_dyn_prompt = None
    if args.simulate_dyn_prompt is not None and any(n < 1 for n in args.simulate_dyn_prompt):
        raise ValueError(f"--simulate_dyn_prompt: prompt lengths must be >= 1, got {args.simulate_dyn_prompt}")
    warnings = [f"{flag}: changes nothing here ({note})" for flag, (status, note) in HABANA_FLAGS.items()
                if status == "warned" and _given(args, flag)]  # fmt: skip
    for flag in ("--regional_compile", "--force_static_compile"):
        if _given(args, flag) and not getattr(args, "torch_compile", False):
            warnings.append(f"{flag} without --torch_compile: changes nothing (as in optimum-habana)")
    import torch

    if args.sdp_on_bf16:
        torch._C._set_math_sdp_allow_fp16_bf16_reduction(True)
    if getattr(args, "torch_compile", False):
        import torch._dynamo

        if args.cache_size_limit is not None:
            torch._dynamo.config.cache_size_limit = args.cache_size_limit
        if args.dynamo_specialize_float:
            torch._dynamo.config.specialize_float = True
        if args.dynamo_allow_unspec_int_on_nn_module:
            torch._dynamo.config.allow_unspec_int_on_nn_module = True
    return warnings
