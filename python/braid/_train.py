"""The training-step benchmark of ``python -m braid.bench --train``.

A DDP step and an FSDP2 (``fully_shard``) step of the same model on braid and
on gloo, side by side in one job: every rank joins a braid default group and a
gloo group over the same ranks, builds the model three times from the same
seed (one copy on each backend, and one trained alone on every rank, without
collectives: the machine's floor and its own jitter), and runs them in turn,
step by step, with a barrier (on gloo) in front of every timed step. A step's time is the slowest
rank's (forward, backward with the gradient collectives overlapping it,
optimizer step). The jobs are launched with torchrun, as users launch them:
on this host (``--standalone``), and, as root, across emulated nodes (network,
UTS, mount and pid namespaces joined by veth pairs: two "hosts" that talk
TCP; see ``braid._nodes``). torchrun's thread settings hold unless
``--threads`` says otherwise: one intra-op thread per rank with several
ranks per node, torch's default (one per core) with one.

Each configuration runs ``--rounds`` times (a fresh job each); the table gives
the median over rounds of each round's median step time, the median of the
rounds' 90th percentiles, gloo's time over braid's, and the same for the model
alone.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

RESULT = "BRAID-TRAIN-RESULT:"
# braid, gloo, and the same model trained alone on every rank (no collectives):
# the machine's floor and its own jitter.
BACKENDS = ("braid", "gloo", "alone")


def _mlp(width: int, depth: int, inputs: int, outputs: int):
    import torch

    layers = [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, outputs))
    return torch.nn.Sequential(*layers)


def worker(spec: dict) -> None:
    """One rank of the job (started by torchrun)."""
    import torch
    import torch.distributed as dist

    import braid.torch  # noqa: F401

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    dist.init_process_group("braid")
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    inputs, outputs = spec["inputs"], 10
    out: dict = {
        "nranks": n,
        "threads": torch.get_num_threads(),
        "kinds": {},
    }

    def build(kind: str, group):
        torch.manual_seed(0)
        m = _mlp(spec["width"], spec["depth"], inputs, outputs)
        if group == "alone":
            pass  # the same computation without collectives: the floor
        elif kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            m = DDP(m, process_group=group, bucket_cap_mb=spec["bucket_mb"])
        else:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, "cpu")
            for layer in m:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)
        return m, torch.optim.SGD(m.parameters(), lr=0.01)

    for kind in spec["kinds"]:
        backends = spec.get("backends", ["braid", "gloo", "alone"])
        models = {be: build(kind, {"braid": None, "gloo": gloo, "alone": "alone"}[be]) for be in backends}
        gen = torch.Generator().manual_seed(rank)
        times: dict[str, list[float]] = {be: [] for be in BACKENDS}
        warm, steps = spec["warmup"], spec["steps"]
        for step in range(warm + steps):
            x = torch.randn(spec["batch"], inputs, generator=gen)
            y = torch.randn(spec["batch"], outputs, generator=gen)
            k = step % len(backends)
            order = backends[k:] + backends[:k]
            for be in order:
                m, opt = models[be]
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                opt.step()
                dt = time.perf_counter() - t0
                if step >= warm:
                    times[be].append(dt)
        # The job's step time is its slowest rank's.
        t = torch.tensor([times[be] or [0.0] * steps for be in BACKENDS], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
        diff = 0.0
        if "braid" in models and "gloo" in models:
            for a, b in zip(models["braid"][0].parameters(), models["gloo"][0].parameters(), strict=True):
                if kind == "fsdp":
                    a, b = a.full_tensor(), b.full_tensor()
                diff = max(diff, float((a.detach() - b.detach()).abs().max()))
        # (an FSDP2 parameter is a DTensor: numel() is the whole tensor's)
        params = sum(p.numel() for p in models[backends[0]][0].parameters())
        out["kinds"][kind] = {
            **{f"{be}_s": t[i].tolist() for i, be in enumerate(BACKENDS)},
            "max_diff": diff,
            "params": params,
        }
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# The launcher.


@dataclass
class Config:
    label: str
    nodes: int
    per_node: int


def _torchrun(nnodes: int, node_rank: int, per_node: int, addr: str, port: int, spec: dict) -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(per_node)]
    if nnodes == 1:
        argv += ["--standalone"]
    else:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                 "--master-addr", addr, "--master-port", str(port)]
    return argv + ["-m", "braid._train", "worker", json.dumps(spec)]


def _parse(out: str) -> dict:
    for line in out.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"the job printed no result:\n{out[-4000:]}")


def _env() -> dict:
    env = dict(os.environ)
    # The job's own output only (torchrun's warnings about OMP_NUM_THREADS
    # go to stderr, kept for errors).
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_one(cfg: Config, spec: dict, timeout: float) -> dict:
    """One job of `cfg`; its rank 0's result."""
    if cfg.nodes == 1:
        argv = _torchrun(1, 0, cfg.per_node, "", 0, spec)
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_env())
        if p.returncode != 0:
            raise RuntimeError(f"{cfg.label}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        return _parse(p.stdout)
    from ._nodes import EmulatedNodes

    with EmulatedNodes(cfg.nodes) as nodes:
        port = 29400 + os.getpid() % 500
        procs = [
            nodes.popen(k, _torchrun(cfg.nodes, k, cfg.per_node, nodes.addr(0), port, spec),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
            for k in range(cfg.nodes)
        ]
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{cfg.label}: no result within {timeout:.0f} s") from None
        for k, p in enumerate(procs):
            if p.returncode != 0:
                raise RuntimeError(
                    f"{cfg.label}: node {k} exit {p.returncode}\n{outs[k][0][-2000:]}\n{outs[k][1][-4000:]}"
                )
        return _parse(outs[0][0])


def _p90(v: list[float]) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


def summarize(cfg: Config, rounds: list[dict]) -> list[dict]:
    rows = []
    for kind in rounds[0]["kinds"]:
        per = {be: [r["kinds"][kind].get(f"{be}_s", [0.0]) for r in rounds] for be in BACKENDS}
        row = {
            "config": cfg.label,
            "kind": kind,
            "threads": rounds[0]["threads"],
            "params": rounds[0]["kinds"][kind]["params"],
            "max_diff": max(r["kinds"][kind]["max_diff"] for r in rounds),
            "rounds": len(rounds),
        }
        for be in BACKENDS:
            row[f"{be}_ms"] = statistics.median(statistics.median(v) for v in per[be]) * 1e3
            row[f"{be}_p90_ms"] = statistics.median(_p90(v) for v in per[be]) * 1e3
            row[f"{be}_round_ms"] = [statistics.median(v) * 1e3 for v in per[be]]
            row[f"{be}_steps_ms"] = [[round(x * 1e3, 2) for x in v] for v in per[be]]
        rows.append(row)
    return rows


def table(rows: list[dict], spec: dict) -> str:
    lines = [
        f"# training step (forward, backward with the gradient collectives, SGD step): an MLP of "
        f"{spec['depth'] + 2} layers, width {spec['width']}, batch {spec['batch']} per rank, DDP "
        f"bucket_cap_mb={spec['bucket_mb']}; {spec['steps']} timed steps per round, braid and gloo "
        "alternating with the model alone (no collectives: the floor); median over rounds of the median "
        "step (ms), median p90",
        f"# {'ranks':<16} {'step':<5} {'thr':>3} {'params':>9}  {'braid':>8} {'p90':>8}  "
        f"{'gloo':>8} {'p90':>8}  {'x':>5}  {'alone':>8} {'p90':>8}  {'max |diff|':>10}",
    ]
    for r in rows:
        x = r["gloo_ms"] / r["braid_ms"] if r["braid_ms"] > 0 else float("nan")
        lines.append(
            f"  {r['config']:<16} {r['kind']:<5} {r['threads']:>3} {r['params']:>9}  "
            f"{r['braid_ms']:8.2f} {r['braid_p90_ms']:8.2f}  {r['gloo_ms']:8.2f} {r['gloo_p90_ms']:8.2f}  "
            f"{x:5.2f}  {r['alone_ms']:8.2f} {r['alone_p90_ms']:8.2f}  {r['max_diff']:10.2e}"
        )
    return "\n".join(lines)


def main_train(args) -> int:
    from ._nodes import unavailable

    spec = {
        "width": args.width,
        "depth": args.depth,
        "inputs": 256,
        "batch": args.batch,
        "bucket_mb": args.bucket_mb,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "kinds": args.kinds,
    }
    configs = [Config(f"1 host x {n}", 1, n) for n in args.np if n > 0]
    if args.nodes:
        why = unavailable()
        if why:
            print(f"# emulated nodes skipped: {why}", flush=True)
        else:
            configs += [Config(f"2 nodes x {k}", 2, k) for k in args.per_node]
    rows: list[dict] = []
    for cfg in configs:
        res = []
        for _ in range(args.rounds):
            res.append(run_one(cfg, spec, args.timeout))
        rows += summarize(cfg, res)
        print(f"# {cfg.label}: done", flush=True)
    print(table(rows, spec), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": spec, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
    else:
        raise SystemExit("usage: python -m braid.bench --train ...")
