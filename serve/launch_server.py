"""Launch the HTTP server (SGLang's flag names).

    python -m serve.launch_server --model-path test-tiny --port 30000 \
        --speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 \
        --speculative-num-draft-tokens 4 --context-length 4096

Multi-host (one process per host, every host runs the same command with its own --node-rank; --tp-size is the
global device count; process 0 serves HTTP and the others follow it in lockstep, see serve/lockstep.py):

    python -m serve.launch_server --model-path ling3-flash --tp-size 16 \
        --dist-init-addr 10.0.0.1:5000 --nnodes 2 --node-rank 0     # and --node-rank 1 on the second host

--model-path is a preset (random weights) or an HF checkpoint dir (config.json + safetensors, and optionally
tokenizer.json / tokenizer_config.json); --random-weights initialises randomly even for a dir. A checkpoint that
does not match its config.json, or a file that cannot be read, is one line `error: ...` and exit status 2 before the
server listens (--check-weights: also inf/nan values). Then the server listens at once; /health answers 503 until
the weights are loaded, the programs compiled and a greedy and a sampled warm-up request have run.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

DTYPES = ("bfloat16", "float32")
DEFAULT_MAX_RUNNING = 8  # SGLang's flag; its default here


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    from ling_jax.generate import add_speculative_flags as add

    add(p)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="ling-jax HTTP server (OpenAI + SGLang-native APIs)")
    p.add_argument("--model-path", required=True, help="preset name (random weights) or HF checkpoint dir")
    p.add_argument("--served-model-name", default=None,
                   help="the model id the API reports and accepts (default: the model dir's or preset's name)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor parallel size (> 1 through compile.runner.ShardedGenerator over a ('tp',) mesh)")
    add_speculative_flags(p)
    p.add_argument("--context-length", type=int, default=None,
                   help="KV cache slots per request (default: what device memory allows after the weights, at most "
                        "the model's max_position_embeddings; ling_jax/memory.py)")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="prompt positions per prefill chunk: one compiled prefill program serves every prompt "
                        "length (default: ling_jax.runner.DEFAULT_CHUNKED_PREFILL_SIZE = 512)")
    p.add_argument("--num-continuous-decode-steps", type=int, default=1,
                   help="decode steps per dispatch (SGLang's flag): N > 1 runs N steps in one program (a lax.scan), "
                        "so the host's per-dispatch cost is paid once per N steps; a stream then receives N steps' "
                        "tokens at a time, the same tokens as N = 1. With continuous batching every dispatch of the "
                        "running group runs N steps")
    # continuous batching (ling_jax/batching.py)
    p.add_argument("--max-running-requests", type=int, default=None,
                   help="requests decoded together (plain, NEXTN or DSPARK rows), each in a slot of "
                        "--context-length rows reserved at start (default "
                        f"{DEFAULT_MAX_RUNNING} on one host with --tp-size 1, else 1; 1 serves one request at a time "
                        "through the batch-1 programs alone)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--random-weights", action="store_true", help="random init even when --model-path is a dir")
    p.add_argument("--check-weights", action="store_true",
                   help="before serving, read every tensor of the checkpoint once and reject inf/nan "
                        "(names the tensor)")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-weights' initialisation")
    p.add_argument("--random-seed", type=int, default=None,
                   help="source of the sampling seeds of requests that bring none (default: random per start)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on every route but /health")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="waiting requests beyond which new ones get 503 (default: unbounded)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take from arrival, queue included; then 504 (default: none)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive; then 408")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: block-fp8 linear weights; a bf16 checkpoint is quantised while it loads")
    p.add_argument("--fp8-activations", choices=("none", "dynamic"), default="none",
                   help="fp8 weights' GEMM inputs (Numerics.fp8_activations): none keeps them bf16 (weight-only fp8, "
                        "the default, also for a checkpoint whose activation_scheme is 'dynamic'); dynamic quantises "
                        "them per token and 128 columns to e4m3 (w8a8, as SGLang / vLLM serve the format)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="every target pass runs a fixed row count, so greedy output is identical with or without "
                        "speculation (NEXTN steps <= 7), also in bf16 (RuntimeOptions.target_rows)")
    p.add_argument("--dist-init-addr", default=None,
                   help="HOST:PORT of process 0's jax.distributed coordinator (multi-host; with --nnodes > 1)")
    p.add_argument("--nnodes", type=int, default=1, help="processes (hosts) in the mesh; each runs this command")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this process's index: 0 serves HTTP, the others follow it in lockstep")
    return p


def init_multi_host(a: argparse.Namespace) -> None:
    """jax.distributed.initialize from the SGLang-style flags (before anything touches a device)."""
    if a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        raise ValueError(f"--node-rank {a.node_rank} must be in [0, --nnodes {a.nnodes})")
    if a.nnodes == 1:
        return
    if not a.dist_init_addr or ":" not in a.dist_init_addr:
        raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (process 0's coordinator)")
    import jax

    # CPU meshes across processes need a collectives implementation (GPUs use NCCL regardless).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from compile.mesh import init_distributed

    init_distributed(a.dist_init_addr, a.nnodes, a.node_rank)
    logging.info("jax.distributed: process %d of %d, %d global devices (%d local)", jax.process_index(),
                 jax.process_count(), jax.device_count(), jax.local_device_count())


def check_checkpoint(a: argparse.Namespace, cfg) -> None:
    """Before the server listens: the checkpoint's names, shapes and dtypes (and with --check-weights its values),
    so that a bad checkpoint is one line and exit status 2 (ling_jax.errors.CheckpointError), not a failed load."""
    from_files = os.path.isdir(a.model_path) and not a.random_weights
    if a.check_weights and not from_files:
        raise ValueError("--check-weights checks a checkpoint directory's files; there are none with a preset or "
                         "--random-weights")
    if from_files:
        from ling_jax.weights import validate_checkpoint

        validate_checkpoint(cfg, a.model_path, check_finite=a.check_weights)


def tensor_parallel(cfg, tp_size: int, multi_host: bool = False):
    """(mesh, param shardings) for tp_size > 1 from the compiler's modules; (None, None) on one device.
    multi_host: the mesh spans every process's devices (tp_size must be the global device count)."""
    if tp_size == 1 and not multi_host:
        return None, None
    if tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {tp_size}")
    try:
        from compile.mesh import make_mesh
        from compile.runner import ShardedGenerator  # noqa: F401 - checked here, used by the loader
        from compile.sharding import shardings_for
    except ImportError as e:
        raise ValueError(f"--tp-size {tp_size}: tensor parallelism needs compile.mesh / compile.runner / "
                         f"compile.sharding ({e}); use --tp-size 1") from None
    mesh = make_mesh(tp_size, multi_host=multi_host)  # ValueError when fewer devices are visible
    return mesh, shardings_for(cfg, mesh)


