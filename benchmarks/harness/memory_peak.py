"""What is alive at a CUDA step's memory peak, by the code that allocated it.

``record()`` turns on the caching allocator's history (``torch.cuda.memory._record_memory_history``, Python frames
included); ``peak_report()`` replays the recorded alloc/free events, finds the moment the allocated bytes were
highest and groups the blocks alive then by their first frame inside polyfuse, transformers, liger_kernel, peft or
torch.optim (the code a reader can change), largest first. Used by ``benchmark_training.py --memory_peak``.
"""

from __future__ import annotations

from collections import defaultdict


OWN_CODE = ("polyfuse/", "transformers/", "liger_kernel/", "peft/", "torch/optim/", "torch/utils/checkpoint")


def record(max_entries: int = 400_000) -> None:
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")


def stop() -> None:
    import torch

    torch.cuda.memory._record_memory_history(enabled=None)


def _site(frames) -> str:
    for fr in frames or ():
        name = fr.get("filename", "")
        if any(part in name for part in OWN_CODE):
            short = name.split("site-packages/")[-1]
            return f"{short}:{fr.get('line')} {fr.get('name')}"
    return "(other)" if frames else "(no frames)"


def live_at_peak(trace) -> tuple[int, dict]:
    """(peak bytes, {address: (size, frames)}) from one device's trace of alloc / free_completed events (the
    history must start with nothing allocated that is freed later, or those frees are ignored)."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for ev in trace:
        action = ev.get("action")
        if action == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames"))
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    return peak, at_peak


def peak_report(baseline_bytes: int = 0, top: int = 14) -> str:
    """The recorded history's peak, as lines: total (plus ``baseline_bytes`` allocated before recording began,
    e.g. weights and optimizer state) and the largest allocation sites alive at that moment."""
    import torch

    snap = torch.cuda.memory._snapshot()
    traces = snap.get("device_traces") or [[]]
    trace = max(traces, key=len)
    peak, live = live_at_peak(trace)
    by_site = defaultdict(lambda: [0, 0])
    for size, frames in live.values():
        cell = by_site[_site(frames)]
        cell[0] += size
        cell[1] += 1
    gib = 2**30
    lines = [
        f"memory peak: {(baseline_bytes + peak) / gib:.2f} GiB = {baseline_bytes / gib:.2f} GiB before recording + "
        f"{peak / gib:.2f} GiB allocated during the step"
    ]
    for site, (size, n) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / gib:7.3f} GiB  {n:4d} blocks  {site}")
    return "\n".join(lines)
