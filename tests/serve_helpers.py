"""Helpers for the serving tests: a tiny model dir with a trained byte-level BPE tokenizer, and the real server
(`python -m serve.launch_server`) as a subprocess on loopback.

Every server the tests start uses the same shapes (MODEL_CFG: test-tiny's first 3 layers, float32, context 512, NEXTN
3 steps, batch 1 unless a test asks for slots: tests/test_serve_batching.py) and one persistent JAX compilation
cache, so only the first start of a session compiles.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from compile.stages import slice_config
from ling_jax.config import get_preset, to_hf_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_DIR = os.path.join(tempfile.gettempdir(), "ling-jax-test-jit-cache")   # the suite's too: tests/conftest.py
SERVER_FLAGS = ["--dtype", "float32", "--context-length", "512", "--speculative-algorithm", "NEXTN",
                "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
                "--max-running-requests", "1"]  # batch 1: the batching tests ask for slots themselves
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = """The quick brown fox jumps over the lazy dog. A tiny model speaks in random tokens, yet the server must
cut its text exactly where a stop string begins. def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)
Speculative decoding drafts several tokens and verifies them in one forward pass of the target model.
"""

# test-tiny's first 3 layers (KDA + dense, KDA + MoE, MLA + MoE, then the MTP layer): every layer kind, and each
# server start compiles about half of test-tiny's 6 layers. eos = the tokenizer's <|endoftext|>, id 0.
MODEL_CFG = slice_config(get_preset("test-tiny"), 3).replace(eos_token_id=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model_dir(path: str, tokenizer: bool = True) -> str:
    """MODEL_CFG's config.json and (unless tokenizer=False: a checkpoint dir without one) a byte-level BPE tokenizer
    trained on a few KB of text (vocab 320 <= 512), with a chat template. Weights: the server's --random-weights."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**to_hf_dict(MODEL_CFG), "torch_dtype": "float32"}, f)
    if tokenizer:
        _write_tokenizer(path)
    return path


def _write_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 20, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    assert tok.get_vocab_size() <= MODEL_CFG.vocab_size
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}, f)


class Server:
    """`python -m serve.launch_server ...` on 127.0.0.1:<free port>; `url`, `log()` (its stderr+stdout so far)."""

    def __init__(self, model_path: str, log_path: str, *extra: str, timeout_s: float = 600, env: dict | None = None,
                 wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_path = model_path
        self.log_path = log_path
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=CACHE_DIR,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                   PYTHONUNBUFFERED="1", **(env or {}))
        cmd = [sys.executable, "-m", "serve.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
               "--port", str(self.port), *SERVER_FLAGS, *extra]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.saw_503 = False
        if not wait:  # a multi-host follower: it never serves HTTP
            return
        try:
            self._wait(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout_s: float):
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    return
                self.saw_503 |= r.status_code == 503
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
