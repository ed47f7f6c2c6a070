"""One batch through ``model.generate`` with the CLI's settings: the call that the prompt runs (cli/generate.py's
``Runs``) and the data-set runs (cli/dataset.py) share, timed by phase."""

from __future__ import annotations

import torch

from polyfuse.cli.progress import token_bar


def input_device(args, device):
    """Where a tokenized batch goes before generate(): the host with --reduce_recompile (generate() prepares it
    there, so only whole-bucket shapes reach the device: optimum-habana's "preprocess on cpu"), else the device."""
    return torch.device("cpu") if getattr(args, "reduce_recompile", False) else device


def generate_batch(args, model, tokenizer, ids, mask, generator, bars: bool = False):
    """``(out, timings, speculative)`` for one tokenized batch: the sequences [rows, L + new], the phase times
    (``first_token_s``, ``rest_s``, ``new_tokens``) and the speculative-decoding counts (None when it did not
    speculate)."""
    from polyfuse.cli.generation_options import cli_generation_kwargs  # --num_beams, --stream, --bad_words, ...
    from polyfuse.generation.hooks import PhaseTimer  # the Stats block's phase times

    kw = cli_generation_kwargs(args, tokenizer)
    if kw["streamer"] is None and kw["num_beams"] == 1:
        kw["streamer"] = token_bar(bars, args.max_new_tokens)
    timer = PhaseTimer(model.runtime)
    out = model.generate(
        ids, mask, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        generator=generator, ignore_eos=args.ignore_eos, bucket_size=args.bucket_size, use_cache=args.use_kv_cache,
        hooks=timer, **kw,
    )  # fmt: skip
    return out, timer.timings, timer.speculative
