"""The torch.distributed backend "braid" across real processes: every call
against gloo on the same inputs, async Work, subgroups, DDP and FSDP2
training against gloo, a killed rank, shrink_group and the reconfigure
API."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("torch")

from harness import run, shm_left  # noqa: E402

TORCH_ENV = {"OMP_NUM_THREADS": "1"}  # as torchrun sets it


@pytest.mark.parametrize("nranks", [2, 3])
def test_every_call_against_gloo(nranks):
    r = run("torch_vs_gloo", nranks, uid=False, env=TORCH_ENV, timeout=300)
    for res in r.results():
        # 8 dtypes x 4 ops x 4 reducing calls, movement, objects, p2p,
        # coalescing, barrier, AVG/PREMUL_SUM, bool, subgroups, futures.
        assert len(res["checked"]) >= 150, res
        assert res["gloo_refused"] == [], res


@pytest.mark.parametrize("nranks", [2, 4])
def test_ddp_training_matches_gloo(nranks):
    r = run("torch_ddp", nranks, uid=False, env=TORCH_ENV, spec={"steps": 20}, timeout=300)
    for res in r.results():
        assert res["ranks_agree"], res
        if nranks == 2:
            # Two summands: every summation order gives the same bits.
            assert res["equal"], res
        else:
            # Four: gloo and braid add in different orders (float32 rounding).
            assert res["max_diff"] < 1e-6, res


def test_fsdp2_fully_shard_step_matches_gloo():
    r = run("torch_fsdp2", 2, uid=False, env=TORCH_ENV, timeout=300)
    for res in r.results():
        assert res["nparams"] == 6 and res["max_diff"] == 0.0, res


def test_killed_rank_raises_naming_it():
    t0 = time.monotonic()
    r = run("torch_kill", 3, uid=False, env=TORCH_ENV, spec={"timeout": 10},
            allow_fail={2}, timeout=120)
    assert r.ranks[2].returncode == -signal.SIGKILL
    for res in r.results()[:2]:
        assert res["type"] == "PeerFailedError", res
        assert "with rank 2: process" in res["msg"], res
        assert res["t_err"] - t0 < 60, res
    assert shm_left([x.pid for x in r.ranks]) == []


def test_killed_rank_ends_receives_from_it_and_from_any_rank():
    t0 = time.monotonic()
    r = run("torch_p2p_kill", 3, uid=False, env=TORCH_ENV, spec={"timeout": 20},
            allow_fail={2}, timeout=120)
    assert r.ranks[2].returncode == -signal.SIGKILL
    for res in r.results()[:2]:
        assert res["type"] == "PeerFailedError", res
        assert "rank 2" in res["msg"], res
        # Found dead, not timed out.
        assert res["t_err"] - t0 < 60 and "timed out" not in res["msg"], res
    assert shm_left([x.pid for x in r.ranks]) == []


def test_reconfigure_api_against_gloo():
    # enable_reconfigure=True, handles through a store, _reconfigure on all
    # three ranks, then on two: the same sums, sizes and ranks as gloo's.
    r = run("torch_reconfigure", 3, uid=False, env=TORCH_ENV, timeout=300)
    for rank, res in enumerate(r.results()):
        assert res["braid"]["supports"] and res["gloo"]["supports"], res
        assert res["braid"]["sums"] == res["gloo"]["sums"], res
        want = [[6.0, 3, rank]] + ([[3.0, 2, rank]] if rank < 2 else [])
        assert res["braid"]["sums"] == want, res


def test_shrink_group_after_a_rank_died():
    # torch.distributed.shrink_group on braid after the last rank was killed
    # in the middle of all_reduces; the survivors' sums are checked.
    r = run("torch_shrink_group", 4, uid=False, env=TORCH_ENV, allow_fail={3}, timeout=300)
    assert r.ranks[3].returncode == -signal.SIGKILL
    for rank, res in enumerate(r.results()[:3]):
        assert res["error"] is not None and res["equal"], res
        assert (res["size"], res["rank"], res["default"]) == (3, rank, 3), res
    assert shm_left([x.pid for x in r.ranks]) == []


def test_bench_runs():
    # A smoke run of python -m braid.bench (the real run is by hand).
    import json
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "b.json")
        p = subprocess.run(
            [sys.executable, "-m", "braid.bench", "--np", "2", "-b", "8", "-e", "4K", "-f", "512",
             "--scale", "0.01", "--ddp-steps", "2", "--json", out],
            capture_output=True, text=True, timeout=300, env=dict(os.environ, **TORCH_ENV),
        )
        assert p.returncode == 0, p.stdout + p.stderr
        assert "torch.distributed.all_to_all_single, 2 ranks" in p.stdout, p.stdout
        res = json.load(open(out))
        rows = res[0]["colls"]["all_reduce"]
        assert [r["bytes"] for r in rows] == [8, 4096]
        assert all(r["braid_us"] > 0 and r["gloo_us"] > 0 for r in rows)
        assert res[0]["ddp"]
        # Time-based batches (the default under --load): each of braid's and
        # gloo's batches lasts about 0.1 s, so one size takes at least 0.2 s.
        t0 = time.monotonic()
        p = subprocess.run(
            [sys.executable, "-m", "braid.bench", "--np", "2", "-b", "8", "-e", "8", "--rounds", "1",
             "--duration", "0.1", "-c", "all_reduce", "--ddp-steps", "0", "--json", out],
            capture_output=True, text=True, timeout=300, env=dict(os.environ, **TORCH_ENV),
        )
        assert p.returncode == 0, p.stdout + p.stderr
        assert "# each batch timed for about 0.1 s" in p.stdout, p.stdout
        rows = json.load(open(out))[0]["colls"]["all_reduce"]
        assert [r["bytes"] for r in rows] == [8] and rows[0]["braid_us"] > 0, rows
        assert time.monotonic() - t0 >= 0.2
        p = subprocess.run(
            [sys.executable, "-m", "braid.bench", "--api", "--np", "2", "-b", "8", "-e", "8", "--scale", "0.01"],
            capture_output=True, text=True, timeout=120,
        )
        assert p.returncode == 0 and "       8" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("nranks", [2, 3])
def test_tags_and_any_source_against_gloo(nranks):
    r = run("torch_p2p_tags", nranks, uid=False, env=TORCH_ENV, timeout=300)
    for res in r.results():
        assert len(res["checked"]) == 4 and res["gloo_refused"] == [], res


@pytest.mark.parametrize("nranks", [2, 3])
def test_sparse_all_reduce_and_ddp_against_gloo(nranks):
    r = run("torch_sparse", nranks, uid=False, env=TORCH_ENV, timeout=300)
    for res in r.results():
        assert res["gloo_refused"] == [] and len(res["checked"]) == 4 + (2 if nranks == 2 else 1), res
        # Bit-identical parameters, and training moved them.
        assert all(d == 0.0 for d in res["ddp_diffs"].values()), res
        assert res["moved"] > 0, res


def test_split_sizes_of_any_sequence_and_precise_messages():
    r = run("torch_args", 2, uid=False, env=TORCH_ENV, timeout=300)
    for res in r.results():
        assert len(res["checked"]) == 6, res
        m = res["msgs"]
        assert "must hold ints" in m["float split sizes"], m
        assert "negative" in m["negative split size"], m
        for k, v in m.items():
            if k.startswith("sparse"):
                assert "sparse" in v and "contiguous" not in v, (k, v)
            if k.startswith("meta"):
                assert "meta tensor" in v and "CUDA tensor" not in v, (k, v)
        assert "not contiguous" in m["transposed all_reduce"], m
        assert "BAND" in m["BAND all_reduce of float"], m


def test_init_warns_when_torch_threads_oversubscribe_the_cpus():
    # Neither OMP_NUM_THREADS nor OMP_WAIT_POLICY.
    env = {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None}
    r = run("torch_threads", 2, uid=False, env=env, timeout=300)
    for res in r.results():
        cpus = res["cpus"]
        # Two unbound ranks on this host share its CPUs.
        assert res["share"] == [2, cpus], res
        # max(2, cpus) threads each: more than cpus // 2, said once.
        assert len(res["said"]) == 1, res
        msg = res["said"][0]
        assert f"2 ranks of this host share {cpus} CPUs" in msg, msg
        assert f"OMP_NUM_THREADS={max(1, cpus // 2)}" in msg, msg
        assert res["again"] == msg, res
        # One thread each fits any host of 2 or more CPUs; a user's
        # OpenMP settings are theirs.
        if cpus >= 2:
            assert res["one thread"] is None, res
        assert res["OMP_NUM_THREADS"] is None and res["OMP_WAIT_POLICY"] is None, res
