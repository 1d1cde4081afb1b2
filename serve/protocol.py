"""Request validation for the OpenAI and SGLang-native endpoints: JSON bodies -> `GenRequest`, or an `APIError`.

Every rejection is an `APIError` carrying an HTTP status and an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}`. Checks that need the model (vocab, context length, tokenizer)
read a `ModelLimits`; nothing here touches the engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ling_jax.sampling import MAX_TOP_LOGPROBS, SamplingOptions

MAX_BODY_BYTES = 1 << 20  # 1 MiB
MAX_JSON_DEPTH = 64
MAX_STOP_STRINGS = 16
MAX_SEED = 2**64  # seeds are uint64 (SGLang / OpenAI clients send any 64-bit value)
CHAT_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MODEL_NAME = "default"  # SGLang's name for "whatever this server serves"
MAX_LOGIT_BIAS = 1024  # entries per request (multi-host serving relays them in a fixed-size record)
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")  # constrained decoding: not implemented


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model."""

    served_model_name: str
    vocab_size: int
    context_length: int
    reserved_rows: int  # rows the run-ahead speculative loop may write past the last token (Generator.check_request)
    tokenizer: Any | None  # ling_jax.tokenizer.Tokenizer
    eos_ids: tuple[int, ...]

    def max_new_tokens(self, n_prompt: int) -> int:
        return self.context_length - self.reserved_rows - n_prompt


@dataclass
class GenRequest:
    """One validated generation request, endpoint-independent."""

    input_ids: list[int]
    max_new_tokens: int
    sampling: SamplingOptions = SamplingOptions()  # temperature, top_p, top_k, min_p, penalties, logit_bias
    top_logprobs: int | None = None  # None: no logprobs; n: each output token's logprob and its n top alternatives
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    extra: dict = field(default_factory=dict)  # endpoint-specific bits (model name, chat or not)


# ---- body and field parsing --------------------------------------------------------------------------------------


def parse_body(raw: bytes) -> dict:
    """Bytes -> a JSON object whose strings are all valid Unicode, nested at most MAX_JSON_DEPTH deep."""
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", code="body_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: {e}", code="invalid_utf8") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # the decoder's own recursion guard: nesting thousands deep
        raise APIError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels", code="too_deep") from None
    except ValueError as e:  # an integer longer than Python's int-string limit (4300 digits)
        raise APIError(400, f"request body has a number that cannot be read: {e}", code="invalid_number") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    check_json_values(body)
    return body


def check_json_values(body: dict):
    """Walk the parsed body (iteratively): depth at most MAX_JSON_DEPTH, and no string (key or value) holding a
    lone UTF-16 surrogate ("\\ud800" is valid JSON but not text: the tokenizer and every encoder fail on it)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        v, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels at '{path}'",
                           param=path or None, code="too_deep")
        if isinstance(v, dict):
            for k, x in v.items():
                p = f"{path}.{k}" if path else k
                _check_text(k, p)
                if isinstance(x, (dict, list, str)):
                    stack.append((x, p, depth + 1))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v) if isinstance(x, (dict, list, str)))
        else:
            _check_text(v, path)


def _check_text(s: str, path: str):
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        param = path.encode("utf-8", "backslashreplace").decode()
        raise APIError(400, f"'{param}' holds a lone UTF-16 surrogate (not valid Unicode text)", param=param,
                       code="invalid_unicode") from None


_MISSING = object()


def _field(d: dict, name: str, kind: str, default: Any = _MISSING, *, param: str | None = None,
           check: Callable[[Any], str | None] | None = None) -> Any:
    """d[name] checked against `kind` ('int', 'number', 'bool', 'str', 'dict', 'list'); None counts as absent."""
    param = param or name
    v = d.get(name)
    if v is None:
        if default is _MISSING:
            raise APIError(400, f"missing required field '{param}'", param=param, code="missing_field")
        return default
    ok = {
        "int": isinstance(v, int) and not isinstance(v, bool),
        "number": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
        "bool": isinstance(v, bool),
        "str": isinstance(v, str),
        "dict": isinstance(v, dict),
        "list": isinstance(v, list),
    }[kind]
    if not ok:
        raise APIError(400, f"'{param}' must be {'a finite number' if kind == 'number' else 'of type ' + kind}, "
                            f"got {json.dumps(v)[:80]}", param=param, code="invalid_type")
    if check is not None and (msg := check(v)):
        raise APIError(400, f"'{param}' {msg}, got {json.dumps(v)[:80]}", param=param, code="invalid_value")
    return v


def _token_ids(v: Any, limits: ModelLimits, param: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise APIError(400, f"'{param}' must be a string or a list of token ids (integers)", param=param,
                       code="invalid_type")
    bad = [t for t in v if not 0 <= t < limits.vocab_size]
    if bad:
        raise APIError(400, f"'{param}' has token ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}",
                       param=param, code="invalid_token_id")
    return list(v)


def _stop_strings(v: Any, param: str = "stop") -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, f"'{param}' must be a string or a list of strings", param=param, code="invalid_type")
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise APIError(400, f"'{param}' takes 1..{MAX_STOP_STRINGS} non-empty strings", param=param,
                       code="invalid_value")
    return tuple(stops)


def _need_tokenizer(limits: ModelLimits, what: str, param: str):
    if limits.tokenizer is None:
        raise APIError(400, f"{what} needs a tokenizer, and this model has none (no tokenizer.json in the model "
                            f"dir): only token ids work, e.g. /generate with input_ids", param=param,
                       code="no_tokenizer")


def _check_model(body: dict, limits: ModelLimits):
    model = _field(body, "model", "str", None)
    if model is not None and model not in (limits.served_model_name, DEFAULT_MODEL_NAME):
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{limits.served_model_name}'",
                       param="model", code="model_not_found")


def _rid(body: dict) -> str | None:
    """SGLang's request id: the client names its request, and /abort_request can name it back."""
    return _field(body, "rid", "str", None, check=lambda r: None if 0 < len(r) <= 256 else "must be 1..256 chars")


