"""benchmark_generation.py's readable table, printed after its JSON lines: the decode and prefill rows, one line each,
in fixed-width columns (the JSON lines, and --output, stay the machine-readable record)."""

from __future__ import annotations


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> list[str]:
    """``columns``: (header, row key) pairs; the lines of a fixed-width table (none for no rows)."""
    if not rows:
        return []
    cells = [[h for h, _ in columns]] + [[_fmt(r.get(k)) for _, k in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    return [lines[0], "  ".join("-" * w for w in widths), *lines[1:]]


def summary(rows: list[dict]) -> str:
    """The decode and prefill rows as two tables (an empty string when the run logged neither)."""
    decode = [dict(r, what_ran=r.get("mode") or r.get("variant") or r.get("quant") or "") for r in rows
              if r.get("what") == "decode" and "error" not in r]  # fmt: skip
    prefill = [r for r in rows if r.get("what") == "prefill"]
    parts = []
    if decode:
        parts += ["Decode:", *table(decode, [("impl", "impl"), ("mode", "what_ran"), ("shape", "shape"), ("batch", "bs"),
                                             ("tokens/s", "tok_per_s"), ("ms/step", "ms_per_step"),
                                             ("warm-up s", "warmup_s"), ("peak GB", "mem_max_GB")])]  # fmt: skip
    if prefill:
        parts += ["Prefill:", *table(prefill, [("impl", "impl"), ("attention", "attention"), ("shape", "shape"),
                                               ("batch", "batch"), ("tokens", "L"), ("ms", "ms"),
                                               ("after idle s", "after_idle_s")])]  # fmt: skip
    failed = [r for r in rows if r.get("what") == "decode" and "error" in r]
    parts += [f"{r['impl']} {r.get('mode', '')} {r['shape']} batch {r['bs']}: failed ({r['error']})" for r in failed]
    return "\n".join(parts)
