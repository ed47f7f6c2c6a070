"""optimum-habana 1.21's ``GaudiTrainingArguments`` fields, with its names, types, defaults and meanings, for
``PolyfuseTrainingArguments`` (a mixin: ``PolyfuseTrainingArguments(GaudiTrainingFields, TrainingArguments)``).

Every field is one of (``GAUDI_FIELDS``; docs/training.md shows the table, tests/test_gaudi_arguments.py checks it
against the fields read from optimum-habana's wheel, tests/data/optimum_habana_1.21_training_args.json):

* implemented: what optimum-habana's GaudiTrainer does with it, done by PolyfuseTrainer or here (torch's dynamo
  settings, as optimum-habana's ``_setup_devices`` sets them);
* warned: a value that changes nothing on this run says so in one line (``gaudi_notes``, printed as ``warning:``);
* refused: a value polyfuse cannot honour is one ``ValueError`` line naming the field.

optimum-habana also overrides six of transformers' defaults (``OWN_DEFAULTS``); polyfuse keeps transformers' defaults
so that GPU and CPU runs are unchanged, and applies optimum-habana's under ``--use_habana`` where the value was left at
transformers' default (:func:`habana_defaults`).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class GaudiTrainingFields:
    use_habana: Optional[bool] = field(default=False, metadata={"help": "Train on an Intel Gaudi (HPU)."})
    gaudi_config_name: Optional[str] = field(
        default=None,
        metadata={"help": "A gaudi_config.json: a file, a folder, or a Hub name in the local Hugging Face cache."},
    )
    use_lazy_mode: Optional[bool] = field(
        default=None,
        # a bare --use_lazy_mode, as optimum-habana's README lines give it (HfArgumentParser passes metadata to
        # argparse; an Optional[bool] with a None default would need a value otherwise)
        metadata={"help": "HPU lazy mode. Default: Habana's own mode with --use_habana.", "nargs": "?", "const": True},
    )
    use_hpu_graphs: Optional[bool] = field(
        default=False, metadata={"help": "Deprecated, use --use_hpu_graphs_for_inference (changes nothing)."}
    )
    use_hpu_graphs_for_inference: Optional[bool] = field(
        default=False, metadata={"help": "Evaluation through HPU graphs (wrap_in_hpu_graph). Gaudi, lazy mode."}
    )
    use_hpu_graphs_for_training: Optional[bool] = field(
        default=False, metadata={"help": "Training through HPU graphs (Habana's ModuleCacher). Gaudi, lazy mode."}
    )
    use_compiled_autograd: Optional[bool] = field(
        default=False, metadata={"help": "With --torch_compile: the backward compiled too (compiled autograd)."}
    )
    compile_from_sec_iteration: Optional[bool] = field(
        default=False,
        metadata={"help": "With --torch_compile: the first step runs eagerly, compiling from the second."},
    )
    compile_dynamic: Optional[bool | None] = field(
        default=None, metadata={"help": "With --torch_compile: torch.compile's dynamic= (None: torch decides)."}
    )
    use_zero3_leaf_promotion: Optional[bool] = field(
        default=False, metadata={"help": "DeepSpeed ZeRO-3: decoder layers as leaf modules (polyfuse always does)."}
    )
    cache_size_limit: Optional[int] = field(
        default=None, metadata={"help": "With --torch_compile: torch._dynamo.config.cache_size_limit."}
    )
    use_regional_compilation: Optional[bool] = field(
        default=False, metadata={"help": "With --torch_compile: compile each repeated block, not the whole model."}
    )
    inline_inbuilt_nn_modules: Optional[bool] = field(
        default=None, metadata={"help": "torch._dynamo.config.inline_inbuilt_nn_modules."}
    )
    allow_unspec_int_on_nn_module: Optional[bool] = field(
        default=None, metadata={"help": "torch._dynamo.config.allow_unspec_int_on_nn_module."}
    )
    disable_tensor_cache_hpu_graphs: Optional[bool] = field(
        default=False, metadata={"help": "HPU graphs keep no tensor cache (less device memory)."}
    )
    max_hpu_graphs: Optional[int] = field(default=None, metadata={"help": "Most HPU graphs cached for inference."})
    distribution_strategy: Optional[str] = field(
        default="ddp",
        metadata={"help": "ddp (DistributedDataParallel); fast_ddp is refused over several processes.",
                  "choices": ["ddp", "fast_ddp"]},
    )  # fmt: skip
    context_parallel_size: Optional[int] = field(
        default=1, metadata={"help": "Ranks one sequence is split over (DeepSpeed Ulysses); only 1 here."}
    )
    minimize_memory: Optional[bool] = field(default=False, metadata={"help": "Habana fp8 memory mode (needs fp8)."})
    throughput_warmup_steps: Optional[int] = field(
        default=0, metadata={"help": "Steps left out of the throughput metrics (train and eval), as optimum-habana."}
    )
    adjust_throughput: bool = field(
        default=False, metadata={"help": "Leave the time spent logging, evaluating and saving out of the throughput."}
    )
    pipelining_fwd_bwd: Optional[bool] = field(
        default=False, metadata={"help": "A mark_step between forward and backward (Gaudi lazy mode)."}
    )
    ignore_eos: Optional[bool] = field(
        default=True, metadata={"help": "generate() setting of optimum-habana's seq2seq trainer (changes nothing)."}
    )
    non_blocking_data_copy: Optional[bool] = field(
        default=False, metadata={"help": "Copy each batch to the device with non_blocking=True."}
    )
    profiling_warmup_steps: Optional[int] = field(default=0, metadata={"help": "Training steps before profiling."})
    profiling_steps: Optional[int] = field(
        default=0, metadata={"help": "Training steps profiled (torch.profiler, trace in ./hpu_profile/train)."}
    )
    profiling_warmup_steps_eval: Optional[int] = field(default=0, metadata={"help": "Eval steps before profiling."})
    profiling_steps_eval: Optional[int] = field(
        default=0, metadata={"help": "Eval steps profiled (trace in ./hpu_profile/evaluation)."}
    )
    profiling_record_shapes: Optional[bool] = field(default=True, metadata={"help": "Profiler: record shapes."})
    profiling_with_stack: Optional[bool] = field(default=False, metadata={"help": "Profiler: record stacks."})
    half_precision_backend: str = field(
        default="hpu_amp",
        metadata={"help": "--bf16 as autocast: hpu_amp (on Gaudi; accelerate's bf16 elsewhere) or cpu_amp (CPU).",
                  "choices": ["cpu_amp", "hpu_amp"]},
    )  # fmt: skip
    attn_implementation: Optional[str] = field(
        default="eager",
        metadata={"help": "gaudi_fused_sdpa: fused attention (= --use_flash_attention); eager / sdpa: the model's.",
                  "choices": ["eager", "sdpa", "gaudi_fused_sdpa"]},
    )  # fmt: skip
    flash_attention_recompute: bool = field(
        default=False, metadata={"help": "Fused attention recomputed in the backward (less memory)."}
    )
    flash_attention_fast_softmax: bool = field(default=False, metadata={"help": "FusedSDPA's fast softmax (Gaudi)."})
    flash_attention_causal_mask: bool = field(
        default=False, metadata={"help": "The kernel's causal flag instead of a mask tensor."}
    )
    flash_attention_fp8: bool = field(default=False, metadata={"help": "FusedSDPA in fp8 (refused)."})
    sdp_on_bf16: bool = field(default=False, metadata={"help": "torch's SDPA math backend may reduce in bf16/fp16."})
    fp8: Optional[bool] = field(default=False, metadata={"help": "fp8 training (refused)."})


IMPLEMENTED, WARNED, REFUSED = "implemented", "warned", "refused"
# field -> (status, what polyfuse does with it); docs/training.md's table shows it.
GAUDI_FIELDS = {
    "use_habana": (IMPLEMENTED, "train on the HPU; without a Gaudi one error line"),
    "gaudi_config_name": (IMPLEMENTED, "a file, a folder, or a Hub name read from the local Hugging Face cache"),
    "use_lazy_mode": (IMPLEMENTED, "mark_step after the backward and the optimizer step; default: Habana's mode"),
    "use_hpu_graphs": (WARNED, "deprecated in optimum-habana too, where it changes nothing"),
    "use_hpu_graphs_for_inference": (IMPLEMENTED, "evaluation through wrap_in_hpu_graph (Gaudi, lazy mode)"),
    "use_hpu_graphs_for_training": (IMPLEMENTED, "training through Habana's ModuleCacher (Gaudi, lazy mode)"),
    "use_compiled_autograd": (IMPLEMENTED, "with --torch_compile: torch._dynamo.config.compiled_autograd"),
    "compile_from_sec_iteration": (IMPLEMENTED, "with --torch_compile: torch.compiler.set_stance('force_eager') "
                                                "for the first step"),
    "compile_dynamic": (IMPLEMENTED, "with --torch_compile: accelerate's dynamo plugin dynamic="),
    "use_zero3_leaf_promotion": (IMPLEMENTED, "with ZeRO-3 polyfuse always makes decoder layers leaf modules"),
    "cache_size_limit": (IMPLEMENTED, "with --torch_compile: torch._dynamo.config.cache_size_limit"),
    "use_regional_compilation": (IMPLEMENTED, "with --torch_compile: accelerate's compile_regions"),
    "inline_inbuilt_nn_modules": (IMPLEMENTED, "torch._dynamo.config.inline_inbuilt_nn_modules (a warning where "
                                               "torch ignores it)"),
    "allow_unspec_int_on_nn_module": (IMPLEMENTED, "torch._dynamo.config.allow_unspec_int_on_nn_module"),
    "disable_tensor_cache_hpu_graphs": (IMPLEMENTED, "wrap_in_hpu_graph(disable_tensor_cache=)"),
    "max_hpu_graphs": (IMPLEMENTED, "wrap_in_hpu_graph(max_graphs=)"),
    "distribution_strategy": (IMPLEMENTED, "ddp (gradient_as_bucket_view on Gaudi); fast_ddp: a warning in one "
                                           "process, refused over several"),
    "context_parallel_size": (REFUSED, "only 1: no sequence parallelism (DeepSpeed Ulysses)"),
    "minimize_memory": (WARNED, "an fp8 setting; fp8 training is refused"),
    "throughput_warmup_steps": (IMPLEMENTED, "the first N steps left out of train/eval samples and steps per "
                                             "second"),
    "adjust_throughput": (IMPLEMENTED, "time spent logging, evaluating and saving left out of the throughput"),
    "pipelining_fwd_bwd": (IMPLEMENTED, "mark_step between forward and backward (Gaudi lazy mode; a warning "
                                        "elsewhere)"),
    "ignore_eos": (WARNED, "a generate() setting; nothing here generates"),
    "non_blocking_data_copy": (IMPLEMENTED, "batches copied with non_blocking=True"),
    "profiling_warmup_steps": (IMPLEMENTED, "torch.profiler schedule warmup"),
    "profiling_steps": (IMPLEMENTED, "torch.profiler over that many steps, trace in ./hpu_profile/train"),
    "profiling_warmup_steps_eval": (IMPLEMENTED, "torch.profiler schedule warmup in evaluation"),
    "profiling_steps_eval": (IMPLEMENTED, "torch.profiler in evaluation, trace in ./hpu_profile/evaluation"),
    "profiling_record_shapes": (IMPLEMENTED, "torch.profiler record_shapes"),
    "profiling_with_stack": (IMPLEMENTED, "torch.profiler with_stack"),
    "optim": (IMPLEMENTED, "transformers' default; adamw_torch under --use_habana"),
    "adam_epsilon": (IMPLEMENTED, "transformers' default; 1e-6 under --use_habana"),
    "logging_nan_inf_filter": (IMPLEMENTED, "transformers' default; False under --use_habana"),
    "ddp_bucket_cap_mb": (IMPLEMENTED, "transformers' default; 230 under --use_habana"),
    "ddp_find_unused_parameters": (IMPLEMENTED, "transformers' default; False under --use_habana"),
    "half_precision_backend": (IMPLEMENTED, "hpu_amp: --bf16 as HPU autocast on Gaudi; cpu_amp: CPU autocast"),
    "attn_implementation": (IMPLEMENTED, "gaudi_fused_sdpa = --use_flash_attention; eager / sdpa: the registry's "
                                         "default attention"),
    "flash_attention_recompute": (IMPLEMENTED, "fused attention recomputed in the backward"),
    "flash_attention_fast_softmax": (IMPLEMENTED, "FusedSDPA fast softmax on Gaudi; a warning elsewhere"),
    "flash_attention_causal_mask": (IMPLEMENTED, "the kernel's causal flag"),
    "flash_attention_fp8": (REFUSED, "no fp8 attention in training"),
    "sdp_on_bf16": (IMPLEMENTED, "torch._C._set_math_sdp_allow_fp16_bf16_reduction(True)"),
    "fp8": (REFUSED, "fp8 training (Transformer Engine on Gaudi) is not implemented"),
}  # fmt: skip
# optimum-habana's overrides of transformers' defaults that polyfuse applies under --use_habana only (its values),
# and use_lazy_mode, whose default follows Habana's own mode (optimum-habana: True, which fails without --use_habana).
HABANA_DEFAULTS = {
    "optim": "adamw_torch",
    "adam_epsilon": 1e-6,
    "logging_nan_inf_filter": False,
    "ddp_bucket_cap_mb": 230,
    "ddp_find_unused_parameters": False,
}
OWN_DEFAULTS = {**dict.fromkeys(HABANA_DEFAULTS, "transformers' default; optimum-habana's under --use_habana"),
                "use_lazy_mode": "None: Habana's own mode under --use_habana, off elsewhere"}  # fmt: skip
# optimum-habana refuses these transformers arguments on Gaudi (its UNSUPPORTED_ARGUMENTS)
HABANA_REFUSED = {
    "fp16": "mixed precision on Gaudi is bf16 (--bf16, or use_torch_autocast in the gaudi config)",
    "fp16_full_eval": "mixed precision on Gaudi is bf16",
    "tf32": "tf32 is an NVIDIA setting",
    "tpu_num_cores": "TPUs are not Gaudi",
    "tpu_metrics_debug": "TPUs are not Gaudi",
    "mp_parameters": "SageMaker model parallelism is not supported on Gaudi",
}


def habana_defaults(args) -> None:
    """Under --use_habana: optimum-habana's defaults for the fields still at transformers' (before validation)."""
    if not args.use_habana:
        return
    from transformers import TrainingArguments

    base = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    for name, value in HABANA_DEFAULTS.items():
        f = base.get(name)
        if f is not None and getattr(args, name) == f.default:
            setattr(args, name, value)


def graphs_on(args) -> bool:
    return bool(args.use_hpu_graphs or args.use_hpu_graphs_for_inference or args.use_hpu_graphs_for_training)


def check_fields(args) -> None:
    """optimum-habana's own checks, and the values polyfuse refuses: one ValueError line naming the field."""
    if graphs_on(args) and not args.use_habana:
        raise ValueError("--use_hpu_graphs_for_inference / --use_hpu_graphs_for_training can only be used with "
                         "--use_habana (HPU graphs are Gaudi's)")  # fmt: skip
    if args.disable_tensor_cache_hpu_graphs and not graphs_on(args):
        raise ValueError("--disable_tensor_cache_hpu_graphs needs HPU graphs (--use_hpu_graphs_for_inference)")
    if args.max_hpu_graphs is not None and not graphs_on(args):
        raise ValueError("--max_hpu_graphs needs HPU graphs (--use_hpu_graphs_for_inference)")
    if args.distribution_strategy not in ("ddp", "fast_ddp"):
        raise ValueError(f"--distribution_strategy must be ddp or fast_ddp, got {args.distribution_strategy!r}")
    if args.throughput_warmup_steps is None or args.throughput_warmup_steps < 0:
        raise ValueError(f"--throughput_warmup_steps must be >= 0, got {args.throughput_warmup_steps}")
    if args.attn_implementation not in ("eager", "sdpa", "gaudi_fused_sdpa"):
        raise ValueError(f"--attn_implementation must be eager, sdpa or gaudi_fused_sdpa, got "
                         f"{args.attn_implementation!r}")  # fmt: skip
    if args.half_precision_backend not in ("cpu_amp", "hpu_amp"):
        raise ValueError(f"--half_precision_backend must be cpu_amp or hpu_amp, got {args.half_precision_backend!r}")
    if args.fp8:
        raise ValueError("--fp8: " + GAUDI_FIELDS["fp8"][1])
    if args.flash_attention_fp8:
        raise ValueError("--flash_attention_fp8: polyfuse has no fp8 attention in training")
    if args.context_parallel_size != 1:
        raise ValueError(f"--context_parallel_size {args.context_parallel_size}: sequence parallelism (DeepSpeed "
                         "Ulysses) is not implemented; only 1")  # fmt: skip
    if args.use_habana:
        for name, why in HABANA_REFUSED.items():
            if getattr(args, name, None):
                raise ValueError(f"--{name} is not supported with --use_habana: {why}")
    if args.attn_implementation == "gaudi_fused_sdpa":
        args.use_flash_attention = True  # optimum-habana's spelling of fused attention


