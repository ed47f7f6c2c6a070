"""polyfuse-generate's numbers: the timed runs summed up as optimum-habana's Stats block names them, each figure either
measured or "n/a" with the reason it would mean nothing (no token after the first; a compile time where nothing was
compiled), and the Input/outputs block."""

from __future__ import annotations

from typing import Optional


def summarize(runs: list[list[dict]], max_new_tokens: int) -> dict:
    """Stats of the finished timed runs, each a list of its batches' timings ({first_s, rest_s, new_tokens, rows,
    e2e_s}); a figure with nothing to measure is None, with its reason under ``notes``."""
    batches = [b for run in runs for b in run]
    if not batches:
        return {"throughput": None, "avg_first_token_latency": None, "avg_rest_token_latency": None,
                "avg_e2e_latency": None, "notes": {"timing": "no timed run finished"}}  # fmt: skip
    seconds = sum(b["e2e_s"] for b in batches)
    tokens = sum(b["new_tokens"] * b["rows"] for b in batches)
    rest = [b["rest_s"] / (b["new_tokens"] - 1) for b in batches if b["new_tokens"] > 1]
    notes = {}
    if not rest and max_new_tokens == 1:
        notes["avg_rest_token_latency"] = "--max_new_tokens 1: no token after the first"
    elif not rest:
        notes["avg_rest_token_latency"] = "every run stopped at its first token: no token after the first"
        notes["throughput"] = "every run stopped at its first token (EOS): no text was generated"
    return {
        "throughput": tokens / seconds if seconds > 0 else None,
        "avg_first_token_latency": 1e3 * sum(b["first_s"] for b in batches) / len(batches),
        "avg_rest_token_latency": 1e3 * sum(rest) / len(rest) if rest else None,
        "avg_e2e_latency": 1e3 * sum(sum(b["e2e_s"] for b in run) for run in runs) / len(runs),
        "notes": notes,
    }


def compile_note(flags: dict, device_type: str, warmup: int, graphs: Optional[int]) -> Optional[str]:
    """Why the warm-up time is no graph compilation time, or None when it is: something compiles or captures
    (--torch_compile that compiled ``graphs`` torch.compile graphs, device graphs, Gaudi's lazy mode) and warm-up
    runs took it."""
    device_graphs = flags.get("use_cuda_graphs") or flags.get("use_hpu_graphs")
    if not (flags.get("torch_compile") or device_graphs or device_type == "hpu"):
        return "nothing to compile: no --torch_compile, --use_cuda_graphs or --use_hpu_graphs"
    if warmup == 0:
        return "--warmup 0: any compilation ran inside the timed runs"
    if flags.get("torch_compile") and not device_graphs and device_type != "hpu" and graphs == 0:
        return "--torch_compile compiled nothing: no op runs its native reference"
    return None


def _figure(value, unit: str, note: Optional[str]) -> str:
    return f"n/a ({note})" if value is None else f"{value} {unit}"


def print_report(r: dict, args) -> None:
    print("\nInput/outputs:")
    per_input = max(len(r["output"]) // max(len(r["input"]), 1), 1)  # --num_return_sequences: rows i * n + j
    for i, inp in enumerate(r["input"]):
        print(f"input {i + 1}: {(inp,)}")
        for j, out in enumerate(r["output"][i * per_input : (i + 1) * per_input]):
            print(f"output {i + 1}.{j + 1}: {(out,)}")
        print()
    notes = r.get("notes", {})
    timing = notes.get("timing")
    lines = [
        "Input tokens",
        "Throughput (including tokenization) = "
        + _figure(r["throughput"], "tokens/second", timing)
        + (f" ({notes['throughput']})" if notes.get("throughput") and r["throughput"] is not None else ""),
        "Average first token latency         = " + _figure(r["avg_first_token_latency"], "ms", timing),
        "Average rest token latency          = "
        + _figure(r["avg_rest_token_latency"], "ms", notes.get("avg_rest_token_latency", timing)),
        "Average end to end latency          = " + _figure(r["avg_e2e_latency"], "ms", timing),
    ]
    for k, v in r["memory"].items():
        if v is not None:
            lines.append("{:35} = {} GB".format(k[:-5].replace("_", " ").capitalize(), v))
    lines.append(
        "Graph compilation duration          = "
        + _figure(r["graph_compilation_duration"], "seconds", notes.get("graph_compilation_duration"))
    )
    if r.get("ops"):
        lines.append(f"Op overrides                        = {r['ops']}")
    spec = r.get("speculative")
    if spec:
        lines.append(f"Speculative decoding                = {spec['method']}, k={spec['k']}")
        lines.append(f"Draft acceptance rate               = {spec['acceptance_rate']}")
        lines.append(f"Mean tokens per verify step         = {spec['tokens_per_step']}")
    sep = "-" * max(len(s) for s in lines)
    print("Stats:\n" + sep + "\n" + "\n".join(lines) + "\n" + sep)