def _sampling(d: dict, limits: ModelLimits, n_prompt: int, max_name: str, default_max: int | None,
              prompt_param: str, transforms: dict, prefix: str = "") -> dict:
    """GenRequest's max_new_tokens (checked against the context), seed and SamplingOptions (temperature, top_p and
    the `transforms`)."""
    room = limits.max_new_tokens(n_prompt)
    if room < 1:
        raise APIError(400, f"the prompt has {n_prompt} tokens; with {limits.reserved_rows} reserved speculative "
                            f"rows it leaves no room in the context length {limits.context_length}",
                       param=prompt_param, code="context_length_exceeded")
    max_new = _field(d, max_name, "int", None, param=prefix + max_name,
                     check=lambda x: None if x >= 1 else "must be >= 1")
    if max_new is None:
        max_new = room if default_max is None else min(default_max, room)
    elif max_new > room:
        raise APIError(400, f"prompt ({n_prompt} tokens) + {max_name} ({max_new}) + {limits.reserved_rows} reserved "
                            f"speculative rows exceeds the context length {limits.context_length} (at most {room} "
                            f"new tokens fit)", param=prefix + max_name, code="context_length_exceeded")
    sampling = SamplingOptions(
        temperature=float(_field(d, "temperature", "number", 1.0, param=prefix + "temperature",
                                 check=lambda x: None if x >= 0 else "must be >= 0")),
        top_p=float(_field(d, "top_p", "number", 1.0, param=prefix + "top_p",
                           check=lambda x: None if 0 < x <= 1 else "must be in (0, 1]")),
        **transforms)
    return dict(max_new_tokens=max_new, sampling=sampling,
                seed=_field(d, "seed", "int", None, param=prefix + "seed",
                            check=lambda x: None if 0 <= x < MAX_SEED else "must be in [0, 2**64)"))


def _in(lo: float, hi: float, lo_open: bool = False) -> Callable[[Any], str | None]:
    ok = (lambda x: lo < x <= hi) if lo_open else (lambda x: lo <= x <= hi)
    return lambda x: None if ok(x) else f"must be in {'(' if lo_open else '['}{lo}, {hi}]"


