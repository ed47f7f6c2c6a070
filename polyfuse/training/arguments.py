"""``PolyfuseTrainingArguments``: transformers' TrainingArguments plus the fused-op flags and every field of
optimum-habana 1.21's GaudiTrainingArguments with its name, type, default and meaning (polyfuse/training/
gaudi_arguments.py: implemented, warned or refused)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from transformers import TrainingArguments

from polyfuse.core import settings
from polyfuse.core.platform import default_device_type, hpu_available
from polyfuse.distributed.context import world_size_from_env
from polyfuse.training import gaudi_arguments
from polyfuse.training.gaudi_arguments import GaudiTrainingFields


# use_fused_* flag -> the registry ops it controls (off -> "-op", i.e. the native reference).
FUSED_FLAG_OPS = {
    "use_fused_rms_norm": ("rms_norm", "add_rms_norm"),
    "use_fused_rope": ("rotary",),
    "use_fused_swiglu": ("swiglu",),
    "use_fused_linear_cross_entropy": ("linear_cross_entropy",),
}


# FSDP2 on a CPU-only (gloo) run has been tested with accelerate 1.15 / transformers 5.24 / torch 2.13. With
# optimum-habana's pins (accelerate 1.10.1, transformers 4.55.4, torch 2.7.1) accelerate's FSDP plugin asks for an
# accelerator's device and the checkpoint load fails on a "cpu:0" location: refused there with one line.
CPU_FSDP_MIN_ACCELERATE = (1, 15)


def cpu_fsdp_unsupported() -> Optional[str]:
    """None when this accelerate can run FSDP2 on a CPU-only run (CI's gloo tests), else the one-line reason."""
    import accelerate

    have = tuple(int(p) for p in accelerate.__version__.split(".")[:2] if p.isdigit())
    if have >= CPU_FSDP_MIN_ACCELERATE:
        return None
    want = ".".join(map(str, CPU_FSDP_MIN_ACCELERATE))
    return (
        f"FSDP2 on a CPU-only run needs accelerate >= {want} (this is {accelerate.__version__}); on GPUs and Gaudi "
        "cards accelerate's own FSDP path applies"
    )


_HAS_WARMUP_RATIO = "warmup_ratio" in TrainingArguments.__dataclass_fields__


@dataclass
class _WarmupRatio:
    """transformers 5 dropped warmup_ratio (its warmup_steps takes a fraction below 1 instead); 4.x's spelling, which
    optimum-habana's README lines use, is kept and handed to warmup_steps."""

    warmup_ratio: Optional[float] = field(
        default=None, metadata={"help": "Linear warm-up over this fraction of the steps (sets --warmup_steps)."}
    )


_COMPAT = () if _HAS_WARMUP_RATIO else (_WarmupRatio,)


@dataclass
class PolyfuseTrainingArguments(GaudiTrainingFields, *_COMPAT, TrainingArguments):
    """transformers' TrainingArguments, optimum-habana's GaudiTrainingArguments fields (gaudi_arguments.py) and
    polyfuse's fused-op flags."""

    use_flash_attention: bool = field(
        default=False,
        metadata={"help": "Fused/flash attention (Habana FusedSDPA on Gaudi, Triton/SDPA flash kernels on CUDA)."},
    )
    attn_softmax_bf16: bool = field(
        default=False, metadata={"help": "Eager attention's softmax in bf16 (Gaudi; a warning elsewhere)."}
    )
    use_fused_rms_norm: bool = field(default=True, metadata={"help": "Fused RMSNorm (and residual add + RMSNorm)."})
    use_fused_rope: bool = field(default=True, metadata={"help": "Fused rotary position embedding."})
    use_fused_swiglu: bool = field(default=True, metadata={"help": "Fused SwiGLU activation."})
    use_fused_linear_cross_entropy: bool = field(
        default=True, metadata={"help": "LM head fused with cross-entropy: logits are never materialized."}
    )
    polyfuse_ops: str = field(
        default="",
        metadata={"help": "Op overrides, e.g. '+attention,-rotary,rms_norm=native' (applied after use_fused_*)."},
    )

    def __post_init__(self):
        if self.use_habana and not hpu_available():  # first: on a machine without a Gaudi, the one thing to say
            raise ValueError("--use_habana needs an Intel Gaudi and habana_frameworks; neither HPU nor package found")
        gaudi_arguments.habana_defaults(self)
        gaudi_arguments.check_fields(self)
        if not _HAS_WARMUP_RATIO and self.warmup_ratio is not None:
            if not 0 <= self.warmup_ratio < 1:
                raise ValueError(f"--warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
            if self.warmup_steps == 0:  # an explicit --warmup_steps wins, as in transformers 4.x
                self.warmup_steps = self.warmup_ratio
        self._validate_polyfuse()
        if not self.use_cpu and not self.use_habana and world_size_from_env() > 1 and default_device_type() == "cpu":
            # torchrun on a machine without an accelerator: without use_cpu accelerate sees no distributed setup and
            # every process would train alone; with it, the processes join one gloo group (DDP, or FSDP2).
            self.use_cpu = True
        if self.use_cpu and world_size_from_env() > 1 and self.ddp_backend in (None, "gloo"):
            self._join_gloo_group()
        super().__post_init__()
        from polyfuse.training.fsdp import validate_args

        validate_args(self)  # FSDP settings polyfuse cannot honour: one ValueError line
        if self.use_cpu and self.fsdp:
            why = cpu_fsdp_unsupported()
            if why:
                raise ValueError(why)
        if self.use_cpu and self.fsdp and "sync_module_states" not in (self.fsdp_config or {}):
            # transformers 4.x hands accelerate sync_module_states=true by default (FSDP_SYNC_MODULE_STATES), and
            # accelerate 1.10's FSDP plugin then asks for an accelerator's current device and raises on a CPU-only
            # run. It only matters for cpu_ram_efficient_loading (rank 0's weights broadcast), which a CPU run
            # does not use: off unless the user set it.
            settings.set_for_child("FSDP_SYNC_MODULE_STATES", "false")
        # one line per field that changes nothing on this run (scripts print them as warning: lines)
        self.gaudi_notes = gaudi_arguments.gaudi_notes(self, "hpu" if self.use_habana else self.device.type)

    def _join_gloo_group(self) -> None:
        """A CPU run under torchrun joins its gloo group here, waiting at most ``ddp_timeout`` seconds for the other
        ranks: accelerate's CPU path passes no timeout (torch's default is 30 minutes), so a rank that never comes
        would keep the others waiting. A group that does not form is one error naming the ranks."""
        import datetime

        import torch.distributed as dist

        if dist.is_initialized():
            return
        try:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=self.ddp_timeout))
        except (RuntimeError, ValueError) as e:  # DistStoreError / DistNetworkError: the rendezvous failed
            from polyfuse.core.errors import one_line

            rank, world = settings.get("RANK", "?"), world_size_from_env()
            raise RuntimeError(
                f"rank {rank} of {world}: the ranks did not all join within --ddp_timeout {self.ddp_timeout} s "
                f"(a rank unreachable or not started?): {one_line(e)}"
            ) from None

    def _validate_polyfuse(self) -> None:
        from polyfuse.core import registry

        if self.use_lazy_mode and not self.use_habana:
            raise ValueError("--use_lazy_mode can only be used with --use_habana (it is an HPU lazy-mode setting)")
        if self.gaudi_config_name and not self.use_habana:
            raise ValueError("--gaudi_config_name can only be used with --use_habana (it configures Gaudi training)")
        if self.deepspeed:  # passed through to transformers' DeepSpeed integration, which needs the package
            import importlib.util

            if importlib.util.find_spec("deepspeed") is None:
                raise ValueError(
                    "--deepspeed needs DeepSpeed: pip install deepspeed (on Gaudi, Habana's fork: "
                    "pip install git+https://github.com/HabanaAI/DeepSpeed.git)"
                )
            if self.fsdp:
                raise ValueError("--deepspeed and --fsdp cannot be used together: choose one")
        sub = [n for n in ("flash_attention_recompute", "flash_attention_causal_mask", "flash_attention_fast_softmax")
               if getattr(self, n)]  # fmt: skip
        if sub and not self.use_flash_attention:
            raise ValueError(f"--{' / --'.join(sub)} need --use_flash_attention (optimum-habana: --attn_implementation "
                             "gaudi_fused_sdpa)")  # fmt: skip
        if self.use_habana:
            from polyfuse.core.runtime import runtime_class

            bridge_lazy = runtime_class("hpu").lazy_mode_enabled()  # Habana's is_lazy(); eager by default on 1.21+
            if self.use_lazy_mode and not bridge_lazy:
                raise ValueError(
                    "--use_lazy_mode: Habana runs in eager mode here; set PT_HPU_LAZY_MODE=1 before Python"
                )
            if self.use_lazy_mode is None:
                self.use_lazy_mode = bridge_lazy
            if self.gaudi_config_name:  # read now, as optimum-habana's _setup_devices does: a missing one fails early
                from polyfuse.training.gaudi_config import GaudiConfig

                GaudiConfig.from_pretrained(self.gaudi_config_name)
            if gaudi_arguments.graphs_on(self) and not self.use_lazy_mode and not self.torch_compile_backend:
                raise ValueError("--use_hpu_graphs_for_inference / --use_hpu_graphs_for_training cannot be used in "
                                 "eager mode: set PT_HPU_LAZY_MODE=1 and --use_lazy_mode")  # fmt: skip
        if self.use_lazy_mode is None:
            self.use_lazy_mode = False
        registry.ops()  # loads the op declarations' users (backend plugins) so overrides can be checked
        registry.parse_overrides(self.polyfuse_ops)  # raises ValueError on an unknown op or a bad entry

    def polyfuse_flags(self) -> dict:
        """The run flags the registry reads (same names as the generation CLI)."""
        return {
            "use_flash_attention": self.use_flash_attention,
            "flash_attention_recompute": self.flash_attention_recompute,
            "flash_attention_causal_mask": self.flash_attention_causal_mask,
            "use_habana": self.use_habana,
            "use_lazy_mode": bool(self.use_lazy_mode),
            # Habana-only options: asked for on other devices they are one warning (gaudi_notes), not passed on
            "flash_attention_fast_softmax": self.flash_attention_fast_softmax and self.use_habana,
            "attn_softmax_bf16": self.attn_softmax_bf16 and self.use_habana,
        }

    def polyfuse_overrides(self) -> str:
        """``use_fused_*=False`` -> ``-op`` entries, then ``polyfuse_ops`` (later entries win)."""
        items = [f"-{op}" for flag, ops in FUSED_FLAG_OPS.items() if not getattr(self, flag) for op in ops]
        if self.polyfuse_ops:
            items.append(self.polyfuse_ops)
        return ",".join(items)