def _dynamo_settings(args, notes: list) -> None:
    """torch's settings, as optimum-habana's _setup_devices sets them (global to the process, like theirs)."""
    import torch

    if args.sdp_on_bf16:
        torch._C._set_math_sdp_allow_fp16_bf16_reduction(True)
    dynamo = None
    if args.inline_inbuilt_nn_modules is not None or args.allow_unspec_int_on_nn_module is not None:
        import torch._dynamo

        dynamo = torch._dynamo.config
    if args.inline_inbuilt_nn_modules is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dynamo.inline_inbuilt_nn_modules = args.inline_inbuilt_nn_modules
        if any("does not do anything" in str(w.message) for w in caught):
            notes.append(f"--inline_inbuilt_nn_modules changes nothing on torch {torch.__version__} (always on)")
    if args.allow_unspec_int_on_nn_module is not None:
        dynamo.allow_unspec_int_on_nn_module = args.allow_unspec_int_on_nn_module
    compile_only = [n for n in ("cache_size_limit", "compile_dynamic") if getattr(args, n) is not None]
    compile_only += [n for n in ("use_regional_compilation", "compile_from_sec_iteration", "use_compiled_autograd")
                     if getattr(args, n)]  # fmt: skip
    if not args.torch_compile:
        notes.extend(f"--{n} changes nothing without --torch_compile" for n in compile_only)
        return
    import torch._dynamo

    if args.cache_size_limit is not None:
        torch._dynamo.config.cache_size_limit = args.cache_size_limit
    if args.use_compiled_autograd:
        torch._dynamo.config.compiled_autograd = True