def _logit_bias(v: Any, limits: ModelLimits, param: str) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} (OpenAI's form; SGLang's too)."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise APIError(400, f"'{param}' must be an object mapping token ids to biases", param=param,
                       code="invalid_type")
    if len(v) > MAX_LOGIT_BIAS:
        raise APIError(400, f"'{param}' has {len(v)} entries; at most {MAX_LOGIT_BIAS}", param=param,
                       code="invalid_value")
    out = []
    for key, bias in v.items():
        tok = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else None
        if tok is None or not 0 <= tok < limits.vocab_size:
            raise APIError(400, f"'{param}' key {json.dumps(key)[:40]} is not a token id in [0, {limits.vocab_size})",
                           param=param, code="invalid_token_id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise APIError(400, f"'{param}' values must be numbers in [-100, 100], got {json.dumps(bias)[:40]}",
                           param=param, code="invalid_value")
        out.append((tok, float(bias)))
    return tuple(out)


def _transforms(d: dict, limits: ModelLimits, prefix: str = "") -> dict:
    """top_k, min_p, the three penalties and logit_bias (SGLang's ranges), applied on device. Grammar-constrained
    decoding is refused by name rather than ignored."""
    for name in GRAMMAR_FIELDS:
        if d.get(name) is not None:
            raise APIError(400, f"'{prefix}{name}' (grammar-constrained decoding) is not supported",
                           param=prefix + name, code="unsupported")
    f = lambda name, kind, default, check: _field(d, name, kind, default, param=prefix + name, check=check)
    return dict(
        top_k=f("top_k", "int", -1, lambda x: None if x >= -1 else "must be -1 or 0 (all tokens) or >= 1"),
        min_p=float(f("min_p", "number", 0.0, _in(0, 1))),
        repetition_penalty=float(f("repetition_penalty", "number", 1.0, _in(0, 2, lo_open=True))),
        presence_penalty=float(f("presence_penalty", "number", 0.0, _in(-2, 2))),
        frequency_penalty=float(f("frequency_penalty", "number", 0.0, _in(-2, 2))),
        logit_bias=_logit_bias(d.get("logit_bias"), limits, prefix + "logit_bias"),
    )


def _top_logprobs(v: Any, param: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"'{param}' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {json.dumps(v)[:40]}",
                       param=param, code="invalid_value")
    return v


def _openai_logprobs(body: dict, chat: bool) -> int | None:
    """Completions: logprobs = n (0..20) top alternatives. Chat: logprobs = true, top_logprobs = n."""
    if not chat:
        if body.get("top_logprobs") is not None:
            raise APIError(400, "'top_logprobs' is a chat field; completions take 'logprobs': n", param="top_logprobs",
                           code="unsupported")
        v = body.get("logprobs")
        return None if v in (None, False) else _top_logprobs(v, "logprobs")
    if not _field(body, "logprobs", "bool", False):
        if body.get("top_logprobs") is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        return None
    v = body.get("top_logprobs")
    return 0 if v is None else _top_logprobs(v, "top_logprobs")


def _response_format(body: dict):
    rf = _field(body, "response_format", "dict", None)
    if rf is not None and rf.get("type") != "text":
        raise APIError(400, f"'response_format' of type {json.dumps(rf.get('type'))[:40]} is not supported (it needs "
                            f"grammar-constrained decoding); only {{\"type\": \"text\"}}", param="response_format",
                       code="unsupported")


def _nonempty(ids: list[int], param: str, limits: ModelLimits) -> list[int]:
    if not ids:
        raise APIError(400, f"'{param}' is empty", param=param, code="empty_prompt")
    return _token_ids(ids, limits, param)  # text encodes to ids the model must know too


def _openai_common(body: dict, limits: ModelLimits, ids: list[int], default_max: int | None,
                   prompt_param: str, chat: bool = False) -> GenRequest:
    _check_model(body, limits)
    _field(body, "n", "int", 1, check=lambda x: None if x == 1 else "must be 1 (only one choice per request)")
    for unsupported in ("best_of", "suffix", "tools", "functions"):
        v = body.get(unsupported)
        if v not in (None, False) and not (unsupported == "best_of" and v == 1):
            raise APIError(400, f"'{unsupported}' is not supported", param=unsupported, code="unsupported")
    if body.get("echo"):
        raise APIError(400, "'echo' is not supported", param="echo", code="unsupported")
    _response_format(body)
    stop = _stop_strings(body.get("stop"))
    if stop:
        _need_tokenizer(limits, "'stop' strings", "stop")
    stop_ids = body.get("stop_token_ids")  # SGLang's extensions to the OpenAI request: stop_token_ids, ignore_eos
    stop_ids = _token_ids(stop_ids, limits, "stop_token_ids") if stop_ids is not None else []
    opts = _field(body, "stream_options", "dict", {})
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return GenRequest(
        input_ids=ids, stop=stop, stop_token_ids=tuple(stop_ids), ignore_eos=_field(body, "ignore_eos", "bool", False),
        stream=_field(body, "stream", "bool", False),
        include_usage=bool(_field(opts, "include_usage", "bool", False, param="stream_options.include_usage")),
        extra={"model": limits.served_model_name, "rid": _rid(body)}, top_logprobs=_openai_logprobs(body, chat),
        **_sampling(body, limits, len(ids), key, default_max, prompt_param, _transforms(body, limits)),
    )


