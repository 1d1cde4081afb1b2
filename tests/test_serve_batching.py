"""Continuous batching through the real server (subprocess, test-tiny, NEXTN 3 steps, deterministic inference,
--max-running-requests 4): concurrent requests give what each gives alone, greedy and seeded; a request aborted
mid-flight, or joining and leaving, changes nothing for the others; nothing lingers in a reused slot; the server
reports its memory budget and refuses slots that do not fit; with --num-continuous-decode-steps 2 concurrent
replies equal the N = 1 server's."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest

from tests.serve_helpers import ROOT, SERVER_FLAGS, Server, make_model_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-batching")
    srv = Server(make_model_dir(str(d / "model")), str(d / "server.log"), "--random-weights", "--seed", "3",
                 "--enable-deterministic-inference", "--max-running-requests", "4", timeout_s=1200)  # its first start compiles every row bucket
    yield srv
    srv.stop()


def _body(i: int, sampled: bool = False, n: int = 12, **extra) -> dict:
    sp = {"max_new_tokens": n + i, "temperature": 0.9 if sampled else 0.0, "ignore_eos": True}
    if sampled:
        sp.update(seed=100 + i, top_p=0.95, top_k=50)
    return {"input_ids": [3 + (7 * i + j) % 300 for j in range(4 + 3 * i)], "sampling_params": sp, **extra}


def _generate(server, body) -> dict:
    r = httpx.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _together(server, bodies) -> list[dict]:
    out = [None] * len(bodies)

    def one(i):
        out[i] = _generate(server, bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return out


def test_concurrent_requests_equal_one_at_a_time(server):
    bodies = [_body(i) for i in range(6)] + [_body(i, sampled=True) for i in range(2)]  # 8 requests, 4 slots
    alone = [_generate(server, b)["output_ids"] for b in bodies]
    together = _together(server, bodies)
    assert [r["output_ids"] for r in together] == alone
    assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in together)
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert info["max_running_requests"] == 4
    budget = info["memory_budget"]
    assert budget["rows"] == 4 + 2 + 1 and budget["context_length"] == 512  # re-form peak (buckets 4, 2) + staging
    assert 0 < budget["total_bytes"] <= budget["limit_bytes"]


def test_abort_and_join_mid_flight_change_nothing_for_the_others(server):
    bodies = [_body(i, n=40) for i in range(3)]
    alone = [_generate(server, b)["output_ids"] for b in bodies]
    victim = _body(5, n=200, rid="victim", stream=True)
    results: dict = {}

    def run_victim():
        with httpx.stream("POST", server.url + "/generate", json=victim, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and "[DONE]" not in line:
                    results["victim"] = line
                    if "aborter" not in results:
                        results["aborter"] = threading.Thread(target=lambda: httpx.post(
                            server.url + "/abort_request", json={"rid": "victim"}, timeout=30))
                        results["aborter"].start()

    v = threading.Thread(target=run_victim)
    v.start()
    together = _together(server, bodies)  # they join while the victim runs; it leaves while they run
    v.join(300)
    assert [r["output_ids"] for r in together] == alone
    assert '"abort"' in results["victim"]
    assert _generate(server, bodies[0])["output_ids"] == alone[0], "a reused slot changed a later request"


def test_slots_that_do_not_fit_are_refused():
    cmd = [sys.executable, "-m", "serve.launch_server", "--model-path", "test-tiny", *SERVER_FLAGS,
           "--context-length", str(2**26), "--max-running-requests", "64"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={"JAX_PLATFORMS": "cpu",
                       **{k: v for k, v in __import__("os").environ.items() if k != "JAX_PLATFORMS"}})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "97 request state rows x --context-length 67108864 do not fit" in r.stderr
    assert "lower --max-running-requests or --context-length" in r.stderr


@pytest.fixture(scope="module")
def steps_server(tmp_path_factory):
    """The same weights and flags, --num-continuous-decode-steps 2: every dispatch of the group runs 2 steps."""
    d = tmp_path_factory.mktemp("serve-batching-steps")
    srv = Server(make_model_dir(str(d / "model")), str(d / "server.log"), "--random-weights", "--seed", "3",
                 "--enable-deterministic-inference", "--max-running-requests", "2",
                 "--num-continuous-decode-steps", "2", timeout_s=1200)
    yield srv
    srv.stop()


def test_two_steps_per_dispatch_equal_one(server, steps_server):
    """Concurrent greedy requests (3 on 2 rows: a join into a dead position; max tokens not multiples of 2, one
    with a stop token inside its run) on the N = 2 batching server equal the N = 1 server's one-at-a-time replies:
    ids, text, finish reason, verify steps counted."""
    bodies = [_body(i, n=11) for i in range(3)]
    alone = [_generate(server, b) for b in bodies]
    stop = alone[1]["output_ids"][6]
    bodies[1]["sampling_params"]["stop_token_ids"] = [stop]
    alone[1] = _generate(server, bodies[1])
    assert alone[1]["meta_info"]["finish_reason"]["type"] == "stop"
    together = _together(steps_server, bodies)
    for a, b in zip(alone, together):
        assert (b["output_ids"], b["text"]) == (a["output_ids"], a["text"])
        for key in ("finish_reason", "completion_tokens", "spec_verify_ct"):
            assert b["meta_info"][key] == a["meta_info"][key], key
    info = httpx.get(steps_server.url + "/server_info", timeout=30).json()
    assert (info["max_running_requests"], info["num_continuous_decode_steps"]) == (2, 2)
