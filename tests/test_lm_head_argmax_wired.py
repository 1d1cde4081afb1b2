"""The fused greedy head (KernelCalls.lm_head_argmax) in the shipped demo model (models/ling-demo, bf16, interpret
mode): where it serves, and that no request gets another answer.

Oracle: the same Generator with the field off (every other kernel the same, interpreted), whose tokens are argmax of
the adjusted logits. Greedy requests with neutral penalties and no logprobs run the steps' static
adjusts_logits=False: plain decode's head and NEXTN's 4 drafts, verify and extend each take the kernel (a census of
the calls at trace time), and 64 greedy tokens are those of the field off, plain and NEXTN5 alike (NEXTN5 also with
the MTP's input in one kernel, KernelCalls.mtp_input_triton). Requests that
need the logits (sampled, logprobs, a penalty, a logit bias) run the program they ran before: no head_argmax call
is traced for them and their tokens and logprobs equal the field off's. The programs themselves: with the field off
adjusts_logits=False changes nothing (the same jaxpr); with it on the demo's bench_step programs have no logits,
no argmax and no lm_head dot left, and one head_argmax pair per head.
"""

import collections
import math
import os

import jax
import jax.numpy as jnp
import pytest

from ling_jax.config import load_config
from ling_jax.kernel_calls import KernelCalls
from ling_jax.model import RuntimeOptions
from ling_jax.runner import Generator
from ling_jax.spec import SpecConfig
from ling_jax.weights import abstract_params, load_params
from tests.test_kernels_router_segments import inlined_eqns

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "ling-demo")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "model.safetensors.index.json")),
                                reason="models/ling-demo is not checked out")
PROMPT = [17, 302, 45, 2001, 9, 9, 771, 1200, 33, 34, 35, 36, 512, 88, 1023, 64]
TRACED: list = []  # (rows, vocabulary, whether the kernel took it), appended when a head_argmax call is traced
MTP_TRACED: list = []  # (rows, whether the kernel took it) of each mtp_input call traced


class Census(KernelCalls):
    """KernelCalls that records each fused-head call (and each MTP input call)."""

    def head_argmax(self, h, w):
        out = super().head_argmax(h, w)
        TRACED.append((math.prod(h.parts[0][0].shape[:-1]), w.shape[0], out is not None))
        return out

    def mtp_input(self, tokens, *args, **kw):
        out = super().mtp_input(tokens, *args, **kw)
        MTP_TRACED.append((math.prod(tokens.shape), out is not None))
        return out


_GENS: dict = {}


def generator(algorithm: str, fused: bool, mtp_input: bool = False) -> Generator:
    """One Generator per (algorithm, fields), kept for the module: its programs compile once. fused: the field on;
    mtp_input: KernelCalls.mtp_input_triton too (the MTP's input in one kernel)."""
    key = (algorithm, fused, mtp_input)
    if key not in _GENS:
        cfg = load_config(MODEL)
        params = load_params(cfg, MODEL, dtype=jnp.bfloat16)
        spec = SpecConfig("NEXTN", 5) if algorithm == "NEXTN" else SpecConfig("NONE")
        calls = (Census(interpret=True, lm_head_argmax=True, mtp_input_triton=mtp_input) if fused
                 else KernelCalls(interpret=True))
        _GENS[key] = Generator(cfg, params, spec=spec, max_len=128, dtype=jnp.bfloat16,
                               opts=RuntimeOptions(kernels=calls))
    return _GENS[key]