def decode_steps(a: argparse.Namespace) -> int:
    """--num-continuous-decode-steps, checked (runner.Generator(decode_steps=N))."""
    n = a.num_continuous_decode_steps
    if n < 1:
        raise ValueError(f"--num-continuous-decode-steps must be >= 1, got {n}")
    return n


def max_running(a: argparse.Namespace) -> int:
    """--max-running-requests, checked: batching runs on one host without tensor parallelism (the lockstep
    protocol and the sharded programs are batch-1), for plain, NEXTN and DSPARK decoding alike; with
    --num-continuous-decode-steps N each dispatch of the group runs N steps (rows that end inside one are cut
    there, ling_jax.batching)."""
    n = a.max_running_requests
    if n is not None and n < 1:
        raise ValueError(f"--max-running-requests must be >= 1, got {n}")
    single = a.nnodes == 1 and a.tp_size == 1
    if n is not None and n > 1 and not single:
        raise ValueError(f"--max-running-requests {n}: continuous batching needs --nnodes 1 and --tp-size 1 (got "
                         f"--nnodes {a.nnodes}, --tp-size {a.tp_size}); use --max-running-requests 1")
    decode_steps(a)  # checked with it
    return n if n is not None else (DEFAULT_MAX_RUNNING if single else 1)


def request_rows(a: argparse.Namespace) -> int:
    """Request rows of state at the peak: with batching, a group re-formed between its largest bucket
    (max_running) and the one below holds both for a moment, beside the staging slot of the next prefill
    (ling_jax.batching); else 1."""
    from ling_jax.batching import row_buckets

    n = max_running(a)
    return n + row_buckets(n)[-2] + 1 if n > 1 else 1


