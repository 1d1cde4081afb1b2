"""The HTTP layer (Starlette): OpenAI `/v1/completions`, `/v1/chat/completions`, `/v1/models`; SGLang-native
`/generate`, `/get_server_info`, `/get_model_info`; `/health`, `/metrics`. Thin over the engine.

The model loads (and compiles, and warms up) in a thread after the server starts listening: until it is warm,
`/health` and every generation endpoint answer 503. Every error is OpenAI-shaped:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from serve import logprobs as lp_format
from serve import protocol
from serve.engine import Engine, Metrics, Output
from serve.engine import Request as EngineRequest
from serve.protocol import APIError, GenRequest, ModelLimits

log = logging.getLogger("serve.server")

# load() -> (engine factory inputs): a Generator, ModelLimits; it compiles and warms up before returning.
Loader = Callable[[], tuple[Any, ModelLimits]]


class AppState:
    """What the routes share: server args, metrics, and the engine once the model is warm."""

    def __init__(self, server_args: dict, metrics: Metrics, seed: int):
        self.server_args, self.metrics, self.seed = server_args, metrics, seed
        self.engine: Engine | None = None
        self.load_error: str | None = None

    def ready_engine(self) -> Engine:
        if self.engine is None:
            msg = f"model failed to load: {self.load_error}" if self.load_error else "the model is still loading"
            raise APIError(503, msg, type="service_unavailable", code="not_ready")
        return self.engine


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _read_body(request: Request) -> dict:
    n = request.headers.get("content-length")
    if n is not None and n.isdigit() and int(n) > protocol.MAX_BODY_BYTES:
        raise APIError(413, f"request body is {n} bytes; the limit is {protocol.MAX_BODY_BYTES}",
                       code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > protocol.MAX_BODY_BYTES:
            raise APIError(413, f"request body exceeds the limit of {protocol.MAX_BODY_BYTES} bytes",
                           code="body_too_large")
        chunks.append(chunk)
    return protocol.parse_body(b"".join(chunks))


async def _watch_disconnect(request: Request, engine: Engine, req: EngineRequest):
    """Cancel `req` when the client goes away (the body is already read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.cancel(req)


async def _outputs(request: Request, engine: Engine, req: EngineRequest) -> AsyncIterator[Output]:
    """The request's outputs until finished; a disconnect (or this iterator being closed) cancels it."""
    watcher = asyncio.create_task(_watch_disconnect(request, engine, req))
    try:
        while True:
            out = await req.queue.get()
            yield out
            if out.finished:
                return
    finally:
        watcher.cancel()
        engine.cancel(req)  # no-op when finished


def _sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _openai_finish(reason: dict | None) -> str | None:
    return None if reason is None else {"stop": "stop", "length": "length"}.get(reason["type"], "abort")


def _usage(req: EngineRequest) -> dict:
    p, c = len(req.gen.input_ids), len(req.output_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _meta_info(req: EngineRequest, spec_enabled: bool) -> dict:
    st = req.stats
    return {
        "id": req.id, "prompt_tokens": len(req.gen.input_ids), "completion_tokens": len(req.output_ids),
        "cached_tokens": 0, "finish_reason": req.finish_reason, "e2e_latency": req.e2e_s,
        "spec_verify_ct": st.verify_steps if spec_enabled else 0,
        "spec_accept_length": st.mean_accept_length if spec_enabled else 1.0,
    }


def _choice_logprobs(chat: bool, gen: GenRequest, tokenizer, ids: list[int], logprobs: list | None,
                     offset: int = 0) -> dict | None:
    if gen.top_logprobs is None:
        return None
    if chat:
        return lp_format.chat_logprobs(ids, logprobs or [], tokenizer)
    return lp_format.completion_logprobs(ids, logprobs or [], tokenizer, offset)


def _abort_error(req: EngineRequest) -> APIError:
    return APIError(500, req.finish_reason.get("message", "request aborted"), type="internal_error",
                    code="aborted")


# ---- OpenAI ------------------------------------------------------------------------------------------------------


def _openai_choice(chat: bool, text: str, ids: list[int], reason: str | None, stream: bool, tokenizer_free: bool):
    c: dict = {"index": 0}
    if chat:
        c["delta" if stream else "message"] = ({"content": text} if stream else {"role": "assistant", "content": text})
    else:
        c.update(text=text, logprobs=None)
    if tokenizer_free:
        c["token_ids"] = ids
    c["finish_reason"] = reason
    return c


async def _openai(request: Request, st: AppState, parse: Callable[[dict, ModelLimits], GenRequest], chat: bool):
    engine = st.ready_engine()
    gen = parse(await _read_body(request), engine.limits)
    req = engine.submit(gen)
    tok_free = engine.limits.tokenizer is None
    base = {"id": ("chatcmpl-" if chat else "cmpl-") + req.id, "created": int(time.time()),
            "model": engine.limits.served_model_name}
    obj = "chat.completion" if chat else "text_completion"

    if not gen.stream:
        async for out in _outputs(request, engine, req):
            pass
        if req.finish_reason["type"] == "abort":
            return _error(_abort_error(req))
        choice = _openai_choice(chat, req.text, req.output_ids, _openai_finish(req.finish_reason), False, tok_free)
        choice["logprobs"] = _choice_logprobs(chat, gen, engine.limits.tokenizer, req.output_ids, req.logprobs)
        if req.finish_reason.get("type") == "stop":
            choice["matched_stop"] = req.finish_reason.get("matched")
        return JSONResponse({**base, "object": obj, "choices": [choice], "usage": _usage(req)})

    async def events():
        chunk = {**base, "object": obj + ".chunk" if chat else obj}
        if chat:
            yield _sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None}]})
        async for out in _outputs(request, engine, req):
            if out.finished and req.finish_reason["type"] == "abort":
                yield _sse(_abort_error(req).body())
                break
            if out.token_ids or out.text or out.finished:
                choice = _openai_choice(chat, out.text, out.token_ids, _openai_finish(out.finish_reason), True,
                                        tok_free)
                choice["logprobs"] = _choice_logprobs(chat, gen, engine.limits.tokenizer, out.token_ids,
                                                      out.logprobs, len(req.text) - len(out.text))
                yield _sse({**chunk, "choices": [choice]})
        if gen.include_usage and req.finish_reason["type"] != "abort":
            yield _sse({**chunk, "choices": [], "usage": _usage(req)})
        yield _sse(b"[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- SGLang-native ---------------------------------------------------------------------------------------------


async def _generate(request: Request, st: AppState):
    engine = st.ready_engine()
    gen = protocol.parse_generate(await _read_body(request), engine.limits)
    req = engine.submit(gen)
    spec = engine.gen.spec.enabled

    def meta(req: EngineRequest) -> dict:
        m = _meta_info(req, spec)
        if gen.top_logprobs is not None:
            m.update(lp_format.sglang_meta(req.output_ids, req.logprobs, engine.limits.tokenizer,
                                           gen.extra["return_text_in_logprobs"]))
        return m

    if not gen.stream:
        async for out in _outputs(request, engine, req):
            pass
        if req.finish_reason["type"] == "abort":
            return _error(_abort_error(req))
        return JSONResponse({"text": req.text, "output_ids": req.output_ids, "meta_info": meta(req)})

    async def events():
        async for out in _outputs(request, engine, req):
            if out.finished and req.finish_reason["type"] == "abort":
                yield _sse(_abort_error(req).body())
                break
            yield _sse({"text": req.text, "output_ids": req.output_ids, "meta_info": meta(req)})
        yield _sse(b"[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- app -----------------------------------------------------------------------------------------------------------


def create_app(server_args: dict, load: Loader, *, served_model_name: str, seed: int = 0,
               on_load_error: Callable[[str], None] | None = None,
               on_shutdown: Callable[[], None] | None = None) -> Starlette:
    """The ASGI app. `load` runs in a thread at startup; the app serves generation once it returns."""
    st = AppState(server_args, Metrics(served_model_name), seed)

    def route(fn):
        async def endpoint(request: Request):
            try:
                return await fn(request, st)
            except APIError as e:
                if e.status >= 500 and e.code != "not_ready":
                    log.warning("%s %s: %s", request.method, request.url.path, e.message)
                return _error(e)

        return endpoint

    async def health(request, st):
        st.ready_engine()
        return Response(status_code=200)

    async def models(request, st):
        m = {"id": served_model_name, "object": "model", "created": 0, "owned_by": "ling-jax",
             "root": server_args.get("model_path"), "max_model_len": server_args.get("context_length")}
        return JSONResponse({"object": "list", "data": [m]})

    async def server_info(request, st):
        e = st.engine
        internal = {"avg_spec_accept_length": e.avg_accept_length if e else 0.0,
                    "spec_verify_ct_total": e.verify_ct_total if e else 0,
                    "spec_accept_tokens_total": e.accept_tokens_total if e else 0,
                    "last_gen_throughput": e.last_gen_throughput if e else 0.0,
                    "num_finished_requests": e.num_finished if e else 0,
                    "num_aborted_requests": e.num_aborted if e else 0,
                    "ready": e is not None}
        return JSONResponse({**server_args, "internal_states": [internal], "version": "ling-jax-0.1.0"})

    async def model_info(request, st):
        return JSONResponse({"model_path": server_args.get("model_path"), "is_generation": True,
                             "served_model_name": served_model_name})

    async def metrics(request, st):
        return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(request, st):
        return await _openai(request, st, protocol.parse_completion, chat=False)

    async def chat(request, st):
        return await _openai(request, st, protocol.parse_chat, chat=True)

    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code))

    async def load_model():
        try:
            generator, limits = await asyncio.to_thread(load)
        except Exception as e:  # noqa: BLE001 - reported by /health and the launcher
            log.exception("model load failed")
            st.load_error = f"{type(e).__name__}: {e}"
            if on_load_error:
                on_load_error(st.load_error)
            return
        engine = Engine(generator, limits, st.metrics, seed)
        engine.start()
        st.engine = engine
        log.info("ready: serving %s", served_model_name)

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(load_model())
        yield
        task.cancel()
        if st.engine is not None:
            await st.engine.stop()
        if on_shutdown is not None:  # blocking (multi-host: tells the followers), so off the event loop
            await asyncio.to_thread(on_shutdown)

    routes = [
        Route("/health", route(health), methods=["GET"]),
        Route("/v1/models", route(models), methods=["GET"]),
        Route("/get_server_info", route(server_info), methods=["GET"]),
        Route("/get_model_info", route(model_info), methods=["GET"]),
        Route("/metrics", route(metrics), methods=["GET"]),
        Route("/v1/completions", route(completions), methods=["POST"]),
        Route("/v1/chat/completions", route(chat), methods=["POST"]),
        Route("/generate", route(_generate), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.serving = st
    return app
