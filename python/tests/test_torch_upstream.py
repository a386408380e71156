"""PyTorch's own distributed tests on the "braid" backend.

torch.testing._internal.distributed.distributed_test.DistributedTest (the
suite behind PyTorch's test/distributed/test_distributed_spawn.py, shipped in
the wheel) accepts a plugin backend: upstream_dist.py adds "braid" to its
"plugin", "ddp" and "subgroup" feature sets and runs it with BACKEND=braid,
WORLD_SIZE=2. Every test spawns its ranks and imports torch in each (about
10 s a test on 2 cores), so CI runs this selection; upstream_dist.py runs
any other test by hand (docs/python.md says which ran and passed).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")

HERE = Path(__file__).resolve().parent

SELECTION = [
    "test_all_reduce_sum_async",
    "test_broadcast",
    "test_send_recv",
    "test_send_recv_any_source",
    "test_send_recv_any_source_autograd_profiler",
    "test_send_recv_any_source_torch_profiler",
    "test_DistributedDataParallelCPU",
]


def run_upstream(names: list[str], timeout: float) -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="braid-upstream-") as tmp:
        env = dict(os.environ, BACKEND="braid", WORLD_SIZE="2", TEMP_DIR=tmp, OMP_NUM_THREADS="1")
        env.pop("CI", None)  # torch's run_tests() needs xmlrunner when CI is set
        args = [f"TestBraidDistributed.{n}" for n in names]
        p = subprocess.run(
            [sys.executable, str(HERE / "upstream_dist.py"), "-v", *args],
            cwd=str(HERE), env=env, capture_output=True, text=True, timeout=timeout,
        )
    out = p.stdout + p.stderr
    # "test_x (__main__.TestBraidDistributed.test_x) ... " then the ranks'
    # log lines, then "ok" / "skipped '...'" / "FAIL" / "ERROR".
    heads = list(re.finditer(r"^(test_\w+) \(__main__\.TestBraidDistributed\.\w+\) \.\.\. ", out, re.M))
    status = {}
    for i, m in enumerate(heads):
        seg = out[m.end() : heads[i + 1].start() if i + 1 < len(heads) else len(out)]
        found = re.search(r"(?m)^(ok|FAIL|ERROR)$|^(skipped (?:'[^']*'|\"[^\"]*\"))", seg) or re.search(
            r"(?m)(ok|FAIL|ERROR)$|(skipped (?:'[^']*'|\"[^\"]*\"))", seg
        )
        status[m.group(1)] = (found.group(1) or found.group(2)) if found else "?"
    if p.returncode != 0 or len(status) != len(names):
        raise AssertionError(f"upstream tests: exit {p.returncode}, {status}\n{out[-8000:]}")
    return status


def test_pytorch_distributed_test_selection():
    status = run_upstream(SELECTION, timeout=900)
    assert all(v == "ok" for v in status.values()), status


if __name__ == "__main__":
    # python test_torch_upstream.py test_a test_b ...   (or @file with names)
    names = []
    for a in sys.argv[1:]:
        names += Path(a[1:]).read_text().split() if a.startswith("@") else [a]
    for start in range(0, len(names), 10):
        chunk = names[start : start + 10]
        try:
            st = run_upstream(chunk, timeout=3600)
        except AssertionError as e:
            print(str(e)[:3000], flush=True)
            continue
        for n, v in st.items():
            print(f"{v[:60]:<60} {n}", flush=True)
