"""torchft on braid: its own test of native process-group reconfiguration
(resize and recover) with the backend "braid", and its DDP training example
(torchft_train.py) with a replica group killed mid-step and restarted, whose
final parameters must equal the same run's on gloo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchft")
pytest.importorskip("parameterized")  # torchft's test module imports it

HERE = Path(__file__).resolve().parent
ENV = dict(os.environ, OMP_NUM_THREADS="1")

RESIZE = """
import braid.torch, sys
import torch.distributed as dist, torch.multiprocessing as mp
from torchft.reconfigure_test import _resize_worker
if __name__ == "__main__":
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    mp.spawn(_resize_worker, args=(store.port, sys.argv[1]), nprocs=3)
    print("ok")
"""


@pytest.mark.parametrize("backend", ["braid", "gloo"])
def test_torchft_native_resize_and_recover(backend):
    # torchft's reconfigure_test: members [0,1,2], [2,0], [1,2,0], each
    # all_reduce checked, then abort and reconfigure again.
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(RESIZE)
    try:
        p = subprocess.run([sys.executable, f.name, backend], env=ENV, capture_output=True,
                           text=True, timeout=240)
    finally:
        os.unlink(f.name)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-3000:] + p.stderr[-5000:]


def _train(backend, out):
    p = subprocess.run([sys.executable, str(HERE / "torchft_run.py"), backend, "20", "8", out],
                       env=ENV, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    logs = "".join(open(os.path.join(out, f)).read()[-3000:]
                   for f in sorted(os.listdir(out)) if f.startswith("log"))
    assert res["codes"] == {"0": 0, "1": 0} and res["restarted"], (res, logs)
    assert res.get("recovery_s") is not None, (res, logs)
    return res


def test_torchft_ddp_example_kill_and_restart_matches_gloo():
    import torch

    outs = {b: tempfile.mkdtemp(prefix=f"braid-torchft-{b}-") for b in ("braid", "gloo")}
    try:
        res = {"braid": _train("braid", outs["braid"])}
        # The reference gets a second try: once in CI (2026-12-07) a gloo
        # replica ended with SIGABRT ("terminate called without an active
        # exception", a thread of torchft's or gloo's destroyed joinable at
        # exit) after its last commit. braid's run gets one try.
        try:
            res["gloo"] = _train("gloo", outs["gloo"])
        except AssertionError as e:
            print(f"gloo's reference run failed, running it again: {str(e)[-2000:]}")
            shutil.rmtree(outs["gloo"], ignore_errors=True)
            outs["gloo"] = tempfile.mkdtemp(prefix="braid-torchft-gloo-")
            res["gloo"] = _train("gloo", outs["gloo"])
        params = {b: [torch.load(os.path.join(outs[b], f"params{r}.pt")) for r in (0, 1)]
                  for b in outs}
    finally:
        for o in outs.values():
            shutil.rmtree(o, ignore_errors=True)
    for b in outs:
        # The restarted replica group healed from the survivor: both end equal.
        assert torch.equal(params[b][0], params[b][1]), b
    assert torch.equal(params["braid"][0], params["gloo"][0])
    print("torchft recovery (kill -> survivor's commit of that step; from the restarted "
          f"process's Manager): {json.dumps(res)}")
