"""Quantized weights at load time: which projections hold packed weights, in which format, and how a checkpoint's
tensors get into them (formats: polyfuse/ops/quant_formats.py; the ops that take them: polyfuse/ops/quant_linear.py).

A quantized projection is a ``QLinear`` (quant/qlinear.py): the packed weight's buffers (no dense weight is ever
allocated for it) and the bias; the decoder sends it to the ``linear_q`` ops (``models/decoder.py`` ``project``). A
fused projection whose parts are packed in different formats is a ``QLinearStack`` of them. What a checkpoint holds is
read by quant/checkpoint.py; what a quantized model reports, by quant/report.py. What is quantized:
every ``nn.Linear`` of the model except the LM head (the output embedding, tied to the input embedding or not),
which keeps the run's dtype unless :func:`quantize_lm_head_` quantizes it after loading (``--quant_lm_head``; the
embedding stays as it is, a tied head is untied) or the checkpoint holds it packed (AutoGPTQ's ``lm_head: true``,
polyfuse's ``formats`` naming ``lm_head``). The loader (loader/load.py) calls :func:`setup` before building,
``apply`` on the meta-built model (swaps the projections), ``place`` for every checkpoint tensor and ``finish`` at
the end.

Where the packed weights come from:
  * ``quant="int8" | "int4" | "fp8" | "fp8_block"``: a float checkpoint (safetensors, or a GGUF dequantized) is
    quantized tensor by tensor as it loads (round to nearest; the formats are row-local, so each fused part is
    quantized on its own). A projection the format cannot pack keeps the run's dtype, with one warning naming it.
  * a GGUF: Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K tensors are kept as stored (``gguf_q8_0`` ...) when the run's ``linear_q`` has an
    implementation besides the native reference (a Triton GEMV on NVIDIA), or with ``quant="gguf"``; otherwise they
    are dequantized at load (the same numbers as the native reference, without dequantizing at every call). Other
    quantized GGUF types are dequantized at load with one warning. Fused parts of different kept types (Q4_K_M's q/k
    Q4_K, v Q6_K) make a ``QLinearStack``.
  * a quantized safetensors checkpoint, read as stored: AutoGPTQ's layout (``quantization_config.quant_method:
    gptq``, 4 bits; what ``save_pretrained`` writes for int4), compressed-tensors fp8 (per-tensor, per-channel,
    1x128 group or 128x128 block scales), and polyfuse's own (``quant_method: polyfuse``, docs/quantization.md).
    ``quant="none"`` dequantizes any of them at load.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import re
import threading
from typing import Callable, Optional

import torch
from torch import nn

from polyfuse.checkpoint.shards import read_blocks, shape_of, shard_for, tp_shards
from polyfuse.core.errors import CheckpointError
from polyfuse.distributed.sharding import TensorParallelError
from polyfuse.ops.quant_formats import (
    FP8_BLOCK,
    GGUF_BYTES,
    GGUF_TYPES,
    INT4_GROUP,
    LOAD_TIME_FORMATS,
    QuantizedWeight,
    cannot_pack,
    components,
    dequantize,
    quantize_components,
)
from polyfuse.quant.checkpoint import Checkpoint, read_checkpoint
from polyfuse.quant.gptq import GPTQ_FORMATS, HessianFactor, gptq_components, record_hessians
from polyfuse.quant.qlinear import QLinear, QLinearStack, head_quantized, quantized_modules
from polyfuse.quant.shards import cannot_split, take


logger = logging.getLogger("polyfuse")

CHOICES = ("fp8", "fp8_block", "int8", "int4", "gguf", "none")
DENSE = (torch.float32, torch.bfloat16, torch.float16)
# compressed-tensors' tensor names -> QLinear buffers; their static activation scales are not used (polyfuse
# quantizes activations per token where it quantizes them at all).
CT_NAMES = {"weight": "qweight", "weight_scale": "scales"}
IGNORED = ("input_scale", "weight_zero_point", "input_zero_point")
GGUF_FLOAT = ("F32", "F16", "BF16", "F64")


def _candidates(model) -> list[tuple[str, nn.Linear]]:
    """The dense projections: Linears holding a weight of their own (not the parameter-free q/k/v/gate/up views of
    the fused projections, models/projection_slice.py), the LM head excepted."""
    head = model.get_output_embeddings()
    return [
        (n, m) for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and "weight" in m._parameters and m is not head
    ]  # fmt: skip


def _layer_groups(candidates: list) -> list[list]:
    """The candidates cut into runs of one decoder layer each (the name up to its first numeric component:
    ``model.layers.3``); a projection outside the layers is a run of its own. GPTQ records one run's H at a time."""

    def layer(candidate) -> str:
        m = re.match(r"(.*?\.\d+)\.", candidate[0])
        return m.group(1) if m else candidate[0]

    return [list(run) for _, run in itertools.groupby(candidates, key=layer)]


def _parts(model, name: str, rows: int) -> list[tuple[str, int]]:
    """[(checkpoint module name, rows)] fused into module ``name`` (itself when it is not fused)."""
    for frag, parts in model.fused_projections().items():
        if name.endswith("." + frag):
            prefix = name[: -len(frag)]
            return [(prefix + part, size) for part, size in parts]
    return [(name, rows)]


