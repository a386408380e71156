"""torch.distributed on braid across emulated nodes, launched with torchrun as
users launch multi-node jobs: each node is a network, UTS, mount and pid
namespace with its own share of the CPUs (braid._nodes), so the nodes talk
TCP and share no memory. Needs root, iproute2 and util-linux; skipped (and
says why) without them.

DDP and FSDP2 training on braid end with the parameters gloo gives on the
same data (bit for bit on 2 ranks; on 4 the summation orders differ), and
`python -m braid.bench --train` runs its whole table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("torch")

from braid._nodes import unavailable  # noqa: E402

why = unavailable()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")


def _spec(kinds: list[str], steps: int) -> dict:
    return {
        "width": 128,
        "depth": 3,
        "inputs": 256,
        "batch": 16,
        "bucket_mb": 0.1,  # several buckets: the backward overlaps them
        "steps": steps,
        "warmup": 2,
        "threads": 0,
        "kinds": kinds,
    }


@pytest.mark.parametrize("per_node", [2, 1])
def test_torchrun_two_nodes_ddp_and_fsdp2_match_gloo(per_node):
    from braid._train import Config, run_one

    cfg = Config(f"2 nodes x {per_node}", 2, per_node)
    res = run_one(cfg, _spec(["ddp", "fsdp"], 6), timeout=300)
    assert res["nranks"] == 2 * per_node, res
    for kind in ("ddp", "fsdp"):
        r = res["kinds"][kind]
        assert len(r["braid_s"]) == 6 and all(t > 0 for t in r["braid_s"]), r
        if per_node == 1:
            # Two summands: every summation order gives the same bits.
            assert r["max_diff"] == 0.0, (kind, r)
        else:
            # Four, added in another order than gloo's (float32 rounding).
            assert r["max_diff"] < 1e-6, (kind, r)


def test_bench_train_mode_prints_its_table():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t.json")
        p = subprocess.run(
            [sys.executable, "-m", "braid.bench", "--train", "--np", "2", "--per-node", "1",
             "--rounds", "1", "--steps", "3", "--warmup", "1", "--width", "64", "--depth", "2",
             "--json", out],
            capture_output=True, text=True, timeout=600,
        )
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        rows = json.load(open(out))["rows"]
        got = {(r["config"], r["kind"]) for r in rows}
        assert got == {(c, k) for c in ("1 host x 2", "2 nodes x 1") for k in ("ddp", "fsdp")}, got
        for r in rows:
            assert r["braid_ms"] > 0 and r["gloo_ms"] > 0 and r["alone_ms"] > 0, r
            assert r["max_diff"] == 0.0, r
        assert "2 nodes x 1" in p.stdout and "ddp" in p.stdout, p.stdout
