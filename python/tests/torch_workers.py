"""torch.distributed scenarios, one process per rank (see workers.py).

Every call runs on a braid group and on a gloo group over the same ranks,
on the same inputs; the results must be equal (values are small integers,
exactly representable, so every summation order gives the same bits).
"""

from __future__ import annotations

import datetime
import gc
import os
import signal
import time
import weakref

import torch
import torch.distributed as dist

SCENARIOS = {}


def scenario(f):
    SCENARIOS[f.__name__] = f
    return f


def init(rank, p, spec, timeout=60):
    # No explicit import of braid: torch finds the backend through the
    # entry point that `pip install` registered.
    dist.init_process_group(
        "braid",
        init_method="file://" + os.path.join(spec["tmp"], "store"),
        rank=rank,
        world_size=p,
        timeout=datetime.timedelta(seconds=timeout),
    )
    assert dist.get_backend() == "braid"
    gloo = dist.new_group(backend="gloo")
    return gloo


def vals(shape, dtype, rank, salt=0, op="SUM"):
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    if op == "PRODUCT":
        v = (i * 3 + rank + salt) % 3
        v = torch.where(v == 0, torch.tensor(-1), v)
    else:
        v = (i * 7 + rank * 5 + salt) % 7 - 3
    if dtype in (torch.uint8, torch.bool):
        v = v.abs()
    return v.to(dtype).reshape(shape)


class Checker:
    def __init__(self, gloo):
        self.gloo = gloo
        self.checked = []
        self.gloo_refused = set()

    def same(self, name, a, b):
        if isinstance(a, (list, tuple)):
            assert len(a) == len(b), name
            for x, y in zip(a, b):
                self.same(name, x, y)
            return
        if not torch.equal(a, b):
            raise AssertionError(f"{name}: braid {a.flatten()[:8].tolist()} != gloo {b.flatten()[:8].tolist()}")

    def both(self, name, fn):
        """fn(group) -> result tensors; run on braid (None) and gloo."""
        try:
            want = fn(self.gloo)
        except RuntimeError as e:
            if "gloo" in str(e).lower() or "not supported" in str(e).lower() or "unsupported" in str(e).lower():
                self.gloo_refused.add(name.split("[")[0])
                return None
            raise
        got = fn(None)
        self.same(name, got, want)
        self.checked.append(name)
        return got


DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8,
          torch.float16, torch.bfloat16]
