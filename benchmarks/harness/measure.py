"""Measurement helpers: the device's copy bandwidth (the decode ceiling) and event-timed medians."""

from __future__ import annotations

import statistics
import time

import torch


def copy_bandwidth(device, nbytes: int = 4 << 30, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / time_median(lambda: dst.copy_(src), reps=reps)


def time_median(fn, reps: int = 10, warmup: int = 2, pause: float = 0.0) -> float:
    """Median seconds of ``fn()`` timed with CUDA events (host clock on the CPU). ``pause``: seconds with the device
    idle before each timed call (each then starts from the idle GPU's clocks: under a long run of heavy calls back to
    back, a GPU may reach its power limit and lower its clock, as the H200 does on fp8 prefill)."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.cuda.is_available()
    for _ in range(reps):
        if pause > 0:
            if cuda:
                torch.cuda.synchronize()
            time.sleep(pause)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def weight_bytes(model, exclude_embedding: bool = False) -> int:
    """Bytes of distinct parameters; the embedding table is read one row per token, so decode can exclude it."""
    seen, total = set(), 0
    emb = model.get_input_embeddings().weight
    if emb is getattr(model.get_output_embeddings(), "weight", None):
        emb = None  # tied: the table is read whole by the LM head
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embedding and emb is not None and p is emb:
            continue
        total += p.numel() * p.element_size()
    for m in model.modules():  # quantized projections hold their packed weights as buffers (quant/quantize.py)
        if hasattr(m, "quantized_weight"):
            total += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False))
    return total
