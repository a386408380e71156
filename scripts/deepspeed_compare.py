"""braid against DeepSpeed's shared-memory all-reduce on CPU tensors, one run.

    python scripts/deepspeed_compare.py                      # 2 and 4 ranks, float32 and bfloat16, 8 B .. 64 MiB
    python scripts/deepspeed_compare.py --np 2 --dtypes bfloat16 --sizes 8 1M \
        --braid-perf target/release/braid-perf               # also braid's Rust API (braid-perf)

Run by scripts/deepspeed-compare.sh, which makes the venv (torch, deepspeed,
ninja, numpy and this tree's braid wheel). Needs a C++ compiler: DeepSpeed
builds its op just in time.

Starts the ranks itself (one process each, OMP_NUM_THREADS=1 as torchrun
sets it; rank r bound to core r mod ncpu unless --no-bind, as braid-perf
binds). Every rank joins DeepSpeed (``deepspeed.comm.init_distributed`` on
gloo with DS_ACCELERATOR=cpu and LOCAL_SIZE = the number of ranks: all local,
so DeepSpeed initialises its shared-memory workspace), a torch.distributed
group on the braid backend, and a ``braid.Communicator`` of its own, and for
each datatype and size times, alternately on the same tensor (sum, in place):

  deepspeed  ``deepspeed.comm.inference_all_reduce(t)``: DeepSpeed's
             shared-memory all-reduce (op ``deepspeed_shm_comm``, csrc/cpu/comm/shm.cpp)
  torch      ``torch.distributed.all_reduce(t, group=<braid group>)``
  python     ``braid.Communicator.all_reduce(buf)``: a numpy array for
             float32, the torch tensor through DLPack for bfloat16

Each round runs every method once (the order rotates from round to round),
each a batch of about --batch-ms milliseconds after a short warm-up; a
batch's time per call is averaged over the ranks (as nccl-tests does); the
table gives the median over the rounds, and braid's time over DeepSpeed's
(below 1: braid is faster). Before timing, each method's result is checked
(rank r contributes r + 1). With --braid-perf, each round also runs
``rust``: braid-perf (the Rust API: its own n processes, bound one core
each, in-place time averaged over its ranks) at the same size, started by
rank 0 while the other ranks wait.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time

METHODS = ("deepspeed", "torch", "python")
PERF_TYPE = {"float32": "float", "bfloat16": "bfloat16"}
ELEM = {"float32": 4, "bfloat16": 2}


def _size(text: str) -> int:
    t = text.strip().upper()
    mult = 1
    for suf, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suf):
            t, mult = t[:-1], m
            break
    return int(float(t) * mult)


def _default_sizes() -> list[int]:
    # 8 B (the latency point), then 64 B .. 64 MiB by powers of 4.
    return [8] + [64 << (2 * k) for k in range(11)]


# ---------------------------------------------------------------------------
# One rank.


def _worker(spec: dict) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import braid
    import braid.torch  # noqa: F401  (registers the backend)
    import deepspeed.comm as dscomm

    torch.set_num_threads(1)
    dscomm.init_distributed(dist_backend="gloo", verbose=False, timeout=datetime.timedelta(seconds=600))
    cdb = dscomm.comm.cdb
    rank, n = dist.get_rank(), dist.get_world_size()
    import deepspeed

    info = {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "braid": getattr(braid, "__version__", "?"),
        "shm_op": cdb.shm_comm_op is not None,
        "shm_level": int(getattr(cdb, "shm_vector_kernel_level", 0)),
        "bind": sorted(os.sched_getaffinity(0)),
    }
    bgroup = dist.new_group(backend="braid")
    uid = [str(braid.UniqueId.create(host="127.0.0.1")) if rank == 0 else None]
    dist.broadcast_object_list(uid, src=0)
    comm = braid.Communicator.init(braid.UniqueId(uid[0]), rank, n, timeout=600)

    def gather_max(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    res: dict = {"np": n, "info": info, "rows": {}}
    for dtname in spec["dtypes"]:
        dt = getattr(torch, dtname)
        rows = []
        for nbytes in spec["sizes"]:
            count = max(1, nbytes // ELEM[dtname])
            t = torch.zeros(count, dtype=dt)
            # The Python API's buffer: numpy for float32 (no bfloat16 in numpy:
            # the torch tensor through DLPack).
            buf = t.numpy() if dtname == "float32" else t
            calls = {
                "deepspeed": lambda: dscomm.inference_all_reduce(t),
                "torch": lambda: dist.all_reduce(t, group=bgroup),
                "python": lambda: comm.all_reduce(buf),
            }
            # Check each method once: rank r gives r + 1, the sum is n(n+1)/2.
            want = n * (n + 1) / 2
            bad = []
            for m in METHODS:
                t.fill_(rank + 1)
                calls[m]()
                if not bool((t.float() == want).all()):
                    bad.append(m)
            t.zero_()
            # Calls per batch: from the slowest method's time per call (the
            # ranks agree on it: the maximum over them).
            est = 0.0
            for m in METHODS:
                calls[m]()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(3):
                    calls[m]()
                est = max(est, (time.perf_counter() - t0) / 3)
            est = gather_max(est)
            iters = int(max(spec["min_iters"], min(spec["max_iters"], spec["batch_ms"] / 1e3 / max(est, 1e-7))))
            perf = spec.get("perf")
            methods = METHODS + (("rust",) if perf else ())
            rounds: dict[str, list[float]] = {m: [] for m in methods}
            for r in range(spec["rounds"]):
                order = methods[r % len(methods):] + methods[:r % len(methods)]
                mine = dict.fromkeys(methods, 0.0)
                for m in order:
                    if m == "rust":
                        # braid-perf (its own n processes) from rank 0 while
                        # the others sleep in gloo's barrier. (Waiting in the
                        # next method's first call instead, DeepSpeed's
                        # spinning one, halved braid-perf's speed above 1 MiB.)
                        if rank == 0:
                            mine[m] = _rust(perf, n, dtname, count * ELEM[dtname], max(20, iters), spec["bind"])
                        dist.barrier()
                        continue
                    for _ in range(max(1, iters // 10)):
                        calls[m]()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        calls[m]()
                    mine[m] = (time.perf_counter() - t0) / iters * 1e6
                tt = torch.tensor([mine[m] for m in methods], dtype=torch.float64)
                dist.all_reduce(tt)
                for i, m in enumerate(methods):
                    # braid-perf's time is already averaged over its ranks.
                    rounds[m].append(float(tt[i]) / (1 if m == "rust" else n))
            rows.append({
                "bytes": count * ELEM[dtname],
                "count": count,
                "iters": iters,
                "bad": bad,
                **{m: _median(v) for m, v in rounds.items()},
                **{m + "_rounds": v for m, v in rounds.items()},
            })
            if rank == 0:
                print(f"# progress: {n} ranks {dtname} {nbytes} B done", file=sys.stderr, flush=True)
        res["rows"][dtname] = rows
    if rank == 0:
        print("RESULT:" + json.dumps(res), flush=True)
    comm.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# The launcher and the table.


def _median(v: list[float]) -> float | None:
    v = [x for x in v if x == x]  # braid-perf's NaNs (no row) left out
    return statistics.median(v) if v else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(n: int, spec: dict, bind: bool, timeout: float) -> dict:
    port = _free_port()
    ncpu = os.cpu_count() or 1
    procs = []
    for r in range(n):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_SIZE=str(n),  # all ranks local: DeepSpeed sets up its shm workspace
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            DS_ACCELERATOR="cpu",
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        )
        pre = (lambda c=r % ncpu: os.sched_setaffinity(0, {c})) if bind else None
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
            env=env, stdout=subprocess.PIPE, text=True, preexec_fn=pre))
    outs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise SystemExit(f"deepspeed_compare: {n} ranks ran past {timeout:.0f} s")
    finally:
        # DeepSpeed never unlinks its workspaces (66 MiB of /dev/shm per rank,
        # named by uid, MASTER_ADDR, MASTER_PORT and rank): remove them.
        for r in range(n):
            try:
                os.unlink(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{r}")
            except OSError:
                pass
    codes = [p.returncode for p in procs]
    for line in outs[0].splitlines():
        if line.startswith("RESULT:"):
            return json.loads(line[7:])
    raise SystemExit(f"deepspeed_compare: rank 0 printed no result (exit codes {codes})")


def _rust(perf: str, n: int, dtname: str, nbytes: int, iters: int, bind: bool) -> float:
    """braid-perf's in-place all_reduce time (us) at `nbytes`, NaN if it gave none."""
    cmd = [perf, "all_reduce", "-np", str(n), "-b", str(nbytes), "-e", str(nbytes), "-d", PERF_TYPE[dtname],
           "-n", str(iters), "-w", str(max(5, iters // 10))]
    if not bind:
        cmd += ["--bind", "none"]
    # Every CPU allowed again (this rank is bound to one): braid-perf binds its ranks itself.
    everywhere = set(range(os.cpu_count() or 1))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       preexec_fn=lambda: os.sched_setaffinity(0, everywhere))
    for line in p.stdout.splitlines():
        cols = line.replace("[0]", "").split()
        if len(cols) >= 13 and cols[0] == str(nbytes) and cols[2] == PERF_TYPE[dtname]:
            return float(cols[9])
    print(f"# braid-perf gave no row for {nbytes} B: {(p.stdout + p.stderr)[-500:]}", file=sys.stderr)
    return float("nan")


def _fmt(us: float | None) -> str:
    if us is None:
        return f"{'-':>9}"
    if us >= 10000:
        return f"{us:9.0f}"
    if us >= 100:
        return f"{us:9.1f}"
    return f"{us:9.2f}"


def _ratio(a: float | None, b: float) -> str:
    return f"{a / b:7.2f}" if a is not None and b > 0 else f"{'-':>7}"


def _table(res: dict, dtname: str, rounds: int) -> str:
    n = res["np"]
    lines = [
        f"# all_reduce (sum, in place), {n} ranks, {dtname}: time per call in us (median over {rounds} "
        "alternating rounds, averaged over ranks); braid/ds = braid's time over DeepSpeed's",
        f"# {'size':>10}  {'deepspeed':>9}  {'torch':>9}  {'python':>9}  {'rust':>9}  {'torch/ds':>8}  "
        f"{'py/ds':>7}  {'rust/ds':>7}",
        f"# {'(B)':>10}  {'shm':>9}  {'braid':>9}  {'braid':>9}  {'braid':>9}",
    ]
    for row in res["rows"][dtname]:
        ds = row["deepspeed"]
        rs = row.get("rust")
        note = f"  WRONG RESULT: {','.join(row['bad'])}" if row["bad"] else ""
        lines.append(
            f"  {row['bytes']:>10}  {_fmt(ds)}  {_fmt(row['torch'])}  {_fmt(row['python'])}  {_fmt(rs)}  "
            f" {_ratio(row['torch'], ds)}  {_ratio(row['python'], ds)}  {_ratio(rs, ds)}{note}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        _worker(json.loads(argv[1]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--sizes", nargs="+", help="bytes (K, M suffixes); default 8 B, then 64 B .. 64 MiB by 4x")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch-ms", type=float, default=40.0, help="milliseconds per timed batch (about)")
    ap.add_argument("--min-iters", type=int, default=5)
    ap.add_argument("--max-iters", type=int, default=20000)
    ap.add_argument("--braid-perf", help="braid-perf binary: adds the Rust API's column")
    ap.add_argument("--no-bind", action="store_true", help="leave the ranks unbound (default: rank r on core r mod ncpu)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--timeout", type=float, default=1800)
    a = ap.parse_args(argv)
    sizes = [_size(s) for s in a.sizes] if a.sizes else _default_sizes()
    spec = {"sizes": sizes, "dtypes": a.dtypes, "rounds": a.rounds, "batch_ms": a.batch_ms,
            "min_iters": a.min_iters, "max_iters": a.max_iters, "bind": not a.no_bind,
            "perf": os.path.abspath(a.braid_perf) if a.braid_perf else None}
    try:
        load = " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        load = "?"
    out = []
    for n in a.np:
        res = _run(n, spec, not a.no_bind, a.timeout)
        i = res["info"]
        if n == a.np[0]:
            print(f"# deepspeed {i['deepspeed']}, torch {i['torch']}, braid {i['braid']}, python "
                  f"{sys.version.split()[0]}, {os.cpu_count()} CPUs, "
                  f"{time.strftime('%Y-%m-%d %H:%M')}, load average {load}")
        print(f"# {n} ranks: DeepSpeed shm op {'built and initialised' if i['shm_op'] else 'NOT AVAILABLE'} "
              f"(vector kernel level {i['shm_level']}: 2 = avx512bw, bf16 and fp32 on the shm kernel; 1 = avx2, "
              f"fp32 only; below that DeepSpeed falls back to torch.distributed.all_reduce on gloo); "
              f"ranks {'bound one core each' if not a.no_bind else 'unbound'}")
        for dtname in a.dtypes:
            print(_table(res, dtname, a.rounds))
            print(flush=True)
            out.append({"np": n, "dtype": dtname, "rows": res["rows"][dtname], "info": i})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
