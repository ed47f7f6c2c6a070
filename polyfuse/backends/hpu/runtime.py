"""``HpuRuntime``: step boundaries, HPU graphs, torch.compile backend, sync and memory statistics on Gaudi.

* Creating the runtime (which the model build does for device ``hpu``) imports ``habana_frameworks.torch``, which
  registers the hpu device with torch, as optimum-habana's ``setup_device`` does for ``--device hpu``.
* Lazy or eager is Habana's own answer, ``habana_frameworks.torch.utils.internal.is_lazy()``: ``PT_HPU_LAZY_MODE``,
  read once when the bridge is imported; **unset means eager since Synapse 1.21** (it meant lazy up to 1.20).
* Lazy mode accumulates ops into a graph that runs at ``mark_step()``. The generation loop calls
  ``runtime.mark_step()`` after every step, and the model calls the hook from ``layer_hook()`` before every decoder
  layer in inference, as optimum-habana's ``GaudiLlamaModel`` does: on one card only (with torch.distributed over
  several processes it skips it, as optimum-habana does).
* Multi-card (``WORLD_SIZE`` > 1): ``PT_HPU_ENABLE_LAZY_COLLECTIVES=true`` is set where unset before the bridge is
  imported (optimum-habana's ``setup_env``), which tensor parallelism with HPU graphs needs; set to false, HPU graphs
  under tensor parallelism are refused in one line. In eager mode mark_step is never called (it is a
  lazy-only function there; optimum-habana PR #707).
* ``graph_module`` wraps a step module with ``habana_frameworks.torch.hpu.wrap_in_hpu_graph`` under
  ``--use_hpu_graphs`` (lazy mode only: the bridge does not export the graph API in eager mode, and
  ``wrap_in_hpu_graph`` is not even looked up there). That call replaces ``module.forward`` in place (and gives the
  wrapper a ``bypass_hpu_graphs=True`` keyword that runs the plain forward), so a module is wrapped once whatever
  phase asks first, and each phase gets an :class:`HpuGraphStep` around it. With ``--limit_hpu_graphs`` the prefill
  step passes ``bypass_hpu_graphs=True``: exactly optimum-habana's first-token bypass; no graph is captured for the
  prompt. ``step.reset()`` drops the captured graphs (``module.clear_cache()``), needed when the KV cache is
  reallocated: graphs hold the tensors they were captured with.
* HPU graphs key their cache on the inputs' shapes and *views* (a slice that moves along its base is a new graph)
  and on the value of every non-tensor argument; a replay copies the new inputs into the capture-time tensors and
  returns the capture-time outputs. The decoding loop therefore feeds one persistent cache-position tensor advanced
  in place (optimum-habana's ``token_idx.add_(1)``), so it captures one decode graph per KV bucket.
* fp8 on Gaudi2, whose e4m3 reaches 240: ``fp8_max()`` makes weights quantized on the device scale to 240, and
  ``adapt_quantized()`` halves the loaded fp8 rows beyond it and doubles their scales (fp8_range.py); Gaudi3 holds
  float8_e4m3fn's 448.
* fp8 on Gaudi: ``adapt_quantized()`` also makes each fp8 weight's [K, N] copy, the form INC passes to
  ``fp8_gemm_v2`` (fp8_linear.py), where the run uses that kernel.
* int4 on Gaudi: ``adapt_quantized()`` also repacks each int4 weight into the layout of Habana's
  ``convert_from_uint4`` once (int4_linear.py), kept beside the module's buffers, where the run uses that kernel.
* ``compile_backend()`` is ``"hpu_backend"`` (optimum-habana's and transformers' torch.compile backend on Gaudi),
  and only in eager mode: "Dynamo and lazy are mutually exclusive" (optimum-habana's training_args.py).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from polyfuse.backends.hpu import _habana, fp8_linear, int4_linear
from polyfuse.backends.hpu.fp8_range import device_fp8_max, fit_gaudi2
from polyfuse.core import settings
from polyfuse.core.runtime import DeviceRuntime, Step


logger = logging.getLogger("polyfuse")

_WRAPPED = "_polyfuse_hpu_graph"

GRAPHS_NEED_LAZY = (
    "--use_hpu_graphs needs Habana's lazy mode, and this process runs in eager mode (the default since Synapse 1.21): "
    "set PT_HPU_LAZY_MODE=1 before starting Python, or use --torch_compile"
)
GRAPHS_NEED_LAZY_COLLECTIVES = (
    "--use_hpu_graphs under tensor parallelism needs PT_HPU_ENABLE_LAZY_COLLECTIVES=true (collectives inside HPU "
    "graphs); it is set to false in this process's environment"
)
COMPILE_NEEDS_EAGER = (
    "--torch_compile on HPU needs Habana's eager mode, and this process runs in lazy mode: "
    "set PT_HPU_LAZY_MODE=0 (or leave it unset on Synapse 1.21+) before starting Python"
)


def lazy_mode_enabled() -> bool:
    """Habana's ``is_lazy()`` (PT_HPU_LAZY_MODE read once by the bridge; unset = eager since Synapse 1.21)."""
    return _habana.is_lazy()


