"""Logprobs in the shapes the APIs return them: SGLang's meta_info lists, OpenAI's completions and chat objects.

The values come from the engine, per output token: (logprob, [(top token id, logprob), ...]) under the target's
distribution after the penalties, the logit bias and the temperature, before top-k / top-p / min-p (SGLang's
definition; see ling_jax.sampling.logprobs). Under speculation they are the verify rows' values.
"""

from __future__ import annotations

from typing import Any

TokenLogprob = tuple[float, list[tuple[int, float]]]


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token's text; without a tokenizer, vLLM's `token_id:N` stand-in."""
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def sglang_meta(ids: list[int], logprobs: list[TokenLogprob], tokenizer: Any, with_text: bool) -> dict:
    """meta_info fields of /generate with return_logprob: [logprob, token id, text | None] per output token."""
    text = (lambda i: token_text(tokenizer, i)) if with_text else (lambda i: None)
    return {
        "output_token_logprobs": [[lp, i, text(i)] for i, (lp, _) in zip(ids, logprobs)],
        "output_top_logprobs": [[[v, j, text(j)] for j, v in top] for _, top in logprobs],
    }


def completion_logprobs(ids: list[int], logprobs: list[TokenLogprob], tokenizer: Any, offset: int = 0) -> dict:
    """A /v1/completions choice's `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [token_text(tokenizer, i) for i in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops = []
    for _, top in logprobs:  # keyed by text: where two tokens share a text, the likelier one's value stays
        d: dict[str, float] = {}
        for j, v in top:
            d.setdefault(token_text(tokenizer, j), v)
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in logprobs], "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(ids: list[int], logprobs: list[TokenLogprob], tokenizer: Any) -> dict:
    """A /v1/chat/completions choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(token_id: int, lp: float) -> dict:
        t = token_text(tokenizer, token_id)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    content = [{**entry(i, lp), "top_logprobs": [entry(j, v) for j, v in top]} for i, (lp, top) in zip(ids, logprobs)]
    return {"content": content, "refusal": None}