def memory_budget(a: argparse.Namespace, cfg, spec, context_length: int, dcfg=None) -> dict:
    """The state memory the slots reserve at start (ling_jax.memory.serving_budget); ValueError if it does not fit.
    dcfg: the DSpark draft's config (its weights, and per row its context K/V instead of an MTP cache)."""
    import jax.numpy as jnp

    from ling_jax.memory import device_memory_bytes, serving_budget

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[a.dtype]
    b = serving_budget(cfg, dtype, chunk_size(a), context_length, rows=request_rows(a),
                       device_bytes=device_memory_bytes(), tp=a.tp_size, nextn=spec.is_nextn,
                       quantization=a.quantization, draft=dcfg)
    logging.info("memory: %d request slots x %d context = %.1f MiB per slot; %.2f GiB of %.2f GiB usable in all",
                 b["rows"], context_length, b["per_request_bytes"] / 2**20, b["total_bytes"] / 2**30,
                 b["limit_bytes"] / 2**30)
    return b


def chunk_size(a: argparse.Namespace) -> int:
    from ling_jax.runner import DEFAULT_CHUNKED_PREFILL_SIZE

    if a.chunked_prefill_size is not None and a.chunked_prefill_size < 1:
        raise ValueError(f"--chunked-prefill-size must be >= 1, got {a.chunked_prefill_size}")
    return a.chunked_prefill_size or DEFAULT_CHUNKED_PREFILL_SIZE


def memory_context_length(a: argparse.Namespace, cfg, spec, dcfg=None) -> int:
    """--context-length's default: what one device's memory holds after its share of the weights."""
    import jax.numpy as jnp

    from ling_jax.memory import default_context_length, device_memory_bytes

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[a.dtype]
    n = default_context_length(cfg, dtype, chunk_size(a), device_bytes=device_memory_bytes(), tp=a.tp_size,
                               nextn=spec.is_nextn, quantization=a.quantization, rows=request_rows(a),
                               draft=dcfg)
    logging.info("--context-length not given: %d slots fit in memory (max_position_embeddings %d)", n,
                 cfg.max_position_embeddings)
    return n


