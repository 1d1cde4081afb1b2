"""Multi-host serving: every process runs the same programs in the same order (JAX is multi-controller).

Process 0 (the leader) serves HTTP; the others (followers) hold their shards of the weights and state and run
`follow`, which replays the leader's calls. Two things cross between processes, both as device broadcasts
(`multihost_utils.broadcast_one_to_all`, collectives over the global mesh):

  1. a request header, its sampling record (top_k, min_p, penalties, logit_bias) and its prompt, when the
     leader starts a `stream` (warm-up requests included);
  2. one flag per consumed chunk: 1 = the consumer asked for the next chunk, 0 = it closed the stream (stop
     string, client disconnect, finish). Everything else the stream decides (EOS, max tokens, the tokens
     themselves) is computed identically on every process from replicated outputs, so it needs no message.

So each process dispatches: prefill, then per chunk one step program and one flag broadcast, in the same
order. The flag travels with the step outputs and is read one step late, like them: the leader dispatches
chunk k's flag and reads chunk k-1's (long complete), so it never waits on a collective and keeps its
run-ahead (step k+1 is already queued on the device behind step k when chunk k's flag goes out). A follower
must know chunk k's decision before it dispatches step k+2, so it reads each flag at once; it still has step
k+1 in flight while it waits. The flag costs one small collective per step, only when --nnodes > 1. If the
leader dies the followers block in the next broadcast until the distributed runtime's heartbeat timeout
ends them.
"""

from __future__ import annotations

import logging
import struct
import threading

import numpy as np

from ling_jax.runner import Generator, collect
from ling_jax.sampling import SamplingOptions
from serve.protocol import MAX_LOGIT_BIAS

log = logging.getLogger("ling_jax.serve")

HEADER = 64  # int32 words: op, n_prompt, bucket, max_new_tokens, seed, temperature, top_p, n_stop,
# top_logprobs + 1 (0: none; it picks the step program), stop ids...
STOP0 = 9
MAX_STOP_IDS = HEADER - STOP0
OP_STREAM, OP_SHUTDOWN = 1, 2
SAMPLING_SCALARS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
SAMPLING_WORDS = len(SAMPLING_SCALARS) + 1 + 2 * MAX_LOGIT_BIAS  # scalars, n_bias, bias ids, bias f32 bits


def prompt_bucket(n: int, minimum: int = 16) -> int:
    """Prompts are broadcast padded to a power of two, so few broadcast shapes are compiled."""
    b = minimum
    while b < n:
        b *= 2
    return b


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def _bits_f32(i: int) -> float:
    return struct.unpack("<f", struct.pack("<i", int(i)))[0]


def _broadcast(x: np.ndarray, is_leader: bool) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x, is_source=is_leader))


class FlagChannel:
    """The per-chunk continue flag as an asynchronous broadcast: `send` dispatches it (the leader's value, zeros
    elsewhere, summed over the processes) and returns the device array without reading it; `read` waits for it.
    `broadcast_one_to_all` would read at once, so the leader would wait for the collective, i.e. for the step
    queued before it."""

    def __init__(self, is_leader: bool):
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        self.is_leader = is_leader
        self.single = jax.process_count() == 1
        if self.single:
            return
        devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
        self.mesh = Mesh(devices, ("processes", "local_devices"))
        self.pspec = PartitionSpec("processes")
        self.sum = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=NamedSharding(self.mesh, PartitionSpec()))

    def send(self, flag: int):
        x = np.full((1,), flag if self.is_leader else 0, np.int32)
        if self.single:
            return x
        from jax.experimental import multihost_utils

        return self.sum(multihost_utils.host_local_array_to_global_array(x[None], self.mesh, self.pspec))

    @staticmethod
    def read(sent) -> int:
        import jax

        return int(np.asarray(sent if isinstance(sent, np.ndarray) else jax.device_get(sent.addressable_data(0)))[0])


def encode_header(op: int, prompt_len: int = 0, bucket: int = 0, max_new_tokens: int = 0, seed: int = 0,
                  temperature: float = 0.0, top_p: float = 1.0, stop_token_ids=None,
                  top_logprobs: int | None = None) -> np.ndarray:
    h = np.zeros((HEADER,), np.int32)
    stops = None if stop_token_ids is None else tuple(int(t) for t in stop_token_ids)
    if stops is not None and len(stops) > MAX_STOP_IDS:
        raise ValueError(f"multi-host serving passes at most {MAX_STOP_IDS} stop token ids, got {len(stops)}")
    h[:8] = [op, prompt_len, bucket, max_new_tokens, seed, _f32_bits(temperature), _f32_bits(top_p),
             -1 if stops is None else len(stops)]
    h[8] = 0 if top_logprobs is None else top_logprobs + 1
    if stops:
        h[STOP0:STOP0 + len(stops)] = stops
    return h


def encode_sampling(top_k: int = -1, min_p: float = 0.0, repetition_penalty: float = 1.0,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias=()) -> np.ndarray:
    """The sampling fields the header does not carry, as int32 words (floats as their f32 bits)."""
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"multi-host serving passes at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(logit_bias)}")
    w = np.zeros((SAMPLING_WORDS,), np.int32)
    w[0] = top_k
    w[1:5] = [_f32_bits(x) for x in (min_p, repetition_penalty, presence_penalty, frequency_penalty)]
    n, ids0 = len(logit_bias), len(SAMPLING_SCALARS) + 1
    w[ids0 - 1] = n
    if n:
        w[ids0 : ids0 + n] = [t for t, _ in logit_bias]
        w[ids0 + MAX_LOGIT_BIAS : ids0 + MAX_LOGIT_BIAS + n] = [_f32_bits(b) for _, b in logit_bias]
    return w


