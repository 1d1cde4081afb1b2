"""The host side of generation: compiled prefill/step programs and the run-ahead decode loop.

Run-ahead: step k+1 is dispatched before step k's outputs are read; outputs are copied to the host
asynchronously and consumed one step late for EOS, max tokens and stop checks. Nothing in the dispatch path
reads a device value (`jax.transfer_guard("disallow")` holds there), so the device never waits for the host.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import ModelConfig
from ling_jax.decode import plain_prefill, plain_step
from ling_jax.model import RuntimeOptions
from ling_jax.sampling import SamplingParams
from ling_jax.spec import SpecConfig, spec_prefill, spec_step

MIN_BUCKET = 16


def prompt_bucket(n: int, max_len: int) -> int:
    """Prompts are padded to a power of two (at least 16) so few prefill programs are compiled."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return min(b, max_len)


@dataclass
class GenerationStats:
    """What one request did. accept lengths count the bonus token (SGLang's avg_spec_accept_length)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    verify_steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    ttft_s: float = 0.0
    total_s: float = 0.0
    num_steps: int = 0  # drafted tokens per step (0 without speculation)

    @property
    def mean_accept_length(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Fraction of verify steps whose j-th draft (j = 1..K) was accepted."""
        if not self.accept_lengths:
            return []
        a = np.asarray(self.accept_lengths) - 1
        return [float(np.mean(a >= j)) for j in range(1, self.num_steps + 1)]

    def as_dict(self) -> dict:
        decode_s = max(self.total_s - self.ttft_s, 1e-9)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "verify_steps": self.verify_steps,
            "mean_accept_length": self.mean_accept_length,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "ttft_s": self.ttft_s,
            "total_s": self.total_s,
            "decode_tokens_per_s": max(self.completion_tokens - 1, 0) / decode_s,
        }


