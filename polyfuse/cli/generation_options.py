"""What ``polyfuse-generate`` passes to ``generate()`` for the flags of the "generation features" block of
``polyfuse/cli/args.py`` (--num_beams, --num_return_sequences, --repetition_penalty, --stop_strings,
--stop_token_ids, --stream), optimum-habana's --bad_words, and the speculative-decoding arguments polyfuse/cli/speculative_setup.py prepared.
Bad values raise one-line ValueErrors, which the CLI prints as ``error:`` lines."""

from __future__ import annotations

from polyfuse.generation.generate import check_generation_options
from polyfuse.generation.streaming import text_streamer


def cli_generation_kwargs(args, tokenizer) -> dict:
    """generate() keyword arguments for one run. ``--stream`` streams the first run only (the first warm-up, or the
    first timed run with --warmup 0): the text is printed once, and the other runs are timed without the per-token
    read-back that streaming costs."""
    num_beams = getattr(args, "num_beams", 1)
    num_return_sequences = getattr(args, "num_return_sequences", 1)
    penalty = getattr(args, "repetition_penalty", 1.0)
    stop_strings = getattr(args, "stop_strings", None) or None
    stop_ids = getattr(args, "stop_token_ids", None) or None
    stream = getattr(args, "stream", False)
    if num_beams < 1:
        raise ValueError(f"--num_beams must be >= 1, got {num_beams}")
    if num_return_sequences < 1:
        raise ValueError(f"--num_return_sequences must be >= 1, got {num_return_sequences}")
    if not penalty > 0:
        raise ValueError(f"--repetition_penalty must be > 0, got {penalty}")
    if num_beams > 1 and num_return_sequences > num_beams:
        raise ValueError(
            f"--num_return_sequences ({num_return_sequences}) must be <= --num_beams ({num_beams}) for beam search"
        )
    if num_beams > 1 and args.do_sample:
        raise ValueError("--do_sample with --num_beams > 1 (beam sampling) is not supported")
    if num_return_sequences > 1 and num_beams == 1 and not args.do_sample:
        raise ValueError("--num_return_sequences > 1 needs --do_sample or --num_beams >= --num_return_sequences")
    if stream and (args.batch_size != 1 or num_beams != 1 or num_return_sequences != 1):
        raise ValueError(
            "--stream prints one sequence as it is generated: it needs --batch_size 1, --num_beams 1 and "
            "--num_return_sequences 1"
        )
    streamer = None
    if stream and not getattr(args, "_polyfuse_streamed", False):
        args._polyfuse_streamed = True
        streamer = text_streamer(tokenizer)
    kwargs = dict(
        num_beams=num_beams,
        num_return_sequences=num_return_sequences,
        repetition_penalty=penalty,
        stop_strings=stop_strings,
        stop_token_ids=stop_ids,
        tokenizer=tokenizer if stop_strings else None,
        streamer=streamer,
        bad_words_ids=getattr(args, "_polyfuse_bad_words", None),  # --bad_words (bad_words_ids below)
        **getattr(args, "_polyfuse_speculation", {}),  # polyfuse/cli/speculative_setup.py: method, k, the draft
    )
    check_generation_options(
        args.do_sample, penalty, num_beams, num_return_sequences, False, stop_strings, kwargs["tokenizer"], streamer
    )
    return kwargs


def bad_words_ids(tokenizer, words) -> list | None:
    """--bad_words' token-id sequences, none of which may be generated (transformers' ``bad_words_ids``). Each word
    as optimum-habana's tokenizer (``add_prefix_space=True``) encodes it, with a leading space: the form a word takes
    inside text; and as it is encoded alone, at the start of a word. A leading space that is a token of its own is
    not banned with the word. The prompts keep their own tokenization (optimum-habana's prefix space reaches them)."""
    if not words:
        return None
    out = []
    for word in words:
        if not word.strip():
            raise ValueError(f"--bad_words: {word!r} has no text to ban")
        alone = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (spaced, alone):
            separate_space = len(ids) > len(alone) and ids[-len(alone) :] == alone
            if ids and not separate_space and ids not in out:
                out.append(ids)
    return out