# ---- endpoints ---------------------------------------------------------------------------------------------------


def parse_completion(body: dict, limits: ModelLimits) -> GenRequest:
    """OpenAI /v1/completions: prompt is a string, a list of token ids, or a one-element list of either."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "missing required field 'prompt'", param="prompt", code="missing_field")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt",
                       code="unsupported")
    if isinstance(prompt, str):
        _need_tokenizer(limits, "a text prompt", "prompt")
        ids = limits.tokenizer.encode(prompt)
    else:
        ids = _token_ids(prompt, limits, "prompt")
    return _openai_common(body, limits, _nonempty(ids, "prompt", limits), default_max=16, prompt_param="prompt")


def _message_text(m: Any, i: int) -> tuple[str, str]:
    p = f"messages[{i}]"
    if not isinstance(m, dict):
        raise APIError(400, f"'{p}' must be an object with 'role' and 'content'", param=p, code="invalid_type")
    role = _field(m, "role", "str", param=p + ".role", check=lambda r: None if r in CHAT_ROLES else
                  f"must be one of {', '.join(CHAT_ROLES)} (a role is pasted into the chat template)")
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(400, f"'{p}.content' parts must be text parts", param=p + ".content",
                               code="invalid_type")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise APIError(400, f"'{p}.content' must be a string or a list of text parts", param=p + ".content",
                       code="invalid_type")
    return role, content


def render_chat(limits: ModelLimits, messages: list[dict]) -> str:
    tok = limits.tokenizer
    if tok.chat_template:
        return tok.apply_chat_template(messages, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"  # no template shipped


def parse_chat(body: dict, limits: ModelLimits) -> GenRequest:
    """OpenAI /v1/chat/completions; the prompt is the chat template applied to the messages."""
    messages = _field(body, "messages", "list")
    if not messages:
        raise APIError(400, "'messages' is empty", param="messages", code="empty_prompt")
    msgs = [dict(zip(("role", "content"), _message_text(m, i))) for i, m in enumerate(messages)]
    _need_tokenizer(limits, "chat", "messages")
    ids = limits.tokenizer.encode(render_chat(limits, msgs))
    req = _openai_common(body, limits, _nonempty(ids, "messages", limits), default_max=None,
                         prompt_param="messages", chat=True)
    req.extra["chat"] = True
    return req


def parse_generate(body: dict, limits: ModelLimits) -> GenRequest:
    """SGLang /generate: `text` or `input_ids`, `sampling_params`, `stream`."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise APIError(400, "give exactly one of 'text' and 'input_ids'", param="text", code="missing_field")
    if text is not None:
        if not isinstance(text, str):
            raise APIError(400, "'text' must be a string (batched requests are not supported)", param="text",
                           code="invalid_type")
        _need_tokenizer(limits, "'text'", "text")
        ids = limits.tokenizer.encode(text)
    else:
        ids = _token_ids(input_ids, limits, "input_ids")
    prompt_param = "text" if text is not None else "input_ids"
    ids = _nonempty(ids, prompt_param, limits)
    sp = _field(body, "sampling_params", "dict", {})
    stop = _stop_strings(sp.get("stop"), "sampling_params.stop")
    if stop:
        _need_tokenizer(limits, "'stop' strings", "sampling_params.stop")
    stop_ids = sp.get("stop_token_ids")
    stop_ids = _token_ids(stop_ids, limits, "sampling_params.stop_token_ids") if stop_ids is not None else []
    _field(sp, "n", "int", 1, param="sampling_params.n",
           check=lambda x: None if x == 1 else "must be 1 (one sample per request; send n requests)")
    _field(sp, "min_new_tokens", "int", 0, param="sampling_params.min_new_tokens",
           check=lambda x: None if x == 0 else "is not supported (must be 0)")
    return GenRequest(
        input_ids=ids, stop=stop, stop_token_ids=tuple(stop_ids),
        ignore_eos=_field(sp, "ignore_eos", "bool", False, param="sampling_params.ignore_eos"),
        stream=_field(body, "stream", "bool", False), top_logprobs=_generate_logprobs(body),
        extra={"rid": _rid(body), "return_text_in_logprobs": _field(body, "return_text_in_logprobs", "bool", False)},
        **_sampling(sp, limits, len(ids), "max_new_tokens", 128, prompt_param,
                    _transforms(sp, limits, prefix="sampling_params."), prefix="sampling_params."),
    )