class Generator:
    """Batch-1 generation over one model: compiles lazily, serves requests one after another.

    Every request starts from a fresh prefill, so nothing of an earlier request (greedy or sampled) can leak
    into a later one.
    """

    def __init__(self, cfg: ModelConfig, params, *, spec: SpecConfig = SpecConfig("NONE"), max_len: int = 2048,
                 dtype=jnp.bfloat16, opts: RuntimeOptions = RuntimeOptions()):
        if spec.enabled and not cfg.mtp_layers:
            raise ValueError(f"{cfg.name} has no MTP layer: NEXTN speculation needs num_nextn_predict_layers >= 1")
        self.cfg, self.params, self.spec, self.max_len = cfg, params, spec, max_len
        self.dtype, self.opts = jnp.dtype(dtype), opts
        self.K = spec.num_steps if spec.enabled else 0
        # rows one step writes past the committed length (verify rows; target_rows pads them)
        self.rows_per_step = max(spec.draft_tokens, opts.numerics.target_rows or 0)
        if spec.enabled and opts.numerics.target_rows is not None and opts.numerics.target_rows < spec.draft_tokens:
            raise ValueError(f"Numerics.target_rows={opts.numerics.target_rows} < {spec.draft_tokens} verify rows")

    # ---- compiled programs (cached per static configuration) ----
    @functools.lru_cache(maxsize=None)
    def prefill_fn(self, bucket: int, is_greedy: bool):
        kw = dict(max_len=self.max_len, is_greedy=is_greedy, dtype=self.dtype, opts=self.opts)
        if self.spec.enabled:
            fn = functools.partial(spec_prefill, cfg=self.cfg, steps=self.K, **kw)
        else:
            fn = functools.partial(plain_prefill, cfg=self.cfg, **kw)
        return jax.jit(lambda params, tokens, n_valid, sampling, key: fn(params, tokens, n_valid, sampling=sampling,
                                                                          key=key))

    @functools.lru_cache(maxsize=None)
    def step_fn(self, is_greedy: bool):
        """The whole step as ONE jitted program; the state is donated (its buffers are updated in place)."""
        if self.spec.enabled:
            fn = functools.partial(spec_step, cfg=self.cfg, steps=self.K, is_greedy=is_greedy, opts=self.opts)
        else:
            fn = functools.partial(plain_step, cfg=self.cfg, is_greedy=is_greedy, opts=self.opts)
        return jax.jit(fn, donate_argnums=(1,))

    def check_request(self, n_prompt: int, max_new_tokens: int):
        if n_prompt < 1:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        # the last step may run K+1 rows past the final emitted token, twice with run-ahead
        need = n_prompt + max_new_tokens + 2 * self.rows_per_step
        if need > self.max_len:
            raise ValueError(f"prompt ({n_prompt}) + max_new_tokens ({max_new_tokens}) + {2 * self.rows_per_step} "
                             f"speculative rows exceeds the context length {self.max_len}")

    def prefill(self, prompt: list[int], sampling: SamplingParams, key, is_greedy: bool):
        n = len(prompt)
        bucket = prompt_bucket(n, self.max_len)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n] = prompt
        return self.prefill_fn(bucket, is_greedy)(self.params, jnp.asarray(tokens), jnp.array([n], jnp.int32),
                                                  sampling, key)

    def stream(self, prompt: list[int], *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, stop_token_ids: tuple[int, ...] | None = None,
               stats: GenerationStats | None = None) -> Iterator[list[int]]:
        """Yield lists of newly generated token ids (one list per consumed step). Closing the iterator cancels.

        EOS / stop tokens are included in the output and end generation; tokens past them are dropped.
        """
        prompt = [int(t) for t in prompt]
        if any(t < 0 or t >= self.cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        self.check_request(len(prompt), max_new_tokens)
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens, stats.num_steps = len(prompt), self.K
        stops = set(stop_token_ids if stop_token_ids is not None else (self.cfg.eos_token_id,))
        sampling = SamplingParams.make(temperature, top_p)
        is_greedy = temperature == 0.0
        t0 = time.perf_counter()
        state, first = self.prefill(prompt, sampling, jax.random.key(seed), is_greedy)
        first = int(jax.device_get(first)[0])
        stats.ttft_s = time.perf_counter() - t0
        emitted = 1
        stats.completion_tokens = 1
        yield [first]
        if first in stops or max_new_tokens == 1:
            stats.finish_reason = "stop" if first in stops else "length"
            stats.total_s = time.perf_counter() - t0
            return

        step = self.step_fn(is_greedy)
        in_flight = None  # the step whose outputs are read next (one step late)
        while True:
            # every step emits at least one token: dispatch while the request is not already sure to be done
            if emitted + (in_flight is not None) < max_new_tokens:
                with jax.transfer_guard("disallow"):
                    state, out = step(self.params, state)
                for a in out:
                    a.copy_to_host_async()
            else:
                out = None
            if in_flight is not None:
                tokens, n_emit = jax.device_get(in_flight)  # explicit, one step late: the device is already busy
                new = [int(t) for t in tokens[0, : int(n_emit[0])]]
                stats.verify_steps += 1
                stats.accept_lengths.append(len(new))
                new = new[: max_new_tokens - emitted]
                for i, t in enumerate(new):
                    if t in stops:
                        new = new[: i + 1]
                        stats.finish_reason = "stop"
                        break
                emitted += len(new)
                stats.completion_tokens = emitted
                yield new
                if stats.finish_reason is None and emitted >= max_new_tokens:
                    stats.finish_reason = "length"
                if stats.finish_reason is not None:
                    break
            if out is None and in_flight is None:
                break
            in_flight = out
        stats.total_s = time.perf_counter() - t0

    def generate(self, prompt: list[int], **kw) -> tuple[list[int], GenerationStats]:
        stats = GenerationStats()
        out: list[int] = []
        for chunk in self.stream(prompt, stats=stats, **kw):
            out.extend(chunk)
        return out, stats


def generate_on_device(cfg: ModelConfig, spec: SpecConfig, n_steps: int, *, is_greedy: bool = True,
                       opts: RuntimeOptions = RuntimeOptions()) -> Callable:
    """Whole-generation variant for benchmarks: `n_steps` steps inside one lax.while_loop (no host in the
    loop). Returns jitted f(params, state) -> (state, tokens int32[B, n_steps * (K+1)], count int32[B])."""
    rows = spec.draft_tokens
    if spec.enabled:
        step = functools.partial(spec_step, cfg=cfg, steps=spec.num_steps, is_greedy=is_greedy, opts=opts)
    else:
        step = functools.partial(plain_step, cfg=cfg, is_greedy=is_greedy, opts=opts)
    put = jax.vmap(lambda b, t, c: jax.lax.dynamic_update_slice_in_dim(b, t, c, axis=0))

    def run(params, state):
        def body(carry):
            i, state, buf, count = carry
            state, out = step(params, state)
            return i + 1, state, put(buf, out.tokens, count), count + out.n_emit

        B = state.bonus.shape[0]
        buf = jnp.zeros((B, n_steps * rows + rows), jnp.int32)  # + rows: the last write may run past the end
        init = (jnp.int32(0), state, buf, jnp.zeros((B,), jnp.int32))
        _, state, buf, count = jax.lax.while_loop(lambda c: c[0] < n_steps, body, init)  # exactly n_steps steps
        return state, buf[:, : n_steps * rows], count

    return jax.jit(run, donate_argnums=(1,))
