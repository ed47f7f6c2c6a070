#!/usr/bin/env python
"""Perplexity of a model over a text shipped in the repo, for one or more weight formats in one run.

    python benchmarks/evaluate_perplexity.py                                   # built-in model, as loaded by default
    python benchmarks/evaluate_perplexity.py --quant none,gguf,int8,fp8,int4   # the same text under each format
    python benchmarks/evaluate_perplexity.py --model_name_or_path /models/llama-3-8b --bf16 --device cuda \
        --quant none,fp8,int8,int4 --context 1024

--quant takes run_generation.py's values (none: every weight dequantized/float; gguf: a GGUF's Q8_0/Q4_0/Q4_1/
Q4_K/Q5_K/Q6_K tensors kept as stored; fp8 | fp8_block | int8 | int4: quantized at load; auto: the default load); a value ending in
"+lm_head" (fp8+lm_head, ...) also quantizes the LM head, as run_generation.py's --quant_lm_head; "+gptq" (int4+gptq,
int8+gptq, fp8+gptq) quantizes by GPTQ instead of round to nearest, calibrated on --calibration_text (default: the
scored text's tokens after --max_tokens, which are not scored) in run_generation.py --quant_calibration's windows
(512 tokens, at most 64, whatever --context is); "+norms" (int4+norms, int4+gptq+norms, ...) then fits the RMSNorm
weights to the float model on the same windows, as --quant_tune_norms, "+scales" the quantized projections' scales, as
--quant_tune_scales, both together with "+norms+scales" (--norm_steps; the row's norm_kl: the KL per token to the
float model on the held-out windows, norm_kl_windows of them, before and after). The first entry is the
baseline the others are compared with. "+a8" (int4+a8, gguf+a8) scores int4 (a GGUF's kept weights) with the
projections' activations quantized to int8 in blocks of 32, as the one-row decode computes them with
the kernel option int4_a8 (GGUF: gguf_a8, on by default) (emulated on every position, teacher-forced: benchmarks/harness/act_int8.py).
"+w8a8" (fp8+w8a8, fp8_block+w8a8, also after +gptq / +scales) scores fp8 with the activations rounded to e4m3 per
token (fp8_block: per token and 128 columns) as a GPU's W8A8 prefill GEMMs round them, on any device (the CPU's fp8
is otherwise weight-only; benchmarks/harness/act_fp8.py); the tuning (+norms, +scales) still fits the weight-only model.
The default text is the Declaration of Independence (public domain, examples/data/declaration_of_independence.txt).

Each JSON line has vs_first (perplexity / the first entry's - 1) and vs_first_se, its standard error from the tokens'
own losses: std(this entry's per-token loss - the first entry's) / sqrt(tokens). A vs_first within about two of
them is not resolved by this text: where activations are rounded (fp8 W8A8 on a GPU, +a8) float-level noise alone
moves the perplexity by that much (docs/quantization.md, "Quality"). --samples N scores every entry N - 1 more
times with its input embeddings jittered by about one bf16 step (x (1 + 0.004 n), n normal; seeds 1 .. N - 1, the
same draws for every entry: benchmarks/harness/perplexity.py jittered_inputs), each against the first entry under the
same jitter: the row's samples_vs_first lists the N results (the unjittered vs_first first) and vs_first_mean is
their mean, the number to hold against a target where one sample is that noisy.
"""

import argparse
import json
import os
import sys
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.harness.act_fp8 import FORMATS as W8A8_FORMATS  # noqa: E402
from benchmarks.harness.act_fp8 import emulate_fp8_activations_  # noqa: E402
from benchmarks.harness.act_int8 import FORMATS as A8_FORMATS  # noqa: E402
from benchmarks.harness.act_int8 import emulate_int8_activations_  # noqa: E402
from benchmarks.harness.perplexity import jittered_inputs, perplexity, token_nll, token_windows  # noqa: E402
from benchmarks.harness.report import append_result, run_meta  # noqa: E402
from polyfuse.cli.generate import UsageError, load_cli_tokenizer, pick_device, read_text  # noqa: E402
from polyfuse.quant.gptq import GPTQ_FORMATS, calibration_windows  # noqa: E402
from polyfuse.quant.quantize import LOAD_TIME_FORMATS, quantize_lm_head_, quantize_model_  # noqa: E402
from polyfuse.quant.tuning import NORM_STEPS, norm_targets, tune_norms_  # noqa: E402


DEFAULT_TEXT = os.path.join(ROOT, "examples", "data", "declaration_of_independence.txt")


FORMATS = ("auto", "none", "gguf") + LOAD_TIME_FORMATS
SUFFIXES = ("lm_head", "gptq", "norms", "scales", "a8", "w8a8")