def _generate_logprobs(body: dict) -> int | None:
    """SGLang's return_logprob / top_logprobs_num, for the output tokens (prompt logprobs are not computed)."""
    if not _field(body, "return_logprob", "bool", False):
        return None
    start = _field(body, "logprob_start_len", "int", -1)
    if start != -1:
        raise APIError(400, f"'logprob_start_len' {start}: prompt logprobs are not supported (use -1: output "
                            f"tokens only)", param="logprob_start_len", code="unsupported")
    if body.get("token_ids_logprob") is not None:
        raise APIError(400, "'token_ids_logprob' is not supported", param="token_ids_logprob", code="unsupported")
    return _top_logprobs(_field(body, "top_logprobs_num", "int", 0), "top_logprobs_num")


# ---- tokenizer and control endpoints -----------------------------------------------------------------------------


def _only(body: dict, known: tuple[str, ...], endpoint: str):
    extra = sorted(set(body) - set(known))
    if extra:
        raise APIError(400, f"{endpoint} does not take {', '.join(map(repr, extra))} (it takes {', '.join(known)})",
                       param=extra[0], code="unsupported")


def parse_tokenize(body: dict, limits: ModelLimits) -> tuple[list[list[int]], bool]:
    """SGLang /tokenize: `prompt` (a string or a list of strings) or chat `messages` -> (token ids per text,
    whether the prompt was a list)."""
    _only(body, ("model", "prompt", "messages", "add_special_tokens"), "/tokenize")
    _check_model(body, limits)
    add = _field(body, "add_special_tokens", "bool", True)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt", code="missing_field")
    _need_tokenizer(limits, "/tokenize", "prompt" if prompt is not None else "messages")
    if messages is not None:
        msgs = _field(body, "messages", "list")
        texts = [render_chat(limits, [dict(zip(("role", "content"), _message_text(m, i)))
                                      for i, m in enumerate(msgs)])]
        return [limits.tokenizer.encode(texts[0])], False
    batched = isinstance(prompt, list)
    texts = prompt if batched else [prompt]
    if not all(isinstance(t, str) for t in texts):
        raise APIError(400, "'prompt' must be a string or a list of strings", param="prompt", code="invalid_type")
    return [limits.tokenizer.encode(t, add_bos=add) for t in texts], batched


def parse_detokenize(body: dict, limits: ModelLimits) -> tuple[list[list[int]], bool, bool]:
    """SGLang /detokenize: `tokens` (ids or a list of id lists) -> (id lists, batched, skip_special_tokens)."""
    _only(body, ("model", "tokens", "skip_special_tokens"), "/detokenize")
    _check_model(body, limits)
    skip = _field(body, "skip_special_tokens", "bool", True)
    tokens = _field(body, "tokens", "list")
    batched = bool(tokens) and all(isinstance(t, list) for t in tokens)
    lists = [_token_ids(t, limits, f"tokens[{i}]") for i, t in enumerate(tokens)] if batched else \
        [_token_ids(tokens, limits, "tokens")]
    _need_tokenizer(limits, "/detokenize", "tokens")
    return lists, batched, skip


def parse_abort(body: dict) -> tuple[str | None, bool]:
    """SGLang /abort_request: {"rid": ...} or {"abort_all": true}."""
    _only(body, ("rid", "abort_all"), "/abort_request")
    abort_all = _field(body, "abort_all", "bool", False)
    rid = _field(body, "rid", "str", None)
    if not abort_all and not rid:
        raise APIError(400, "give a non-empty 'rid' or 'abort_all': true", param="rid", code="missing_field")
    return rid, abort_all
