"""Side-by-side benchmark: torch.distributed on braid and on gloo, one run.

    python -m braid.bench                      # 2 and 4 ranks, 8 B .. 64 MiB
    python -m braid.bench --np 2 -b 8 -e 16M --plot bench.png --json bench.json
    python -m braid.bench --api --np 2 -e 1M --braid-perf target/release/braid-perf \
        --braid-run target/release/braid-run   # the Python API against the Rust API
    python -m braid.bench --np 2 -e 64M -f 8 --load busy    # under one busy process per core
    python -m braid.bench --train              # DDP and FSDP2 steps, 1 host and 2 emulated nodes

Starts the ranks itself (one process each, ``OMP_NUM_THREADS=1`` as torchrun
sets it), joins a braid default group and a gloo group over the same ranks,
and for each collective and size times braid and gloo alternately on the
same tensors (float32), in several alternating batches of which the fastest
counts (the host may be shared; with ``--duration``, default under
``--load``, batches last that long and the median counts): all_reduce (sum, in place), all_gather_into_tensor,
reduce_scatter_tensor (sum), broadcast (root 0, in place) and
all_to_all_single. Tables follow nccl-tests: size in bytes (the whole array
for all_gather, reduce_scatter and all_to_all), count of elements per rank,
time in microseconds (averaged over ranks), algbw = size / time and busbw =
algbw x factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all
(n-1)/n; broadcast 1) in GB/s; "x" is gloo's time over braid's.

Then a DDP training step (forward, backward with gradient all_reduce,
optimizer step) of two models, braid and gloo alternating step by step;
median milliseconds per step.

``--load busy`` runs the collectives with one busy process per core beside
them, ``--load torch`` with every rank multiplying matrices on torch's
default intra-op threads beside its collectives: what a training step does
to the collectives it overlaps.

``--train`` instead times whole training steps (``braid._train``): DDP and
FSDP2 on braid and on gloo in one job each, launched with torchrun on this
host and, as root, on two emulated nodes (separate network, UTS, mount and
pid namespaces: two hosts that talk TCP).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

COLLECTIVES = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single"]
_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
_WHOLE = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"}


def _size(text: str) -> int:
    t = text.strip().upper()
    mult = 1
    for suf, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suf):
            t, mult = t[:-1], m
            break
    return int(float(t) * mult)


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def _iters(nbytes: int, scale: float) -> int:
    """Calls per timed batch: about 4 MB moved, 3 to 200 calls."""
    return max(3, min(200, int(scale * 4e6 / max(nbytes, 1024))))


# ---------------------------------------------------------------------------
# One rank.


def _worker(rank: int, n: int, spec: dict) -> None:
    import torch
    import torch.distributed as dist

    import braid.torch  # noqa: F401  (the entry point would find it too)

    torch.set_num_threads(1)
    dist.init_process_group(
        "braid",
        init_method="file://" + spec["store"],
        rank=rank,
        world_size=n,
        timeout=datetime.timedelta(seconds=300),
    )
    gloo = dist.new_group(backend="gloo")
    groups = {"braid": None, "gloo": gloo}
    stop = None
    if spec.get("load") == "torch":
        import threading

        # torch's default: one intra-op thread per core (the ranks' own
        # calls stay single-threaded as above only for their element-wise
        # work; the products run on the default pool).
        torch.set_num_threads(os.cpu_count() or 1)
        stop = threading.Event()
        threading.Thread(target=_compute_beside, args=(stop,), daemon=True).start()
    res: dict = {"np": n, "colls": {}, "ddp": {}}

    def tensors(coll: str, nbytes: int):
        per = max(1, nbytes // 4 // (n if coll in _WHOLE else 1))
        if coll == "all_reduce" or coll == "broadcast":
            return per, (torch.ones(per),)
        if coll == "all_gather_into_tensor":
            return per, (torch.empty(per * n), torch.ones(per))
        if coll == "reduce_scatter_tensor":
            return per, (torch.empty(per), torch.ones(per * n))
        return per, (torch.empty(per * n), torch.ones(per * n))

    def call(coll: str, ts, g) -> None:
        if coll == "all_reduce":
            dist.all_reduce(ts[0], group=g)
        elif coll == "broadcast":
            dist.broadcast(ts[0], src=0, group=g)
        elif coll == "all_gather_into_tensor":
            dist.all_gather_into_tensor(ts[0], ts[1], group=g)
        elif coll == "reduce_scatter_tensor":
            dist.reduce_scatter_tensor(ts[0], ts[1], group=g)
        else:
            dist.all_to_all_single(ts[0], ts[1], group=g)

    def timed(coll, ts, g, iters) -> float:
        for _ in range(max(2, iters // 10)):
            call(coll, ts, g)
        dist.barrier(group=g)
        t0 = time.perf_counter()
        for _ in range(iters):
            call(coll, ts, g)
        secs = time.perf_counter() - t0
        want = spec["duration"]
        while want > 0:
            # More calls in chunks (each at most a quarter of the duration)
            # until the slowest rank has timed `want` seconds; the ranks
            # agree between chunks, outside the timing.
            e = torch.tensor([secs], dtype=torch.float64)
            dist.all_reduce(e, op=dist.ReduceOp.MAX, group=gloo)
            slowest = float(e[0])
            if slowest >= want:
                break
            per = max(slowest, 1e-9) / iters
            more = max(1, int(min(want - slowest, want / 4) / per) + 1)
            t0 = time.perf_counter()
            for _ in range(more):
                call(coll, ts, g)
            secs += time.perf_counter() - t0
            iters += more
        us = secs / iters * 1e6
        # nccl-tests' default: the average over ranks.
        t = torch.tensor([us], dtype=torch.float64)
        dist.all_reduce(t, group=gloo)
        return float(t[0]) / n

    for coll in spec["colls"]:
        rows = []
        for nbytes in spec["sizes"]:
            per, ts = tensors(coll, nbytes)
            iters = _iters(nbytes, spec["scale"])
            got = {"braid": [], "gloo": []}
            for _ in range(spec["rounds"]):
                for name in ("braid", "gloo"):
                    got[name].append(timed(coll, ts, groups[name], iters))
            # The fastest round; with --duration (a batch that spans many
            # scheduler slices) the median.
            pick = statistics.median if spec["duration"] > 0 else min
            best = {name: pick(v) for name, v in got.items()}
            whole = per * 4 * (n if coll in _WHOLE else 1)
            rows.append({"bytes": whole, "count": per, "braid_us": best["braid"], "gloo_us": best["gloo"]})
        res["colls"][coll] = rows

    if stop is not None:
        stop.set()
    if spec["ddp_steps"] > 0:
        res["ddp"] = _ddp(rank, n, gloo, spec["ddp_steps"])
    if rank == 0:
        print("RESULT:" + json.dumps(res), flush=True)
    dist.destroy_process_group()


def _ddp(rank: int, n: int, gloo, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def mlp(width: int, depth: int) -> torch.nn.Module:
        layers: list[torch.nn.Module] = [torch.nn.Linear(64, width), torch.nn.ReLU()]
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        layers.append(torch.nn.Linear(width, 8))
        return torch.nn.Sequential(*layers)

    out = {}
    for name, width, depth in (("small (13K params)", 64, 2), ("medium (2.1M params)", 512, 8)):
        models = {}
        for be, g in (("braid", None), ("gloo", gloo)):
            torch.manual_seed(0)
            m = DDP(mlp(width, depth), process_group=g)
            models[be] = (m, torch.optim.SGD(m.parameters(), lr=0.01))
        gen = torch.Generator().manual_seed(rank)
        times: dict[str, list[float]] = {"braid": [], "gloo": []}
        for step in range(steps + 5):
            x = torch.randn(32, 64, generator=gen)
            y = torch.randn(32, 8, generator=gen)
            for be in ("braid", "gloo"):
                m, opt = models[be]
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                opt.step()
                if step >= 5:
                    times[be].append(time.perf_counter() - t0)
        med = {be: sorted(v)[len(v) // 2] * 1e3 for be, v in times.items()}
        t = torch.tensor([med["braid"], med["gloo"]], dtype=torch.float64)
        dist.all_reduce(t, group=gloo)
        out[name] = {"braid_ms": float(t[0]) / n, "gloo_ms": float(t[1]) / n}
    return out


# ---------------------------------------------------------------------------
# The launcher and the tables.


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _fmt_time(us: float) -> str:
    if us >= 10000:
        return f"{us:7.0f}"
    if us >= 100:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def _table(coll: str, n: int, rows: list[dict]) -> str:
    f = _FACTOR[coll](n)
    redop = "sum" if coll in ("all_reduce", "reduce_scatter_tensor") else "none"
    root = "0" if coll == "broadcast" else "-1"
    lines = [
        f"# torch.distributed.{coll}, {n} ranks, float32: braid and gloo in one run (alternated per size)",
        "#                                              braid                    gloo",
        f"# {'size':>10}  {'count':>10}  {'type':>6}  {'redop':>5}  {'root':>4}"
        f"  {'time':>7}  {'algbw':>6}  {'busbw':>6}  {'time':>7}  {'algbw':>6}  {'busbw':>6}  {'x':>6}",
        f"# {'(B)':>10}  {'(elements)':>10}  {'':>6}  {'':>5}  {'':>4}"
        f"  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}",
    ]
    for r in rows:
        cells = []
        for be in ("braid", "gloo"):
            us = r[f"{be}_us"]
            alg = r["bytes"] / (us * 1e3) if us > 0 else 0.0
            cells.append(f"{_fmt_time(us)}  {alg:6.2f}  {alg * f:6.2f}")
        x = r["gloo_us"] / r["braid_us"] if r["braid_us"] > 0 else float("nan")
        lines.append(
            f"  {r['bytes']:>10}  {r['count']:>10}  {'float':>6}  {redop:>5}  {root:>4}  "
            + "  ".join(cells)
            + f"  {x:6.2f}"
        )
    return "\n".join(lines)


def _ddp_table(results: list[dict]) -> str:
    lines = ["# DDP training step (forward, backward, gradient all_reduce, SGD step), median ms",
             f"# {'ranks':>5}  {'model':<22}  {'braid':>8}  {'gloo':>8}  {'x':>6}"]
    for res in results:
        for name, d in res.get("ddp", {}).items():
            x = d["gloo_ms"] / d["braid_ms"] if d["braid_ms"] > 0 else float("nan")
            lines.append(f"  {res['np']:>5}  {name:<22}  {d['braid_ms']:8.3f}  {d['gloo_ms']:8.3f}  {x:6.2f}")
    return "\n".join(lines)


def _run(n: int, spec: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="braid-bench-") as tmp:
        spec = dict(spec, store=os.path.join(tmp, "store"))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "braid.bench", "--worker", str(r), str(n), json.dumps(spec)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(n)
        ]
        outs = []
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                so, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise SystemExit(f"braid.bench: {n} ranks did not finish within {timeout:.0f} s")
            outs.append((p.returncode, so))
        for rc, so in outs:
            if rc != 0:
                raise SystemExit(f"braid.bench: a rank failed (exit {rc}); its errors are above")
        for line in outs[0][1].splitlines():
            if line.startswith("RESULT:"):
                return json.loads(line[len("RESULT:"):])
    raise SystemExit("braid.bench: rank 0 printed no result")


def _plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("braid.bench: --plot needs matplotlib (pip install matplotlib)") from None
    colls = [c for c in COLLECTIVES if any(c in r["colls"] for r in results)]
    ddp = [(res["np"], name, d) for res in results for name, d in res.get("ddp", {}).items()]
    panels = len(colls) + (1 if ddp else 0)
    cols = min(3, panels)
    rows = (panels + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[panels:]:
        ax.axis("off")
    if ddp:
        ax = flat[len(colls)]
        labels = [f"{name.split(' ')[0]}, {n} ranks" for n, name, _ in ddp]
        xs = range(len(ddp))
        ax.bar([x - 0.2 for x in xs], [d["braid_ms"] for _, _, d in ddp], 0.4, label="braid")
        ax.bar([x + 0.2 for x in xs], [d["gloo_ms"] for _, _, d in ddp], 0.4, label="gloo")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (median)")
        ax.set_title("DDP training step", fontsize=9)
        ax.legend(fontsize=7)
    for ax, coll in zip(flat, colls):
        for res in results:
            rows = res["colls"].get(coll)
            if not rows:
                continue
            xs = [r["bytes"] for r in rows]
            for be, style in (("braid", "-o"), ("gloo", "--s")):
                ax.loglog(xs, [r[f"{be}_us"] for r in rows], style, ms=3, label=f"{be}, {res['np']} ranks")
        ax.set_title(f"torch.distributed {coll}", fontsize=9)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("time per call (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------
# --api: braid's Python API against its Rust API (braid-perf).


def _api_iters(nbytes: int, scale: float) -> int:
    return max(20, min(20000, int(scale * 4e8 / max(nbytes, 1024))))


def _api_worker(spec: dict) -> None:
    import numpy as np

    import braid

    comm = braid.Communicator.from_env()
    out = {}
    for nbytes in spec["sizes"]:
        a = np.ones(max(1, nbytes // 4), dtype=np.float32)
        r = np.empty_like(a)
        iters = _api_iters(nbytes, spec["scale"])
        best = {"out": float("inf"), "in": float("inf")}
        for _ in range(spec["rounds"]):
            for mode in ("out", "in"):
                for _ in range(max(10, iters // 10)):
                    comm.all_reduce(a, None if mode == "in" else r)
                comm.barrier()
                t0 = time.perf_counter()
                if mode == "in":
                    for _ in range(iters):
                        comm.all_reduce(a)
                else:
                    for _ in range(iters):
                        comm.all_reduce(a, r)
                us = (time.perf_counter() - t0) / iters * 1e6
                t = np.array([us])
                comm.all_reduce(t)
                best[mode] = min(best[mode], float(t[0]) / comm.size)
        out[nbytes] = best
    if comm.rank == 0:
        print("RESULT:" + json.dumps(out), flush=True)


def _api_python(n: int, spec: dict) -> dict:
    import secrets
    import socket

    # As braid-run does: rank 0 hosts the rendezvous named by BRAID_UNIQUE_ID.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uid = f"127.0.0.1:{port}/{secrets.token_hex(16)}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "braid.bench", "--api-worker", json.dumps(spec)],
            env=dict(os.environ, BRAID_UNIQUE_ID=str(uid), BRAID_RANK=str(r), BRAID_NRANKS=str(n)),
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for line in outs[0].splitlines():
        if line.startswith("RESULT:"):
            return {int(k): v for k, v in json.loads(line[7:]).items()}
    raise SystemExit("braid.bench --api: rank 0 printed no result")


def _api_rust(n: int, nbytes: int, iters: int, braid_run: str, braid_perf: str) -> dict:
    """braid-perf's all_reduce time (us) at `nbytes`, out of place and in place."""
    cmd = [braid_run, "-n", str(n), braid_perf, "all_reduce", "-b", str(nbytes), "-e", str(nbytes),
           "-n", str(iters), "-w", str(max(10, iters // 10))]
    so = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    for line in so.splitlines():
        cols = line.replace("[0]", "").split()
        if cols and cols[0] == str(nbytes) and len(cols) >= 13:
            return {"out": float(cols[5]), "in": float(cols[9])}
    raise SystemExit(f"braid.bench --api: no result row in braid-perf's output:\n{so[-2000:]}")


def _api(a: argparse.Namespace, sizes: list[int]) -> None:
    spec = {"sizes": sizes, "scale": a.scale, "rounds": max(1, a.rounds)}
    rust = bool(a.braid_perf)
    print("# braid.Communicator.all_reduce (numpy float32, blocking, GIL released) against the "
          "Rust API (braid-perf, same sizes, alternating runs); time in us, averaged over ranks")
    print(f"# {'ranks':>5}  {'size':>10}  {'python':>8}  {'python':>8}"
          + (f"  {'rust':>8}  {'rust':>8}  {'diff':>7}" if rust else ""))
    print(f"# {'':>5}  {'(B)':>10}  {'out':>8}  {'in':>8}" + (f"  {'out':>8}  {'in':>8}  {'out':>7}" if rust else ""))
    for n in a.np:
        py = _api_python(n, spec)
        for nbytes in sizes:
            line = f"  {n:>5}  {nbytes:>10}  {py[nbytes]['out']:8.3f}  {py[nbytes]['in']:8.3f}"
            if rust:
                it = _api_iters(nbytes, a.scale)
                rs = _api_rust(n, nbytes, it, a.braid_run, a.braid_perf)
                line += f"  {rs['out']:8.3f}  {rs['in']:8.3f}  {py[nbytes]['out'] - rs['out']:7.3f}"
            print(line, flush=True)


_LOAD_TEXT = {
    "busy": "one busy process per core for the whole run",
    "torch": "every rank multiplies matrices on torch's default intra-op threads beside its collectives",
}


def _busy(n: int) -> list[subprocess.Popen]:
    """`n` processes that keep a core busy each."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _compute_beside(stop) -> None:
    """Matrix products on torch's default intra-op threads until `stop` is set
    (the GIL is released while they run)."""
    import torch

    a = torch.randn(256, 256)
    b = torch.randn(256, 256)
    while not stop.is_set():
        torch.mm(a, b)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        _worker(int(argv[1]), int(argv[2]), json.loads(argv[3]))
        return
    if argv and argv[0] == "--api-worker":
        _api_worker(json.loads(argv[1]))
        return
    ap = argparse.ArgumentParser(prog="python -m braid.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, nargs="+", default=[2, 4], help="rank counts (default: 2 4)")
    ap.add_argument("-b", "--minbytes", default="8", help="smallest size (default 8)")
    ap.add_argument("-e", "--maxbytes", default="64M", help="largest size (default 64M)")
    ap.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier (default 2)")
    ap.add_argument("-c", "--collectives", nargs="+", default=COLLECTIVES, choices=COLLECTIVES)
    ap.add_argument("--rounds", type=int, default=5,
                    help="timed batches per size and backend, alternating; the fastest counts (default 5)")
    ap.add_argument("--scale", type=float, default=1.0, help="iterations x this (default 1)")
    ap.add_argument("--duration", type=float, default=None,
                    help="time each batch for about this many seconds (more calls in chunks, "
                         "the count agreed across ranks) and report the median round instead of "
                         "the fastest; default 0.2 under --load (a batch of a few fast calls "
                         "lands inside one scheduler slice or none), else off")
    ap.add_argument("--ddp-steps", type=int, default=30, help="timed DDP steps per model (0: none)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per rank count")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--plot", help="write a PNG of time against size (needs matplotlib)")
    ap.add_argument("--api", action="store_true",
                    help="instead: braid's Python API (numpy all_reduce) against the Rust API")
    ap.add_argument("--braid-perf", help="with --api: the braid-perf binary to compare with")
    ap.add_argument("--braid-run", default="braid-run", help="with --api: the braid-run binary")
    ap.add_argument("--load", choices=["none", "busy", "torch"], default="none",
                    help="collectives under load: busy = one busy process per core for the whole "
                         "run; torch = every rank computes matrix products on torch's default "
                         "intra-op threads beside its collectives (default none)")
    tr = ap.add_argument_group("training step (--train)")
    tr.add_argument("--train", action="store_true",
                    help="instead: DDP and FSDP2 training steps on braid and on gloo, launched with "
                         "torchrun on this host (--np) and, as root, on 2 emulated nodes (--per-node)")
    tr.add_argument("--kinds", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    tr.add_argument("--per-node", type=int, nargs="+", default=[1, 2],
                    help="ranks per emulated node (default: 1 2)")
    tr.add_argument("--no-nodes", dest="nodes", action="store_false",
                    help="skip the emulated nodes")
    tr.add_argument("--width", type=int, default=512, help="MLP width (default 512)")
    tr.add_argument("--depth", type=int, default=4, help="hidden layers (default 4: 1.19 M parameters)")
    tr.add_argument("--batch", type=int, default=64, help="samples per rank and step (default 64)")
    tr.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb (default 1)")
    tr.add_argument("--steps", type=int, default=30, help="timed steps per round (default 30)")
    tr.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    tr.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads per rank (default 0: as torchrun sets them)")
    a = ap.parse_args(argv)
    if a.train:
        from ._train import main_train

        if "--np" not in argv:
            a.np = [2, 4]
        if "--rounds" not in argv:
            a.rounds = 5
        if "--timeout" not in argv:
            a.timeout = 600.0
        raise SystemExit(main_train(a))
    if a.api:
        _api(a, _sizes(_size(a.minbytes), _size(a.maxbytes), max(2, a.stepfactor)))
        return
    spec = {
        "sizes": _sizes(_size(a.minbytes), _size(a.maxbytes), max(2, a.stepfactor)),
        "colls": a.collectives,
        "rounds": max(1, a.rounds),
        "scale": a.scale,
        "ddp_steps": a.ddp_steps,
        "load": a.load,
        "duration": max(0.0, a.duration if a.duration is not None else (0.2 if a.load != "none" else 0.0)),
    }
    import platform

    import torch

    import braid

    print(f"# braid {braid.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, load average {_load()}", flush=True)
    if a.load != "none":
        print(f"# under load: {_LOAD_TEXT[a.load]}", flush=True)
    if spec["duration"] > 0:
        print(f"# each batch timed for about {spec['duration']:g} s; the median of "
              f"{spec['rounds']} rounds counts", flush=True)
    results = []
    for n in a.np:
        busy = _busy(os.cpu_count() or 1) if a.load == "busy" else []
        try:
            res = _run(n, spec, a.timeout)
        finally:
            for b in busy:
                b.kill()
                b.wait()
        results.append(res)
        for coll in a.collectives:
            print(_table(coll, n, res["colls"][coll]), flush=True)
            print(flush=True)
    if a.ddp_steps > 0:
        print(_ddp_table(results), flush=True)
    print(f"# load average at the end: {_load()}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.plot:
        _plot(results, a.plot)
        print(f"# plot: {a.plot}")


if __name__ == "__main__":
    main()
