"""polyfuse-generate's inputs: --prompt, --prompt_file or --chat_file read and checked before anything loads, their
chat-template rendering, and the batches they run in. Every input runs: fewer inputs than --batch_size are cycled to
fill one batch (optimum-habana's behaviour), more run in batches of --batch_size, the last one holding the rest."""

from __future__ import annotations

import json
import sys

from polyfuse.cli.errors import UsageError


DEFAULT_PROMPT = "DeepSpeed is a machine learning framework"


def read_text(path: str, flag: str) -> str:
    """A UTF-8 text file's contents, or one UsageError line naming ``flag`` and what is wrong with the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{flag} {path}: a folder, not a text file") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None


def read_prompt_file(path: str) -> list[str]:
    """--prompt_file: one prompt per line, blank lines skipped."""
    prompts = [line.rstrip("\r") for line in read_text(path, "--prompt_file").split("\n") if line.strip()]
    if not prompts:
        raise UsageError(f"--prompt_file {path}: no prompts in it (one per line; blank lines are skipped)")
    return prompts


def read_inputs(args) -> list:
    """The distinct inputs, each a prompt string or a message list (--chat_file), read and checked before anything
    loads. --chat_file and --system_prompt turn --use_chat_template on."""
    prompt_file = getattr(args, "prompt_file", None)
    given = [f for f, v in (("--prompt", args.prompt), ("--prompt_file", prompt_file), ("--chat_file", args.chat_file))
             if v]  # fmt: skip
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)}: give one of them")
    if args.chat_file is None:
        if args.system_prompt is not None:
            args.use_chat_template = True
        if prompt_file:
            return read_prompt_file(prompt_file)
        return list(args.prompt or [DEFAULT_PROMPT])
    return read_chat_file(args)


def read_chat_file(args) -> list:
    where = f"--chat_file {args.chat_file}"
    try:
        with open(args.chat_file, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{where}: not valid UTF-8 JSON ({e})") from None
    except OSError as e:
        raise UsageError(f"{where}: cannot read it ({e.strerror or e})") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if isinstance(data, list) and data and all(isinstance(m, dict) for m in data):
        data = [data]  # one conversation
    shape = '[{"role": ..., "content": ...}, ...] or a list of such conversations'
    if not isinstance(data, list) or not data or not all(isinstance(c, list) and c for c in data):
        raise UsageError(f"{where}: expected {shape}")
    for i, conv in enumerate(data, 1):
        for m in conv:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise UsageError(f"{where}: conversation {i} has a message that is not {{role: str, content: str}}")
        if conv[-1]["role"] == "assistant":
            raise UsageError(
                f"{where}: conversation {i} ends with an assistant message; end it with the user's turn to answer"
            )
    args.use_chat_template = True
    return data


def render_inputs(args, tokenizer, inputs: list) -> list[str]:
    """Each distinct input as the text that is tokenized: the prompt, or its chat template rendering."""
    if not args.use_chat_template:
        return list(inputs)
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("--use_chat_template: this tokenizer has no chat template")
    texts, kept_own = [], []
    for i, item in enumerate(inputs, 1):
        messages = list(item) if isinstance(item, list) else [{"role": "user", "content": item}]
        if args.system_prompt is not None:
            if messages[0]["role"] == "system":
                kept_own.append(str(i))
            else:
                messages.insert(0, {"role": "system", "content": args.system_prompt})
        try:
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        except Exception as e:
            raise UsageError(f"the tokenizer's chat template rejects input {i} ({type(e).__name__}: {e})") from None
    if kept_own:
        print(
            f"warning: --system_prompt ignored for conversation {', '.join(kept_own)} of --chat_file, which has its "
            "own system message",
            file=sys.stderr,
        )
    return texts


def row_groups(n_inputs: int, batch_size: int) -> list[list[int]]:
    """The input index of every row of every batch."""
    if n_inputs <= batch_size:
        return [[i % n_inputs for i in range(batch_size)]]
    return [list(range(s, min(s + batch_size, n_inputs))) for s in range(0, n_inputs, batch_size)]


def check_prompts(args, tokenizer, texts: list[str]) -> tuple[list[str], list[str]]:
    """(texts to tokenize, texts as they are used, for the report), once before the runs. An empty prompt alone is
    an error; among others it warns and starts from the BOS token, as transformers' text-generation pipeline starts
    an empty prompt. Prompts longer than --max_input_tokens are truncated from the left, with one warning."""
    special = not args.use_chat_template
    texts = list(texts)
    lengths = [len(tokenizer(t, add_special_tokens=special).input_ids) for t in texts]
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty and len(empty) == len(texts):
        which = "--prompt is" if len(texts) == 1 else "every --prompt is"
        raise UsageError(f"{which} empty: there is nothing to generate from; give it some text")
    if empty:
        flat = [i for group in row_groups(len(texts), args.batch_size) for i in group]
        rows = [str(r + 1) for r, i in enumerate(flat) if i in empty]
        numbers = ", ".join(str(i + 1) for i in empty)
        if tokenizer.bos_token is None:
            raise UsageError(f"--prompt {numbers} is empty and this tokenizer has no BOS token to start it from: give "
                             "it some text")  # fmt: skip
        print(
            f"warning: --prompt {numbers} is empty (input {', '.join(rows)} of {len(flat)}): generated from the BOS "
            f"token {tokenizer.bos_token!r} alone, as transformers' text-generation pipeline does",
            file=sys.stderr,
        )
        for i in empty:
            texts[i] = tokenizer.bos_token
    return texts, truncated(args, tokenizer, texts, special)


def truncated(args, tokenizer, texts: list[str], special: bool) -> list[str]:
    """The texts as --max_input_tokens > 0 leaves them (their last tokens), with one warning when any is cut."""
    used = list(texts)
    limit = args.max_input_tokens
    if limit <= 0:
        return used
    budget = limit - (tokenizer.num_special_tokens_to_add() if special else 0)
    dropped = []
    for i, t in enumerate(texts):
        ids = tokenizer(t, add_special_tokens=False).input_ids
        if len(ids) > budget:
            dropped.append(f"{len(ids) - budget} tokens of prompt {i + 1}")
            used[i] = tokenizer.decode(ids[len(ids) - budget :]) if budget > 0 else ""
    if dropped:
        print(
            f"warning: --max_input_tokens {limit}: prompts truncated from the left (their last {limit} tokens "
            f"kept); dropped the first {', '.join(dropped)}",
            file=sys.stderr,
        )
    return used


def encode(args, tokenizer, prompts: list[str], device):
    """Token ids of one batch (tokenization is part of the timed run, as in optimum-habana), left-padded; with
    --max_input_tokens > 0 padded / truncated (from the left) to that length."""
    kw = {"return_tensors": "pt", "add_special_tokens": not args.use_chat_template}
    if args.max_input_tokens > 0:
        kw.update(padding="max_length", max_length=args.max_input_tokens, truncation=True)
    else:
        kw.update(padding=True)
    enc = tokenizer(prompts, **kw)
    return enc.input_ids.to(device), enc.attention_mask.to(device)
