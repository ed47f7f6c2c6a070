"""OpenAI's request bodies, checked field by field into what the engine runs; every bad field is an :class:`APIError`
(a 4xx with OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``), never a 500.

Accepted as OpenAI documents them: ``model``, ``messages`` (roles system / developer / user / assistant; content a
string or text parts) or ``prompt`` (a string, strings, token ids, lists of token ids), ``max_tokens`` /
``max_completion_tokens``, ``temperature`` (0: greedy), ``top_p``, ``n``, ``stop``, ``seed``, ``stream``,
``stream_options.include_usage``, ``logprobs`` / ``top_logprobs`` (chat) or ``logprobs`` (completions), and
``presence_penalty`` / ``frequency_penalty`` at 0. Extensions, as vLLM has them: ``top_k``, ``ignore_eos``,
``stop_token_ids``. What the server cannot do (tools, other response formats, penalties, ``logit_bias``, ``echo``,
``suffix``, ``best_of`` > ``n``) is refused by name rather than ignored. Other unknown fields are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from polyfuse.serving.request import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class Context:
    """What checking a request needs from the server."""

    model_name: str
    tokenizer: object
    max_model_len: int
    vocab_size: int


@dataclass
class GenerationRequest:
    chat: bool
    model: str
    prompts: list  # token ids, one list per prompt
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    request_logprobs: bool = False  # chat: logprobs asked
    extra: dict = field(default_factory=dict)


ROLES = {"system", "developer", "user", "assistant"}
UNSUPPORTED = {
    "tools": "tool calling", "tool_choice": "tool calling", "functions": "function calling",
    "function_call": "function calling", "logit_bias": "logit_bias", "suffix": "suffix", "audio": "audio output",
}  # fmt: skip


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default, low, high, low_open=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"'{name}' must be a number, got {v!r}", name)
    if (v <= low if low_open else v < low) or v > high:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise bad(f"'{name}' must be in {interval}, got {v}", name)
    return float(v)


def _integer(body: dict, name: str, default, low, high=None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(f"'{name}' must be an integer, got {v!r}", name)
    if v < low or (high is not None and v > high):
        where = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad(f"'{name}' must be {where}, got {v}", name)
    return v


def _flag(body: dict, name: str, default=False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {v!r}", name)
    return v


def _stop(body: dict) -> tuple:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    return tuple(stops)


def _refuse_unsupported(body: dict) -> None:
    for name, what in UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}):
            raise bad(f"'{name}' is not supported by this server ({what})", name, "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad(f"'{name}' other than 0 is not supported by this server", name, "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("'response_format' other than {\"type\": \"text\"} is not supported", "response_format",
                  "unsupported_parameter")  # fmt: skip


def check_model(body: dict, ctx: Context) -> str:
    model = body.get("model")
    if model is None:
        raise bad("you must provide a model parameter", "model")
    if not isinstance(model, str):
        raise bad(f"'model' must be a string, got {model!r}", "model")
    if model != ctx.model_name:
        raise APIError(404, f"The model `{model}` does not exist (this server serves `{ctx.model_name}`)", "model",
                       "model_not_found", "not_found_error")  # fmt: skip
    return model


def _sampling(body: dict, ctx: Context, prompt_len: int, chat: bool) -> tuple:
    """(SamplingParams, the value of ``max_tokens``) for one prompt of ``prompt_len`` tokens."""
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    room = ctx.max_model_len - prompt_len
    max_tokens = _integer(body, name, None, 1)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise bad(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). Please "
            f"reduce the prompt or '{name}'.", name, "context_length_exceeded",
        )  # fmt: skip
    if chat:
        want = _flag(body, "logprobs")
        top = _integer(body, "top_logprobs", None, 0, 20)
        if top is not None and not want:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _integer(body, "logprobs", None, 0, 20)
    n = _integer(body, "n", 1, 1, 128)
    best_of = _integer(body, "best_of", None, 1)
    if best_of is not None and best_of != n:
        raise bad("'best_of' other than 'n' is not supported", "best_of", "unsupported_parameter")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < ctx.vocab_size for t in ids):
        raise bad("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    top_k = _integer(body, "top_k", 0, -1)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(0, top_k),
        n=n,
        seed=_integer(body, "seed", None, -(2**63)),
        stop=_stop(body),
        stop_token_ids=tuple(ids),
        ignore_eos=_flag(body, "ignore_eos"),
        logprobs=logprobs,
    )
    if params.seed is not None:
        params.seed %= 2**63
    return params


def _stream(body: dict) -> tuple:
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return stream, _flag(opts, "include_usage")


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def chat_prompt(messages, ctx: Context) -> list:
    if messages is None:
        raise bad("'messages' is a required property", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    conversation = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}, got {role!r}",
                      f"messages[{i}].role")  # fmt: skip
        conversation.append({"role": "system" if role == "developer" else role, "content": _content(m, i)})
    tok = ctx.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad("this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template's own checks (role order, ...)
        raise bad(f"the chat template rejects these messages ({type(e).__name__}: {e})", "messages") from None
    return tok(text, add_special_tokens=False).input_ids


def completion_prompts(prompt, ctx: Context) -> list:
    if prompt is None:
        raise bad("'prompt' is a required property", "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of those", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(ctx.tokenizer(p, add_special_tokens=True).input_ids)
        elif isinstance(p, list) and all(_is_int(t) and 0 <= t < ctx.vocab_size for t in p):
            out.append(list(p))
        else:
            raise bad(f"'prompt' entries must be strings or lists of token ids below {ctx.vocab_size}", "prompt")
    return out


def parse(body, ctx: Context, chat: bool) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = check_model(body, ctx)
    _refuse_unsupported(body)
    if not chat and _flag(body, "echo"):
        raise bad("'echo' is not supported by this server", "echo", "unsupported_parameter")
    prompts = [chat_prompt(body.get("messages"), ctx)] if chat else completion_prompts(body.get("prompt"), ctx)
    param = "messages" if chat else "prompt"
    longest = max(len(p) for p in prompts)
    if any(not p for p in prompts):
        raise bad("the prompt has no tokens", param)
    if longest >= ctx.max_model_len:
        raise bad(f"This model's maximum context length is {ctx.max_model_len} tokens. However, your prompt has "
                  f"{longest} tokens (at least one is needed for the completion).", param,
                  "context_length_exceeded")  # fmt: skip
    params = _sampling(body, ctx, longest, chat)
    stream, include_usage = _stream(body)
    return GenerationRequest(chat, model, prompts, params, stream, include_usage, chat and params.logprobs is not None)
