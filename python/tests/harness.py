"""Runs test scenarios as real processes, one per rank.

``run(scenario, nranks)`` starts ``python workers.py <scenario> <rank>
<nranks> <spec>`` for every rank, waits for all of them (bounded), kills the
lot on a timeout, and returns each rank's result: the JSON object the
scenario returned (printed on a ``RESULT:`` line). A rank that raises exits
non-zero and the test fails with its output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers.py"


@dataclass
class Rank:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    result: dict | None = None
    pid: int = 0


@dataclass
class Run:
    ranks: list[Rank] = field(default_factory=list)
    elapsed: float = 0.0

    def results(self) -> list[dict]:
        return [r.result or {} for r in self.ranks]

    def report(self) -> str:
        out = []
        for r in self.ranks:
            out.append(f"--- rank {r.rank} (pid {r.pid}) exit {r.returncode}")
            out.append(r.stdout[-4000:])
            out.append(r.stderr[-6000:])
        return "\n".join(out)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    scenario: str,
    nranks: int,
    *,
    timeout: float = 120.0,
    env: dict[str, str | None] | None = None,
    spec: dict | None = None,
    uid: bool = True,
    check: bool = True,
    allow_fail: set[int] | None = None,
) -> Run:
    """Run `scenario` on `nranks` processes.

    With ``uid`` the harness creates a braid unique id (this process hosts
    the rendezvous) and passes its text to the ranks; ``spec`` is passed as
    JSON. ``check`` fails the test unless every rank (other than those in
    ``allow_fail``) exited 0 with a result. ``env`` adds to this
    process's environment; a variable mapped to None is left out.
    """
    import braid

    spec = dict(spec or {})
    tmp = tempfile.mkdtemp(prefix="braid-pytest-")
    spec.setdefault("tmp", tmp)
    holder = None
    if uid:
        holder = braid.UniqueId.create(timeout=timeout)
        spec["uid"] = str(holder)
    penv = dict(os.environ)
    penv.setdefault("BRAID_TIMEOUT", "60")
    penv["PYTHONUNBUFFERED"] = "1"
    penv.pop("BRAID_DEBUG", None)
    for k, v in (env or {}).items():
        if v is None:
            penv.pop(k, None)
        else:
            penv[k] = v
    procs = []
    t0 = time.monotonic()
    for r in range(nranks):
        p = subprocess.Popen(
            [sys.executable, str(WORKERS), scenario, str(r), str(nranks), json.dumps(spec)],
            cwd=str(HERE),
            env=penv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        procs.append(p)
    out = Run()
    deadline = t0 + timeout
    outs: list[tuple[str, str, int | None]] = []
    for p in procs:
        left = max(0.1, deadline - time.monotonic())
        try:
            so, se = p.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            for q in procs:
                _kill(q)
            so, se = p.communicate()
            se += f"\n[harness] killed after the {timeout}s timeout"
        outs.append((so, se, p.returncode))
    out.elapsed = time.monotonic() - t0
    for r, (p, (so, se, rc)) in enumerate(zip(procs, outs)):
        res = None
        for line in so.splitlines():
            if line.startswith("RESULT:"):
                res = json.loads(line[len("RESULT:") :])
        out.ranks.append(Rank(r, rc, so, se, res, p.pid))
    del holder
    if check:
        bad = [
            x
            for x in out.ranks
            if x.rank not in (allow_fail or set()) and (x.returncode != 0 or x.result is None)
        ]
        assert not bad, f"ranks {[x.rank for x in bad]} failed:\n{out.report()}"
    return out


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def shm_left(pids: list[int]) -> list[str]:
    """braid's shared-memory segments in /dev/shm created by these pids."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    prefixes = tuple(f"braid-{pid}-" for pid in pids)
    return [n for n in names if n.startswith(prefixes)]
