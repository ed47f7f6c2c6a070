"""The HTTP API (FastAPI): OpenAI's routes over the async engine.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON, or server-sent events with ``stream``; a final
usage chunk with ``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text). Every error is OpenAI's error object with a 4xx (bad request 400, bad key 401, unknown model or
route 404, queue full 429, shutting down 503); an unexpected failure is a 500 with the same object and the server
goes on. A client that hangs up (checked every 0.25 s while its request runs, and at every write of a stream) has its
request aborted: its blocks are freed at the engine's next step. With an API key every route but ``/health``
needs ``Authorization: Bearer <key>``, compared in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyfuse.serving.async_engine import AsyncEngine, Draining, QueueFull
from polyfuse.serving.metrics import CONTENT_TYPE_LATEST, Metrics
from polyfuse.serving.protocol import APIError, Context, GenerationRequest, parse


POLL_S = 0.25  # how often a running request checks that its client is still there


@dataclass
class ServerState:
    aengine: AsyncEngine
    ctx: Context
    metrics: Metrics
    api_key: Optional[str] = None
    created: int = 0


class Disconnected(Exception):
    pass


def _error(status: int, message: str, type_: str, code=None, param=None) -> JSONResponse:
    return JSONResponse(APIError(status, message, param, code, type_).body(), status_code=status)


def create_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="polyfuse serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        return _error(500, f"internal error: {type(e).__name__}: {e}", "internal_error")

    def authorized(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), state.api_key.encode())
        if not ok:
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", None,
                           "invalid_api_key")  # fmt: skip

    @app.get("/health")
    async def health():
        return {"status": "draining" if state.aengine.draining else "ok"}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorized)])
    async def model(model: str):
        if model != state.ctx.model_name:
            raise APIError(404, f"The model `{model}` does not exist", "model", "model_not_found", "not_found_error")
        return _model_card(state)

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics():
        return Response(state.metrics.render(state.aengine), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(request: Request):
        return await _generate(state, request, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request):
        return await _generate(state, request, chat=False)

    return app


def _model_card(state: ServerState) -> dict:
    return {"id": state.ctx.model_name, "object": "model", "created": state.created, "owned_by": "polyfuse",
            "max_model_len": state.ctx.max_model_len}  # fmt: skip


async def _body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None


def _submit(state: ServerState, req: GenerationRequest, out: asyncio.Queue) -> list:
    handles = []
    try:
        for i, prompt in enumerate(req.prompts):
            handles.append(state.aengine.submit(prompt, req.params, out, tag=i))
    except QueueFull as e:
        for h in handles:
            state.aengine.abort(h)
        raise APIError(429, str(e), None, "queue_full", "rate_limit_error") from None
    except Draining as e:
        raise APIError(503, str(e), None, "shutting_down", "service_unavailable") from None
    return handles


def _engine_error(e: Exception) -> APIError:
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, Draining):
        return APIError(503, str(e), None, "shutting_down", "service_unavailable")
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", None, None, "internal_error")


async def _next(out: asyncio.Queue, request: Request):
    while True:
        try:
            return await asyncio.wait_for(out.get(), timeout=POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise Disconnected() from None


async def _generate(state: ServerState, request: Request, chat: bool):
    req = parse(await _body(request), state.ctx, chat)
    out: asyncio.Queue = asyncio.Queue()
    handles = _submit(state, req, out)
    view = Choices(state, req, chat)
    if req.stream:
        return StreamingResponse(_stream(state, request, req, out, handles, view), media_type="text/event-stream")
    try:
        while not view.complete:
            handle, item = await _next(out, request)
            if isinstance(item, Exception):
                raise _engine_error(item)
            view.add(handle, item)
    except BaseException:
        for h in handles:
            state.aengine.abort(h)
        raise
    return view.response()


async def _stream(state, request, req: GenerationRequest, out, handles, view):
    try:
        while not view.complete:
            handle, item = await _next(out, request)
            if isinstance(item, Exception):
                yield _sse(_engine_error(item).body())
                break
            chunk = view.chunk(handle, item)
            if chunk is not None:
                yield _sse(chunk)
        else:
            if req.include_usage:
                yield _sse(view.usage_chunk())
        yield "data: [DONE]\n\n"
    finally:  # a hang-up (cancelled, or Disconnected from _next) or the end: nothing is left running
        for h in handles:
            state.aengine.abort(h)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Choices:
    """The choices of one HTTP request as they grow, and their OpenAI form (whole, or chunk by chunk)."""

    def __init__(self, state: ServerState, req: GenerationRequest, chat: bool):
        self.state, self.req, self.chat = state, req, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.n = req.params.n
        self.text: dict = {}
        self.logprobs: dict = {}
        self.finish: dict = {}
        self.tokens: dict = {}
        self.prompt_tokens: dict = {}
        self.cached_tokens: dict = {}
        self.started: set = set()

    @property
    def complete(self) -> bool:
        """Every choice's last delta is in (the handles' own counts run ahead, in the engine thread)."""
        return len(self.finish) == len(self.req.prompts) * self.n

    def _index(self, handle, d) -> int:
        return handle.tag * self.n + d.index

    def add(self, handle, d) -> int:
        i = self._index(handle, d)
        self.text[i] = self.text.get(i, "") + d.text
        self.tokens[i] = self.tokens.get(i, 0) + len(d.token_ids)
        self.logprobs.setdefault(i, []).extend(d.logprobs)
        self.prompt_tokens[handle.tag], self.cached_tokens[handle.tag] = d.prompt_tokens, d.cached_tokens
        if d.finish_reason is not None:
            self.finish[i] = d.finish_reason
        return i

    def usage(self) -> dict:
        prompt, completion = sum(self.prompt_tokens.values()), sum(self.tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}  # fmt: skip

    def _logprobs(self, entries: list, offset0: int = 0):
        if not entries or self.req.params.logprobs is None:
            return None
        tok = self.state.aengine.engine.detok
        if self.chat:

            def one(t, lp):
                s = tok.token_text(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

            return {
                "content": [{**one(t, lp), "top_logprobs": [one(a, b) for a, b in alts]} for t, lp, alts in entries]
            }
        texts = [tok.token_text(t) for t, _, _ in entries]
        offsets, pos = [], offset0
        for s in texts:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{tok.token_text(a): b for a, b in alts} for _, _, alts in entries],
                "text_offset": offsets}  # fmt: skip

    def response(self) -> dict:
        choices = []
        for i in sorted(self.text):
            lp = self._logprobs(self.logprobs.get(i, []))
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": self.text[i]},
                                "logprobs": lp, "finish_reason": self.finish.get(i)})  # fmt: skip
            else:
                choices.append({"index": i, "text": self.text[i], "logprobs": lp, "finish_reason": self.finish.get(i)})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.req.model, "choices": choices, "usage": self.usage()}  # fmt: skip

    def chunk(self, handle, d) -> Optional[dict]:
        before = len(self.text.get(self._index(handle, d), ""))
        i = self.add(handle, d)
        lp = self._logprobs(d.logprobs, before)
        if self.chat:
            delta = {"content": d.text}
            if i not in self.started:
                self.started.add(i)
                delta = {"role": "assistant", "content": d.text}
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}
        else:
            choice = {"index": i, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        if not d.text and d.finish_reason is None and lp is None and (not self.chat or "role" not in choice["delta"]):
            return None  # nothing to say yet (a held-back or partial character)
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.req.model, "choices": [choice]}  # fmt: skip
        if self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.req.model, "choices": [], "usage": self.usage()}  # fmt: skip
