"""The HTTP layer (Starlette): OpenAI `/v1/completions`, `/v1/chat/completions`, `/v1/models[/{id}]`;
SGLang-native `/generate`, `/server_info`, `/model_info` (and their older `/get_*` names), `/tokenize`,
`/detokenize`, `/abort_request`, `/flush_cache`, `/health_generate`; `/health`, `/metrics`. Thin over the engine.

The model loads (and compiles, and warms up) in a thread after the server starts listening: until it is warm,
`/health` and every generation endpoint answer 503. Every error is OpenAI-shaped:
`{"error": {"message", "type", "param", "code"}}`; a stream that fails after it started sends one such object
as its last event, then `[DONE]`. `begin_shutdown` (SIGTERM) answers every request in flight at once: 503, or
that final error event in a stream.
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
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from serve import logprobs as lp_format
from serve import protocol
from serve.engine import Engine, Metrics, Output
from serve.engine import Request as EngineRequest
from serve.http_io import ApiKeyMiddleware, ServeOptions, authenticated, public_view, read_json_body
from serve.protocol import APIError, GenRequest, ModelLimits

log = logging.getLogger("serve.server")

# load() -> (engine factory inputs): a Generator, ModelLimits; it compiles and warms up before returning.
Loader = Callable[[], tuple[Any, ModelLimits]]


class AppState:
    """What the routes share: server args, options, metrics, and the engine once the model is warm."""

    def __init__(self, server_args: dict, metrics: Metrics, opts: ServeOptions):
        self.server_args, self.metrics, self.opts = server_args, metrics, opts
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self.shutting_down = False
        self.loop: asyncio.AbstractEventLoop | None = None  # set at startup; signal handlers post to it

    def ready_engine(self) -> Engine:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        if self.engine is None:
            msg = f"model failed to load: {self.load_error}" if self.load_error else "the model is still loading"
            raise APIError(503, msg, type="service_unavailable", code="not_ready")
        return self.engine

    def begin_shutdown(self):
        """On the event loop: refuse new requests and end every request in flight now (503 / a final error
        event), before the HTTP server waits for connections to close."""
        if self.shutting_down:
            return
        self.shutting_down = True
        n = self.engine.abort_rid(None, abort_all=True, message="the server is shutting down",
                                  status_code=503) if self.engine else 0
        log.info("shutting down: %d request(s) in flight ended", n)

    def begin_shutdown_threadsafe(self):
        """From a signal handler or another thread."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.begin_shutdown)

    async def body(self, request: Request) -> dict:
        return await read_json_body(request, self.opts.body_timeout_s)


_UNREAD_BODY = ("body_timeout", "body_too_large", "client_disconnected")


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


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


def _meta_info(req: EngineRequest, spec_enabled: bool, n_out: int, reason: dict | None) -> dict:
    st = req.stats
    return {
        "id": req.id, "prompt_tokens": len(req.gen.input_ids), "completion_tokens": n_out,
        "cached_tokens": 0, "finish_reason": reason, "e2e_latency": req.e2e_s if reason else 0.0,
        "spec_verify_ct": st.verify_steps if spec_enabled else 0,
        "spec_accept_length": st.mean_accept_length if spec_enabled else 1.0,
    }


_ABORT_CODES = {503: ("service_unavailable", "shutting_down"), 504: ("timeout", "request_timeout")}


def _failed(req: EngineRequest) -> APIError | None:
    """The error a finished request answers with: an abort with a status code (internal error, timeout,
    shutdown); None for a normal reply (an /abort_request abort is one, shortened, as in SGLang)."""
    r = req.finish_reason
    if r["type"] != "abort" or "status_code" not in r:
        return None
    type_, code = _ABORT_CODES.get(r["status_code"], ("internal_error", "aborted"))
    return APIError(r["status_code"], r.get("message", "request aborted"), type=type_, code=code)