OPS = {"SUM": dist.ReduceOp.SUM, "PRODUCT": dist.ReduceOp.PRODUCT,
       "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX}


@scenario
def torch_vs_gloo(rank, p, spec):
    gloo = init(rank, p, spec)
    c = Checker(gloo)
    n = 1000 * p
    for dt in DTYPES:
        dn = str(dt).split(".")[1]
        for on, op in OPS.items():
            def ar(g, dt=dt, op=op, on=on):
                t = vals((n,), dt, rank, op=on)
                dist.all_reduce(t, op=op, group=g)
                return t
            c.both(f"all_reduce[{dn},{on}]", ar)

            def ar_async(g, dt=dt, op=op, on=on):
                t = vals((3, 5), dt, rank, 1, op=on)
                w = dist.all_reduce(t, op=op, group=g, async_op=True)
                fut = w.get_future()
                w.wait()
                assert w.is_completed()
                v = fut.wait()
                assert torch.equal(v[0], t), "future value is not the output"
                return t
            c.both(f"all_reduce async[{dn},{on}]", ar_async)

            def red(g, dt=dt, op=op, on=on):
                outs = []
                for root in range(p):
                    t = vals((77,), dt, rank, root, op=on)
                    dist.reduce(t, dst=root, op=op, group=g)
                    outs.append(t if rank == root else torch.zeros(0))
                return outs
            c.both(f"reduce[{dn},{on}]", red)

            def rs(g, dt=dt, op=op, on=on):
                o = torch.empty(40, dtype=dt)
                dist.reduce_scatter_tensor(o, vals((40 * p,), dt, rank, 2, op=on), op=op, group=g)
                lo = torch.empty(6, dtype=dt)
                dist.reduce_scatter(lo, [vals((6,), dt, rank, q, op=on) for q in range(p)], op=op, group=g)
                return [o, lo]
            c.both(f"reduce_scatter[{dn},{on}]", rs)

        def move(g, dt=dt):
            out = []
            for root in range(p):
                t = vals((33,), dt, rank, 5) if rank == root else torch.zeros(33, dtype=dt)
                dist.broadcast(t, src=root, group=g)
                out.append(t)
            lst = [torch.empty(4, 3, dtype=dt) for _ in range(p)]
            dist.all_gather(lst, vals((4, 3), dt, rank, 6), group=g)
            big = torch.empty(p * 50, dtype=dt)
            dist.all_gather_into_tensor(big, vals((50,), dt, rank, 7), group=g)
            g_out = [torch.empty(9, dtype=dt) for _ in range(p)] if rank == 0 else None
            dist.gather(vals((9,), dt, rank, 8), g_out, dst=0, group=g)
            s_out = torch.empty(9, dtype=dt)
            dist.scatter(s_out, [vals((9,), dt, q, 9) for q in range(p)] if rank == p - 1 else None, src=p - 1, group=g)
            a2a = torch.empty(p * 10, dtype=dt)
            dist.all_to_all_single(a2a, vals((p * 10,), dt, rank, 10), group=g)
            # Uneven split sizes over rows of a 2-d tensor.
            isz = [(rank + q) % 3 + 1 for q in range(p)]
            osz = [(q + rank) % 3 + 1 for q in range(p)]
            a2av = torch.empty(sum(osz), 4, dtype=dt)
            dist.all_to_all_single(a2av, vals((sum(isz), 4), dt, rank, 11), osz, isz, group=g)
            return out + lst + [big, s_out, a2a, a2av] + (g_out or [])
        c.both(f"movement[{dn}]", move)

        def a2a_list(g, dt=dt):
            outs = [torch.empty(5, dtype=dt) for _ in range(p)]
            dist.all_to_all(outs, [vals((5,), dt, rank, q) for q in range(p)], group=g)
            return outs
        try:
            c.both(f"all_to_all[{dn}]", a2a_list)
        except (RuntimeError, ValueError) as e:
            # gloo has no list all_to_all on CPU: compare with the definition.
            outs = a2a_list(None)
            for q in range(p):
                assert torch.equal(outs[q], vals((5,), dt, q, rank)), (q, outs[q])
            c.checked.append(f"all_to_all[{dn}] (vs definition: {str(e)[:40]})")

    # AVG (gloo has none) and PREMUL_SUM against gloo's SUM.
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        t = vals((64,), dt, rank)
        ref = t.clone()
        dist.all_reduce(ref, group=gloo)
        avg = t.clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        assert torch.equal(avg, ref / p), (avg, ref / p)
        pre = t.clone()
        dist.all_reduce(pre, op=dist._make_nccl_premul_sum(2.0))
        assert torch.equal(pre, ref * 2), (pre, ref * 2)
        o = torch.empty(16, dtype=dt)
        dist.reduce_scatter_tensor(o, vals((16 * p,), dt, rank), op=dist.ReduceOp.AVG)
        r2 = torch.empty(16, dtype=dt)
        dist.reduce_scatter_tensor(r2, vals((16 * p,), dt, rank), group=gloo)
        assert torch.equal(o, r2 / p)
        c.checked.append(f"avg/premul[{dt}]")
    # bool: SUM/MAX = or, PRODUCT/MIN = and (gloo agrees).
    for on, op in OPS.items():
        c.both(f"all_reduce[bool,{on}]", lambda g, op=op: _bool_ar(rank, op, g))

    # Coalesced forms.
    def coal(g):
        ts = [vals((10 + i,), torch.float32, rank, i) for i in range(3)]
        with dist._coalescing_manager(group=g):
            for t in ts:
                dist.all_reduce(t, group=g)
        outs = [torch.empty(p * 4) for _ in range(2)]
        with dist._coalescing_manager(group=g):
            for i, o in enumerate(outs):
                dist.all_gather_into_tensor(o, vals((4,), torch.float32, rank, i), group=g)
        rso = [torch.empty(3) for _ in range(2)]
        with dist._coalescing_manager(group=g):
            for i, o in enumerate(rso):
                dist.reduce_scatter_tensor(o, vals((3 * p,), torch.float32, rank, i), group=g)
        return ts + outs + rso
    c.both("coalesced", coal)

    def objects(g):
        objs = [None] * p
        dist.all_gather_object(objs, {"rank": rank, "x": [rank] * 3}, group=g)
        bl = [rank * 10, "s"] if rank == 1 else [None, None]
        dist.broadcast_object_list(bl, src=1, group=g)
        assert objs == [{"rank": q, "x": [q] * 3} for q in range(p)], objs
        assert bl == [10, "s"], bl
        return torch.tensor([len(objs)])
    c.both("objects", objects)

    # Point to point: isend/irecv, batch_isend_irecv (large, both ways),
    # blocking send/recv; same values as gloo.
    def p2p(g):
        nxt, prv = (rank + 1) % p, (rank - 1) % p
        big = vals((1 << 20,), torch.float32, rank)
        inbox = torch.empty_like(big)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, big, nxt, group=g),
                                       dist.P2POp(dist.irecv, inbox, prv, group=g)])
        for r in reqs:
            r.wait()
        small = torch.empty(7)
        sreq = dist.isend(vals((7,), torch.float32, rank, 3), nxt, group=g)
        dist.recv(small, prv, group=g)
        sreq.wait()
        assert sreq.is_completed()
        # Two ranks isend large tensors to each other before receiving.
        big2 = torch.empty(1 << 20)
        s2 = dist.isend(big, prv, group=g)
        r2 = dist.irecv(big2, nxt, group=g)
        r2.wait()
        s2.wait()
        return [inbox, small, big2]
    c.both("p2p", p2p)

    def barrier(g):
        dist.barrier(group=g)
        w = dist.barrier(group=g, async_op=True)
        w.wait()
        return torch.zeros(1)
    c.both("barrier", barrier)

    # Work: then() chains see the result; exceptions surface in wait.
    t = torch.ones(4)
    w = dist.all_reduce(t, async_op=True)
    f2 = w.get_future().then(lambda f: f.value()[0] * 2)
    assert torch.equal(f2.wait(), torch.full((4,), 2.0 * p))
    c.checked.append("future.then")

    # A blocking call's Work, as torch's C++ callers get it (asyncOp false):
    # its future, taken before its wait, holds that call's output; once
    # waited on and dropped it keeps no tensor alive (braid reuses one such
    # Work per thread).
    def blocking_work(g):
        pg = g if g is not None else dist.group.WORLD
        outs = []
        for k in range(3):
            t = vals((5,), torch.float32, rank, k)
            opts = dist.AllreduceOptions()
            opts.asyncOp = False
            w = pg.allreduce([t], opts)
            fut = w.get_future()
            w.wait()
            assert w.is_completed()
            assert torch.equal(fut.wait()[0], t), "a blocking call's future is not its output"
            outs.append(t)
        t = vals((1 << 16,), torch.float32, rank, 9)
        gone = weakref.ref(t)
        opts = dist.AllreduceOptions()
        opts.asyncOp = False
        w = pg.allreduce([t], opts)
        w.wait()
        del w, t
        gc.collect()
        assert gone() is None, "a waited blocking call's Work keeps its tensor alive"
        return outs
    c.both("blocking Work", blocking_work)

    # Subgroups: braid and gloo subgroups of the same ranks.
    sub_ranks = list(range(0, p, 2)) if p > 2 else [0, 1]
    bsub = dist.new_group(sub_ranks)
    gsub = dist.new_group(sub_ranks, backend="gloo")
    if rank in sub_ranks:
        a = vals((100,), torch.float32, rank)
        b = a.clone()
        dist.all_reduce(a, group=bsub)
        dist.all_reduce(b, group=gsub)
        assert torch.equal(a, b)
        assert dist.get_backend(bsub) == "braid"
        x = torch.empty(len(sub_ranks) * 3)
        dist.all_gather_into_tensor(x, vals((3,), torch.float32, rank), group=bsub)
        y = torch.empty(len(sub_ranks) * 3)
        dist.all_gather_into_tensor(y, vals((3,), torch.float32, rank), group=gsub)
        assert torch.equal(x, y)
    c.checked.append("subgroup")

    # Bad input raises and the group stays usable.
    errors = []
    for bad in (lambda: dist.all_reduce(torch.zeros(8, 2).t()),  # non-contiguous
                lambda: dist.all_reduce(torch.zeros(4, dtype=torch.int16)),
                lambda: dist.all_reduce(torch.zeros(4, dtype=torch.int32), op=dist.ReduceOp.BXOR),
                lambda: dist.all_gather_into_tensor(torch.zeros(3), torch.zeros(2))):
        try:
            bad()
        except ValueError as e:
            errors.append(type(e).__name__)
    assert len(errors) == 4, errors
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(p)))
    dist.destroy_process_group()
    return {"checked": c.checked, "gloo_refused": sorted(c.gloo_refused)}


