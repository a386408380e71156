"""Runs ``torchft_train.py`` with torchft's lighthouse and two replica
groups (one process each) on one backend; replica group 1 kills itself at
step KILL_AT and is started again, as a job scheduler would. Prints one
JSON line: the exit codes, and the time from the kill to the survivor's
commit of the step the victim died in (and from the restarted process's
Manager to that commit). The final parameters are in OUT/params{0,1}.pt."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(backend: str, steps: int, kill_at: int, out: str, timeout: float = 120.0) -> dict:
    lh_port = free_port()
    lighthouse = shutil.which("torchft_lighthouse") or str(
        Path(sys.executable).parent / "torchft_lighthouse"
    )
    lh = subprocess.Popen(
        [lighthouse, "--min_replicas", "2", "--quorum_tick_ms", "100",
         "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "1000",
         "--bind", f"127.0.0.1:{lh_port}"],
        stdout=open(os.path.join(out, "lighthouse.txt"), "w"), stderr=subprocess.STDOUT,
    )
    env = dict(os.environ)
    env.update({
        "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lh_port}",
        "MASTER_ADDR": "127.0.0.1",
        "BACKEND": backend,
        "STEPS": str(steps),
        "KILL_AT": str(kill_at),
        "OUT": out,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("RESTARTED", None)

    def start(replica: int, restarted: bool) -> subprocess.Popen:
        e = dict(env, REPLICA_GROUP_ID=str(replica), MASTER_PORT=str(free_port()))
        if restarted:
            e["RESTARTED"] = "1"
        log = open(os.path.join(out, f"log{replica}{'r' if restarted else ''}.txt"), "w")
        return subprocess.Popen([sys.executable, str(HERE / "torchft_train.py")], env=e,
                                stdout=log, stderr=subprocess.STDOUT)

    procs = {0: start(0, False), 1: start(1, False)}
    restarted = False
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < timeout:
            codes = {r: p.poll() for r, p in procs.items()}
            if codes[1] is not None and codes[1] != 0 and not restarted:
                procs[1] = start(1, True)  # the scheduler restarts the group
                restarted = True
                continue
            if all(c is not None for c in codes.values()):
                break
            time.sleep(0.05)
        codes = {r: p.poll() for r, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        lh.kill()
        lh.wait()
    res: dict = {"codes": codes, "restarted": restarted}
    killed = os.path.join(out, "killed")
    commits = os.path.join(out, "commits0.json")
    if os.path.exists(killed) and os.path.exists(commits):
        t_kill = float(open(killed).read())
        # The survivor's commit of the step the victim died in.
        after = [t for s, t in json.load(open(commits)) if s >= kill_at and t > t_kill]
        res["recovery_s"] = (after[0] - t_kill) if after else None
        # Most of that is starting Python and torch again: from the new
        # process's Manager to the commit is the part the backend is in.
        rejoined = os.path.join(out, "rejoined")
        if after and os.path.exists(rejoined):
            res["from_rejoin_s"] = after[0] - float(open(rejoined).read())
    return res


def main() -> None:
    backend, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = sys.argv[4] if len(sys.argv) > 4 else tempfile.mkdtemp(prefix=f"torchft-{backend}-")
    os.makedirs(out, exist_ok=True)
    res = run(backend, steps, kill_at, out)
    res["out"] = out
    print(json.dumps(res))


if __name__ == "__main__":
    main()