def decode_sampling(w: np.ndarray) -> dict:
    ids0 = len(SAMPLING_SCALARS) + 1
    n = int(w[ids0 - 1])
    bias = tuple((int(w[ids0 + i]), _bits_f32(w[ids0 + MAX_LOGIT_BIAS + i])) for i in range(n))
    return dict(top_k=int(w[0]), **{k: _bits_f32(v) for k, v in zip(SAMPLING_SCALARS[1:], w[1:5])},
                logit_bias=bias)


def decode_header(h: np.ndarray) -> tuple[int, dict, int, int]:
    """-> (op, stream kwargs, prompt length, bucket)."""
    op, n, bucket, max_new, seed, temp, top_p, n_stop = (int(v) for v in h[:8])
    stops = None if n_stop < 0 else tuple(int(t) for t in h[STOP0:STOP0 + n_stop])
    kw = dict(max_new_tokens=max_new, seed=seed, temperature=_bits_f32(temp), top_p=_bits_f32(top_p),
              stop_token_ids=stops, top_logprobs=int(h[8]) - 1 if h[8] else None)
    return op, kw, n, bucket


class LockstepGenerator:
    """The leader's Generator: same interface, but every stream is announced to the followers first and every
    chunk's continue/close decision is broadcast. Attributes not defined here come from the wrapped generator."""

    def __init__(self, gen: Generator):
        self.gen = gen
        self._busy = threading.Lock()  # held from a stream's announcement to its last flag
        self._flags = FlagChannel(is_leader=True)

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def stream(self, prompt, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               stop_token_ids=None, stats=None, top_logprobs=None, **sampling):
        prompt = [int(t) for t in prompt]
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                  stop_token_ids=stop_token_ids)
        # Validate here, before announcing: a request the leader refuses must not reach the followers.
        if any(t < 0 or t >= self.gen.cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {self.gen.cfg.vocab_size})")
        self.gen.check_request(len(prompt), max_new_tokens)
        SamplingOptions(temperature=temperature, top_p=top_p, **sampling).device(self.gen.cfg.vocab_size)
        bucket = prompt_bucket(len(prompt))
        header = encode_header(OP_STREAM, len(prompt), bucket, top_logprobs=top_logprobs, **kw)
        padded = np.zeros((bucket,), np.int32)
        padded[: len(prompt)] = prompt
        return self._relay(header, encode_sampling(**sampling), padded, prompt, stats,
                           dict(kw, top_logprobs=top_logprobs, **sampling))

    def _relay(self, header, sampling, padded, prompt, stats, kw):
        # A generator: nothing is announced until the consumer asks for the first chunk, so a stream created and
        # dropped unread costs the followers nothing.
        with self._busy:
            _broadcast(header, True)
            _broadcast(sampling, True)
            _broadcast(padded, True)
            it = self.gen.stream(prompt, stats=stats, **kw)
            pending = None  # the last flag sent, read when the next one goes out (one step late)
            try:
                for chunk in it:
                    yield chunk
                    sent = self._flags.send(1)  # the consumer asked for more
                    if pending is not None:
                        self._flags.read(pending)
                    pending = sent
            except GeneratorExit:
                pending = self._flags.send(0)
                it.close()
                raise
            finally:
                if pending is not None:  # nothing outstanding once the stream is over
                    self._flags.read(pending)

    def generate(self, prompt, **kw):
        return collect(self.stream, prompt, **kw)

    def shutdown(self, timeout_s: float = 60.0):
        """Tell the followers to leave `follow` (once, when the server stops; after the stream in flight, if any,
        has been closed by its consumer)."""
        if not self._busy.acquire(timeout=timeout_s):
            log.error("a stream is still in flight after %.0f s: followers not told to shut down", timeout_s)
            return
        try:
            _broadcast(encode_header(OP_SHUTDOWN), True)
            log.info("followers told to shut down")
        finally:
            self._busy.release()


def follow(gen: Generator) -> int:
    """A follower's whole life: replay the leader's streams until it says shut down. Returns the number of
    streams replayed."""
    n_streams = 0
    flags = FlagChannel(is_leader=False)
    while True:
        op, kw, n, bucket = decode_header(_broadcast(np.zeros((HEADER,), np.int32), False))
        if op == OP_SHUTDOWN:
            log.info("leader shut down after %d streams", n_streams)
            return n_streams
        if op != OP_STREAM:
            raise RuntimeError(f"unknown lockstep op {op}: leader and follower versions differ?")
        sampling = decode_sampling(_broadcast(np.zeros((SAMPLING_WORDS,), np.int32), False))
        prompt = _broadcast(np.zeros((bucket,), np.int32), False)[:n].tolist()
        it = gen.stream(prompt, **kw, **sampling)
        for _ in it:
            if not flags.read(flags.send(0)):  # chunk k's decision, needed before step k+2 is dispatched
                it.close()
                break
        n_streams += 1
