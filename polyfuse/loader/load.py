"""Build any polyfuse model: config -> modules on the meta device -> storage in the target dtype and device ->
weights copied in one tensor at a time (no random init, no second full copy) -> kernels resolved by the registry.

Model-agnostic: every function takes the model class (or model). What a class must provide is in
``polyfuse.core.model_protocol``: ``config_class`` and ``config_for`` (which configs it takes), ``fused_projections``
(its load-time fusions of transformers' weights) and ``init_buffers`` (tables derived from the config).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from polyfuse.checkpoint.config import gguf_architecture, gguf_config_fields, read_config_dict
from polyfuse.checkpoint.readers import iter_gguf, iter_safetensors, open_gguf
from polyfuse.checkpoint.shards import copy_shard, tp_shards
from polyfuse.checkpoint.staging import DeviceStager, SpanReader, copy_weight
from polyfuse.core.context import SelectionContext
from polyfuse.core.errors import CheckpointError
from polyfuse.core.flags import check_flags
from polyfuse.core.registry import resolve
from polyfuse.core.runtime import get_runtime
from polyfuse.distributed.context import agree, for_build
from polyfuse.distributed.sharding import TensorParallelError
from polyfuse.loader.compile import compile_for_run
from polyfuse.loader.hf_args import resolve_dtype
from polyfuse.loader.hf_files import checkpoint_fields, generation_config_for, tokenizer_source
from polyfuse.ops.attention import options_from_flags
from polyfuse.quant import quantize
from polyfuse.quant import report as quant_report


# Threads reading safetensors tensors and copying them to the device concurrently.
LOAD_WORKERS = min(8, os.cpu_count() or 1)

logger = logging.getLogger("polyfuse")


def _target(fused: dict, hf_name: str) -> tuple[str, Optional[slice]]:
    """HF parameter name -> (model parameter name, row slice inside it or None)."""
    for frag, parts in fused.items():
        start = 0
        for part, size in parts:
            if f".{part}." in hf_name:
                return hf_name.replace(part, frag), slice(start, start + size)
            start += size
    return hf_name, None


def build(model_cls, config, dtype=torch.float32, device="cpu", flags=None, overrides="", training=False, tp=None,
          quant=None):  # fmt: skip  # size: from_pretrained's and from_config's build keywords, passed on
    """Empty model (uninitialized storage) on ``device`` in ``dtype``, with kernels resolved. ``tp``: the
    ``polyfuse.distributed.TPContext`` whose rank's shard to build (only that shard gets storage); default: the
    process's context (``polyfuse.distributed.init`` / ``request_from_env``), never for training."""
    device = torch.device(device)
    tp = for_build(device, tp, training)
    if tp.active and tp.device is not None:
        if tp.device.type != device.type:
            raise TensorParallelError(f"the process group runs on {tp.device.type}; cannot build on {device.type}")
        device = tp.device if device.index is None else device
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_cls(config, tp=tp) if tp.active else model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    if quant is not None:  # quantized projections (quant/quantize.py QuantSetup): packed buffers, no dense weight
        quant.apply(model)
    get_runtime(device)  # the device's runtime first: it imports what the device needs (habana_frameworks on hpu)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_buffers(device)
    model.train(training)
    set_kernels(model, flags or {}, overrides, training)
    return model


def set_kernels(model, flags: dict, overrides: str = "", training: bool = False, device=None):
    """(Re)resolve the model's kernels for its device (or ``device``: where it is going to run, e.g. a model built
    in host memory that FSDP2 shards onto the GPU) and dtype and the run's flags. A device-specific flag the device
    does not honour is turned off with one warning naming what runs instead (as the CLI does)."""
    device = model.device if device is None else torch.device(device)
    flags, warnings = check_flags(device.type, flags)
    for w in warnings:
        logger.warning("warning: %s", w)
    ctx = SelectionContext(device, model.dtype, dict(flags), training, overrides)
    model.kernels = resolve(ctx)
    model.runtime = get_runtime(device)
    model.flags = dict(flags)
    model.attention_options = options_from_flags(flags)
    if hasattr(model, "compile_decoder"):
        model.compile_decoder(None)  # a decoder compiled for earlier kernels runs them no more
    if flags.get("torch_compile"):
        compile_for_run(model, flags, training)  # loader/compile.py: the whole decoder, its layers or its ops
    return model.kernels


