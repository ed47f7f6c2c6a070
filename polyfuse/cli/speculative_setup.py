"""``polyfuse-generate``'s speculative decoding: the flags of polyfuse/cli/speculative_options.py checked before any
run, the draft model or EAGLE-3 heads loaded once, and generate()'s keyword arguments kept on ``args`` for every run
(polyfuse/cli/generation_options.py passes them). Bad input is one ``error:`` line (ValueError / CheckpointError,
printed by the CLI); where speculation cannot apply, one ``warning:`` line naming what runs instead."""

from __future__ import annotations

import sys
from typing import Optional

from polyfuse.generation.options import GenerationOptions
from polyfuse.generation.speculative.plan import make_proposer
from polyfuse.generation.speculative.settings import speculative_setting


FLAGS = ("assistant_model", "prompt_lookup_num_tokens", "max_matching_ngram_size", "speculative_model",
         "speculative_method", "num_speculative_tokens")  # fmt: skip
GIVEN = object()  # stands for a draft not loaded yet while the flags are checked


def _setting(args):
    try:
        options = GenerationOptions(
            prompt_lookup_num_tokens=args.prompt_lookup_num_tokens, max_matching_ngram_size=args.max_matching_ngram_size,
            speculative_method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
        )  # fmt: skip
    except ValueError as e:
        raise ValueError("--" + str(e)) from None
    draft = GIVEN if args.assistant_model else None
    heads = GIVEN if args.speculative_model else None
    return speculative_setting(options, draft, heads)


def _fallback(args, setting) -> Optional[str]:
    if args.num_beams > 1:
        return f"--num_beams {args.num_beams}: beam search runs without speculative decoding ({setting.method})"
    if not args.use_kv_cache:
        return f"speculative decoding ({setting.method}) needs --use_kv_cache: the cache-less forward runs without it"
    return None


def _load_draft(args, path: str, model, tokenizer, device, flags, open_checkpoint):
    from polyfuse.models import AutoModelForCausalLM

    folder, gguf, theirs = open_checkpoint(path)
    if theirs is not None and theirs.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"--assistant_model {path}: its tokenizer differs from the model's (a draft model must "
                         "share the model's tokenizer)")  # fmt: skip
    draft = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=model.dtype, device=device, flags=flags,
                                                 overrides=args.ops)  # fmt: skip
    return draft.eval()


def prepare_speculation(args, model, tokenizer, device, flags, open_checkpoint) -> Optional[str]:  # 6: the run's
    """Check and load; keep generate()'s arguments on ``args._polyfuse_speculation``. ``open_checkpoint(path)``:
    (folder, GGUF file or None, its tokenizer or None), as the CLI resolves --model_name_or_path. Returns the
    proposer's line for --print_backends, or None without speculation."""
    args._polyfuse_speculation = {}
    if all(getattr(args, f, None) is None for f in FLAGS):
        return None
    setting = _setting(args)
    if setting is None:
        return None
    why = _fallback(args, setting)
    if why is not None:
        print(f"warning: {why}", file=sys.stderr)
        return None
    kwargs = dict(speculative_method=setting.method, num_speculative_tokens=setting.k)
    if setting.method == "prompt_lookup":
        kwargs["max_matching_ngram_size"] = setting.ngram
    elif setting.method == "draft":
        path = args.assistant_model or args.speculative_model
        kwargs["assistant_model"] = _load_draft(args, path, model, tokenizer, device, flags, open_checkpoint)
    else:
        from polyfuse.models import load_eagle3

        kwargs["speculative_model"] = load_eagle3(args.speculative_model, model, overrides=args.ops)
    drafts = kwargs.get("assistant_model"), kwargs.get("speculative_model")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    line = make_proposer(setting, model, eos, *drafts).describe()  # the engine's own checks of the draft
    args._polyfuse_speculation = kwargs
    return f"speculative decoding: {line}"