def _bool_ar(rank, op, g):
    t = torch.tensor([rank % 2 == 0, True, False, rank == 0])
    dist.all_reduce(t, op=op, group=g)
    return t


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _train(model, rank, steps, seed=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    times = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 8, generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


@scenario
def torch_ddp(rank, p, spec):
    """The same DDP training loop on braid and on gloo: equal parameters."""
    gloo = init(rank, p, spec)
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = spec.get("steps", 20)
    torch.manual_seed(0)
    mb = DDP(Net())  # the default group: braid
    torch.manual_seed(0)
    mg = DDP(Net(), process_group=gloo)
    tb = _train(mb, rank, steps)
    tg = _train(mg, rank, steps)
    diffs = [float((a - b).abs().max()) for a, b in zip(mb.parameters(), mg.parameters())]
    # Parameters agree across ranks too.
    flat = torch.cat([q.detach().flatten() for q in mb.parameters()])
    other = flat.clone()
    dist.broadcast(other, src=0)
    dist.destroy_process_group()
    return {
        "max_diff": max(diffs),
        "equal": all(d == 0.0 for d in diffs),
        "ranks_agree": bool(torch.equal(flat, other)),
        "braid_ms": sorted(tb)[len(tb) // 2] * 1e3,
        "gloo_ms": sorted(tg)[len(tg) // 2] * 1e3,
    }


@scenario
def torch_fsdp2(rank, p, spec):
    """An FSDP2 (fully_shard) training step on braid and on gloo."""
    gloo = init(rank, p, spec)
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build(mesh):
        torch.manual_seed(0)
        m = Net()
        for layer in (m.a, m.b, m.c):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    mesh_b = init_device_mesh("cpu", (p,))
    assert dist.get_backend(mesh_b.get_group()) == "braid"
    mesh_g = DeviceMesh.from_group(gloo, "cpu")
    mb, mg = build(mesh_b), build(mesh_g)
    _train(mb, rank, 3)
    _train(mg, rank, 3)
    diffs = []
    for a, b in zip(mb.parameters(), mg.parameters()):
        fa, fb = a.full_tensor(), b.full_tensor()
        diffs.append(float((fa - fb).abs().max()))
    dist.destroy_process_group()
    return {"max_diff": max(diffs), "nparams": len(diffs)}


@scenario
def torch_kill(rank, p, spec):
    """A rank dies; dist.all_reduce raises braid's error naming it."""
    init(rank, p, spec, timeout=spec.get("timeout", 10))
    import braid

    t = torch.ones(1 << 14)
    for i in range(100000):
        if rank == p - 1 and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        except braid.Error as e:
            return {"type": type(e).__name__, "msg": str(e), "t_err": time.monotonic()}
    raise AssertionError("no error")


# ---------------------------------------------------------------------------
# What gloo does that programs rely on: tags, receives from any source,
# sparse all_reduce, split sizes of any sequence type, precise messages.


def _others(rank, p):
    return [q for q in range(p) if q != rank]


@scenario
def torch_p2p_tags(rank, p, spec):
    """Point to point with tags and from any source, against gloo."""
    gloo = init(rank, p, spec)
    c = Checker(gloo)
    sizes = {1: 5, 2: 300_000, 3: 17}  # tag 2: larger than a burst's head

    def out_of_order(g):
        # Every rank isends three tagged messages to every other rank, which
        # receives them in another order than they were sent.
        reqs = [
            dist.isend(vals((n,), torch.float32, rank, tag * 10 + q), q, group=g, tag=tag)
            for q in _others(rank, p)
            for tag, n in sizes.items()
        ]
        out = []
        for q in _others(rank, p):
            bufs = {tag: torch.empty(n) for tag, n in sizes.items()}
            for tag in (3, 1, 2):
                dist.recv(bufs[tag], q, group=g, tag=tag)
            out += [bufs[t] for t in sorted(bufs)]
        for r in reqs:
            r.wait()
        return out
    c.both("tags out of order", out_of_order)

    def batch(g):
        # batch_isend_irecv with tags; the receives are posted in the
        # other order; two messages with one tag keep their order.
        ops, outs = [], {}
        for q in _others(rank, p):
            for tag in (5, 6, 6):
                ops.append(dist.P2POp(dist.isend, vals((7 + tag,), torch.int64, rank, tag + len(ops)),
                                      q, group=g, tag=tag))
        for q in _others(rank, p):
            for k, tag in enumerate((6, 5, 6)):
                t = torch.empty(7 + tag, dtype=torch.int64)
                outs[(q, k)] = t
                ops.append(dist.P2POp(dist.irecv, t, q, group=g, tag=tag))
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        return [outs[k] for k in sorted(outs)]
    c.both("batch_isend_irecv tags", batch)

    def any_source(g):
        # Rank 0 receives from any source (recv and irecv, tag 4) while a
        # tag-9 message of every sender waits for its own receive.
        if rank == 0:
            got = []
            for i in range(2 * (p - 1)):
                t = torch.full((6,), -1.0)
                if i % 2 == 0:
                    s = dist.recv(t, group=g, tag=4)
                else:
                    w = dist.irecv(t, group=g, tag=4)
                    w.wait()
                    s = w._source_rank()
                assert torch.equal(t, torch.full((6,), float(s))), (s, t)
                got.append(s)
            late = []
            for q in _others(rank, p):
                t = torch.empty(3, dtype=torch.int32)
                dist.recv(t, q, group=g, tag=9)
                late.append(t)
            # Which sender comes first varies: compare the multiset.
            return [torch.tensor(sorted(got))] + late
        w9 = dist.isend(torch.full((3,), 100 + rank, dtype=torch.int32), 0, group=g, tag=9)
        dist.send(torch.full((6,), float(rank)), 0, group=g, tag=4)
        dist.send(torch.full((6,), float(rank)), 0, group=g, tag=4)
        w9.wait()
        return []
    c.both("recv from any source", any_source)

    def big_unexpected(g):
        # A large message that no receive wants yet is kept while a later
        # small one with another tag is received first.
        nxt, prv = (rank + 1) % p, (rank - 1) % p
        a = dist.isend(vals((1 << 20,), torch.float32, rank, 1), nxt, group=g, tag=11)
        b = dist.isend(vals((3,), torch.float32, rank, 2), nxt, group=g, tag=12)
        small, big = torch.empty(3), torch.empty(1 << 20)
        dist.recv(small, prv, group=g, tag=12)
        dist.recv(big, prv, group=g, tag=11)
        a.wait()
        b.wait()
        return [small, big]
    c.both("large unexpected message", big_unexpected)

    # Bad tags and peers raise before anything is sent; the group goes on.
    import braid
    errors = []
    for bad in (lambda: dist.isend(torch.ones(2), (rank + 1) % p, tag=-1),
                lambda: dist.irecv(torch.ones(2), (rank + 1) % p, tag=-3),
                lambda: dist.isend(torch.ones(2), rank)):
        try:
            bad()
        except (braid.InvalidArgumentError, ValueError) as e:
            errors.append(str(e))
    assert len(errors) == 3, errors
    assert "tag -1" in errors[0] and "non-negative" in errors[0], errors
    # A receive into a tensor that a pending send uses is refused; the send
    # still goes (and is received).
    nxt, prv = (rank + 1) % p, (rank - 1) % p
    x, y = vals((4,), torch.float32, rank, 20), torch.empty(4)
    w = dist.isend(x, nxt, tag=20)
    try:
        dist.irecv(x, prv, tag=20)
        raise AssertionError("overlap not refused")
    except braid.InvalidArgumentError as e:
        assert "overlaps" in str(e), e
    dist.recv(y, prv, tag=20)
    w.wait()
    assert torch.equal(y, vals((4,), torch.float32, prv, 20)), y
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(p)))
    dist.destroy_process_group()
    return {"checked": c.checked, "gloo_refused": sorted(c.gloo_refused)}


def _sparse_case(case, rank, p):
    g = torch.Generator().manual_seed(100 * case + rank)
    if case == 0:  # 1-d, duplicates (not coalesced), nnz differs per rank
        n = 3 + rank
        i = torch.randint(0, 20, (1, n), generator=g)
        i[0, -1] = i[0, 0]
        return torch.sparse_coo_tensor(i, torch.randn(n, generator=g), (20,))
    if case == 1:  # 2 sparse dims, float64
        n = 5 + 2 * rank
        i = torch.stack([torch.randint(0, 6, (n,), generator=g), torch.randint(0, 7, (n,), generator=g)])
        return torch.sparse_coo_tensor(i, torch.randn(n, generator=g, dtype=torch.float64), (6, 7))
    if case == 2:  # hybrid: 1 sparse dim, dense rows of 3; int64 values
        n = 4
        i = torch.randint(0, 9, (1, n), generator=g)
        return torch.sparse_coo_tensor(i, torch.randint(-5, 5, (n, 3), generator=g), (9, 3))
    # case 3: rank 1 has no entries at all
    n = 0 if rank == 1 else 4
    i = torch.randint(0, 10, (1, n), generator=g)
    return torch.sparse_coo_tensor(i, torch.randn(n, generator=g), (10,))


class _SparseNet(torch.nn.Module):
    def __init__(self, with_dense):
        super().__init__()
        self.emb = torch.nn.Embedding(60, 8, sparse=True)
        self.lin = torch.nn.Linear(8, 3) if with_dense else None

    def forward(self, idx):
        h = self.emb(idx).sum(1)
        return self.lin(h) if self.lin is not None else h[:, :3]


@scenario
def torch_sparse(rank, p, spec):
    """Sparse all_reduce against gloo's (indices, values, layout), and DDP
    with a sparse embedding against gloo's."""
    import braid
    from torch.nn.parallel import DistributedDataParallel as DDP

    gloo = init(rank, p, spec)
    c = Checker(gloo)
    for case in range(4):
        def sp(g, case=case):
            t = _sparse_case(case, rank, p)
            w = dist.all_reduce(t, group=g, async_op=True)
            w.wait()
            assert w.result()[0] is t
            assert t.layout == torch.sparse_coo
            return [t._indices(), t._values(), torch.tensor([t.is_coalesced()])]
        c.both(f"sparse all_reduce[{case}]", sp)
    # Only SUM, as gloo; different shapes raise on every rank; the group
    # stays usable.
    errs = []
    try:
        dist.all_reduce(_sparse_case(0, rank, p), op=dist.ReduceOp.MAX)
    except braid.InvalidArgumentError as e:
        errs.append(str(e))
    try:
        dist.all_reduce(torch.sparse_coo_tensor([[0]], [1.0], (5 + rank,)))
    except braid.InvalidArgumentError as e:
        errs.append(str(e))
    assert len(errs) == 2 and "SUM" in errs[0] and "differ across ranks" in errs[1], errs
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(p)))

    # DDP with a sparse embedding: the same training on braid and gloo.
    # Every gradient sum is in rank order on both (sparse), so the
    # parameters end bit-identical; with a dense layer too on 2 ranks (two
    # summands add alike in any order).
    diffs = {}
    for with_dense in ([False, True] if p == 2 else [False]):
        models = []
        for group in (None, gloo):
            torch.manual_seed(0)
            m = DDP(_SparseNet(with_dense), process_group=group)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(7 + rank)
            for _ in range(8):
                idx = torch.randint(0, 60, (5, 4), generator=g)
                y = torch.randn(5, 3, generator=g)
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(idx), y).backward()
                assert m.module.emb.weight.grad.is_sparse
                opt.step()
            models.append(m)
        mb, mg = models
        diffs[str(with_dense)] = max(float((a - b).abs().max())
                                     for a, b in zip(mb.parameters(), mg.parameters()))
        moved = float((mb.module.emb.weight - _SparseNet(with_dense).emb.weight).abs().max())
        c.checked.append(f"ddp sparse (dense layer: {with_dense})")
    dist.destroy_process_group()
    return {"checked": c.checked, "gloo_refused": sorted(c.gloo_refused), "ddp_diffs": diffs,
            "moved": moved}