def load_weights(model, tensors, workers: int = 1, quant=None, progress=None) -> None:
    """Copy (HF name, tensor) pairs into the model's parameters. A tensor may be a zero-argument callable that reads
    it: with ``workers`` > 1 the reads and the host-to-device copies of different tensors then overlap.
    ``progress(nbytes, total_bytes)`` is called (from any loader thread) as each parameter tensor is copied."""
    params = dict(model.named_parameters(remove_duplicate=False))
    fused = model.fused_projections()
    shards, rank = tp_shards(model)  # tensor parallelism: what this rank reads of each tensor (checkpoint/shards.py)
    tied = model.config.tie_word_embeddings
    tied_head = {}  # a tied model's lm_head.weight found in the checkpoint: compared with the embedding at the end
    if quant is not None:
        quant.bind(model)

    def place(item) -> Optional[str]:
        hf_name, tensor = item
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if tied and hf_name == "lm_head.weight":
            # Never written into the shared tensor here: with threads the embedding and this head would race.
            tied_head[hf_name] = tensor() if callable(tensor) else tensor
            return hf_name
        name, rows = _target(fused, hf_name)
        hit = quant.place(name, rows, tensor) if quant is not None else None  # a quantized projection's tensor
        if hit is not None:
            return hit
        param = params.get(name)
        if param is None:
            raise CheckpointError(f"unexpected weight {hf_name!r} for a {model.config.model_type} checkpoint")
        dst = param.data if rows is None else param.data[rows]
        if not (shards and copy_shard(dst, tensor, shards, hf_name, rank)):
            copy_weight(dst, tensor, hf_name, files, stager)
        if progress is not None:
            progress(dst.numel() * dst.element_size(), total_bytes)
        return hf_name

    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # GPU loads read each tensor into a pinned buffer and copy it without blocking (staging.py).
    files = SpanReader()
    stager = DeviceStager(model.device, files) if model.device.type == "cuda" else None
    try:
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                seen = set(pool.map(place, tensors))
        else:
            seen = {place(item) for item in tensors}
        if stager is not None:
            stager.finish()
    finally:
        files.close()
    if tied_head:
        _tie_or_untie(model, tied_head["lm_head.weight"], "model.embed_tokens.weight" in seen)
        seen.add("model.embed_tokens.weight")
    if quant is not None:
        quant.finish(model)
    missing = sorted(set(expected_hf_names(model)) - seen)
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[0]!r}")


def _tie_or_untie(model, head: torch.Tensor, have_embedding: bool) -> None:
    """``tie_word_embeddings`` with an ``lm_head.weight`` in the checkpoint, as transformers does: equal to the
    embedding (or no embedding in the checkpoint) -> stay tied; different -> untie, lm_head keeps its own weights
    (one warning), and the config says so, so a save writes both."""
    emb = model.get_input_embeddings().weight
    if tuple(head.shape) != tuple(emb.shape):
        raise CheckpointError(f"weight 'lm_head.weight' has shape {tuple(head.shape)}, expected {tuple(emb.shape)}")
    head = head.to(device=emb.device, dtype=emb.dtype)
    if not have_embedding:
        emb.data.copy_(head)
        return
    if torch.equal(head, emb.data):
        return
    logger.warning(
        "warning: tie_word_embeddings is true but the checkpoint's lm_head.weight differs from "
        "model.embed_tokens.weight; untying them (lm_head keeps its own weights, as transformers does)"
    )
    model.config.tie_word_embeddings = False
    vocab = getattr(model, "vocab", None)  # tensor parallelism: this rank's rows of the vocab-parallel head
    rows = head if vocab is None else head[vocab.start : vocab.stop]
    lm_head = model.get_output_embeddings()
    lm_head.weight = torch.nn.Parameter(rows.clone(), requires_grad=emb.requires_grad)


def expected_hf_names(model) -> list[str]:
    return [n for n, _ in _state_items(model)]


def hf_state_items(model, params=None):
    """(HF name, tensor view) for every weight, splitting the fused projections back. ``params``: (name, tensor)
    pairs in the model's own names to write instead of its parameters (a full state dict gathered from FSDP2
    shards, polyfuse/training/fsdp.py)."""
    if tp_shards(model)[0]:
        raise TensorParallelError("a tensor-parallel model holds one rank's shard; save it from a world-size-1 build")
    return _state_items(model, params)


