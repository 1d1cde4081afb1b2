"""The one HBM ceiling every bench divides by (docs/architecture.md, "How to measure").

    ceiling = max( streaming-read Pallas kernel over >= 4 GiB      (bytes read / time),
                   XLA's elementwise copy over the same array         (bytes read + written / time),
                   the fastest kernel measured in the run             (its counted bytes / its time) )

Why the maximum of three: XLA's copy alone understated the card (2.99-3.35 TB/s in earlier runs while the MoE
kernel read its experts at 4.0 TB/s), which printed fractions of floor above 1. The streaming kernel is the
direct measure of what a read-bound kernel can reach; the copy is kept as a second opinion; and a kernel of the
run that beats both sets the ceiling itself, so no fraction exceeds 1. A kernel that beats the streaming kernel
by more than a few percent is suspicious (bytes miscounted, or L2 hits): `Ceiling.observe` records it and
`Ceiling.summary` names it, so the JSON shows where the ceiling came from.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

STREAM_COLS = 1024  # columns of the streamed array (one program reads a [rows_per_program, 1024] slab)
ROWS_PER_PROGRAM = 512  # the array's rows are a multiple of every variant's slab


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """One variant of the streaming kernel: slab rows per program, rows per load, Triton warps and stages."""

    rows_per_program: int = 512
    sub_rows: int = 16
    num_warps: int = 8
    num_stages: int = 1

    def __post_init__(self):
        if ROWS_PER_PROGRAM % self.rows_per_program or self.rows_per_program % self.sub_rows:
            raise ValueError(f"rows_per_program={self.rows_per_program} must divide {ROWS_PER_PROGRAM} and be a "
                             f"multiple of sub_rows={self.sub_rows}")


# Measured the best on H200 is not known in advance: Ceiling.measure takes the fastest of these.
STREAM_VARIANTS = (StreamConfig(), StreamConfig(64, 16, 4, 1), StreamConfig(128, 32, 8, 3), StreamConfig(512, 32, 8, 4))


def _stream_kernel(x_ref, o_ref, *, cfg: StreamConfig):
    """o[0, :] = sum over this program's rows of x (f32): every byte of x is read exactly once."""

    def body(j, acc):
        rows = x_ref[pl.ds(j * cfg.sub_rows, cfg.sub_rows), :]
        return acc + rows.astype(jnp.float32)

    zero = jnp.zeros((cfg.sub_rows, STREAM_COLS), jnp.float32)
    acc = lax.fori_loop(0, cfg.rows_per_program // cfg.sub_rows, body, zero)
    o_ref[...] = jnp.sum(acc, axis=0, keepdims=True)


def stream_read(x, cfg: StreamConfig = StreamConfig(), *, interpret: bool = False):
    """x [R, 1024] bf16 (R a multiple of 512) -> [R / rows_per_program, 1024] f32 partial column sums."""
    R, C = x.shape
    if C != STREAM_COLS or R % ROWS_PER_PROGRAM:
        raise ValueError(f"stream_read needs [k * {ROWS_PER_PROGRAM}, {STREAM_COLS}], got {x.shape}")
    n = R // cfg.rows_per_program
    return pl.pallas_call(
        functools.partial(_stream_kernel, cfg=cfg),
        grid=(n,),
        in_specs=[pl.BlockSpec((cfg.rows_per_program, C), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((1, C), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((n, C), jnp.float32),
        interpret=interpret,
        compiler_params=None if interpret else _triton_params(cfg),
    )(x)


def _triton_params(cfg: StreamConfig):
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def device_kernel_runs(run, reps=3):
    """Device kernel events [(ts_us, dur_us)] of `reps` calls of run() under a profiler trace (one list per
    call; calls are separated by 20 ms of host sleep). None when the trace has no GPU kernels (CPU)."""

    logdir = tempfile.mkdtemp(prefix="kbench-")
    try:
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            for _ in range(reps):
                time.sleep(0.02)
                jax.block_until_ready(run())
            time.sleep(0.02)
        path = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            tr = json.load(f)
    except Exception as ex:  # no usable trace: the caller falls back to wall time
        print(f"profiler trace unusable ({type(ex).__name__}: {str(ex)[:200]})", flush=True)
        return None
    ev = tr["traceEvents"] if isinstance(tr, dict) else tr
    pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    tname = {(e["pid"], e.get("tid")): e["args"]["name"] for e in ev
                      if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {p for p, n in pname.items() if "gpu" in n.lower() or "stream" in n.lower()}
    ks = sorted((float(e["ts"]), float(e["dur"])) for e in ev
                            if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e
                            and "xla" not in tname.get((e["pid"], e.get("tid")), "").lower())
    runs, cur = [], []
    for ts, dur in ks:
        if cur and ts - max(t + d for t, d in cur) > 10e3:
            runs.append(cur)
            cur = []
        cur.append((ts, dur))
    runs = [r for r in runs + [cur] if r]
    return runs if len(runs) == reps else None



def _device_s(f, *args) -> float:
    """Seconds of device kernel time per call of f (profiler trace: launch and host dispatch excluded), or the
    wall-clock median where there is no trace (CPU)."""
    jax.block_until_ready(f(*args))
    runs = device_kernel_runs(lambda: f(*args), reps=5) if jax.default_backend() == "gpu" else None
    if not runs:
        return _median_s(f, *args)
    return float(np.median([sum(d for _, d in r) for r in runs])) * 1e-6


def _median_s(f, *args, reps: int = 20) -> float:
    jax.block_until_ready(f(*args))  # compile + warm
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


@dataclasses.dataclass
class Ceiling:
    """Bytes/s of the HBM ceiling, with where each candidate came from. Mutable on purpose: a bench creates one,
    feeds it every kernel it times (`observe`), and reads `bytes_per_s` when it computes fractions at the end."""

    stream_bytes_per_s: float
    copy_bytes_per_s: float
    best_kernel_bytes_per_s: float = 0.0
    best_kernel: str | None = None
    stream_variants: dict | None = None  # StreamConfig repr -> bytes/s

    @classmethod
    def measure(cls, device=None, gib: float = 4.0) -> "Ceiling":
        """Both direct measurements over a `gib` GiB bf16 array (>= 4 GiB on a GPU: 66x the 60 MB L2)."""
        device = device or jax.devices()[0]
        gpu = device.platform == "gpu"
        rows = int(gib * 2**30 / (2 * STREAM_COLS)) // ROWS_PER_PROGRAM * ROWS_PER_PROGRAM if gpu else 4096
        make = jax.jit(lambda k: jax.random.normal(k, (rows, STREAM_COLS), jnp.bfloat16))
        x = make(jax.device_put(jax.random.key(0), device))
        variants = {}
        for sc in STREAM_VARIANTS if gpu else STREAM_VARIANTS[:1]:
            try:
                t = _device_s(jax.jit(lambda a, sc=sc: stream_read(a, sc, interpret=not gpu)), x)
            except Exception as e:  # noqa: BLE001  (a variant Triton rejects must not cost the ceiling)
                print(f"stream variant {sc} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            variants[repr(sc)] = (x.nbytes + rows // sc.rows_per_program * STREAM_COLS * 4) / t
        t_copy = _device_s(jax.jit(lambda a: a + 1), x)
        return cls(stream_bytes_per_s=max(variants.values()), copy_bytes_per_s=2 * x.nbytes / t_copy,
                   stream_variants=variants)

    def observe(self, name: str, nbytes: float, seconds: float) -> None:
        """A kernel of the run moved `nbytes` in `seconds`; it raises the ceiling if it beats the others."""
        if seconds > 0 and nbytes / seconds > self.best_kernel_bytes_per_s:
            self.best_kernel_bytes_per_s, self.best_kernel = nbytes / seconds, name

    @property
    def bytes_per_s(self) -> float:
        return max(self.stream_bytes_per_s, self.copy_bytes_per_s, self.best_kernel_bytes_per_s)

    @property
    def source(self) -> str:
        best = self.bytes_per_s
        if best == self.best_kernel_bytes_per_s:
            return f"kernel of the run: {self.best_kernel}"
        return "streaming-read Pallas kernel" if best == self.stream_bytes_per_s else "XLA copy"

    def summary(self) -> dict:
        s = dict(ceiling_bytes_per_s=self.bytes_per_s, ceiling_source=self.source,
                 stream_read_bytes_per_s=self.stream_bytes_per_s, xla_copy_bytes_per_s=self.copy_bytes_per_s,
                 best_kernel_bytes_per_s=self.best_kernel_bytes_per_s, best_kernel=self.best_kernel,
                 stream_variants=self.stream_variants)
        if self.best_kernel_bytes_per_s > 1.05 * max(self.stream_bytes_per_s, self.copy_bytes_per_s):
            s["warning"] = (f"{self.best_kernel} beat the streaming kernel by "
                            f"{self.best_kernel_bytes_per_s / self.stream_bytes_per_s - 1:.0%}: check its byte count")
        return s


def apply(rows: list[dict], ceiling: Ceiling) -> list[dict]:
    """Observe every row with bytes and a time, then (re)compute floor_us and fraction_of_floor at the final
    ceiling, so every row of a run is divided by the same number."""
    timed = [r for r in rows if isinstance(r.get("time_us"), (int, float)) and r["time_us"] > 0 and r.get("bytes")
             and r.get("floor_kind", "bytes") == "bytes"]  # compute-bound floors (e.g. flops@tf32) stay as they are
    for r in timed:
        ceiling.observe(r["name"], r["bytes"], r["time_us"] * 1e-6)
    for r in timed:
        r["floor_us"] = r["bytes"] / ceiling.bytes_per_s * 1e6
        r["fraction_of_floor"] = r["floor_us"] / r["time_us"]
    return rows