def make_loader(a: argparse.Namespace, cfg, spec, tokenizer, mesh, shardings, context_length: int, *,
                warm: bool = True, loaded: list | None = None):
    """The blocking load: weights (progress bar), Generator, compile + warm-up (progress bar).
    Multi-host: the leader's Generator is a LockstepGenerator (followers replay its calls, the warm-up too);
    warm=False for a follower (its warm-up is the leader's). loaded: receives the generator."""

    def load():
        import jax
        import jax.numpy as jnp
        from tqdm import tqdm

        from ling_jax.runner import Generator
        from ling_jax.weights import array_spec, init_params, load_params
        from serve.engine import warmup
        from serve.protocol import ModelLimits

        dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[a.dtype]
        if a.nnodes > 1:  # every process starts each collective phase together (see compile.mesh.barrier)
            from compile.mesh import barrier

            barrier("ling_jax:load")
        t0 = time.perf_counter()
        if a.random_weights or not os.path.isdir(a.model_path):
            with tqdm(total=1, desc="random init", unit="model", file=sys.stderr) as bar:
                params = init_params(cfg, a.seed, dtype, shardings, a.quantization)  # fp8: drawn in fp8
                jax.block_until_ready(params)
                bar.update()
        else:
            with tqdm(total=len(array_spec(cfg)), desc="loading weights", unit="tensor", file=sys.stderr) as bar:
                params = load_params(cfg, a.model_path, dtype=dtype, shardings=shardings,
                                     progress=lambda i, n: bar.update(i - bar.n), quantization=a.quantization)
                jax.block_until_ready(params)
        logging.info("weights ready in %.1f s", time.perf_counter() - t0)
        if a.nnodes > 1:
            barrier("ling_jax:weights_ready")
        from ling_jax.model import Numerics, RuntimeOptions
        from ling_jax.spec import deterministic_rows

        from ling_jax.weights import fp8_activations_note

        rows = deterministic_rows(spec.draft_tokens) if a.enable_deterministic_inference else None
        logging.info(fp8_activations_note(a.model_path, a.quantization, a.fp8_activations))
        numerics = Numerics(target_rows=rows, fp8_activations=a.fp8_activations)
        kw = dict(spec=spec, max_len=context_length, dtype=dtype,
                  opts=RuntimeOptions(numerics=numerics), chunked_prefill_size=chunk_size(a),
                  decode_steps=decode_steps(a))
        if spec.is_dspark:
            from ling_jax import dspark
            from ling_jax.generate import load_draft

            kw["draft"] = load_draft(dspark.load_config(spec.draft_model_path), spec, dtype)
        if mesh is None:
            gen = Generator(cfg, params, **kw)
        else:
            from compile.runner import ShardedGenerator

            gen = ShardedGenerator(cfg, params, mesh, **kw)
        if a.nnodes > 1 and a.node_rank == 0:
            from serve.lockstep import LockstepGenerator

            gen = LockstepGenerator(gen)
        if max_running(a) > 1:
            from ling_jax.batching import BatchGenerator

            gen = BatchGenerator(gen, max_running(a))  # the slots' memory is allocated here
        if loaded is not None:
            loaded.append(gen)
        if not warm:
            return gen, None
        eos = (tokenizer.eos_ids if tokenizer is not None else ()) or (cfg.eos_token_id,)
        limits = ModelLimits(served_name(a), cfg.vocab_size, context_length,
                             gen.reserved_rows, tokenizer, tuple(eos))
        t1 = time.perf_counter()
        steps = 2 + len(getattr(gen, "row_buckets", (1,))) - 1
        with tqdm(total=steps, desc="compile + warm-up (greedy, sampled, row buckets)", unit="program",
                  file=sys.stderr) as bar:
            warmup(gen, limits, progress=bar.update)
        logging.info("compiled and warm in %.1f s", time.perf_counter() - t1)
        return gen, limits

    return load


def served_name(a: argparse.Namespace) -> str:
    """The model id: --served-model-name, else the model dir's last component (a clean name, not a path)."""
    return a.served_model_name or os.path.basename(os.path.normpath(a.model_path))


class _Terminated(Exception):
    """SIGTERM, raised in the main thread (as SIGINT raises KeyboardInterrupt)."""


def _terminated(sig, frame):
    raise _Terminated