def check_entries(quants: list[str], gguf) -> None:
    """Every --quant entry, before any model is loaded."""
    for quant in quants:
        fmt, *suffixes = quant.split("+")
        if fmt not in FORMATS:
            raise UsageError(f"--quant {quant!r}: the format is one of {', '.join(FORMATS)}")
        if set(suffixes) - set(SUFFIXES) or len(set(suffixes)) != len(suffixes):
            raise UsageError(f"--quant {quant}: suffixes are +gptq, +norms, +scales, +lm_head, +a8 and +w8a8, each "
                             "at most once")  # fmt: skip
        if fmt == "gguf" and gguf is None:
            raise UsageError(f"--quant {quant}: keeps a GGUF's tensors as stored; this model is not a GGUF (give "
                             "--gguf_file)")  # fmt: skip
        if "gptq" in suffixes and fmt not in GPTQ_FORMATS:
            raise UsageError(f"--quant {quant}: GPTQ quantizes {', '.join(GPTQ_FORMATS)}")
        for tuned in ("norms", "scales"):
            if tuned in suffixes and fmt not in LOAD_TIME_FORMATS:
                raise UsageError(f"--quant {quant}: +{tuned} tunes the {tuned} of a model quantized at load "
                                 f"({', '.join(LOAD_TIME_FORMATS)})")  # fmt: skip
        if "lm_head" in suffixes and fmt == "none":
            raise UsageError(f"--quant {quant}: none keeps every weight float; give the head's format (int8+lm_head)")
        if "a8" in suffixes and fmt not in A8_FORMATS:
            raise UsageError(f"--quant {quant}: +a8 is for {', '.join(A8_FORMATS)} (the formats whose one-row GEMV "
                             "has int8 activations)")  # fmt: skip
        if "w8a8" in suffixes and fmt not in W8A8_FORMATS:
            raise UsageError(f"--quant {quant}: +w8a8 is for {', '.join(W8A8_FORMATS)} (the formats a GPU multiplies "
                             "on e4m3 activations in prefill)")  # fmt: skip