def _distributed_world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class HpuGraphStep(Step):
    """What ``graph_module`` returns under --use_hpu_graphs: calls the module wrapped by ``wrap_in_hpu_graph``."""

    def __init__(self, module: torch.nn.Module, bypass: bool = False):
        super().__init__(module)
        self.module = module
        self.bypass = bypass  # --limit_hpu_graphs on the prefill step: run the plain forward

    def __call__(self, *args, **kwargs):
        if self.bypass:
            kwargs["bypass_hpu_graphs"] = True
        return self.module(*args, **kwargs)

    def reset(self) -> None:
        """Drop every captured graph of the wrapped module (shared by the prefill and decode steps)."""
        clear = getattr(self.module, "clear_cache", None)
        if clear is not None:
            clear()


def _runs(kernels, name: str) -> bool:
    chain = {i.name for i in kernels.choices["linear_q"].chain}
    return name in chain


class HpuRuntime(DeviceRuntime):
    device_type = "hpu"
    honours = frozenset(
        {
            "use_hpu_graphs",
            "limit_hpu_graphs",
            "flash_attention_recompute",
            "flash_attention_causal_mask",
            "flash_attention_fast_softmax",
            "attn_softmax_bf16",
        }
    )
    # Whether HPU graphs replay in-place updates of their inputs faithfully is unverified: keep the per-token loop.
    inplace_decode = False
    static_shapes = True  # lazy mode compiles a graph per shape signature
    compiles_decoder = True  # --torch_compile: the whole decoder with hpu_backend (optimum-habana's)

    def __init__(self, device: torch.device):
        super().__init__(device)
        if settings.get("WORLD_SIZE") > 1:  # before the bridge starts, as optimum-habana's setup_env
            settings.set_for_child("PT_HPU_ENABLE_LAZY_COLLECTIVES", "true", overwrite=False)
        _habana.import_bridge()  # registers the hpu device with torch; harmless (False) outside Habana's stack
        self.lazy_mode = lazy_mode_enabled()

    # -- step boundaries -------------------------------------------------------------------------------------------
    def _mark_step_fn(self) -> Optional[Callable[[], None]]:
        if not self.lazy_mode:
            return None
        return _habana.import_component(_habana.CORE, "mark_step")

    def mark_step(self) -> None:
        fn = self._mark_step_fn()
        if fn is not None:
            fn()

    def layer_hook(self) -> Optional[Callable[[], None]]:
        """mark_step before every decoder layer in inference, on one card only: optimum-habana's Llama skips it when
        torch.distributed runs more than one process (a step boundary between a layer's collectives would split
        them across graphs)."""
        if _distributed_world() > 1:
            return None
        return self._mark_step_fn()

    # -- graphs ----------------------------------------------------------------------------------------------------
    def graph_module(self, module: torch.nn.Module, phase: str, flags: dict):
        if phase not in ("prefill", "decode"):
            raise ValueError(f"graph_module: phase must be 'prefill' or 'decode', got {phase!r}")
        if not flags.get("use_hpu_graphs"):
            return Step(module)
        if flags.get("torch_compile"):
            logger.warning("polyfuse: --use_hpu_graphs is ignored with --torch_compile (as in optimum-habana)")
            return Step(module)
        if not self.lazy_mode:
            raise ValueError(GRAPHS_NEED_LAZY)
        if _distributed_world() > 1 and not settings.get("PT_HPU_ENABLE_LAZY_COLLECTIVES"):
            raise ValueError(GRAPHS_NEED_LAZY_COLLECTIVES)
        wrap = _habana.require(_habana.HPU, "wrap_in_hpu_graph")
        if not getattr(module, _WRAPPED, False):
            kwargs = {}
            if flags.get("max_graphs") is not None:
                kwargs["max_graphs"] = flags["max_graphs"]
            module = wrap(module, **kwargs)
            setattr(module, _WRAPPED, True)
        return HpuGraphStep(module, bypass=phase == "prefill" and bool(flags.get("limit_hpu_graphs")))

    def inference_graphs(self, module: torch.nn.Module, disable_tensor_cache: bool = False, max_graphs=None):
        """``wrap_in_hpu_graph(module, disable_tensor_cache=, max_graphs=)`` as optimum-habana's GaudiTrainer wraps
        the model for evaluation (lazy mode only); the module's forward is replaced in place."""
        if not self.lazy_mode:
            raise ValueError(GRAPHS_NEED_LAZY.replace("--use_hpu_graphs", "--use_hpu_graphs_for_inference"))
        wrap = _habana.require(_habana.HPU, "wrap_in_hpu_graph")
        return wrap(module, disable_tensor_cache=disable_tensor_cache, max_graphs=max_graphs)

    def training_graphs(self, module: torch.nn.Module) -> torch.nn.Module:
        """Habana's ``ModuleCacher()(model=module, inplace=True)``, as GaudiTrainer's ``_wrap_model`` does with
        ``use_hpu_graphs_for_training`` (lazy mode only)."""
        if not self.lazy_mode:
            raise ValueError(GRAPHS_NEED_LAZY.replace("--use_hpu_graphs", "--use_hpu_graphs_for_training"))
        cacher = _habana.require(_habana.HPU, "ModuleCacher")
        cacher()(model=module, inplace=True)
        return module

    # -- quantized weights -----------------------------------------------------------------------------------------
    @classmethod
    def fp8_max(cls):
        """Gaudi2's e4m3 reaches 240 (INC's ``get_fullscale``): fp8 weights quantized here are scaled to it."""
        return device_fp8_max()

    def adapt_quantized(self, weights, kernels=None) -> None:
        """int4 weights get Habana's packing beside AutoGPTQ's where the run's ``linear_q`` chain has
        ``uint4_matmul`` and the run is bfloat16 (int4_linear.py: made here once rather than on the first call,
        where an HPU graph would capture it; no second copy for a run that never uses it); on Gaudi2, fp8 weight
        rows holding codes beyond its e4m3 range (240) are halved and their scales doubled (fp8_range.py)."""
        if kernels is not None and _runs(kernels, "uint4_matmul") and kernels.context.dtype in int4_linear.DTYPES:
            for w in weights:
                if w.format == "int4":
                    int4_linear.prepare(w)
        if device_fp8_max() is not None:
            rows = sum(fit_gaudi2(w.qweight, w.scales) for w in weights if w.format in ("fp8", "fp8_block"))
            if rows:
                logger.info("polyfuse: gaudi2: %d fp8 weight row(s) beyond e4m3's 240 halved, their scales doubled",
                            rows)  # fmt: skip
        if kernels is not None and _runs(kernels, "fp8_gemm"):  # INC's [K, N] copy, after the rows were fitted
            for w in weights:
                if w.format == "fp8":
                    fp8_linear.prepare(w)

    @classmethod
    def lazy_mode_enabled(cls) -> bool:
        return lazy_mode_enabled()

    @classmethod
    def refusal(cls, flags: dict):
        lazy = lazy_mode_enabled()
        if flags.get("use_hpu_graphs") and not flags.get("torch_compile") and not lazy:
            return GRAPHS_NEED_LAZY
        if flags.get("torch_compile") and lazy:
            return COMPILE_NEEDS_EAGER
        return None

    def compile_backend(self) -> str:
        """``"hpu_backend"``, in eager mode only (ValueError naming PT_HPU_LAZY_MODE=0 in lazy mode)."""
        if self.lazy_mode:
            raise ValueError(COMPILE_NEEDS_EAGER)
        _habana.find_called_kernels()  # before dynamo traces a kernel's lookup (an import it cannot trace)
        return "hpu_backend"

    def compile_options(self, static: bool) -> dict:
        """hpu_backend's options as optimum-habana's ``get_torch_compiled_model`` passes them."""
        return {"force_static_compile": bool(static), "keep_input_mutations": True}

    # -- training --------------------------------------------------------------------------------------------------
    def fused_optimizer(self, params, **kwargs):
        """Habana's FusedAdamW (GaudiConfig ``use_fused_adam``), or None outside Habana's stack."""
        from polyfuse.backends.hpu.optim import fused_adamw

        return fused_adamw(params, **kwargs)

    def fused_clip_norm(self, params, max_norm: float):
        """Habana's FusedClipNorm (GaudiConfig ``use_fused_clip_norm``), or None outside Habana's stack."""
        from polyfuse.backends.hpu.optim import fused_clip_norm

        return fused_clip_norm(params, max_norm)

    # -- sync and memory -------------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        sync = _habana.import_component(_habana.HPU, "synchronize")
        if sync is None:
            sync = getattr(getattr(torch, "hpu", None), "synchronize", None)
        if sync is not None:
            sync()

    def sampling_generator(self, seed: int):
        """None: torch has no ``Generator(device="hpu")``; the HPU's default generator is seeded instead, as
        optimum-habana's ``set_seed`` does (``torch.manual_seed`` and ``hpu.random.manual_seed_all``)."""
        torch.manual_seed(seed)
        seed_all = _habana.import_component(_habana.HPU + ".random", "manual_seed_all")
        if seed_all is not None:
            seed_all(seed)
        return None

    def reset_peak_memory(self) -> None:
        reset = _habana.import_component(_habana.HPU, "reset_peak_memory_stats")
        if reset is not None:
            reset()

    def memory_stats(self) -> dict:
        """Like optimum-habana's ``get_hpu_memory_stats``: InUse / MaxInUse / Limit in GB, rounded to 2 decimals."""
        stats_fn = _habana.import_component(_habana.HPU, "memory_stats")
        if stats_fn is None:
            return super().memory_stats()
        mem = stats_fn(self.device)
        gb = 1024**3
        return {
            "memory_allocated (GB)": round(mem["InUse"] / gb, 2),
            "max_memory_allocated (GB)": round(mem["MaxInUse"] / gb, 2),
            "total_memory_available (GB)": round(mem["Limit"] / gb, 2),
        }