def gaudi_notes(args, device_type: str) -> list:
    """After validation: torch's settings applied, and one line for each field that changes nothing on this run."""
    notes: list = []
    _dynamo_settings(args, notes)
    if args.use_hpu_graphs:
        notes.append("--use_hpu_graphs is deprecated (optimum-habana: use --use_hpu_graphs_for_inference); it "
                     "changes nothing")  # fmt: skip
    hpu_lazy = device_type == "hpu" and bool(args.use_lazy_mode)
    if args.pipelining_fwd_bwd and not hpu_lazy:
        notes.append(f"--pipelining_fwd_bwd changes nothing on {device_type}: it is a mark_step for Gaudi's lazy mode")
    if args.flash_attention_fast_softmax and device_type != "hpu":
        notes.append(f"--flash_attention_fast_softmax changes nothing on {device_type} (Habana FusedSDPA option)")
    if getattr(args, "attn_softmax_bf16", False) and device_type != "hpu":
        notes.append(f"--attn_softmax_bf16 changes nothing on {device_type}: softmax stays in fp32 (Gaudi's eager "
                     "attention option)")  # fmt: skip
    if args.minimize_memory:
        notes.append("--minimize_memory changes nothing: it is an fp8 setting and fp8 training is refused")
    if args.ignore_eos is False:
        notes.append("--ignore_eos changes nothing: it is a generate() setting and nothing here generates")
    if args.use_zero3_leaf_promotion and not args.deepspeed:
        notes.append("--use_zero3_leaf_promotion changes nothing without --deepspeed (ZeRO-3)")
    if args.distribution_strategy == "fast_ddp":
        if args.world_size > 1:
            raise ValueError("--distribution_strategy fast_ddp (optimum-habana's fused all-reduce in HPU graphs) is "
                             "not implemented over several processes: use ddp, the default")  # fmt: skip
        notes.append("--distribution_strategy fast_ddp changes nothing in one process")
    if args.half_precision_backend == "cpu_amp" and args.bf16 and device_type != "cpu":
        notes.append(f"--half_precision_backend cpu_amp changes nothing on {device_type}: --bf16 as accelerate does")
    return notes