@scenario
def torch_threads(rank, p, spec):
    """The warning init_process_group gives when torch's intra-op threads
    outnumber this rank's share of the CPUs (set here to one per CPU this
    process may run on, torch's default where nothing sets it, and at least
    two), and the advice's answer in the cases it must stay silent."""
    import warnings

    from braid._torch import core

    cpus = len(os.sched_getaffinity(0))
    many = max(2, cpus)
    torch.set_num_threads(many)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        init(rank, p, spec)
    said = [str(w.message) for w in caught if "braid:" in str(w.message)]
    comm = dist.distributed_c10d._get_default_group()._core.comm
    out = {"cpus": cpus, "share": list(comm.cpu_share), "said": said}
    torch.set_num_threads(1)
    out["one thread"] = core.threads_advice(comm)
    torch.set_num_threads(many)
    out["again"] = core.threads_advice(comm)
    for var, val in (("OMP_NUM_THREADS", str(cpus)), ("OMP_WAIT_POLICY", "passive")):
        os.environ[var] = val
        out[var] = core.threads_advice(comm)
        del os.environ[var]
    dist.barrier()
    dist.destroy_process_group()
    return out


@scenario
def torch_args(rank, p, spec):
    """all_to_all_single's split sizes as any sequence of ints (against
    gloo's result with lists), and argument errors that name their cause."""
    import numpy as np

    import braid

    gloo = init(rank, p, spec)
    isz = [(rank + q) % 3 + 1 for q in range(p)]
    osz = [(q + rank) % 3 + 1 for q in range(p)]
    inp = vals((sum(isz), 4), torch.float32, rank, 11)
    want = torch.empty(sum(osz), 4)
    dist.all_to_all_single(want, inp, osz, isz, group=gloo)
    forms = {
        "list": list, "tuple": tuple,
        "numpy int64": lambda x: np.array(x, dtype=np.int64),
        "numpy int32": lambda x: np.array(x, dtype=np.int32),
        "tensor int64": lambda x: torch.tensor(x, dtype=torch.int64),
        "tensor int32": lambda x: torch.tensor(x, dtype=torch.int32),
    }
    checked = []
    for name, conv in forms.items():
        got = torch.empty(sum(osz), 4)
        dist.all_to_all_single(got, inp, conv(osz), conv(isz))
        assert torch.equal(got, want), name
        w = dist.all_to_all_single(got, inp, conv(osz), conv(isz), async_op=True)
        w.wait()
        assert torch.equal(got, want), name
        checked.append(f"split sizes as {name}")

    def err(fn):
        try:
            fn()
        except braid.Error as e:
            return str(e)
        raise AssertionError("no error")

    msgs = {
        "float split sizes": err(lambda: dist.all_to_all_single(
            torch.empty(sum(osz), 4), inp, [1.5] * p, isz)),
        "negative split size": err(lambda: dist.all_to_all_single(
            torch.empty(sum(osz), 4), inp, osz, [-1] + isz[1:])),
    }
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    meta = torch.empty(4, device="meta")
    msgs["sparse broadcast"] = err(lambda: dist.broadcast(sparse, src=0))
    msgs["sparse all_gather_into_tensor"] = err(
        lambda: dist.all_gather_into_tensor(torch.empty(4 * p), sparse))
    msgs["sparse reduce_scatter_tensor"] = err(
        lambda: dist.reduce_scatter_tensor(torch.empty(4), torch.sparse_coo_tensor([[0]], [1.0], (4 * p,))))
    msgs["sparse isend"] = err(lambda: dist.isend(sparse, (rank + 1) % p))
    msgs["sparse reduce"] = err(lambda: dist.reduce(sparse, dst=0))
    msgs["sparse reduce_scatter"] = err(
        lambda: dist.reduce_scatter(torch.empty(4), [sparse] * p))
    msgs["sparse all_reduce_coalesced"] = err(
        lambda: dist.all_reduce_coalesced([sparse, torch.ones(2)]))
    msgs["meta all_reduce"] = err(lambda: dist.all_reduce(meta))
    msgs["meta broadcast"] = err(lambda: dist.broadcast(meta, src=0))
    msgs["meta all_gather_into_tensor"] = err(
        lambda: dist.all_gather_into_tensor(torch.empty(4 * p, device="meta"), meta))
    msgs["meta all_to_all_single"] = err(
        lambda: dist.all_to_all_single(torch.empty(4, device="meta"), meta))
    msgs["meta isend"] = err(lambda: dist.isend(meta, (rank + 1) % p))
    msgs["transposed all_reduce"] = err(lambda: dist.all_reduce(torch.zeros(3, 2).t()))
    msgs["BAND all_reduce of float"] = err(
        lambda: dist.all_reduce(torch.zeros(3), op=dist.ReduceOp.BAND))
    # Still usable.
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(p)))
    dist.destroy_process_group()
    return {"checked": checked, "msgs": msgs}