def _choice_logprobs(chat: bool, gen: GenRequest, tokenizer, ids: list[int], logprobs: list | None,
                     offset: int = 0) -> dict | None:
    if gen.top_logprobs is None:
        return None
    if chat:
        return lp_format.chat_logprobs(ids, logprobs or [], tokenizer)
    return lp_format.completion_logprobs(ids, logprobs or [], tokenizer, offset)


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
    gen = parse(await st.body(request), engine.limits)
    req = engine.submit(gen)
    tok_free = engine.limits.tokenizer is None
    base = {"id": ("chatcmpl-" if chat else "cmpl-") + req.id, "created": int(time.time()),
            "model": engine.limits.served_model_name}
    obj = "chat.completion" if chat else "text_completion"

    if not gen.stream:
        async for out in _outputs(request, engine, req):
            pass
        if (err := _failed(req)) is not None:
            return _error(err)
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
            if out.finished and (err := _failed(req)) is not None:
                yield _sse(err.body())
                break
            if out.token_ids or out.text or out.finished:
                choice = _openai_choice(chat, out.text, out.token_ids, _openai_finish(out.finish_reason), True,
                                        tok_free)
                choice["logprobs"] = _choice_logprobs(chat, gen, engine.limits.tokenizer, out.token_ids,
                                                      out.logprobs, len(req.text) - len(out.text))
                yield _sse({**chunk, "choices": [choice]})
        if gen.include_usage and _failed(req) is None:
            yield _sse({**chunk, "choices": [], "usage": _usage(req)})
        yield _sse(b"[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- SGLang-native ---------------------------------------------------------------------------------------------


async def _generate(request: Request, st: AppState):
    engine = st.ready_engine()
    gen = protocol.parse_generate(await st.body(request), engine.limits)
    req = engine.submit(gen)
    spec = engine.gen.spec.enabled

    def meta(req: EngineRequest, ids: list[int], reason: dict | None) -> dict:
        """meta_info for the first len(ids) output tokens (with their logprobs when asked for)."""
        m = _meta_info(req, spec, len(ids), reason)
        if gen.top_logprobs is not None:
            m.update(lp_format.sglang_meta(ids, (req.logprobs or [])[:len(ids)], engine.limits.tokenizer,
                                           gen.extra["return_text_in_logprobs"]))
        return m

    if not gen.stream:
        async for out in _outputs(request, engine, req):
            pass
        if (err := _failed(req)) is not None:
            return _error(err)
        return JSONResponse({"text": req.text, "output_ids": req.output_ids,
                             "meta_info": meta(req, req.output_ids, req.finish_reason)})

    async def events():
        # SGLang's stream: each event carries the text and ids so far, built from the outputs consumed (req's
        # fields already hold what is queued behind them); the final event once.
        text, ids = "", []
        async for out in _outputs(request, engine, req):
            if out.finished and (err := _failed(req)) is not None:
                yield _sse(err.body())
                break
            text, ids = text + out.text, ids + out.token_ids
            if out.token_ids or out.text or out.finished:
                yield _sse({"text": text, "output_ids": ids, "meta_info": meta(req, ids, out.finish_reason)})
        yield _sse(b"[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- app -----------------------------------------------------------------------------------------------------------


async def _tokenize(request: Request, st: AppState):
    engine = st.ready_engine()
    ids, batched = protocol.parse_tokenize(await st.body(request), engine.limits)
    counts = [len(x) for x in ids]
    return JSONResponse({"tokens": ids if batched else ids[0], "count": counts if batched else counts[0],
                         "max_model_len": engine.limits.context_length})


async def _detokenize(request: Request, st: AppState):
    engine = st.ready_engine()
    lists, batched, skip = protocol.parse_detokenize(await st.body(request), engine.limits)
    texts = [engine.limits.tokenizer.tok.decode(x, skip_special_tokens=skip) for x in lists]
    return JSONResponse({"text": texts if batched else texts[0]})


async def _abort_request(request: Request, st: AppState):
    engine = st.ready_engine()
    rid, abort_all = protocol.parse_abort(await st.body(request))
    engine.abort_rid(rid, abort_all)
    return Response(status_code=200)  # SGLang answers 200 whether or not the request was still running


HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT


async def _health_generate(request: Request, st: AppState):
    """One greedy token through the engine (queued like any request): 200 once it comes back."""
    engine = st.ready_engine()
    req = engine.submit(GenRequest(input_ids=[0], max_new_tokens=1), log_metrics=False)

    async def finished():
        while not (await req.queue.get()).finished:
            pass

    try:
        await asyncio.wait_for(finished(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        engine.abort(req, {"type": "abort", "message": "health check timed out", "status_code": 503})
        raise APIError(503, f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s", type="service_unavailable",
                       code="unhealthy") from None
    if (err := _failed(req)) is not None:
        raise err
    return Response(status_code=200)


async def _flush_cache(request: Request, st: AppState):
    """SGLang's radix-cache flush. Every request here prefills from scratch (no prefix cache), so there is
    nothing to flush: it succeeds, as SGLang's does on an empty cache."""
    t = request.query_params.get("timeout")
    try:
        if t is not None and not float(t) >= 0:
            raise ValueError
    except ValueError:
        raise APIError(400, f"'timeout' must be a number >= 0, got {t!r}", param="timeout",
                       code="invalid_value") from None
    return Response("Cache flushed.\n(ling-jax keeps no prefix cache: every request prefills from scratch.)\n",
                    media_type="text/plain")


def _model_card(model: str, st: AppState) -> dict:
    return {"id": model, "object": "model", "created": 0, "owned_by": "ling-jax", "root": model, "parent": None,
            "max_model_len": st.server_args.get("context_length")}


def _internal_state(e: Engine | None) -> dict:
    """SGLang's internal_states[0]; its bench_serving prints avg_spec_accept_length as the accept length."""
    return {"avg_spec_accept_length": e.avg_accept_length if e else 0.0,
            "spec_verify_ct_total": e.verify_ct_total if e else 0,
            "spec_accept_tokens_total": e.accept_tokens_total if e else 0,
            "last_gen_throughput": e.last_gen_throughput if e else 0.0,
            "num_finished_requests": e.num_finished if e else 0,
            "num_aborted_requests": e.num_aborted if e else 0,
            "ready": e is not None}


def create_app(server_args: dict, load: Loader, *, served_model_name: str, opts: ServeOptions = ServeOptions(),
               on_load_error: Callable[[str], None] | None = None,
               on_shutdown: Callable[[], None] | None = None) -> Starlette:
    """The ASGI app. `load` runs in a thread at startup; the app serves generation once it returns."""
    st = AppState(server_args, Metrics(served_model_name), opts)

    def route(fn):
        async def endpoint(request: Request):
            try:
                return await fn(request, st)
            except APIError as e:
                if e.status >= 500 and e.code not in ("not_ready", "shutting_down", "queue_full"):
                    log.warning("%s %s: %s", request.method, request.url.path, e.message)
                resp = _error(e)
                if e.code in _UNREAD_BODY:  # the rest of the body may still come: not a connection to reuse
                    resp.headers["connection"] = "close"
                return resp

        return endpoint

    async def health(request, st):
        st.ready_engine()
        return Response(status_code=200)

    async def models(request, st):
        return JSONResponse({"object": "list", "data": [_model_card(served_model_name, st)]})

    async def model(request, st):
        m = request.path_params["model"]
        if m != served_model_name:
            raise APIError(404, f"The model '{m}' does not exist", param="model", code="model_not_found")
        return JSONResponse(_model_card(m, st))

    async def server_info(request, st):
        info = {**server_args, "internal_states": [_internal_state(st.engine)], "version": "ling-jax-0.1.0"}
        return JSONResponse(public_view(info, authenticated(request)))

    async def model_info(request, st):
        info = {"model_path": server_args.get("model_path"), "tokenizer_path": server_args.get("tokenizer_path"),
                "served_model_name": served_model_name, "is_generation": True, "preferred_sampling_params": None,
                "weight_version": "default", "has_image_understanding": False, "has_audio_understanding": False}
        return JSONResponse(public_view(info, authenticated(request)))

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
        engine = Engine(generator, limits, st.metrics, opts.random_seed, max_queued=opts.max_queued_requests,
                        request_timeout_s=opts.request_timeout_s)
        engine.start()
        st.engine = engine
        log.info("ready: serving %s", served_model_name)

    @asynccontextmanager
    async def lifespan(app):
        st.loop = asyncio.get_running_loop()
        task = asyncio.create_task(load_model())
        yield
        task.cancel()
        st.begin_shutdown()
        if st.engine is not None:
            await st.engine.stop()
        if on_shutdown is not None:  # blocking (multi-host: tells the followers), so off the event loop
            await asyncio.to_thread(on_shutdown)

    get, post, both = ["GET"], ["POST"], ["GET", "POST"]
    routes = [Route(path, route(fn), methods=methods) for path, fn, methods in [
        ("/health", health, get), ("/health_generate", _health_generate, get),
        ("/v1/models", models, get), ("/v1/models/{model:path}", model, get),
        ("/server_info", server_info, get), ("/get_server_info", server_info, get),
        ("/model_info", model_info, get), ("/get_model_info", model_info, get),
        ("/metrics", metrics, get), ("/flush_cache", _flush_cache, both),
        ("/v1/completions", completions, post), ("/v1/chat/completions", chat, post), ("/generate", _generate, post),
        ("/tokenize", _tokenize, post), ("/v1/tokenize", _tokenize, post),
        ("/detokenize", _detokenize, post), ("/v1/detokenize", _detokenize, post),
        ("/abort_request", _abort_request, post)]]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error},
                    middleware=[Middleware(ApiKeyMiddleware, api_key=opts.api_key)])
    app.state.serving = st
    return app