def _set_module(model, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _resolve(tensor) -> torch.Tensor:
    return tensor() if callable(tensor) else tensor


def _kernel_takes_quantized(ctx) -> bool:
    """Does the run's ``linear_q`` have an implementation besides the native reference on this device?"""
    from polyfuse.core.registry import NATIVE, implementations, run_overrides

    overrides = run_overrides(ctx)
    if ctx.training or overrides.get("linear_q") == "-":
        return False
    return any(i.name != NATIVE and i.unusable_reason(ctx) is None for i in implementations("linear_q"))


# ---- the setup: decisions per projection, then loading ------------------------------------------------------------


class QuantSetup:
    """One load's quantization: built by :func:`setup` from the request and the checkpoint, then ``apply`` (meta
    model), ``tensors`` (the checkpoint iterator), ``place`` (each tensor) and ``finish``."""

    def __init__(self, request: Optional[str], ckpt: Checkpoint, keep_gguf: bool, device, dtype, keep_head=False):
        self.request, self.ckpt, self.keep_gguf = request, ckpt, keep_gguf
        self.keep_head = keep_head  # a GGUF's own output.weight kept as stored too (quant_lm_head)
        self.device, self.dtype = torch.device(device), dtype
        self.qmodules: dict[str, QLinear] = {}
        # dense module -> ({part: (format, group size)}, parts) of its packed tensors
        self.staged: dict[str, tuple] = {}
        self.stacks: dict[str, list] = {}  # QLinearStack -> [(first row, row after, segment module name)]
        self.keep: set = set()  # GGUF weight names read as stored
        self.dense_why: dict[str, list] = {}
        self.filled: dict = {}
        self.pending: dict = {}
        self.params: dict = {}
        self.part_of: dict = {}
        self.shards: dict = {}  # tensor parallelism: {checkpoint fragment: Shard} of this rank (checkpoint/shards.py)
        self.lock = threading.Lock()
        self.random = False  # for_random_weights: also the GGUF types, packed by round to nearest

    # -- decisions ------------------------------------------------------------------------------------------------

    def _module_format(self, name: str, lin: nn.Linear, parts) -> tuple[Optional[str], int, str]:
        """(format or None for dense, group size, why dense) of one projection."""
        ck, k = self.ckpt, lin.in_features
        sizes = tuple(s for _, s in parts)
        if self.request in LOAD_TIME_FORMATS or (self.random and self.request in GGUF_BYTES):
            why = cannot_pack(self.request, k, sizes)
            return (None, 0, f"--quant {self.request}: {why}") if why else (self.request, INT4_GROUP, "")
        if ck.kind == "gguf":  # only when its quantized tensors are kept (setup returns None otherwise)
            types = {ck.gguf_types.get(p + ".weight") for p, _ in parts}
            kept = {GGUF_TYPES.get(t) for t in types}
            if len(types) == 1 and None not in kept and self.keep_gguf:
                fmt = kept.pop()
                why = cannot_pack(fmt, k, sizes)
                if not why:
                    self._check_split(fmt, 0, parts)
                return (None, 0, why) if why else (fmt, 0, "")
            other = sorted(t for t in types if t and t not in GGUF_TYPES and t not in GGUF_FLOAT)
            if other:
                return None, 0, f"GGUF type {'/'.join(other)} has no quantized kernel: dequantized at load"
            if len(types) > 1 and self.keep_gguf and not types & set(GGUF_FLOAT):
                return None, 0, f"fused parts of GGUF types {', '.join(sorted(types))} not all packable: dequantized"
            return None, 0, ""
        packed = [any(f"{p}.{c}" in ck.keys for c in ("qweight", "weight_scale")) for p, _ in parts]
        if not any(packed):
            return None, 0, ""
        if not all(packed):
            raise CheckpointError(f"{name}: some of its fused parts are quantized in the checkpoint, some are not")
        if ck.kind == "polyfuse":
            fmts = {ck.formats.get(p) for p, _ in parts}
            # parts in several formats reach here only to be dequantized, or where _segments could not pack one
            if None in fmts or (len(fmts) != 1 and self.request != "none"):
                raise CheckpointError(f"{name}: quantization_config.formats gives its parts {sorted(map(str, fmts))}")
            if self.request == "none":  # each part dequantized in its own format
                self.staged[name] = ({p: (ck.formats[p], int(ck.groups.get(p, INT4_GROUP))) for p, _ in parts}, parts)
                return None, 0, ""
            fmt, group = fmts.pop(), int(ck.groups.get(parts[0][0], INT4_GROUP))
        else:  # group_size -1: one group over all of K (of the whole projection, under tensor parallelism)
            whole_k = max(
                [s.size for p, _ in parts if (s := shard_for(self.shards, f"{p}.weight")) and s.dim == 1] or [k]
            )
            fmt, group = ck.fmt, ck.group_size if ck.group_size > 0 else whole_k
        if self.request == "none":
            self.staged[name] = (dict.fromkeys((p for p, _ in parts), (fmt, group)), parts)
            return None, 0, ""
        if fmt == "int4" and len(parts) > 1:
            g_idx = [ck.read(f"{p}.g_idx") for p, _ in parts if f"{p}.g_idx" in ck.keys]
            if any(not torch.equal(g_idx[0], g) for g in g_idx[1:]):
                self.staged[name] = (dict.fromkeys((p for p, _ in parts), (fmt, group)), parts)
                return None, 0, "act-order GPTQ: its fused parts have different g_idx: dequantized at load"
        self._check_split(fmt, group, parts)
        return fmt, group, ""

    def _segments(self, lin: nn.Linear, parts) -> Optional[list]:
        """[(format, group size, parts)] of a fused projection whose parts are kept in different formats (a K-quant
        GGUF's q/k Q4_K with v Q6_K; a polyfuse save of one), one run of consecutive parts per format; None where its
        parts share one format, or where one of them is not kept (``_module_format`` decides those)."""
        ck = self.ckpt
        if len(parts) < 2 or self.request in LOAD_TIME_FORMATS:
            return None
        if ck.kind == "gguf" and self.keep_gguf:
            kinds = [(GGUF_TYPES.get(ck.gguf_types.get(p + ".weight")), 0) for p, _ in parts]
        elif ck.kind == "polyfuse" and self.request != "none":
            kinds = [(ck.formats.get(p), int(ck.groups.get(p, INT4_GROUP))) for p, _ in parts]
            if any(f"{p}.qweight" not in ck.keys for p, _ in parts):
                return None
        else:
            return None
        if any(fmt is None for fmt, _ in kinds) or len(set(kinds)) == 1:
            return None
        runs: list = []
        for part, kind in zip(parts, kinds):
            if runs and runs[-1][:2] == kind:
                runs[-1][2].append(part)
            else:
                runs.append((*kind, [part]))
        if any(cannot_pack(fmt, lin.in_features, tuple(s for _, s in seg)) for fmt, _, seg in runs):
            return None
        for fmt, group, seg in runs:
            self._check_split(fmt, group, seg)
        return runs

    def _stack(self, model, name: str, lin: nn.Linear, runs: list) -> None:
        """Swap ``name`` for a QLinearStack of one QLinear per run (meta device, as ``apply``)."""
        with torch.device("meta"):
            segs = [QLinear(lin.in_features, sum(s for _, s in seg), fmt, False, lin.weight.dtype, group or INT4_GROUP,
                            tuple(s for _, s in seg)) for fmt, group, seg in runs]  # fmt: skip
            stack = QLinearStack(lin.in_features, lin.out_features, segs, lin.bias is not None, lin.weight.dtype)
        start = 0
        for i, (q, (fmt, _, seg)) in enumerate(zip(segs, runs)):
            q.hf_parts = seg
            self.qmodules[f"{name}.segments.{i}"] = q
            self.stacks.setdefault(name, []).append((start, start + q.out_features, f"{name}.segments.{i}"))
            start += q.out_features
            if fmt.startswith("gguf"):
                self.keep.update(p + ".weight" for p, _ in seg)
        _set_module(model, name, stack)

    def _check_split(self, fmt: str, group: int, parts) -> None:
        """Tensor parallelism: this rank's rows / columns of each part must be cut from its packed components."""
        for p, _ in parts:
            shard = shard_for(self.shards, f"{p}.weight")
            if shard is None:
                continue
            act_order = False
            if fmt == "int4" and shard.dim == 1 and f"{p}.g_idx" in self.ckpt.keys:
                g_idx = self.ckpt.read(f"{p}.g_idx")
                act_order = not torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // group)
            why = cannot_split(fmt, shard, group, act_order)
            if why:
                raise TensorParallelError(
                    f"{p} ({fmt}) cannot be split for tensor parallelism: {why}; load it with --quant none "
                    "(dequantized), or at another world size"
                )

    def apply(self, model) -> None:
        """Swap the projections that will hold packed weights for QLinear modules (the model is on the meta
        device: nothing is allocated yet). The LM head only where the checkpoint holds it packed."""
        self.shards = tp_shards(model)[0]
        head = model.get_output_embeddings()
        packed_head = any(f"lm_head.{c}" in self.ckpt.keys for c in ("qweight", "weight_scale"))
        # asked for (quant_lm_head): a GGUF's own output.weight (untied) in a kept type, kept as the projections are
        packed_head = packed_head or (self.keep_head and self.keep_gguf and self.ckpt.kind == "gguf"
                                      and self.ckpt.gguf_types.get("lm_head.weight") in GGUF_TYPES)  # fmt: skip
        extra = [("lm_head", head)] if packed_head else []  # --quant none: staged, dequantized into the float head
        if packed_head and model.config.tie_word_embeddings:  # the checkpoint's head is its own: untie before loading
            logger.warning("warning: tie_word_embeddings is true but the checkpoint holds a packed lm_head; untying "
                           "them (the head keeps its own weights, the embedding its own)")  # fmt: skip
            model.config.tie_word_embeddings = False
            w = head.weight  # tied: the embedding's [vocab, hidden]; the head's own is its (rank's) rows
            shape = (head.out_features, head.in_features)
            head.weight = nn.Parameter(torch.empty(shape, dtype=w.dtype, device=w.device), w.requires_grad)
        for name, lin in _candidates(model) + extra:
            parts = _parts(model, name, lin.out_features)
            runs = self._segments(lin, parts)
            if runs is not None:
                self._stack(model, name, lin, runs)
                continue
            fmt, group, why = self._module_format(name, lin, parts)
            if why:
                self.dense_why.setdefault(why, []).append(name)
            if fmt is None:
                continue
            with torch.device("meta"):
                q = QLinear(lin.in_features, lin.out_features, fmt, lin.bias is not None, lin.weight.dtype, group,
                            tuple(s for _, s in parts))  # fmt: skip
            q.hf_parts = parts
            _set_module(model, name, q)
            self.qmodules[name] = q
            if fmt.startswith("gguf"):
                self.keep.update(p + ".weight" for p, _ in parts)
        for why, names in self.dense_why.items():
            kept = "keep the run's dtype" if "dequantized" not in why else f"load as {_name(self.dtype)}"
            logger.warning("warning: %s: %s (%d projection(s): %s)", why, kept, len(names), ", ".join(names))

    def bind(self, model) -> None:
        """After allocation: the modules and parameters the tensors are copied into."""
        self.qmodules = quantized_modules(model)
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.shards = tp_shards(model)[0]
        self.part_of = {}
        for name, q in self.qmodules.items():
            start = 0
            for hf, size in q.hf_parts:
                self.part_of[(name, start)] = hf
                start += size

    # -- loading ----------------------------------------------------------------------------------------------

    def place(self, name: str, rows: Optional[slice], tensor) -> Optional[str]:
        """Copy one checkpoint tensor (already mapped to the model's module ``name`` and output ``rows``) if it
        belongs to a quantized projection; returns the checkpoint name it satisfies, or None (not ours)."""
        mod, _, comp = name.rpartition(".")
        if mod in self.stacks and comp != "bias":  # the segment holding these rows (the bias is the stack's own)
            if rows is None:
                raise CheckpointError(f"{name}: {mod} holds parts in different formats; a tensor of all its rows")
            start, stop, seg = next(x for x in self.stacks[mod] if x[0] <= rows.start < x[1])
            if rows.stop > stop:
                raise CheckpointError(f"{name}: rows {rows.start}:{rows.stop} span two formats of {mod}")
            mod, rows = seg, slice(rows.start - start, rows.stop - start)
        if mod not in self.qmodules and mod not in self.staged:
            return None
        if comp == "bias":
            if mod + ".bias" in self.params:
                return None  # an ordinary parameter
            if _resolve(tensor).count_nonzero():
                raise CheckpointError(f"{name}: a non-zero bias the model's config does not have")
            return name  # AutoGPTQ writes zero biases for bias-free projections
        if mod in self.qmodules:
            return self._place(mod, self.qmodules[mod], rows, comp, tensor)
        return self._stage(mod, rows, comp, tensor)

    def _place(self, mod: str, q: QLinear, rows, comp: str, tensor) -> Optional[str]:
        rows = rows or slice(0, q.out_features)
        hf = self.part_of[(mod, rows.start)]
        if comp in IGNORED or (comp == "weight" and is_placeholder(tensor)):
            return f"{hf}.{comp}"
        shard = shard_for(self.shards, f"{hf}.weight")
        whole = _whole(rows.stop - rows.start, q.in_features, shard)
        sliced = comp == "weight" and shard is not None and _dtype(tensor) in DENSE
        if sliced:  # a float weight quantized at load: only this rank's rows / columns are read
            _check_shape(hf, shape_of(tensor), whole)
            tensor = read_blocks(_sliceable(tensor), shard.dim, shard.blocks)
        t = _resolve(tensor)
        if comp == "weight" and t.dtype in DENSE:
            if self.request not in LOAD_TIME_FORMATS:
                raise CheckpointError(f"{hf}.weight: a float weight where the checkpoint's format is {q.format}")
            if shard is not None and not sliced:
                _check_shape(hf, tuple(t.shape), whole)
                t = read_blocks(t, shard.dim, shard.blocks)
            w = t.to(device=q.qweight.device, dtype=torch.float32)
            for buf, value in device_quantizer(w.device)(q.format, w, q.group_size or INT4_GROUP).items():
                self._write(mod, q, buf, rows, value, hf)
            return f"{hf}.weight"
        buf = CT_NAMES.get(comp, comp) if self.ckpt.kind == "compressed-tensors" else comp
        if buf not in q.spec:
            raise CheckpointError(f"unexpected weight {hf}.{comp} for a {q.format} projection")
        if shard is not None:  # the whole part's component, in its shape, then this rank's entries of it
            spec = components(q.format, *whole, q.group_size or INT4_GROUP)[buf]
            t = self._adapt(q.format, buf, t, spec.shape)
            if tuple(t.shape) != tuple(spec.shape):
                raise CheckpointError(f"weight {hf}.{comp} has shape {tuple(t.shape)}, expected {tuple(spec.shape)}")
            t = take(buf, t, spec, shard, q.group_size)
        self._write(mod, q, buf, rows, t, hf)
        return f"{hf}.{comp}"

    def _adapt(self, fmt: str, buf: str, value: torch.Tensor, shape: tuple) -> torch.Tensor:
        if buf != "scales" or tuple(value.shape) == shape:
            return value
        if len(shape) == 1 and value.numel() in (1, shape[0]):  # per-tensor or [N, 1] per-channel scales
            return value.reshape(-1).expand(shape[0])
        if fmt == "fp8_block" and self.ckpt.block_scales and value.shape[0] == math.ceil(shape[0] / FP8_BLOCK):
            return value.repeat_interleave(FP8_BLOCK, dim=0)[: shape[0]]  # 128x128 blocks -> 1x128 rows
        return value

    def _write(self, mod: str, q: QLinear, buf: str, rows: slice, value: torch.Tensor, hf: str) -> None:
        spec, dst = q.spec[buf], q._buffers[buf]
        if spec.n_dim is not None:
            dst = dst.narrow(spec.n_dim, rows.start // spec.n_per, (rows.stop - rows.start) // spec.n_per)
        value = self._adapt(q.format, buf, value, tuple(dst.shape))
        if tuple(value.shape) != tuple(dst.shape):
            raise CheckpointError(f"weight {hf}.{buf} has shape {tuple(value.shape)}, expected {tuple(dst.shape)}")
        if buf == "qweight" and value.dtype != dst.dtype:
            raise CheckpointError(f"weight {hf}.{buf} is {_name(value.dtype)}, {q.format} stores {_name(dst.dtype)}")
        if spec.n_dim is None:  # one buffer shared by the fused parts (act-order's g_idx): the first part writes it,
            # the others must hold the same; under the lock, or a part read on another thread compares before the
            # first one's copy lands (seen as a spurious "differs" on a loaded 2-core machine)
            with self.lock:
                first = (mod, buf) not in self.filled
                self.filled.setdefault((mod, buf), set()).add(None)
                same = first or torch.equal(dst, value.to(dst.device, dst.dtype))
                if first:
                    dst.copy_(value)
            if not same:
                raise CheckpointError(f"{hf}.{buf}: differs between the parts fused into {mod}")
            return
        with self.lock:
            self.filled.setdefault((mod, buf), set()).add(rows.start)
        dst.copy_(value)

    def _stage(self, mod: str, rows, comp: str, tensor) -> Optional[str]:
        """A packed tensor of a projection loaded dense: collected per part, dequantized once the part is whole."""
        fmts, parts = self.staged[mod]
        rows = rows or slice(0, sum(s for _, s in parts))
        hf = next(p for (p, _), start in zip(parts, _starts(parts)) if start == rows.start)
        fmt, group = fmts[hf]
        if comp in IGNORED or (comp == "weight" and is_placeholder(tensor)):
            return f"{hf}.{comp}"
        buf = CT_NAMES.get(comp, comp) if self.ckpt.kind == "compressed-tensors" else comp
        shard = shard_for(self.shards, f"{hf}.weight")  # TP: the whole part is dequantized, then this rank's slice
        n, k = _whole(rows.stop - rows.start, self.params[mod + ".weight"].shape[1], shard)
        spec = components(fmt, n, k, group)
        if buf not in spec:
            raise CheckpointError(f"unexpected weight {hf}.{comp} for a {fmt} projection")
        value = self._adapt(fmt, buf, _resolve(tensor), spec[buf].shape)
        with self.lock:
            have = self.pending.setdefault((mod, rows.start), {})
            have[buf] = value
            if set(have) != set(spec):
                return f"{hf}.{comp}"
            del self.pending[(mod, rows.start)]
        qw = QuantizedWeight(fmt, (n, k), group_size=group if fmt in ("int4", "fp8_block") else 0, **have)
        w = dequantize(qw, torch.float32)
        self.params[mod + ".weight"].data[rows].copy_(w if shard is None else read_blocks(w, shard.dim, shard.blocks))
        return f"{hf}.weight"

    def finish(self, model) -> None:
        missing = [f"{hf}.{buf}" for (mod, start), hf in self.part_of.items() for buf, spec in
                   self.qmodules[mod].spec.items() if (None if spec.n_dim is None else start)
                   not in self.filled.get((mod, buf), ())]  # fmt: skip
        missing += [f"{self.part_of.get(key, key[0])}: {sorted(have)}" for key, have in self.pending.items()]
        if missing:
            raise CheckpointError(f"checkpoint is missing {len(missing)} quantized tensor(s), e.g. {missing[0]!r}")
        finalize(model)


def _whole(n: int, k: int, shard) -> tuple[int, int]:
    """(N, K) of a whole checkpoint part whose rank holds [n, k] of it under ``shard`` (None: all of it)."""
    if shard is None:
        return n, k
    return (shard.size, k) if shard.dim == 0 else (n, shard.size)


def _check_shape(hf: str, shape: Optional[tuple], whole: tuple) -> None:
    """A float weight sliced for tensor parallelism must have the whole projection's shape (None: unknown here)."""
    if shape is not None and tuple(shape) != tuple(whole):
        raise CheckpointError(f"weight {hf}.weight has shape {tuple(shape)}, expected {tuple(whole)}")


def _dtype(tensor) -> Optional[torch.dtype]:
    """A checkpoint tensor's dtype without reading it (a safetensors reader's span; None where it has none)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype
    span = getattr(tensor, "span", None)
    return getattr(span, "dtype", None)


def _sliceable(tensor):
    """A tensor, or a reader that slices (safetensors' get_slice); any other reader is read whole first."""
    if isinstance(tensor, torch.Tensor) or hasattr(tensor, "slice"):
        return tensor
    return _resolve(tensor)


def _starts(parts) -> list[int]:
    out, start = [], 0
    for _, size in parts:
        out.append(start)
        start += size
    return out


def setup(quant: Optional[str], raw: dict, path, gguf_file, device, dtype, flags=None, overrides="", training=False,
          where: str = "checkpoint", keep_gguf_head: bool = False) -> Optional[QuantSetup]:  # fmt: skip  # size: the loader's facts
    """The load's QuantSetup, or None when no projection can end up quantized (a float checkpoint, no --quant).
    ``keep_gguf_head`` (``quant_lm_head``): a GGUF's own output.weight in a kept type stays as stored too."""
    from polyfuse.core.context import SelectionContext

    if quant in ("", "auto"):
        quant = None
    if quant is not None and quant not in CHOICES:
        raise ValueError(f"--quant {quant!r}: choose one of {', '.join(CHOICES)}")
    if gguf_file is not None and quant in (None, "none"):
        ctx = SelectionContext(torch.device(device), dtype, dict(flags or {}), training, overrides)
        if quant == "none" or not _kernel_takes_quantized(ctx):
            return None  # every tensor dequantized at load, as without quantization (the file is not read twice)
        quant = "gguf"
    ckpt = read_checkpoint(raw, path, gguf_file, where)
    if quant == "gguf" and ckpt.kind != "gguf":
        raise ValueError("--quant gguf keeps a GGUF's quantized tensors: the checkpoint is not a GGUF")
    if quant in LOAD_TIME_FORMATS and ckpt.kind not in ("dense", "gguf"):
        fmts = {ckpt.fmt} if ckpt.fmt else set(ckpt.formats.values())
        if fmts != {quant}:
            raise ValueError(
                f"--quant {quant}: the checkpoint is already quantized ({ckpt.kind}: {', '.join(sorted(fmts))}); load "
                "it without --quant (or --quant none to dequantize it)"
            )
        quant = None  # already in the requested format: loaded as stored
    if ckpt.kind == "dense" and quant not in LOAD_TIME_FORMATS:
        return None
    return QuantSetup(quant, ckpt, quant == "gguf", device, dtype, keep_gguf_head)


def for_random_weights(quant: Optional[str], device, dtype) -> Optional[QuantSetup]:
    """from_config: random weights quantized in ``quant`` (benchmarks): a load-time format, or a GGUF type packed by
    round to nearest (as a llama.cpp file's projections would be stored)."""
    if quant in (None, "", "none", "auto"):
        return None
    if quant not in (*LOAD_TIME_FORMATS, *GGUF_BYTES):
        raise ValueError(
            f"quant={quant!r} for random weights: choose one of {', '.join((*LOAD_TIME_FORMATS, *GGUF_BYTES))}"
        )
    setup = QuantSetup(quant, Checkpoint("dense"), False, device, dtype)
    setup.random = True
    return setup


def device_quantizer(device) -> Callable:
    """Round to nearest (``quantize_components``) for weights quantized on ``device``: fp8 scaled to the device's
    e4m3 range where its runtime says it is smaller than 448 (Gaudi2: 240, as Intel Neural Compressor quantizes
    there), since the device cannot hold the larger codes."""
    from polyfuse.core.runtime import runtime_class

    fp8_max = runtime_class(torch.device(device).type).fp8_max()
    return quantize_components if fp8_max is None else functools.partial(quantize_components, fp8_max=fp8_max)


def _write_part(q: QLinear, start: int, w: torch.Tensor, quantize=None) -> None:
    """Quantize the float rows ``w`` into ``q``'s buffers from output row ``start`` on (one fused part, or all);
    ``quantize(fmt, w, group_size)`` gives the buffers (round to nearest on w's device by default, or GPTQ's)."""
    quantize = quantize or device_quantizer(w.device)
    for buf, value in quantize(q.format, w, q.group_size or INT4_GROUP).items():
        spec, dst = q.spec[buf], q._buffers[buf]
        if spec.n_dim is not None:
            dst = dst.narrow(spec.n_dim, start // spec.n_per, w.shape[0] // spec.n_per)
        dst.copy_(value)


def _pack(lin: nn.Linear, fmt: str, parts: list, group: int, quantize=None) -> QLinear:
    """A QLinear holding ``lin``'s weight quantized part by part (``parts``: [(checkpoint name, rows)]) and its bias."""
    w = lin.weight
    with torch.device(w.device):
        q = QLinear(lin.in_features, lin.out_features, fmt, lin.bias is not None, w.dtype, group,
                    tuple(s for _, s in parts))  # fmt: skip
    q.hf_parts = parts
    for start, (_, size) in zip(_starts(parts), parts):
        _write_part(q, start, w[start : start + size], quantize)
    if lin.bias is not None:
        q.bias.data.copy_(lin.bias)
    return q


@torch.no_grad()
def init_random_(model, generator: torch.Generator, std: float) -> None:
    """Fill every QLinear with random normal(0, std) weights, quantized part by part (no dense copy of the model)."""
    for q in quantized_modules(model).values():
        start = 0
        for size in q.parts:
            w = torch.empty(size, q.in_features, device=generator.device).normal_(0.0, std, generator=generator)
            w = w.to(q.qweight.device)
            _write_part(q, start, w)
            start += size
    finalize(model)


# The projections that make keys and values (their H weighs each window's first tokens: gptq.sink_weighted).
SINK_PROJECTIONS = ("qkv_proj", "q_proj", "k_proj", "v_proj")


@torch.no_grad()
def quantize_model_(model, fmt: str, calibration: Optional[list] = None, progress=None) -> None:
    """Quantize a built float model's projections in place (what ``from_pretrained(quant=fmt)`` does while loading,
    for a model already in memory): each fused part on its own, shapes the format cannot pack left as they are
    (one warning naming them). With ``calibration`` (token windows: 1-D or [B, L] LongTensors) int4 / int8 / fp8
    are quantized by GPTQ (quant/gptq.py) with the inputs the float model gives each projection on them, instead
    of round to nearest (recorded one decoder layer at a time, so one layer's Hessians are held; the packed modules
    are swapped in at the end); the layout, kernels and checkpoints are the same. ``progress(done, total)`` is
    called after each decoder layer (a progress bar)."""
    if fmt not in LOAD_TIME_FORMATS:
        raise ValueError(f"quantize_model_: choose one of {', '.join(LOAD_TIME_FORMATS)}, not {fmt!r}")
    candidates = _candidates(model)
    sinks: set = set()
    if calibration is not None:
        if fmt not in GPTQ_FORMATS:
            raise ValueError(f"quantize_model_: GPTQ calibration quantizes {', '.join(GPTQ_FORMATS)}, not {fmt!r}")
        if not calibration:
            raise ValueError("quantize_model_: calibration holds no token windows")
        sinks = {lin.weight.data_ptr() for n, lin in candidates if n.rsplit(".", 1)[-1] in SINK_PROJECTIONS}
    skipped: dict = {}
    unreached = []
    packed = []  # swapped in at the end: every layer's H comes from the float model
    groups = _layer_groups(candidates)
    for done, group in enumerate(groups, 1):
        todo = []
        for name, lin in group:
            parts = _parts(model, name, lin.out_features)
            why = cannot_pack(fmt, lin.in_features, tuple(s for _, s in parts))
            if why:
                skipped.setdefault(why, []).append(name)
            else:
                todo.append((name, lin, parts))
        hessians = None
        if calibration is not None and todo:  # this layer's packable projections, the forward stopped after them
            keys = {lin.weight.data_ptr(): name for name, lin, _ in todo}
            hessians = record_hessians(model, calibration, keys, sinks & keys.keys(), stop_early=True)
        for name, lin, parts in todo:
            quantize = None  # round to nearest on the weight's device
            if hessians is not None:
                if lin.weight.data_ptr() in hessians:  # popped: each H is freed once its projection is packed
                    h, tokens = hessians.pop(lin.weight.data_ptr())
                    quantize = functools.partial(gptq_components, h=HessianFactor(h, tokens))  # one per projection
                else:  # the calibration forward never called it
                    unreached.append(name)
            packed.append((name, _pack(lin, fmt, parts, INT4_GROUP, quantize)))
        if progress is not None:
            progress(done, len(groups))
    for name, q in packed:
        _set_module(model, name, q)
    if unreached:
        logger.warning("warning: --quant %s: GPTQ: no calibration input reached %d projection(s), rounded to nearest: "
                       "%s", fmt, len(unreached), ", ".join(unreached))  # fmt: skip
    for why, names in skipped.items():
        logger.warning("warning: --quant %s: %s: keep the run's dtype (%d projection(s): %s)", fmt, why, len(names),
                       ", ".join(names))  # fmt: skip
    finalize(model)
    model.steps = None  # graphs captured before read the float weights


@torch.no_grad()
def quantize_lm_head_(model, fmt: Optional[str] = None) -> bool:
    """Quantize a loaded model's LM head in place (``--quant_lm_head``): ``fmt`` or the format its quantized
    projections share. A tied head is untied first (the input embedding stays as it is; ``tie_word_embeddings``
    becomes false, so a save writes both and loads back without re-quantizing). A head the format cannot pack keeps
    its dtype (one warning). Returns whether the head is quantized. With labels the model's loss comes from the
    packed head's logits (plain cross-entropy, as for perplexity), not from the fused float-head loss. Decode reads
    the head once per token (128256 x 4096 for Llama 3: 1.05 GB in bf16), so the one-row GEMV on a packed head saves
    ~5% of an 8B fp8 token (docs/quantization.md)."""
    head = model.get_output_embeddings()
    if isinstance(head, QLinear):
        return True
    if fmt is None:
        fmts = {q.format for q in quantized_modules(model).values()}
        if fmts and fmts <= set(GGUF_BYTES):
            raise ValueError(
                f"--quant_lm_head: the projections are GGUF blocks kept as stored ({', '.join(sorted(fmts))}) but the "
                "head is not: a GGUF's head is kept only when loaded with quant_lm_head=True (as --quant_lm_head "
                f"loads it) from a file with its own output.weight in {'/'.join(GGUF_TYPES)} (not tied to the "
                "embedding); give a format to pack it in (--quant fp8|fp8_block|int8|int4 on the GGUF file or a "
                "float checkpoint, which packs the projections too: a saved checkpoint of kept GGUF blocks cannot "
                "take one), or drop --quant_lm_head"
            )
        if len(fmts) != 1 or not fmts <= set(LOAD_TIME_FORMATS):
            raise ValueError(
                "--quant_lm_head: give the format (the model's projections are "
                + (", ".join(sorted(fmts)) if fmts else "not quantized") + "): use it with --quant fp8|fp8_block|int8|int4"
            )  # fmt: skip
        fmt = fmts.pop()
    if fmt not in LOAD_TIME_FORMATS and fmt not in GGUF_BYTES:  # GGUF types: llama.cpp's blocks, round to nearest
        raise ValueError(f"--quant_lm_head: choose one of {', '.join((*LOAD_TIME_FORMATS, *GGUF_BYTES))}, not {fmt!r}")
    groups = {q.group_size for q in quantized_modules(model).values() if q.format == fmt and q.group_size}
    group = groups.pop() if len(groups) == 1 else INT4_GROUP  # the projections' group: a GPTQ save stays GPTQ
    why = cannot_pack(fmt, head.in_features, (head.out_features,))
    if why:
        logger.warning("warning: --quant_lm_head %s: %s: the LM head keeps the run's dtype", fmt, why)
        return False
    vocab = getattr(model, "vocab", None)  # tensor parallelism: the rank's rows of the vocab-parallel head
    if vocab is not None and head.weight.shape[0] != head.out_features:  # tied: the replicated embedding's rows
        rows = nn.Linear(head.in_features, head.out_features, bias=False, device="meta")
        rows.weight = nn.Parameter(head.weight[vocab.start : vocab.stop], requires_grad=False)
        head = rows
    model.config.tie_word_embeddings = False
    model.lm_head = _pack(head, fmt, [("lm_head", head.out_features)], group)
    finalize(model)
    model.steps = None  # graphs captured before read the float head
    kernels = getattr(model, "kernels", None)
    if kernels is not None and kernels.choices["linear_q"].implementation.name == "native":
        logger.warning("warning: --quant_lm_head: no quantized matmul kernel on %s: the head is dequantized at every "
                       "call (slower than keeping it in %s)", model.device.type, _name(model.dtype))  # fmt: skip
    return True


# ---- after loading: flags, summary, save layout -------------------------------------------------------------------


def finalize(model) -> None:
    """Per-module facts read from the loaded data (int4: is g_idx in order?), the device runtime's adaptation of
    the buffers (``adapt_quantized``), the model's summary and the ``quantization_config`` a save writes."""
    qs = quantized_modules(model)
    for q in qs.values():
        if q.format == "int4":
            order = torch.arange(q.in_features, device=q.g_idx.device, dtype=torch.int32) // q.group_size
            q.act_order = not torch.equal(q.g_idx, order)
    runtime = getattr(model, "runtime", None)  # the device's own form of a format, where it needs one
    if qs and runtime is not None:
        runtime.adapt_quantized([q.quantized_weight() for q in qs.values()], getattr(model, "kernels", None))
    if qs:
        model.config.quantization_config = quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # everything was dequantized at load: a save writes float weights


def quantization_config(model) -> dict:
    """config.json's ``quantization_config`` for the model's packed weights: AutoGPTQ's when every quantized
    projection is int4 with one group size (the files are then a GPTQ checkpoint), else polyfuse's."""
    qs = quantized_modules(model)
    fmts = {q.format for q in qs.values()}
    groups = {q.group_size for q in qs.values()}
    # A GPTQ loader packs every projection of the layers: one kept dense would be read as missing packed weights.
    dense = any(type(m) is nn.Linear for n, m in model.named_modules() if n.startswith("model.layers."))
    if fmts == {"int4"} and len(groups) == 1 and not dense:
        return {
            "quant_method": "gptq", "bits": 4, "group_size": groups.pop(), "sym": False, "checkpoint_format": "gptq",
            "desc_act": any(q.act_order for q in qs.values()), "lm_head": head_quantized(model),
        }  # fmt: skip
    formats, group_sizes = {}, {}
    for q in qs.values():
        for hf, _ in q.hf_parts:
            formats[hf] = q.format
            if q.format == "int4":
                group_sizes[hf] = q.group_size
    return {"quant_method": "polyfuse", "version": 1, "formats": formats, "group_sizes": group_sizes}


def refusal_placeholders(model):
    """(``<part>.weight``, an empty tensor) for every packed part of a save in polyfuse's own format: transformers
    without polyfuse builds that projection as a float ``nn.Linear`` and refuses the checkpoint on the size mismatch
    (4.55 and 5.x alike) instead of loading random weights; polyfuse's loader skips them. AutoGPTQ's format gets
    none (transformers reads it with its GPTQ quantizer)."""
    qc = getattr(model.config, "quantization_config", None) or {}
    if qc.get("quant_method") != "polyfuse":
        return
    for q in quantized_modules(model).values():
        for hf, _ in q.hf_parts:
            yield f"{hf}.weight", torch.empty(0, dtype=torch.uint8)


def is_placeholder(tensor) -> bool:
    """An empty ``.weight`` written by :func:`refusal_placeholders`."""
    shape = shape_of(tensor)
    return (tuple(_resolve(tensor).shape) if shape is None else shape) == (0,)


def quantized_state_items(model):
    """(checkpoint name, tensor view) of every packed buffer, split back into the checkpoint's modules (what
    ``save_pretrained`` writes beside the float weights; ``hf_state_items`` has the biases)."""
    for q in quantized_modules(model).values():
        start = 0
        for hf, size in q.hf_parts:
            for buf, spec in q.spec.items():
                t = q._buffers[buf]
                if spec.n_dim is not None:
                    t = t.narrow(spec.n_dim, start // spec.n_per, size // spec.n_per)
                elif len(q.hf_parts) > 1:
                    t = t.clone()  # g_idx: one copy per part (a file holds no shared storage)
                yield f"{hf}.{buf}", t
            start += size