def _state_items(model, params=None):
    fused = model.fused_projections()
    named = ((n, p.data) for n, p in model.named_parameters()) if params is None else params
    for name, data in named:
        hit = next(((f, parts) for f, parts in fused.items() if f".{f}." in name), None)
        if hit is None:
            yield name, data
            continue
        frag, parts = hit
        for (part, _), chunk in zip(parts, data.split([s for _, s in parts], dim=0)):
            yield name.replace(frag, part), chunk


def dtype_of(dtype):
    if isinstance(dtype, str):
        dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return dtype


def _gguf_path(path: Optional[str], gguf_file: str) -> str:
    return gguf_file if os.path.isabs(gguf_file) or path is None else os.path.join(path, gguf_file)


def checkpoint_source(path, gguf_file: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(folder, GGUF file or None) of what ``from_pretrained`` was given: a path to a ``.gguf`` file is that file in
    its folder, and a folder holding exactly one ``.gguf`` and no config.json is that GGUF (as the CLI takes them)."""
    if path is None or gguf_file is not None:
        return path, gguf_file
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        if len(ggufs) > 1:
            names = ", ".join(ggufs[:3]) + (", ..." if len(ggufs) > 3 else "")
            raise CheckpointError(f"{path} holds {len(ggufs)} GGUF files ({names}): pick one with gguf_file=")
    return path, None


def _not_a_folder(path) -> str:
    if path is not None and os.path.isfile(path):
        return f"{path}: a file, not a checkpoint folder (give its folder, with config.json, or a .gguf file)"
    return f"{path}: no such checkpoint folder"


def check_finite(model, where: str) -> None:
    """One CheckpointError naming the first floating-point weight (by its checkpoint name) or buffer holding NaN or
    Inf. Cheap: one min/max reduction per tensor, no copy, and one read-back for the whole model."""
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    named = list(_state_items(model)) + [(n, b) for n, b in model.named_buffers() if b.dtype in floats]
    named = [(n, t) for n, t in named if t.dtype in floats and t.numel() > 0 and t.device.type != "meta"]
    if not named:
        return
    finite = torch.stack([torch.isfinite(torch.stack(torch.aminmax(t))).all() for _, t in named]).tolist()
    bad = [n for (n, _), ok in zip(named, finite) if not ok]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(f"{where}: weight {bad[0]!r}{more} holds NaN or Inf values: the checkpoint is corrupt "
                              "or was converted wrongly")  # fmt: skip


def checkpoint_model_type(path: Optional[str], gguf_file: Optional[str]) -> tuple[str, str]:
    """(model_type, where) of a checkpoint, read before anything else: config.json's ``model_type`` or the GGUF's
    ``general.architecture``."""
    path, gguf_file = checkpoint_source(path, gguf_file)
    if gguf_file is not None:
        file = _gguf_path(path, gguf_file)
        return gguf_architecture(open_gguf(file)) or "unknown", file
    if path is None or not os.path.isdir(path):
        raise CheckpointError(_not_a_folder(path))
    raw = read_config_dict(path)
    return raw.get("model_type") or raw.get("architectures") or "unknown", path


def read_checkpoint_config(path: Optional[str], gguf_file: Optional[str]):
    """(raw config dict, tensors iterator factory, workers) for a folder or a GGUF file."""
    if gguf_file is not None:
        file = _gguf_path(path, gguf_file)
        reader = open_gguf(file)
        arch = gguf_architecture(reader)
        raw = dict(gguf_config_fields(reader, file) if arch else {}, model_type=arch or "unknown")
        return raw, (lambda config, keep=(): iter_gguf(reader, config, arch, keep)), 1, file
    if path is None or not os.path.isdir(path):
        raise CheckpointError(_not_a_folder(path))
    return read_config_dict(path), (lambda config, keep=(): iter_safetensors(path)), LOAD_WORKERS, path


def from_pretrained(
    model_cls,
    path: str,
    gguf_file: Optional[str] = None,
    dtype=torch.float32,
    device="cpu",
    flags: Optional[dict] = None,
    overrides: str = "",
    training: bool = False,
    tp=None,
    quant: Optional[str] = None,
    progress=None,
    quant_lm_head: bool = False,
    *,
    config=None,
    config_updates: Optional[dict] = None,
):  # size: the public loading keywords (docs/architecture.md), one per documented option
    """``progress(nbytes, total_bytes)``: called as each tensor is copied (a loading bar). ``dtype="auto"``: the
    checkpoint's (hf_args.py). ``config``: a transformers config object used instead of the checkpoint's;
    ``config_updates``: attributes set on the config (transformers' ``from_pretrained(path, attr=value)``).
    ``quant``: fp8 | fp8_block | int8 | int4 quantizes a float checkpoint as it loads; gguf keeps a GGUF's
    Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K tensors as stored; none dequantizes everything; None: a quantized checkpoint loads
    as stored, a GGUF's tensors stay quantized where a kernel takes them (quant/quantize.py). ``quant_lm_head``: a
    GGUF's own output.weight in such a type is kept as stored too, as the LM head (otherwise it is dequantized)."""
    t0 = time.perf_counter()
    given, (path, gguf_file) = path, checkpoint_source(path, gguf_file)
    raw, tensors, workers, where = read_checkpoint_config(path, gguf_file)
    dtype = resolve_dtype(dtype, raw, gguf_file is not None)
    config = model_cls.config_for(checkpoint_fields(raw, config, config_updates, model_cls.config_class), where)
    tp = for_build(device, tp, training)
    gguf = _gguf_path(path, gguf_file) if gguf_file is not None else None
    qsetup = quantize.setup(quant, raw, path, gguf, device, dtype, flags, overrides, training, where, quant_lm_head)
    try:
        model = build(model_cls, config, dtype, device, flags, overrides, training, tp, qsetup)
        with torch.no_grad():
            load_weights(
                model, tensors(config, qsetup.keep if qsetup else ()), workers=workers, quant=qsetup, progress=progress
            )
            check_finite(model, where)
        error = None
    except (ValueError, OSError, RuntimeError) as e:  # CheckpointError is a ValueError; CUDA OOM a RuntimeError
        if not tp.active:
            raise
        error = e
    # Tensor parallelism: every rank learns whether every other loaded, and the same model (no rank left waiting).
    if tp.active:
        # Not the quantization_config: a rank's shapes may take a format another rank's fall back from (int4 needs
        # multiples of 8 rows: 65 + 64 columns quantize on one rank only), and each rank runs its own projections.
        fields = {k: v for k, v in config.to_diff_dict().items() if k != "quantization_config"}
        digest = hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]
        agree(tp, error, f"{model_cls.__name__} (config {digest})")
    if qsetup is not None:
        quant_report.warn_unaccelerated(model)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    model.load_seconds = time.perf_counter() - t0
    model.name_or_path = str(given)  # as transformers' models: PEFT writes it to adapter_config.json
    model.config._name_or_path = str(given)
    model.generation_config = generation_config_for(path, gguf_file, model.config)
    model.tokenizer_source = tokenizer_source(path, gguf_file)
    return model


def init_generator(device, seed: int) -> torch.Generator:
    """A generator on ``device``, or on the host where torch has none for the device (HPU: Habana seeds its device's
    default generator through habana_frameworks.torch.hpu.random; ``torch.Generator(device="hpu")`` raises)."""
    try:
        return torch.Generator(device=device).manual_seed(seed)
    except RuntimeError:
        return torch.Generator().manual_seed(seed)


def from_config(
    model_cls, config, dtype=torch.float32, device="cpu", flags=None, overrides="", training=False, seed=0, tp=None,
    quant=None,
):  # fmt: skip  # size: the public from_config keywords
    """Random weights in the given shape (HF's init: normal(0, initializer_range), norms at one, biases at zero).
    Under tensor parallelism each rank draws only its shard, on its device; the replicated embedding is drawn
    first, from the same seed, so it is equal on every rank."""
    dtype = dtype_of(dtype) or torch.float32
    qsetup = quantize.for_random_weights(quant, device, dtype)  # benchmarks: random weights, quantized
    model = build(model_cls, config, dtype, device, flags, overrides, training, tp, qsetup)
    gen = init_generator(model.device, seed)
    std = getattr(config, "initializer_range", 0.02)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif gen.device.type == p.device.type:
                p.normal_(0.0, std, generator=gen)
            else:
                p.copy_(torch.empty(p.shape, dtype=p.dtype).normal_(0.0, std, generator=gen))
    if qsetup is not None:
        quantize.init_random_(model, gen, std)
    return model