def make_server(config, serving):
    """A uvicorn.Server whose exit signal first ends the requests in flight (server.AppState.begin_shutdown):
    uvicorn alone would wait for open streams up to its graceful timeout, then cut them without a last event."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            serving.begin_shutdown_threadsafe()
            super().handle_exit(sig, frame)

    return Server(config)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    import uvicorn

    from ling_jax.config import load_config
    from ling_jax.tokenizer import load_tokenizer
    from serve.http_io import ServeOptions
    from serve.server import create_app

    try:
        from ling_jax.generate import speculative_config

        spec, dcfg = speculative_config(a)
        cfg = load_config(a.model_path)
        if dcfg is not None:
            dcfg.check_target(cfg)
            if a.tp_size > 1 or a.nnodes > 1:
                raise ValueError("--speculative-algorithm DSPARK runs on one device (--tp-size 1, --nnodes 1)")
        if spec.is_nextn and not cfg.mtp_layers:
            raise ValueError(f"{a.model_path} has no MTP layer: --speculative-algorithm NEXTN needs one")
        tokenizer = load_tokenizer(a.model_path) if os.path.isdir(a.model_path) else None
        check_checkpoint(a, cfg)
        chunk_size(a)  # checks the flags before anything loads
        max_running(a)  # (and --num-continuous-decode-steps with it)
        opts = ServeOptions(api_key=a.api_key, random_seed=a.random_seed, max_queued_requests=a.max_queued_requests,
                            request_timeout_s=a.request_timeout, body_timeout_s=a.body_timeout)
        init_multi_host(a)
        mesh, shardings = tensor_parallel(cfg, a.tp_size, multi_host=a.nnodes > 1)
        context_length = a.context_length or memory_context_length(a, cfg, spec, dcfg)
        least = 2 * decode_steps(a) * spec.draft_tokens + 5  # warm-up: a 4-token prompt, 1 new token, 2 dispatches
        if context_length < least:
            raise ValueError(f"--context-length {context_length} is too small (at least {least})")
        budget = memory_budget(a, cfg, spec, context_length, dcfg)
    except (ValueError, KeyError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.node_rank > 0:
        return run_follower(a, cfg, spec, tokenizer, mesh, shardings, context_length)
    name = served_name(a)
    server_args = {k: v for k, v in vars(a).items() if k != "api_key"}
    import jax

    if spec.enabled:  # the resolved values (DSPARK: gamma from the draft's config.json)
        server_args.update(speculative_num_steps=spec.num_steps, speculative_num_draft_tokens=spec.draft_tokens,
                           speculative_eagle_topk=1)
    server_args.update(served_model_name=name, tokenizer_path=a.model_path if tokenizer is not None else None,
                       context_length=context_length, chunked_prefill_size=chunk_size(a), vocab_size=cfg.vocab_size,
                       max_running_requests=max_running(a), num_continuous_decode_steps=decode_steps(a),
                       memory_budget=budget,
                       jax_version=jax.__version__,
                       device=f"{jax.device_count()}x {jax.devices()[0].device_kind}",
                       has_tokenizer=tokenizer is not None, chat_template=bool(tokenizer and tokenizer.chat_template))
    if tokenizer is None:
        logging.warning("no tokenizer.json in %s: only token ids work (/generate input_ids, completions with a "
                        "list-of-ints prompt)", a.model_path)
    server: uvicorn.Server | None = None
    failed: list[str] = []

    def on_load_error(msg: str):
        failed.append(msg)
        server.should_exit = True

    loaded: list = []
    app = create_app(server_args, make_loader(a, cfg, spec, tokenizer, mesh, shardings, context_length,
                                              loaded=loaded),
                     served_model_name=name, opts=opts, on_load_error=on_load_error,
                     on_shutdown=(lambda: loaded and loaded[0].shutdown()) if a.nnodes > 1 else None)
    server = make_server(uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level.lower(),
                                        timeout_graceful_shutdown=5), app.state.serving)
    # uvicorn re-raises the SIGINT / SIGTERM it handled once the app's shutdown ran: both end here, exit 0
    signal.signal(signal.SIGTERM, _terminated)
    try:
        server.run()
    except (KeyboardInterrupt, _Terminated):
        pass
    if failed:
        print(f"error: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def run_follower(a: argparse.Namespace, cfg, spec, tokenizer, mesh, shardings, context_length: int) -> int:
    """Process node_rank > 0: load this process's shards, then replay the leader's streams until it stops."""
    from serve.lockstep import follow

    gen, _ = make_loader(a, cfg, spec, tokenizer, mesh, shardings, context_length, warm=False)()
    logging.info("follower %d ready", a.node_rank)
    n = follow(gen)
    logging.info("follower %d done after %d streams", a.node_rank, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
