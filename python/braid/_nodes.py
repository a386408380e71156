"""Emulated nodes on one machine, as containers make them (root only).

Each node is a network namespace with its own UTS namespace (host name), mount
namespace (a private ``/dev/shm`` and ``/proc``) and pid namespace, joined to
the others by veth pairs through a bridge in the caller's namespace, and, as
a container's cpuset, its own share of this machine's CPUs (processes started
in it run on those only, so torch's default thread count is the node's CPU
count, not the machine's). A process
started in node ``i`` sees only that node's processes and shared memory, so
braid (and gloo) treat the nodes as separate hosts and talk over TCP between
them, as across real machines. Everything is removed on exit, and every
process started in a node ends with it (the node's pid namespace dies with
its first process).

    with EmulatedNodes(2) as nodes:
        p = nodes.popen(0, ["torchrun", "--nnodes", "2", ...])

Used by ``python -m braid.bench --train`` and the multi-node tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence

__all__ = ["EmulatedNodes", "unavailable"]


def unavailable() -> str | None:
    """Why emulated nodes cannot be made here, or None."""
    if os.geteuid() != 0:
        return "emulated nodes need root (network, mount, UTS and pid namespaces)"
    for tool in ("ip", "unshare", "nsenter", "taskset"):
        if shutil.which(tool) is None:
            return f"emulated nodes need `{tool}` (apt-get install iproute2 util-linux)"
    return None


def _run(*argv: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {r.stderr.strip()}")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _sweep_dead() -> None:
    """Removes the namespaces and bridges of emulated nodes whose creator
    died without cleaning up (their names carry its pid)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == "braid" and parts[2].startswith("n") and parts[1].isdigit():
            if not os.path.exists(f"/proc/{parts[1]}"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
                subprocess.run(["ip", "link", "del", f"bnb{parts[1]}"[:15]], capture_output=True)


class EmulatedNodes:
    """``n`` emulated nodes; ``addr(i)`` is node ``i``'s address, ``popen(i,
    argv)`` starts a process inside it."""

    def __init__(self, n: int, tag: str | None = None, split_cpus: bool = True) -> None:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        self.n = n
        # Node i's CPUs: an equal share of the ones this process may use
        # (all of them on every node when there are fewer CPUs than nodes).
        mine = sorted(os.sched_getaffinity(0))
        k = len(mine) // n
        self.cpus: list[list[int]] = [
            mine[i * k:(i + 1) * k] if split_cpus and k > 0 else mine for i in range(n)
        ]
        _sweep_dead()
        pid = os.getpid()
        self.tag = tag or str(pid % 10_000_000)
        self.subnet = 10 + pid % 200
        self.bridge = f"bnb{self.tag}"[:15]
        self.names: list[str] = []
        self.holders: list[subprocess.Popen] = []
        self.inits: list[int] = []
        self.vethes: list[str] = []
        self.tmp = tempfile.mkdtemp(prefix="braid-nodes-")
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def addr(self, i: int) -> str:
        return f"10.215.{self.subnet}.{i + 1}"

    def _setup(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(self.n):
            ns = f"braid-{self.tag}-n{i}"
            _run("ip", "netns", "add", ns)
            self.names.append(ns)
            veth = f"bnv{self.tag}n{i}"[:15]
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.vethes.append(veth)
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # Like a container's: the node's name resolves to its address.
            hosts = os.path.join(self.tmp, f"hosts{i}")
            with open(hosts, "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.addr(i)} braid-node{i}\n")
                for j in range(self.n):
                    if j != i:
                        f.write(f"{self.addr(j)} braid-node{j}\n")
            script = (
                f"hostname braid-node{i} && mount -t tmpfs braid-shm /dev/shm && "
                f"mount -t proc proc /proc && mount --bind {hosts} /etc/hosts && "
                "echo ready && exec sleep 1000000"
            )
            h = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "--pid", "--fork",
                 "--propagation", "private", "sh", "-c", script],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            self.holders.append(h)
            line = h.stdout.readline() if h.stdout else ""
            if line.strip() != "ready":
                err = h.stderr.read() if h.stderr else ""
                raise RuntimeError(f"node {i}: could not set up its namespaces: {err.strip()}")
            init = 0
            for _ in range(100):
                kids = _children(h.pid)
                if kids:
                    init = kids[0]
                    break
                time.sleep(0.01)
            if not init:
                raise RuntimeError(f"node {i}: its first process did not start")
            self.inits.append(init)

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``i`` (all its namespaces, its CPUs)."""
        cpus = ",".join(str(c) for c in self.cpus[i])
        return ["nsenter", "-t", str(self.inits[i]), "-n", "-m", "-u", "-p", "--",
                "taskset", "-c", cpus, *argv]

    def popen(self, i: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(i, argv), **kw)

    def close(self) -> None:
        # Ending a node's first process ends every process of its pid
        # namespace.
        for init in self.inits:
            try:
                os.kill(init, signal.SIGKILL)
            except OSError:
                pass
        for h in self.holders:
            if h.poll() is None:
                h.kill()
            try:
                h.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for s in (h.stdout, h.stderr):
                if s:
                    s.close()
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for v in self.vethes:
            subprocess.run(["ip", "link", "del", v], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.holders, self.names, self.vethes, self.inits = [], [], [], []

    def __enter__(self) -> EmulatedNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
