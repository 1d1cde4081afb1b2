"""The host side of generation: compiled prefill/step programs and the run-ahead decode loop.

Prefill runs in chunks of at most `chunked_prefill_size` = C positions (SGLang's --chunked-prefill-size): a few
compiled chunk sizes (`prefill_buckets`, e.g. 32 / 128 / 512) serve every prompt length: whole C-chunks back to back
(no host read until the last chunk), then the smallest bucket that holds the rest, so a short prompt does not pay a
whole C-row chunk. Steps are compiled with and without logprobs: the default step computes none.
Run-ahead: step k+1 is dispatched before step k's outputs are read; outputs are copied to the host
asynchronously and consumed one step late for EOS, max tokens and stop checks. Nothing in the dispatch path
reads a device value (`jax.transfer_guard("disallow")` holds there), so the device never waits for the host.

Continuous decode steps (SGLang's --num-continuous-decode-steps): one dispatch runs N steps (a lax.scan over the
step inside one program) and the host reads their N outputs together, one dispatch late. The host's cost of a
dispatch (XLA launches each of the step's few hundred kernels, ~2-5 us each) is then paid once per N steps: on the
H200 the demo model's step is host-bound at N = 1 (plain 1167 us, of which 1143 us is the dispatch) and runs at
370 us with N = 8 (bench/results/step-ling-demo-kdaverify-ms*-h200x1-2026-12-01.json). The price: up to N - 1
steps computed past a request's end (discarded) and outputs streamed N steps at a time.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.aliased_step import AliasedStep
from ling_jax.config import ModelConfig
from ling_jax.decode import plain_init, plain_prefill_chunk, plain_step
from ling_jax.dspark_step import dspark_init, dspark_prefill_chunk, dspark_step
from ling_jax.model import RuntimeOptions, head_fused
from ling_jax.sampling import MAX_TOP_LOGPROBS, SamplingOptions, SamplingParams
from ling_jax.spec import SpecConfig, spec_init, spec_prefill_chunk, spec_step

# 512 positions per prefill chunk. A prompt's last chunk is the smallest of PREFILL_BUCKET_FRACTIONS x C that holds
# it, so a short one (a chat turn) pays a 32-row chunk, not 512; at batch 1 a 512-row chunk already routes 4,096
# token-expert pairs, so the MoE reads every expert's weights once per chunk, as larger chunks do. The prefill attention
# scores are [H, C, S] f32 per MLA layer: 2 GiB at C = 512 and a 32k context, 8 GiB at SGLang's 2048.
DEFAULT_CHUNKED_PREFILL_SIZE = 512
PREFILL_BUCKET_FRACTIONS = (16, 4, 1)  # compiled chunk sizes C/16, C/4, C (at least MIN_PREFILL_BUCKET rows)
MIN_PREFILL_BUCKET = 8


def prefill_buckets(chunk: int) -> tuple[int, ...]:
    """The compiled prefill chunk sizes for --chunked-prefill-size `chunk` (ascending, the largest = chunk)."""
    return tuple(sorted({min(chunk, max(MIN_PREFILL_BUCKET, chunk // f)) for f in PREFILL_BUCKET_FRACTIONS}))


def prefill_schedule(n: int, buckets: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, size) of each chunk of an n-token prompt: whole largest chunks, then the smallest bucket >= the rest.
    Every start but the last is a multiple of the largest bucket, so the chunks stay inside the cache rows."""
    out, start, C = [], 0, buckets[-1]
    while n - start > C:
        out.append((start, C))
        start += C
    out.append((start, next(b for b in buckets if b >= n - start)))
    return out


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
    # with top_logprobs requested, per emitted token: its logprob and the top (token id, logprob) pairs
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

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
    into a later one. Compiled programs, each once per greedy / sampled: init, one prefill chunk per bucket, the
    step with and without logprobs (`warm_up` builds them all). DSPARK: draft = (DSparkConfig, draft params); the
    programs then take (target params, draft params) as their first argument (`run_params`).
    """

    def __init__(self, cfg: ModelConfig, params, *, spec: SpecConfig = SpecConfig("NONE"), max_len: int = 2048,
                 chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE, dtype=jnp.bfloat16,
                 opts: RuntimeOptions = RuntimeOptions(), draft=None, decode_steps: int = 1):
        if spec.is_nextn and not cfg.mtp_layers:
            raise ValueError(f"{cfg.name} has no MTP layer: NEXTN speculation needs num_nextn_predict_layers >= 1")
        if spec.is_dspark != (draft is not None):
            raise ValueError("a DSpark draft (DSparkConfig, params) is needed exactly when the algorithm is DSPARK")
        self.dcfg = draft[0] if draft is not None else None
        if self.dcfg is not None:
            self.dcfg.check_target(cfg)
            if spec.num_steps != self.dcfg.block_size:
                raise ValueError(f"DSpark num_steps={spec.num_steps} must be the draft's block_size "
                                 f"{self.dcfg.block_size}")
        self.run_params = (params, draft[1]) if draft is not None else params
        if chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {chunked_prefill_size}")
        if decode_steps < 1:
            raise ValueError(f"decode_steps (--num-continuous-decode-steps) must be >= 1, got {decode_steps}")
        self.decode_steps = decode_steps
        self.cfg, self.params, self.spec, self.max_len = cfg, params, spec, max_len
        self.dtype, self.opts = jnp.dtype(dtype), opts
        self.chunk = min(chunked_prefill_size, max_len)
        self.buckets = prefill_buckets(self.chunk)
        # cache rows: whole chunks, so the last chunk's writes stay inside the cache (dynamic_update_slice would
        # clamp its start otherwise); positions past max_len are never committed (check_request)
        self.slots = -(-max_len // self.chunk) * self.chunk
        self.K = spec.num_steps if spec.enabled else 0
        # rows one step writes past the committed length (verify rows; target_rows pads them)
        self.rows_per_step = max(spec.draft_tokens, opts.numerics.target_rows or 0)
        if spec.enabled and opts.numerics.target_rows is not None and opts.numerics.target_rows < spec.draft_tokens:
            raise ValueError(f"Numerics.target_rows={opts.numerics.target_rows} < {spec.draft_tokens} verify rows")

    # ---- compiled programs (cached per static configuration) ----
    @functools.lru_cache(maxsize=None)
    def init_fn(self, is_greedy: bool):
        """(sampling, key) -> the empty state a prefill starts from."""
        kw = dict(cfg=self.cfg, batch=1, slots=self.slots, dtype=self.dtype)
        if self.spec.is_dspark:
            return jax.jit(functools.partial(dspark_init, dcfg=self.dcfg, **kw))
        if self.spec.enabled:
            return jax.jit(functools.partial(spec_init, steps=self.K, is_greedy=is_greedy, **kw))
        return jax.jit(functools.partial(plain_init, **kw))

    def prefill_chunk(self, is_greedy: bool):
        """The prefill chunk function (run_params, state, tokens int32[1, C], next_token int32[1], n_prompt int32[1])
        -> (state, first, logprobs), not jitted (the batcher's start program wraps it with the init)."""
        kw = dict(cfg=self.cfg, is_greedy=is_greedy, opts=self.opts)
        if self.spec.is_dspark:
            chunk = functools.partial(dspark_prefill_chunk, dcfg=self.dcfg, **kw)
            return lambda pp, state, *a: chunk(pp[0], pp[1], state, *a)
        if self.spec.enabled:
            return functools.partial(spec_prefill_chunk, **kw)
        chunk = functools.partial(plain_prefill_chunk, **kw)
        return lambda params, state, tokens, next_token, n_prompt: chunk(params, state, tokens, n_prompt)

    @functools.lru_cache(maxsize=None)
    def prefill_fn(self, is_greedy: bool):
        """prefill_chunk as one jitted program; the state is donated."""
        return jax.jit(self.prefill_chunk(is_greedy), donate_argnums=(1,))

    def step(self, is_greedy: bool, with_logprobs: bool, adjusts_logits: bool = True):
        """The step function (run_params, state) -> (state, StepOutput), not jitted (the batched programs wrap it).
        adjusts_logits: the steps' static flag (False only for programs of requests that leave their logits as
        they are: `adjusts_logits`)."""
        if self.spec.is_dspark:
            dspark = functools.partial(dspark_step, cfg=self.cfg, dcfg=self.dcfg, spec=self.spec, is_greedy=is_greedy,
                                       opts=self.opts, with_logprobs=with_logprobs, adjusts_logits=adjusts_logits)
            return lambda pp, state: dspark(pp[0], pp[1], state)  # run_params = (target, draft)
        kw = dict(cfg=self.cfg, is_greedy=is_greedy, opts=self.opts, with_logprobs=with_logprobs,
                  adjusts_logits=adjusts_logits)
        if self.spec.enabled:
            return functools.partial(spec_step, steps=self.K, **kw)
        return functools.partial(plain_step, **kw)

    def dispatch_step(self, is_greedy: bool, with_logprobs: bool = False, adjusts_logits: bool = True):
        """The function one dispatch runs, not jitted: the step, or with decode_steps = N > 1 N steps (its outputs
        gain a leading axis [N, ...])."""
        fn = self.step(is_greedy, with_logprobs, adjusts_logits)
        if self.decode_steps > 1:
            fn = functools.partial(_continuous_steps, step=fn, n=self.decode_steps)
        return fn

    def step_fn(self, is_greedy: bool, with_logprobs: bool = False, adjusts_logits: bool = True):
        """The whole step as ONE jitted program on donated state (its buffers updated in place), whose outputs
        also reuse their buffers (aliased_step: XLA's CUDA graph of the step is recorded once, not every call).
        One program per (is_greedy, with_logprobs, adjusts_logits) however the call spells its defaults."""
        return self.step_program(bool(is_greedy), bool(with_logprobs), bool(adjusts_logits))

    @functools.lru_cache(maxsize=None)
    def step_program(self, is_greedy: bool, with_logprobs: bool, adjusts_logits: bool):
        """step_fn's program, built once per key (every argument given: the cache's key is the program's)."""
        return AliasedStep(self.dispatch_step(is_greedy, with_logprobs, adjusts_logits))

    def adjusts_logits(self, options: SamplingOptions, with_logprobs: bool) -> bool:
        """The static adjusts_logits of the step a request runs: False for a greedy request without logprobs whose
        penalties and logit bias are neutral where that makes another program: DSPARK's (its Markov decode is then
        argmax only: dspark_step.draft_block), or one with the fused lm_head + argmax (the kernel calls run it:
        KernelCalls.lm_head_argmax); True otherwise, so every other request runs the program it ran before (and no
        identical program is built twice)."""
        if options.is_greedy and not with_logprobs and not options.adjusts_logits:
            return not (self.spec.is_dspark or head_fused(self.opts))
        return True

    def request_step_fn(self, options: SamplingOptions, with_logprobs: bool):
        """step_fn for a request: its greedy / logprobs flags and `adjusts_logits`."""
        return self.step_fn(options.is_greedy, with_logprobs, self.adjusts_logits(options, with_logprobs))

    def check_inputs(self, prompt, max_new_tokens: int, top_logprobs: int | None) -> list[int]:
        """A request's prompt as ints, checked with its lengths and top_logprobs (every stream's first step)."""
        prompt = [int(t) for t in prompt]
        if any(t < 0 or t >= self.cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
        self.check_request(len(prompt), max_new_tokens)
        return prompt

    @property
    def reserved_rows(self) -> int:
        """Cache rows a request needs past its last emitted token: the last dispatch may run N steps of
        rows_per_step rows past it, twice with run-ahead (the server's ModelLimits.reserved_rows)."""
        return 2 * self.decode_steps * self.rows_per_step

    def check_request(self, n_prompt: int, max_new_tokens: int):
        if n_prompt < 1:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        slack = self.reserved_rows
        need = n_prompt + max_new_tokens + slack
        if need > self.max_len:
            raise ValueError(f"prompt ({n_prompt}) + max_new_tokens ({max_new_tokens}) + {slack} "
                             f"speculative rows exceeds the context length {self.max_len}")

    def prefill(self, prompt: list[int], sampling: SamplingParams, key, is_greedy: bool, state=None):
        """Every chunk of the prompt through the prefill programs (whole chunks, then the smallest bucket that
        holds the rest). Returns (state, first token int32[1], its Logprobs), still on device. state: start from
        this one (its leaves are overwritten) instead of a fresh init's."""
        chunks = self.prefill_chunks(prompt)
        state = self.init_fn(is_greedy)(sampling, key) if state is None else state
        for chunk in chunks:
            state, first, lp = self.prefill_fn(is_greedy)(self.run_params, state, *chunk)
        return state, first, lp

    def prefill_chunks(self, prompt: list[int]) -> list[tuple]:
        """The prefill program's (tokens int32[1, c], next token int32[1], n_prompt int32[1]) per chunk."""
        n = len(prompt)
        schedule = prefill_schedule(n, self.buckets)
        start, size = schedule[-1]
        tokens = np.zeros((1, start + size + 1), np.int32)  # + 1: the (padding) token after the last chunk
        tokens[0, :n] = prompt
        n_prompt = np.array([n], np.int32)
        return [(tokens[:, s : s + c], tokens[:, s + c], n_prompt) for s, c in schedule]

    def stream(self, prompt: list[int], *, max_new_tokens: int, seed: int = 0,
               stop_token_ids: tuple[int, ...] | None = None, stats: GenerationStats | None = None,
               top_logprobs: int | None = None, **sampling) -> Iterator[list[int]]:
        """Yield lists of newly generated token ids (one list per consumed step). Closing the iterator cancels.

        sampling: SamplingOptions fields (temperature, top_p, top_k, min_p, the penalties, logit_bias).
        top_logprobs: None, or 0..MAX_TOP_LOGPROBS: record every emitted token's logprob and that many top
        alternatives in `stats` (token_logprobs, top_logprobs).
        EOS / stop tokens are included in the output and end generation; tokens past them are dropped.
        """
        prompt = self.check_inputs(prompt, max_new_tokens, top_logprobs)
        options = SamplingOptions(**sampling)
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens, stats.num_steps = len(prompt), self.K
        stops = set(stop_token_ids if stop_token_ids is not None else (self.cfg.eos_token_id,))
        is_greedy = options.is_greedy
        t0 = time.perf_counter()
        state, first, lp = self.prefill(prompt, options.device(self.cfg.vocab_size), jax.random.key(seed), is_greedy)
        first, lp = jax.device_get((first, lp if top_logprobs is not None else None))
        first = int(first[0])
        if lp is not None:
            _record_logprobs(stats, jax.tree.map(lambda a: a[:, None], lp), 1, top_logprobs)
        stats.ttft_s = time.perf_counter() - t0
        emitted = 1
        stats.completion_tokens = 1
        yield [first]
        if first in stops or max_new_tokens == 1:
            stats.finish_reason = "stop" if first in stops else "length"
            stats.total_s = time.perf_counter() - t0
            return

        step, N = self.request_step_fn(options, top_logprobs is not None), self.decode_steps
        in_flight = None  # the dispatch whose outputs are read next (one dispatch late)
        while True:
            # every step emits at least one token: dispatch while the request is not already sure to be done
            if emitted + N * (in_flight is not None) < max_new_tokens:
                with jax.transfer_guard("disallow"):
                    state, out = step(self.run_params, state)
                out = (out.tokens, out.n_emit) + ((out.logprobs,) if top_logprobs is not None else ())
                for a in jax.tree.leaves(out):
                    a.copy_to_host_async()
            else:
                out = None
            if in_flight is not None:
                outs = jax.device_get(in_flight)  # explicit, one dispatch late: the device is busy
                if N == 1:
                    outs = jax.tree.map(lambda a: a[None], outs)
                for j in range(N):  # the steps of the dispatch, in order
                    tokens, n_emit, *lp = jax.tree.map(lambda a: a[j], outs)
                    new = [int(t) for t in tokens[0, : int(n_emit[0])]]
                    stats.verify_steps += 1
                    stats.accept_lengths.append(len(new))
                    new = new[: max_new_tokens - emitted]
                    for i, t in enumerate(new):
                        if t in stops:
                            new = new[: i + 1]
                            stats.finish_reason = "stop"
                            break
                    if lp:
                        _record_logprobs(stats, lp[0], len(new), top_logprobs)
                    emitted += len(new)
                    stats.completion_tokens = emitted
                    yield new
                    if stats.finish_reason is None and emitted >= max_new_tokens:
                        stats.finish_reason = "length"
                    if stats.finish_reason is not None:
                        break
                if stats.finish_reason is not None:
                    break
            if out is None and in_flight is None:
                break
            in_flight = out
        stats.total_s = time.perf_counter() - t0

    def generate(self, prompt: list[int], **kw) -> tuple[list[int], GenerationStats]:
        return collect(self.stream, prompt, **kw)


def collect(stream, prompt, **kw) -> tuple[list[int], GenerationStats]:
    """A whole generation from any `stream(prompt, stats=..., **kw)` (Generator, BatchGenerator, the lockstep
    leader): (token ids, GenerationStats)."""
    stats = GenerationStats()
    out: list[int] = []
    for chunk in stream(prompt, stats=stats, **kw):
        out.extend(chunk)
    return out, stats


def _continuous_steps(params, state, *, step, n: int):
    """n steps of `step` in one program: (params, state) -> (state, outputs stacked [n, ...])."""
    return jax.lax.scan(lambda s, _: step(params, s), state, None, length=n)


def warm_up_prompts(gen) -> list[list[int]]:
    """One prompt per prefill bucket, sized to it (3 new tokens fit), for the buckets a prompt can need."""
    prompts = []
    for i, b in enumerate(gen.buckets):
        n = min(b, gen.max_len - gen.reserved_rows - 3)
        if n < 1 or (i and n <= gen.buckets[i - 1]):
            continue  # the context is too short for this bucket: no prompt can need it
        prompts.append([2 + t % (gen.cfg.vocab_size - 2) for t in range(n)])
    return prompts


def warm_up(gen, progress=None):
    """Compile and run every program serving uses (blocking; before accepting traffic): per greedy / sampled, every
    prefill bucket and the step with and without logprobs (prompts sized to each bucket, 3 new tokens each).
    gen: a Generator, or anything with its generate / buckets / max_len / reserved_rows / cfg (the multi-host
    leader's LockstepGenerator, whose generate the followers replay)."""
    for is_greedy in (True, False):
        for i, prompt in enumerate(warm_up_prompts(gen)):
            for lp in ((None, 0) if i == 0 else (None,)):
                gen.generate(prompt, max_new_tokens=3, temperature=0.0 if is_greedy else 1.0, seed=0,
                             stop_token_ids=(), top_logprobs=lp)
            if i == 0 and is_greedy and not gen.adjusts_logits(SamplingOptions(), False):
                # the neutral greedy requests ran the fused head's step: a penalty builds the one that adjusts
                gen.generate(prompt, max_new_tokens=3, temperature=0.0, seed=0, stop_token_ids=(),
                             presence_penalty=0.5)
        if progress:
            progress()


def _record_logprobs(stats: GenerationStats, lp, n: int, top: int):
    """Append the first n rows of host Logprobs (arrays [1, rows(, N)]) to stats."""
    for j in range(n):
        stats.token_logprobs.append(float(lp.chosen[0, j]))
        stats.top_logprobs.append([(int(i), float(v)) for i, v in zip(lp.top_ids[0, j, :top], lp.top[0, j, :top])])


@contextlib.contextmanager
def count_compiles():
    """Collects the names of the XLA executables built inside the block (jax records one event per compile or
    persistent-cache load, i.e. per in-memory cache miss): serving must build none per request."""
    from jax._src import dispatch

    names: list[str] = []

    def listener(event, duration, **kw):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            names.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def generate_on_device(cfg: ModelConfig, spec: SpecConfig, n_steps: int, *, is_greedy: bool = True,
                       opts: RuntimeOptions = RuntimeOptions(), dcfg=None, adjusts_logits: bool = True) -> Callable:
    """Whole-generation variant for benchmarks: `n_steps` steps inside one lax.while_loop (no host in the
    loop). Returns jitted f(params, state) -> (state, tokens int32[B, n_steps * (K+1)], count int32[B]);
    for DSPARK (dcfg: its DSparkConfig) params is (target params, draft params). adjusts_logits: the steps'
    static flag (Generator.adjusts_logits gives the one a request's step takes)."""
    rows = spec.draft_tokens
    kw = dict(cfg=cfg, is_greedy=is_greedy, opts=opts, adjusts_logits=adjusts_logits)
    if spec.is_dspark:
        dstep = functools.partial(dspark_step, dcfg=dcfg, spec=spec, **kw)
        step = lambda pp, state: dstep(pp[0], pp[1], state)
    elif spec.enabled:
        step = functools.partial(spec_step, steps=spec.num_steps, **kw)
    else:
        step = functools.partial(plain_step, **kw)
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