@scenario
def torch_p2p_kill(rank, p, spec):
    """A rank dies while the others wait for its messages: a receive from
    it and a receive from any rank both end with braid's error naming it."""
    init(rank, p, spec, timeout=spec.get("timeout", 10))
    import braid

    t = torch.ones(4)
    dist.all_reduce(t)  # every rank is up
    if rank == p - 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    buf = torch.empty(4)
    try:
        if rank == 0:
            dist.recv(buf, p - 1, tag=3)
        else:
            dist.recv(buf, tag=3)  # from any rank
    except braid.Error as e:
        return {"type": type(e).__name__, "msg": str(e), "t_err": time.monotonic()}
    raise AssertionError("no error")


def _reconfigure_run(backend, rank, p, spec, tag):
    """torch's reconfigure API on `backend`: a group created with
    enable_reconfigure=True, handles exchanged through a store, all ranks
    reconfigured, then the first p-1 ranks alone. Returns what each step saw."""
    store = dist.FileStore(os.path.join(spec["tmp"], f"reconf-{tag}"), p)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=p,
        timeout=datetime.timedelta(seconds=30),
        enable_reconfigure=True,
    )
    out = {"supports": dist._supports_reconfigure()}
    sums = []
    for step, members in enumerate([list(range(p)), list(range(p - 1))]):
        if rank not in members:
            break
        store.set(f"{tag}/handle/{step}/{rank}", dist._get_reconfigure_handle())
        keys = [f"{tag}/handle/{step}/{r}" for r in members]
        store.wait(keys, datetime.timedelta(seconds=30))
        handles = [store.get(k).decode() for k in keys]
        dist._reconfigure(uuid=1000 + step, handles=handles).wait()
        t = torch.full((1000,), float(rank + 1))
        dist.all_reduce(t)
        sums.append([t[0].item(), dist.get_world_size(), dist.get_rank()])
    out["sums"] = sums
    # Every rank leaves the store before any destroys it.
    store.add(f"{tag}/done", 1)
    store.wait([f"{tag}/done"], datetime.timedelta(seconds=30))
    while int(store.add(f"{tag}/done", 0)) < p:
        time.sleep(0.01)
    dist.destroy_process_group()
    return out


@scenario
def torch_reconfigure(rank, p, spec):
    """The reconfigure API on braid and on gloo, side by side."""
    import braid  # noqa: F401  (registers the backend; the entry point does too)

    got = _reconfigure_run("braid", rank, p, spec, "braid")
    want = _reconfigure_run("gloo", rank, p, spec, "gloo")
    return {"braid": got, "gloo": want}


@scenario
def torch_shrink_group(rank, p, spec):
    """The last rank dies; the others shrink it out with
    torch.distributed.shrink_group and go on, checked against a gloo group
    of the survivors."""
    init(rank, p, spec, timeout=20)
    victim = p - 1
    t = torch.ones(1 << 12)
    err = None
    for i in range(1_000_000):
        if rank == victim and i == 10:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(t.clone())
        except Exception as e:  # noqa: BLE001 (torch wraps braid's errors)
            err = type(e).__name__
            break
    pg = dist.shrink_group([victim])
    x = torch.arange(100, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(x, group=pg)
    want = torch.arange(100, dtype=torch.float32) * sum(r + 1 for r in range(p - 1))
    return {"error": err, "size": pg.size(), "rank": pg.rank(), "equal": bool(torch.equal(x, want)),
            "default": dist.get_world_size()}