@pytest.mark.parametrize("algorithm,heads", [("NONE", [1]), ("NEXTN", [1, 1, 1, 1, 6, 1])])
def test_greedy_tokens_with_the_fused_head_equal_the_logits_path(algorithm, heads):
    """64 greedy tokens: the same with the field on as off; every head of the step took the kernel (plain: the
    target's one row; NEXTN5: 4 drafts, the 6 verify rows, the extend's row; the prefill keeps its logits: it
    returns logprobs)."""
    TRACED.clear()
    on, on_stats = generator(algorithm, True).generate(PROMPT, max_new_tokens=64, stop_token_ids=())
    per_trace = [(rows, 4096, True) for rows in heads]  # (the runner traces a step more than once)
    assert TRACED and TRACED == per_trace * (len(TRACED) // len(heads)), TRACED
    off, off_stats = generator(algorithm, False).generate(PROMPT, max_new_tokens=64, stop_token_ids=())
    assert len(on) == 64 and on == off, next(i for i, (a, b) in enumerate(zip(on, off)) if a != b)
    assert on_stats.accept_lengths == off_stats.accept_lengths
    if algorithm == "NEXTN":
        assert on_stats.mean_accept_length > 2.0, on_stats.as_dict()


def test_nextn_greedy_with_the_mtp_input_kernel_too():
    """KernelCalls.mtp_input_triton on as well: every MTP pass of the step (4 drafts, the extend's 6 rows; not the
    prefill's chunk of 32 rows) takes the kernel, and the 64 greedy tokens and accept lengths are the field off's."""
    TRACED.clear()
    MTP_TRACED.clear()
    on, on_stats = generator("NEXTN", True, mtp_input=True).generate(PROMPT, max_new_tokens=64, stop_token_ids=())
    per_trace = [(1, True)] * 4 + [(6, True)]
    step = [m for m in MTP_TRACED if m != (32, False)]  # the prefill chunk's call: too many rows for the kernel
    assert step and step == per_trace * (len(step) // len(per_trace)), MTP_TRACED
    off, off_stats = generator("NEXTN", False).generate(PROMPT, max_new_tokens=64, stop_token_ids=())
    assert on == off, next(i for i, (a, b) in enumerate(zip(on, off)) if a != b)
    # Not equality of the accept lengths: the output above must be equal (lossless), but the drafts of the kernel
    # and of XLA's CPU fusion of the reference differ by machine (equal on the CI hosts through 2026-12-07; on an
    # AMD EPYC host of 2026-12-08, even at 623dd63, the mean moved by 0.15: open, see the 12-08 closing note).
    assert abs(on_stats.mean_accept_length - off_stats.mean_accept_length) <= 0.2, (on_stats.accept_lengths,
                                                                                     off_stats.accept_lengths)


REQUESTS = {
    "sampled": dict(temperature=0.8, top_p=0.9, seed=3),
    "logprobs": dict(top_logprobs=2),
    "penalty": dict(repetition_penalty=1.3, frequency_penalty=0.4),
    "logit bias": dict(logit_bias=((33, 5.0), (34, -3.0))),
}


@pytest.mark.parametrize("algorithm", ["NONE", "NEXTN"])
@pytest.mark.parametrize("request_kind", list(REQUESTS))
def test_requests_that_need_logits_keep_the_logits_path(algorithm, request_kind):
    """With the field on, a request that needs its logits runs a program without the fused head (no call
    traced) and gets the field off's tokens and logprobs."""
    kw = REQUESTS[request_kind]
    TRACED.clear()
    on, on_stats = generator(algorithm, True).generate(PROMPT, max_new_tokens=16, stop_token_ids=(), **kw)
    assert TRACED == []
    off, off_stats = generator(algorithm, False).generate(PROMPT, max_new_tokens=16, stop_token_ids=(), **kw)
    assert on == off
    assert on_stats.token_logprobs == off_stats.token_logprobs and on_stats.top_logprobs == off_stats.top_logprobs
    if request_kind == "logprobs":
        assert len(on_stats.token_logprobs) == 16


def _step_eqns(mode, calls, adjusts_logits):
    from compile.stages import Program

    cfg = load_config(MODEL)
    prog = Program(cfg, mode=mode, steps=5, max_len=256, opts=RuntimeOptions(kernels=calls),
                   adjusts_logits=adjusts_logits)
    return jax.make_jaxpr(prog.fn())(abstract_params(cfg, jnp.bfloat16), prog.abstract_state())


@pytest.mark.parametrize("mode,heads", [("plain", 1), ("nextn", 6)])
def test_demo_step_has_no_logits_with_the_fused_head(mode, heads):
    """The demo's bench_step programs (plain; NEXTN5), traced only. Field off: adjusts_logits=False is the very
    program of adjusts_logits=True. Field on with adjusts_logits=False: one head_argmax_tiles + head_argmax_reduce
    per head, no argmax and no [.., 4096] f32 value made (no lm_head dot, no logits; the history's int32
    [1, 4096] counts stay); with adjusts_logits=True the field changes nothing."""
    off = _step_eqns(mode, KernelCalls(), True)
    assert str(_step_eqns(mode, KernelCalls(), False)) == str(off)
    assert str(_step_eqns(mode, KernelCalls(lm_head_argmax=True), True)) == str(off)
    eqns = inlined_eqns(_step_eqns(mode, KernelCalls(lm_head_argmax=True), False).jaxpr)
    name = lambda e: e[3].params["name"] if e[0] == "pallas_call" else e[0]
    names = collections.Counter(map(name, eqns))
    assert names["head_argmax_tiles"] == names["head_argmax_reduce"] == heads, names
    old = collections.Counter(map(name, inlined_eqns(off.jaxpr)))
    assert old["argmax"] == heads and names["argmax"] == 0, (old["argmax"], names["argmax"])
    vocab_f32 = lambda v: v.aval.shape[-1:] == (4096,) and v.aval.dtype == jnp.float32
    logits = [name(e) for e in eqns if any(map(vocab_f32, e[3].outvars))]
    assert not logits, logits


def test_only_neutral_greedy_requests_get_the_fused_program():
    """Generator.adjusts_logits, the program a request runs (test-tiny, nothing compiled but the batcher's empty
    slot): with the field on, False (the fused head's program) only for a greedy request without logprobs whose
    penalties and logit bias are neutral (top_p / top_k / min_p do not touch a greedy token); True for every other
    request, and for every request with the field off. The batcher warms the extra program only with the field on."""
    from ling_jax.batching import BatchGenerator
    from ling_jax.config import get_preset
    from ling_jax.sampling import SamplingOptions
    from ling_jax.weights import init_params

    cfg = get_preset("test-tiny")
    params = init_params(cfg, 0, jnp.float32)
    gen = lambda calls: Generator(cfg, params, max_len=32, dtype=jnp.float32, opts=RuntimeOptions(kernels=calls))
    on, off = gen(KernelCalls(interpret=True, lm_head_argmax=True)), gen(KernelCalls(interpret=True))
    neutral = [SamplingOptions(), SamplingOptions(top_p=0.5, top_k=3, min_p=0.2)]
    adjusting = [SamplingOptions(temperature=0.7), SamplingOptions(repetition_penalty=1.1),
                 SamplingOptions(presence_penalty=0.1), SamplingOptions(frequency_penalty=-0.2),
                 SamplingOptions(logit_bias=((3, 0.5),))]
    assert [on.adjusts_logits(o, False) for o in neutral] == [False, False]
    assert all(on.adjusts_logits(o, True) for o in neutral)                       # logprobs need the logits
    assert all(on.adjusts_logits(o, False) for o in adjusting)
    assert all(off.adjusts_logits(o, lp) for o in neutral + adjusting for lp in (False, True))
    assert BatchGenerator(on, 2).step_variants()[-1] == (True, False, False)
    assert all(len(v) == 2 for v in BatchGenerator(off, 2).step_variants())
