"""`Endpoint`: an OpenAI-compatible HTTP server (FastAPI on uvicorn, on a thread of the process that owns the
rollout engines) for agents written against the `openai` client.

`/v1/chat/completions` and `/v1/completions` (streaming included: the chunks are sent once the completion is
sampled) run on the engines through `backend` (`RolloutGroup.complete`); every completion is recorded in
its session exactly as sampled (workers/endpoint/sessions.py). Guards, in the order a request meets them:
a body over `max_request_bytes` (or without a length) is refused before it is read (413 / 411); a request
without the bearer token of an open session gets 401; a body that is not a valid request gets 400; a
session past its call or token budget gets 400. Errors are OpenAI's error objects. The server binds
`host` (127.0.0.1 unless the caller names the node's address).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from workers.endpoint.batcher import Backend, Batcher
from workers.endpoint.chat import BadRequest, assistant_message, render, template_messages
from workers.endpoint.protocol import ChatRequest, CompletionRequest, error_body
from workers.endpoint.sessions import Completion, Session, Sessions

MAX_REQUEST_BYTES = 1 << 20


class HTTPError(Exception):
    """Answered as an OpenAI error object with `status`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, code, param)


class _BodyLimit:
    """ASGI middleware: a POST must declare its length, at most `limit` bytes, before its body is read (the
    HTTP layer then holds the body to that length)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            length = dict(scope["headers"]).get(b"content-length")
            status, msg = 0, ""
            if length is None:
                status, msg = 411, "a request body needs a Content-Length header"
            elif not length.isdigit() or int(length) > self.limit:
                status, msg = 413, f"the request body is over {self.limit} bytes"
            if status:
                body = json.dumps(error_body(msg, code="request_too_large" if status == 413 else None)).encode()
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class Endpoint:
    """The server and its sessions. `backend(requests)` samples (see `RolloutWorker.complete`); `version()`
    is the policy version the engines hold; `tokenizer` is the policy's (its chat template renders the
    messages). Each completion samples at most `max_tokens`, within the session's token budget and the
    model's `max_model_len`."""

    def __init__(self, backend: Backend, tokenizer: Any, version: Callable[[], int], max_tokens: int,
                 max_model_len: int, host: str = "127.0.0.1", port: int = 0,
                 max_request_bytes: int = MAX_REQUEST_BYTES, request_timeout_s: float = 300.0,
                 model_name: str = "policy") -> None:
        self.tokenizer, self.max_tokens, self.max_model_len = tokenizer, max_tokens, max_model_len
        self.host, self.port, self.request_timeout_s, self.model_name = host, port, request_timeout_s, model_name
        self.max_request_bytes = max_request_bytes
        self.sessions = Sessions()
        self.batcher = Batcher(backend, version)
        self.refused: dict[int, int] = {}  # HTTP status -> requests refused with it
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> Endpoint:
        """Bind and serve on a daemon thread; returns once the server accepts connections."""
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(_BodyLimit(self.app(), self.max_request_bytes), log_level="warning",
                                lifespan="off", access_log=False, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="openai-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        self.batcher.close()

    def open_session(self, session_id: str, max_calls: int, max_tokens: int) -> tuple[Session, str]:
        return self.sessions.open(session_id, max_calls, max_tokens)

    def close_session(self, token: str) -> Session | None:
        return self.sessions.close(token)

    # ---- the app ---------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.exception_handler(HTTPError)
        async def _refused(request: Request, exc: HTTPError) -> JSONResponse:
            self.refused[exc.status] = self.refused.get(exc.status, 0) + 1
            return JSONResponse(exc.body, status_code=exc.status)

        @app.exception_handler(StarletteHTTPException)
        async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            self.refused[exc.status_code] = self.refused.get(exc.status_code, 0) + 1
            return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code)

        @app.get("/v1/models")
        async def models(request: Request) -> dict[str, Any]:
            self._auth(request)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "rlhf"}]}

        @app.post("/v1/chat/completions", response_model=None)
        async def chat(request: Request) -> Any:
            session = self._auth(request)
            req = _parse(ChatRequest, await request.body())
            try:
                ids = render(self.tokenizer, template_messages(req.messages, session), req.tools)
            except BadRequest as e:
                raise HTTPError(400, str(e), param=e.param, code=e.code) from None
            comp = await self._complete(session, ids, req.max_completion_tokens or req.max_tokens, req)
            message, call_ids = assistant_message(comp.text)
            if not self.sessions.record(session, comp, call_ids):
                raise HTTPError(401, "the session closed while the completion ran", code="session_closed")
            reason = "tool_calls" if call_ids else comp.finish_reason
            head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model}
            if req.stream:
                return StreamingResponse(_chat_chunks(head, message, reason), media_type="text/event-stream")
            return {**head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
                    "usage": _usage(comp)}

        @app.post("/v1/completions", response_model=None)
        async def completions(request: Request) -> Any:
            session = self._auth(request)
            req = _parse(CompletionRequest, await request.body())
            if isinstance(req.prompt, str):
                ids = list(self.tokenizer(req.prompt)["input_ids"])
            else:
                vocab = len(self.tokenizer)
                if any(not 0 <= t < vocab for t in req.prompt):
                    raise HTTPError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
                ids = list(req.prompt)
            comp = await self._complete(session, ids, req.max_tokens, req)
            if not self.sessions.record(session, comp, []):
                raise HTTPError(401, "the session closed while the completion ran", code="session_closed")
            head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model}
            if req.stream:
                return StreamingResponse(_text_chunks(head, comp), media_type="text/event-stream")
            return {**head, "object": "text_completion",
                    "choices": [{"index": 0, "text": comp.text, "finish_reason": comp.finish_reason,
                                 "logprobs": None}],
                    "usage": _usage(comp)}

        return app

    def _auth(self, request: Request) -> Session:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        session = self.sessions.find(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
        if session is None:
            raise HTTPError(401, "a valid bearer token of an open agent session is required",
                            code="invalid_api_key")
        return session

    async def _complete(self, session: Session, ids: list[int], wanted: int | None, req: Any) -> Completion:
        """Sample one completion of `ids` for `session`, within its budgets."""
        if len(session.completions) + session.pending >= session.max_calls:
            raise HTTPError(400, f"the session has used its {session.max_calls} completions",
                            code="session_call_limit")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise HTTPError(400, f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len}",
                            code="context_length_exceeded", param="messages")
        new = min(wanted or self.max_tokens, self.max_tokens, room, session.tokens_left)
        if new < 1:
            raise HTTPError(400, f"the session has sampled its {session.max_tokens} tokens",
                            code="session_token_limit")
        session.pending += 1
        try:
            fut = self.batcher.submit({"prompt_ids": ids, "max_tokens": new, "stop": req.stops(), "seed": req.seed})
            try:
                res, version = await asyncio.wait_for(asyncio.wrap_future(fut), self.request_timeout_s)
            except TimeoutError:
                raise HTTPError(504, f"no completion within {self.request_timeout_s:g} s",
                                kind="server_error") from None
            except Exception as e:  # noqa: BLE001 - the engines' failure, told to the agent
                raise HTTPError(503, f"the engines failed: {type(e).__name__}", kind="server_error") from None
        finally:
            session.pending -= 1
        return Completion(list(ids), list(res["token_ids"]), list(res["logprobs"]), int(version),
                          str(res["finish_reason"]), str(res["text"]))


def _parse(model: Any, body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first: dict[str, Any] = dict(e.errors()[0]) if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise HTTPError(400, f"invalid request: {where + ': ' if where else ''}{first.get('msg', str(e))}",
                        param=where or None) from None


def _usage(comp: Completion) -> dict[str, int]:
    return {"prompt_tokens": len(comp.prompt_ids), "completion_tokens": len(comp.token_ids),
            "total_tokens": len(comp.prompt_ids) + len(comp.token_ids)}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _chat_chunks(head: dict[str, Any], message: dict[str, Any], reason: str) -> AsyncIterator[str]:
    base = {**head, "object": "chat.completion.chunk"}
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(message["tool_calls"])]
    yield _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    yield _sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": reason}]})
    yield "data: [DONE]\n\n"


async def _text_chunks(head: dict[str, Any], comp: Completion) -> AsyncIterator[str]:
    base = {**head, "object": "text_completion"}
    yield _sse({**base, "choices": [{"index": 0, "text": comp.text, "finish_reason": None}]})
    yield _sse({**base, "choices": [{"index": 0, "text": "", "finish_reason": comp.finish_reason}]})
    yield "data: [DONE]\n\n"