def check_output(path: str, flag: str = "--output") -> None:
    """--output: an existing file or a new one in an existing, writable folder (checked before anything runs)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: a folder; give a file to append the JSON lines to")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: no such folder {folder}")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise UsageError(f"{flag} {path}: not writable")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", default=None, help="checkpoint folder; default: the built-in model")
    p.add_argument("--gguf_file", default=None)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder or .gguf file, for a checkpoint without one (save_pretrained writes none)",
    )
    p.add_argument("--text", default=DEFAULT_TEXT, help="a UTF-8 text file")
    p.add_argument("--quant", default="auto", help="comma list of formats to evaluate, the first is the baseline")
    p.add_argument("--context", type=int, default=512, help="tokens per window (non-overlapping), at least 2")
    p.add_argument("--max_tokens", type=int, default=0, help=">0: score only the first tokens of the text")
    p.add_argument(
        "--calibration_text",
        default=None,
        help="+gptq, +norms, +scales: a UTF-8 text file to calibrate on (see above)",
    )
    p.add_argument(
        "--norm_steps", type=int, default=None, help=f"+norms, +scales: Adam steps, one window each ({NORM_STEPS})"
    )
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="score each entry this many times: unjittered, then with jittered input embeddings (see above)",
    )
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "hpu"])
    p.add_argument("--output", default=None,
                   help="append one JSON line per format here, once every entry has run")  # fmt: skip
    p.add_argument("--results", default=None, help="also append the rows, with the date, device, versions and "
                   "command, to this JSON-lines file or to perplexity.jsonl in this folder (benchmarks/results)")  # fmt: skip
    args = p.parse_args(argv)
    args.token = None  # load_cli_tokenizer's Hub token: local files only here
    try:
        return run(args)
    except UsageError as e:
        print(f"evaluate_perplexity.py: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    from polyfuse.models import AutoModelForCausalLM
    from polyfuse.models.builtin import builtin_model

    if args.context < 2:
        raise UsageError(f"--context must be >= 2 (a window scores its tokens after the first), got {args.context}")
    if args.norm_steps is not None and args.norm_steps < 1:
        raise UsageError(f"--norm_steps must be >= 1, got {args.norm_steps}")
    if args.norm_steps is not None and not any("+norms" in q or "+scales" in q for q in args.quant.split(",")):
        raise UsageError("--norm_steps: no --quant entry has +norms or +scales (int4+norms, ...)")
    if args.samples < 1:
        raise UsageError(f"--samples must be >= 1 (1: the unjittered run alone), got {args.samples}")
    if args.max_tokens < 0:
        raise UsageError(f"--max_tokens must be >= 0 (0: the whole text), got {args.max_tokens}")
    quants = args.quant.split(",")
    path, gguf = args.model_name_or_path, args.gguf_file
    if path is None and gguf is None:
        path, gguf = builtin_model()
    check_entries(quants, gguf)
    if args.output:
        check_output(args.output)
    if args.results and not os.path.isdir(args.results):
        check_output(args.results, "--results")
    device = pick_device(args.device)
    tokenizer = load_cli_tokenizer(args, path, gguf)
    ids = torch.tensor(tokenizer(read_text(args.text, "--text"), add_special_tokens=False).input_ids)
    windows = token_windows(ids, args.context, args.max_tokens)
    if not windows:
        kept = min(len(ids), args.max_tokens) if args.max_tokens > 0 else len(ids)
        raise UsageError(f"no tokens to score: {kept} token(s) of --text {args.text} (--max_tokens {args.max_tokens}); "
                         "a window needs 2")  # fmt: skip
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    calibration = None
    if any("+gptq" in q or "+norms" in q or "+scales" in q for q in quants):
        if args.calibration_text:
            text = read_text(args.calibration_text, "--calibration_text")
            cal_ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
            where = f"--calibration_text {args.calibration_text} has too few (give a longer text)"
        else:
            cal_ids = ids[args.max_tokens :] if args.max_tokens > 0 else ids[:0]
            where = (
                "the text after --max_tokens has too few (give --calibration_text, or a smaller --max_tokens)"
                if args.max_tokens > 0
                else "give --calibration_text, or --max_tokens below the text's length (the rest calibrates)"
            )
        calibration = calibration_windows(cal_ids)  # run_generation.py --quant_calibration's windows
        if not calibration:
            raise UsageError(f"+gptq, +norms and +scales need calibration tokens: {where}")
    base = base_nll = base_jittered = None
    rows = []
    for quant in quants:
        t0 = time.perf_counter()
        fmt, *suffixes = quant.split("+")
        head, gptq, a8, w8a8 = ("lm_head" in suffixes, "gptq" in suffixes, "a8" in suffixes, "w8a8" in suffixes)
        scales = "scales" in suffixes
        tune = "norms" in suffixes or scales
        kl = None
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, gguf_file=gguf, dtype=dtype, device=device,
                quant="none" if gptq or tune else None if fmt == "auto" else fmt,
                quant_lm_head=head and gguf is not None and not tune,  # tuning needs the float head
            )  # fmt: skip
            targets = norm_targets(model, calibration) if tune else None  # the float model's, on the same windows
            if gptq or tune:  # the float model first: its projections' inputs on the calibration tokens
                quantize_model_(model, fmt, calibration if gptq else None)
            if tune:  # run_generation.py's --quant_tune_norms / --quant_tune_scales
                steps = args.norm_steps or NORM_STEPS
                kl = tune_norms_(model, calibration, targets, steps, norms="norms" in suffixes, scales=scales)
            if head:  # run_generation.py's --quant_lm_head
                quantize_lm_head_(model, fmt if fmt in LOAD_TIME_FORMATS else None)
        except (ValueError, OSError) as e:  # what the loaders raise for a model / format that do not fit
            raise UsageError(f"--quant {quant}: {e}") from None
        if a8:
            emulate_int8_activations_(model)
        if w8a8:
            emulate_fp8_activations_(model)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ppl, n = perplexity(model, windows)
        eval_s = time.perf_counter() - t0
        # a second forward, for vs_first's standard error: the perplexity itself stays the fused loss's (the
        # numbers recorded in docs/ came from it, without a [tokens, vocab] logits tensor)
        nll = token_nll(model, windows).double()
        jittered = []  # per seed: this entry's per-token losses with the input embeddings jittered
        for seed in range(1, args.samples):
            with jittered_inputs(model, seed):
                jittered.append(token_nll(model, windows).double())
        row = {"quant": quant, "perplexity": ppl, "tokens": n, "context": args.context, "dtype": str(dtype)[6:],
               "calibration_tokens": sum(len(w) for w in calibration) if gptq or tune else 0,
               "device": args.device, "load_s": round(load_s, 2), "eval_s": round(eval_s, 2)}  # fmt: skip
        if kl is not None:
            row["norm_kl"] = [round(kl["before"], 5), round(kl["after"], 5)]
            row["norm_kl_windows"] = kl["held_out"] or 1  # the held-out windows that judged (one: the only one)
        if base is None:
            base, base_nll, base_jittered = ppl, nll, jittered
        row["vs_first"] = ppl / base - 1.0
        row["vs_first_se"] = ((nll - base_nll).std() / len(nll) ** 0.5).item() if len(nll) > 1 else 0.0
        if args.samples > 1:  # each jittered sample against the first entry under the same draws
            samples = [row["vs_first"]] + [
                (a.mean() - b.mean()).exp().item() - 1.0 for a, b in zip(jittered, base_jittered)
            ]
            row["samples_vs_first"] = samples
            row["vs_first_mean"] = sum(samples) / len(samples)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del model
    if args.output:  # every row at once: a run stopped by an error leaves the file as it was
        with open(args.output, "a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
    if args.results:
        meta = run_meta(torch.cuda.get_device_name() if args.device == "cuda" else args.device)
        text = {"text": os.path.basename(args.text), "max_tokens": args.max_tokens}
        if args.calibration_text:
            text["calibration"] = os.path.basename(args.calibration_text)
        for row in rows:
            append_result(args.results, {"what": "perplexity", **text, **row}, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
