"""bench_step --routing-from reads the distinct-expert means of an earlier run's step rows and skips its other rows
(a TTFT row has no routing: the 2026-12-02 fp8 run's JSON made the reuse fail with a KeyError)."""

import json

from bench.bench_step import routing_from
from ling_jax.config import get_preset


def test_routing_from_skips_rows_without_routing(tmp_path):
    cfg = get_preset("test-tiny")
    n_moe = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    rows = [{"name": "plain decode step", "distinct_experts_per_router_call": [4, 6] + [5] * (n_moe - 2)},
            {"name": "NEXTN step (steps=2, 3 verify rows)", "distinct_experts_per_router_call": [3.0, 7.0, 9.0, 2.0]},
            {"name": "TTFT prompt 8192, chunk 1024", "ttft_ms": 3575.6}]
    path = tmp_path / "step.json"
    path.write_text(json.dumps({"rows": rows}))
    plain = routing_from(str(path), cfg, "plain", 0)
    assert len(plain) == n_moe and all(abs(x - (4 + 6 + 5 * (n_moe - 2)) / n_moe) < 1e-9 for x in plain)
    # NEXTN: the draft passes as recorded, the verify pass at the mean of the middle ones, the extend pass last
    assert routing_from(str(path), cfg, "nextn", 2) == [3.0] + [8.0] * n_moe + [2.0]
