"""Test scenarios, one process per rank (started by harness.run).

    python workers.py <scenario> <rank> <nranks> <json spec>

Each scenario returns a JSON-able dict, printed on a ``RESULT:`` line.
References come from numpy (or gloo, for the torch backend), never from
braid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

import braid

SCENARIOS = {}


def scenario(f):
    SCENARIOS[f.__name__] = f
    return f


def comm_of(rank, nranks, spec, timeout=None):
    return braid.Communicator.init(spec["uid"], rank, nranks, timeout=timeout)


# ---------------------------------------------------------------------------
# Python API: every collective x datatype x operator against numpy.

NP_TYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"]
OPS = ["SUM", "PROD", "MIN", "MAX", "AVG"]


def inputs(r, n, dtype, op, salt=0):
    """Rank r's input: small integers, so that sums and products are exact
    in every datatype (and stay in range of int8)."""
    i = np.arange(n, dtype=np.int64)
    if op == "PROD":
        v = (i * 3 + r + salt) % 3  # 0, 1, 2
        v = np.where(v == 0, -1, v)  # -1, 1, 2: |prod| <= 16 on 4 ranks
    else:
        v = (i * 7 + r * 5 + salt) % 7 - 3  # -3..3
    if np.dtype(dtype).kind == "u":
        v = np.abs(v)
    return v.astype(dtype)


def reference(arrs, dtype, op):
    a = np.stack([x.astype(np.float64) for x in arrs])
    if op == "SUM":
        r = a.sum(0)
    elif op == "PROD":
        r = a.prod(0)
    elif op == "MIN":
        r = a.min(0)
    elif op == "MAX":
        r = a.max(0)
    else:
        s = a.sum(0)
        if dtype != "bfloat16" and np.dtype(dtype).kind in "iu":
            r = np.trunc(s / len(arrs))  # braid: integer division toward zero
        else:
            r = s / len(arrs)
    return r


def same(got, want, dtype, op, what):
    got64 = np.asarray(got).astype(np.float64)
    kind = np.dtype(dtype).kind if dtype != "bfloat16" else "f"
    if op == "AVG" and kind == "f":
        rtol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6}.get(str(dtype), 1e-12)
        ok = np.allclose(got64, want, rtol=rtol, atol=0)
    else:
        ok = np.array_equal(got64, want)
    if not ok:
        bad = np.nonzero(~np.isclose(got64, want))[0][:5]
        raise AssertionError(
            f"{what}: {dtype} {op}: got {got64[bad]} at {bad}, want {np.asarray(want)[bad]}"
        )


@scenario
def matrix(rank, p, spec):
    comm = comm_of(rank, p, spec)
    sizes = spec.get("sizes", [1, 5, 70_000])
    checked = 0
    pending = []  # (handle, check) of asynchronous calls, checked at the end
    for dtype in NP_TYPES:
        for op in OPS:
            bop = braid.Op[op]
            for k in sizes:
                n = k * p
                xs = [inputs(r, n, dtype, op) for r in range(p)]
                ref = reference(xs, dtype, op)
                mine = xs[rank]
                asy = (k + len(op)) % 2 == 1  # mix blocking and asynchronous
                # AllReduce, out of place and in place.
                out = np.empty_like(mine)
                h = comm.all_reduce(mine, out, bop, async_op=asy)
                buf = mine.copy()
                h2 = comm.all_reduce(buf, op=bop, async_op=asy)
                if asy:
                    pending.append((h, lambda out=out, ref=ref, d=dtype, o=op: same(out, ref, d, o, "all_reduce")))
                    pending.append((h2, lambda buf=buf, ref=ref, d=dtype, o=op: same(buf, ref, d, o, "all_reduce in place")))
                else:
                    same(out, ref, dtype, op, "all_reduce")
                    same(buf, ref, dtype, op, "all_reduce in place")
                # ReduceScatter.
                out = np.empty(k, dtype=dtype)
                comm.reduce_scatter(mine, out, bop)
                same(out, ref[rank * k : (rank + 1) * k], dtype, op, "reduce_scatter")
                buf = mine.copy()
                comm.reduce_scatter(buf, op=bop)
                same(buf[rank * k : (rank + 1) * k], ref[rank * k : (rank + 1) * k], dtype, op, "reduce_scatter in place")
                # Reduce to each root in turn.
                root = (k + len(op)) % p
                out = np.zeros_like(mine)
                comm.reduce(mine, out if rank == root else None, bop, root)
                if rank == root:
                    same(out, ref, dtype, op, "reduce")
                buf = mine.copy()
                comm.reduce(buf, op=bop, root=root)
                if rank == root:
                    same(buf, ref, dtype, op, "reduce in place")
                else:
                    assert np.array_equal(buf, mine), "reduce in place changed a non-root buffer"
                checked += 8
            # Data movement once per datatype (the operator does not apply).
            if op != "SUM":
                continue
            for k in sizes:
                n = k * p
                xs = [inputs(r, n, dtype, "SUM", salt=11) for r in range(p)]
                mine = xs[rank]
                blocks = [x[r * k : (r + 1) * k] for r, x in enumerate(xs)]
                # AllGather.
                out = np.empty(n, dtype=dtype)
                comm.all_gather(blocks[rank], out)
                same(out, np.concatenate(blocks).astype(np.float64), dtype, "SUM", "all_gather")
                buf = np.zeros(n, dtype=dtype)
                buf[rank * k : (rank + 1) * k] = blocks[rank]
                comm.all_gather(buf)
                same(buf, np.concatenate(blocks).astype(np.float64), dtype, "SUM", "all_gather in place")
                # Broadcast from each root.
                for root in range(p):
                    buf = mine.copy() if rank == root else np.zeros(n, dtype=dtype)
                    comm.broadcast(buf, root=root)
                    same(buf, xs[root].astype(np.float64), dtype, "SUM", "broadcast")
                    out = np.zeros(n, dtype=dtype)
                    comm.broadcast(mine if rank == root else None, out, root=root)
                    same(out, xs[root].astype(np.float64), dtype, "SUM", "broadcast out of place")
                # AllToAll: block j of rank i lands in block i of rank j.
                want = np.concatenate([xs[i][rank * k : (rank + 1) * k] for i in range(p)])
                out = np.empty(n, dtype=dtype)
                comm.all_to_all(mine, out)
                same(out, want.astype(np.float64), dtype, "SUM", "all_to_all")
                buf = mine.copy()
                comm.all_to_all(buf)
                same(buf, want.astype(np.float64), dtype, "SUM", "all_to_all in place")
                # Gather and scatter to/from the last rank.
                root = p - 1
                out = np.zeros(n, dtype=dtype) if rank == root else None
                comm.gather(blocks[rank], out, root=root)
                if rank == root:
                    same(out, np.concatenate(blocks).astype(np.float64), dtype, "SUM", "gather")
                out = np.zeros(k, dtype=dtype)
                comm.scatter(xs[root] if rank == root else None, out, root=root)
                same(out, xs[root][rank * k : (rank + 1) * k].astype(np.float64), dtype, "SUM", "scatter")
                # AllToAllv: rank i sends (i + j) % 3 + k elements to rank j.
                cnt = lambda i, j: (i + j) % 3 + k  # noqa: E731
                sc = [cnt(rank, j) for j in range(p)]
                rc = [cnt(i, rank) for i in range(p)]
                send = np.concatenate([np.full(cnt(rank, j), rank * 10 + j, dtype=dtype) for j in range(p)]) if dtype != "uint8" else np.concatenate([np.full(cnt(rank, j), rank * 4 + j, dtype=dtype) for j in range(p)])
                recv = np.zeros(sum(rc), dtype=dtype)
                comm.all_to_allv(send, sc, recv, rc)
                mul = 10 if dtype != "uint8" else 4
                want = np.concatenate([np.full(cnt(i, rank), i * mul + rank) for i in range(p)])
                same(recv, want.astype(np.float64), dtype, "SUM", "all_to_allv")
                checked += 9 + 2 * p
    for h, check in pending:
        h.wait()
        check()
    comm.barrier()
    return {"checked": checked}


@scenario
def bf16(rank, p, spec):
    """bfloat16 (and float16) through DLPack: torch CPU tensors."""
    import torch

    comm = comm_of(rank, p, spec)
    checked = 0
    for tdt, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        assert braid.datatype_of(torch.zeros(1, dtype=tdt)) == ("bfloat16" if name == "bfloat16" else "half")
        for op in OPS:
            for k in (3, 40_000):
                n = k * p
                xs = [inputs(r, n, "int64", op) for r in range(p)]
                ref = reference(xs, name, op)
                t = torch.from_numpy(xs[rank]).to(tdt)
                out = torch.empty_like(t)
                comm.all_reduce(t, out, braid.Op[op])
                same(out.float().numpy(), ref, name, op, "all_reduce")
                comm.all_reduce(t, op=braid.Op[op])
                same(t.float().numpy(), ref, name, op, "all_reduce in place")
                rs = torch.empty(k, dtype=tdt)
                comm.reduce_scatter(torch.from_numpy(xs[rank]).to(tdt), rs, braid.Op[op])
                same(rs.float().numpy(), ref[rank * k : (rank + 1) * k], name, op, "reduce_scatter")
                buf = torch.from_numpy(xs[rank]).to(tdt)
                comm.reduce(buf, op=braid.Op[op], root=0)
                if rank == 0:
                    same(buf.float().numpy(), ref, name, op, "reduce")
                checked += 4
        blocks = [torch.full((7,), float(r + 1), dtype=tdt) for r in range(p)]
        out = torch.empty(7 * p, dtype=tdt)
        comm.all_gather(blocks[rank], out)
        assert torch.equal(out, torch.cat(blocks))
        out = torch.empty(7 * p, dtype=tdt)
        comm.all_to_all(torch.cat(blocks), out)
        assert torch.equal(out, torch.full((7 * p,), float(rank + 1), dtype=tdt)), out
        b = torch.full((5,), 2.5, dtype=tdt) if rank == 0 else torch.zeros(5, dtype=tdt)
        comm.broadcast(b, root=0)
        assert torch.equal(b, torch.full((5,), 2.5, dtype=tdt))
        checked += 3
    return {"checked": checked}


@scenario
def tensor_views(rank, p, spec):
    """torch tensors read from their own attributes (not through DLPack):
    every datatype's name, views at an offset, and the tensors that must
    still take DLPack's checks (autograd, not contiguous, negative views,
    other dtypes) and their errors; a negative view, which DLPack would
    export as its negated memory, is refused."""
    import torch

    comm = comm_of(rank, p, spec)

    class NoDlpack(torch.Tensor):
        """A tensor whose __dlpack__ fails: only the direct read works."""

        def __dlpack__(self, *a, **k):
            raise AssertionError("__dlpack__ was called")

    names = {
        torch.int8: "int8", torch.uint8: "uint8", torch.int32: "int32", torch.int64: "int64",
        torch.float16: "half", torch.bfloat16: "bfloat16", torch.float32: "float",
        torch.float64: "double",
    }
    for tdt, name in names.items():
        t = torch.zeros(3, dtype=tdt)
        assert braid.datatype_of(t) == name, (tdt, braid.datatype_of(t))
        assert braid.datatype_of(t.as_subclass(NoDlpack)) == name, tdt
    # A view into the middle of a buffer: only its elements change.
    base = torch.arange(12, dtype=torch.float32) + 100 * rank
    view = base[4:8].as_subclass(NoDlpack)
    comm.all_reduce(view)
    want = torch.arange(12, dtype=torch.float32) + 100 * rank
    want[4:8] = sum(torch.arange(4, 8, dtype=torch.float32) + 100 * r for r in range(p))
    assert torch.equal(base, want), (base, want)
    # A row of a 2-d tensor, bf16 (the case DLPack made slow).
    m = torch.full((3, 5), float(rank + 1), dtype=torch.bfloat16)
    comm.all_reduce(m[1])
    assert torch.equal(m[1], torch.full((5,), float(sum(range(1, p + 1))), dtype=torch.bfloat16))
    assert torch.equal(m[0], torch.full((5,), float(rank + 1), dtype=torch.bfloat16))
    raised = {}
    cases = {
        "transposed": torch.zeros(4, 3).t(),
        "requires_grad": torch.zeros(4, requires_grad=True),
        "neg_view": torch._neg_view(torch.zeros(4)),
        "int16": torch.zeros(4, dtype=torch.int16),
        "bool": torch.zeros(4, dtype=torch.bool),
        "meta": torch.zeros(4, device="meta"),
    }
    for what, t in cases.items():
        try:
            comm.all_reduce(t)
        except braid.InvalidArgumentError as e:
            raised[what] = str(e)
        else:
            raise AssertionError(f"{what}: no error")
    assert "not contiguous" in raised["transposed"], raised
    assert "gradient" in raised["requires_grad"], raised
    assert "negative view" in raised["neg_view"], raised
    assert "int16" in raised["int16"] and "bool" in raised["bool"], raised
    assert "meta" in raised["meta"] or "host memory" in raised["meta"], raised
    # The communicator is still usable, on every rank alike.
    x = torch.ones(2)
    comm.all_reduce(x)
    assert torch.equal(x, torch.full((2,), float(p)))
    return {"raised": raised}


@scenario
def async_waiter_runs(rank, p, spec):
    """A handle waited at once may run its operation on the waiting thread
    (the worker had not started it, nothing before it was unfinished):
    results, callbacks and issue order are as on the worker."""
    comm = comm_of(rank, p, spec)
    me = threading.get_ident()
    here = 0
    for i in range(200):
        # The other ranks come 1 ms late, so the operation is unfinished when
        # the callback is added: it runs where the operation ran.
        late = rank != i % p
        if late:
            time.sleep(0.001)
        x = np.full(4, float(rank + i), dtype=np.float32)
        ran = []
        h = comm.all_reduce(x, async_op=True)
        h.add_done_callback(lambda err, ran=ran: ran.append((err, threading.get_ident())))
        h.wait()
        assert ran and ran[0][0] is None, ran
        here += not late and ran[0][1] == me
        assert (x == sum(float(r + i) for r in range(p))).all(), (i, x)
    # Waited out of order: the later one cannot run before the earlier.
    a = np.full(1000, float(rank), dtype=np.float64)
    b = np.full(3, 1.0)
    ha = comm.all_reduce(a, async_op=True)
    hb = comm.all_reduce(b, async_op=True)
    hb.wait()
    assert ha.done(), "a later operation finished before an earlier one"
    ha.wait()
    assert (a == sum(range(p))).all() and (b == p).all()
    # A blocking call behind queued ones, then synchronize.
    hs = [comm.all_reduce(np.full(50_000, 1.0), async_op=True) for _ in range(4)]
    y = np.ones(2)
    comm.all_reduce(y)
    assert all(h.done() for h in hs) and (y == p).all()
    comm.synchronize()
    assert comm.pending == 0
    return {"here": here}


@scenario
def kinds(rank, p, spec):
    """Buffer kinds: bytearray, memoryview, array.array, bytes (send only),
    numpy, torch; point to point, groups, async ordering."""
    import array

    comm = comm_of(rank, p, spec)
    assert comm.rank == rank and comm.size == p
    # bytearray (uint8) and memoryview casts.
    b = bytearray([rank + 1] * 8)
    comm.all_reduce(b)
    assert list(b) == [sum(range(1, p + 1))] * 8, list(b)
    m = memoryview(bytearray(8 * 4)).cast("i")
    for i in range(8):
        m[i] = rank * 100 + i
    comm.all_reduce(m, op=braid.MAX)
    assert list(m) == [(p - 1) * 100 + i for i in range(8)]
    a = array.array("d", [float(rank)] * 3)
    comm.all_reduce(a, op="sum")
    assert list(a) == [float(sum(range(p)))] * 3
    # bytes: read-only, fine as a send buffer.
    out = bytearray(4 * p)
    comm.all_gather(bytes([rank] * 4), out)
    assert list(out) == [r for r in range(p) for _ in range(4)]
    # Point to point: a ring shift in a group, then plain send/recv pairs.
    nxt, prv = (rank + 1) % p, (rank - 1) % p
    got = np.zeros(1000, dtype=np.float64)
    with comm.group() as g:
        g.send(np.full(1000, float(rank)), nxt)
        g.recv(got, prv)
    assert (got == prv).all()
    if rank == 0:
        comm.send(np.arange(10, dtype=np.int32), 1)
        back = np.zeros(10, dtype=np.int32)
        comm.recv(back, 1)
        assert (back == np.arange(10) * 2).all()
    elif rank == 1:
        x = np.zeros(10, dtype=np.int32)
        comm.recv(x, 0)
        comm.send(x * 2, 0)
    # Large exchange both ways in one group (no deadlock whatever the size).
    big = np.full(3 << 20, float(rank), dtype=np.float32)
    inbox = np.zeros_like(big)
    g = comm.group()
    g.send(big, nxt)
    g.recv(inbox, prv)
    g.run()
    assert (inbox == prv).all()
    # Asynchronous: handles complete in issue order; a blocking call after
    # them runs after them.
    bufs = [np.full(100_000, float(i + rank), dtype=np.float64) for i in range(6)]
    hs = [comm.all_reduce(x, async_op=True) for x in bufs]
    last = np.ones(4)
    comm.all_reduce(last)
    assert all(h.done() for h in hs), [h.done() for h in hs]
    for i, (h, x) in enumerate(zip(hs, bufs)):
        h.wait()
        assert (x == sum(float(i + r) for r in range(p))).all()
    assert (last == p).all()
    # A callback runs when the operation completes.
    seen = []
    h = comm.all_reduce(np.ones(3), async_op=True)
    h.add_done_callback(lambda err: seen.append(err))
    h.wait()
    assert seen == [None], seen
    assert comm.pending == 0
    comm.synchronize()
    # torch tensor through DLPack.
    import torch

    t = torch.full((6,), float(rank))
    comm.all_reduce(t)
    assert torch.equal(t, torch.full((6,), float(sum(range(p)))))
    return {"ok": True}


@scenario
def bad_input(rank, p, spec):
    """Rank 0 makes bad calls; each raises before anything is sent, and the
    communicator works afterwards (rank 1 issues only the good calls: a
    bad call that sent anything would break the next collective)."""
    comm = comm_of(rank, p, spec)
    raised = []
    if rank == 0:
        f = np.zeros(8, dtype=np.float32)
        cases = {
            "non-contiguous": lambda: comm.all_reduce(np.zeros(16, dtype=np.float32)[::2]),
            "read-only recv": lambda: comm.all_reduce(f, _ro(8)),
            "read-only in place": lambda: comm.all_reduce(_ro(8)),
            "bytes in place": lambda: comm.all_reduce(b"12345678"),
            "dtype mismatch": lambda: comm.all_reduce(f, np.zeros(8, dtype=np.float64)),
            "length mismatch": lambda: comm.all_reduce(f, np.zeros(9, dtype=np.float32)),
            "not a buffer": lambda: comm.all_reduce([1.0, 2.0]),
            "no braid dtype": lambda: comm.all_reduce(np.zeros(4, dtype=np.int16)),
            "complex": lambda: comm.all_reduce(np.zeros(4, dtype=np.complex64)),
            "bool": lambda: comm.all_reduce(np.zeros(4, dtype=bool)),
            "big-endian": lambda: comm.all_reduce(np.zeros(4, dtype=">f4")),
            "reduce_scatter sizes": lambda: comm.reduce_scatter(np.zeros(7, dtype=np.float32), np.zeros(3, dtype=np.float32)),
            "reduce_scatter blocks": lambda: comm.reduce_scatter(np.zeros(2 * p + 1, dtype=np.float32)),
            "all_gather sizes": lambda: comm.all_gather(np.zeros(3, dtype=np.float32), np.zeros(3 * p + 1, dtype=np.float32)),
            "overlap": lambda: comm.all_gather(f[:4], f),
            "root": lambda: comm.broadcast(f, root=p),
            "negative root": lambda: comm.reduce(f, root=-1),
            "peer self": lambda: comm.send(f, 0),
            "peer range": lambda: comm.recv(f, p + 3),
            "bad op": lambda: comm.all_reduce(f, op=17),
            "bad op name": lambda: comm.all_reduce(f, op="mean"),
            "a2av counts": lambda: comm.all_to_allv(f, [1] * (p + 1), np.zeros(8, dtype=np.float32), [1] * p),
            "a2av past end": lambda: comm.all_to_allv(f, [8] * p, np.zeros(8, dtype=np.float32), [8] * p),
            "gather recv": lambda: comm.gather(f, np.zeros(3, dtype=np.float32), root=0),
            "scatter no send": lambda: comm.scatter(None, f, root=0),
            "wait timeout arg": lambda: comm.all_reduce(f, async_op=True).wait(-1),
        }
        for name, call in cases.items():
            try:
                call()
            except braid.InvalidArgumentError as e:
                assert isinstance(e, ValueError)
                raised.append(name)
                continue
            except Exception as e:  # wrong class
                raise AssertionError(f"{name}: {type(e).__name__}: {e}") from e
            raise AssertionError(f"{name}: no exception")
    # The communicator is still usable, and in step: the one good call that
    # ran on rank 0 above ("wait timeout arg" issued an all_reduce before
    # its bad wait) is matched here.
    if rank != 0:
        comm.all_reduce(np.zeros(8, dtype=np.float32))
    x = np.full(5, float(rank + 1))
    comm.all_reduce(x)
    assert (x == sum(range(1, p + 1))).all(), x
    assert comm.async_error() is None
    return {"raised": raised}


def _ro(n):
    a = np.zeros(n, dtype=np.float32)
    a.setflags(write=False)
    return a


@scenario
def gil(rank, p, spec):
    """A blocking collective releases the GIL: while rank 0 waits for a late
    rank 1, another thread of rank 0 keeps running Python."""
    comm = comm_of(rank, p, spec)
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    th = threading.Thread(target=spin)
    th.start()
    if rank == 1:
        time.sleep(1.0)
    x = np.ones(4)
    before = ticks[0]
    t0 = time.monotonic()
    comm.all_reduce(x)
    waited = time.monotonic() - t0
    during = ticks[0] - before
    stop.set()
    th.join()
    return {"waited": waited, "ticks": during}


@scenario
def split_abort(rank, p, spec):
    comm = comm_of(rank, p, spec)
    # Split: even and odd ranks, ordered by descending rank.
    sub = comm.split(rank % 2, key=p - rank)
    members = [r for r in range(p) if r % 2 == rank % 2]
    assert sub.size == len(members)
    assert sub.rank == sorted(members, reverse=True).index(rank)
    x = np.array([float(rank)])
    sub.all_reduce(x)
    assert x[0] == sum(members)
    none = comm.split(None if rank == 0 else 1)
    assert (none is None) == (rank == 0)
    # Abort from another thread fails a pending operation promptly.
    err = {}
    if rank == 0:
        t = threading.Timer(0.5, comm.abort)
        t.start()
        t0 = time.monotonic()
        try:
            # The others join late; a large buffer cannot all be sent ahead
            # into the links, so they need rank 0 after its abort.
            comm.all_reduce(np.ones(1 << 23, dtype=np.float32))
        except braid.Error as e:
            err = {"type": type(e).__name__, "msg": str(e), "after": time.monotonic() - t0}
        assert comm.async_error() is not None
        try:
            comm.all_reduce(np.ones(4))
            raise AssertionError("an aborted communicator ran an operation")
        except braid.UnusableError:
            pass
    else:
        # The others see rank 0's abort as an error in the matching call.
        try:
            time.sleep(1.5)
            comm.all_reduce(np.ones(1 << 23, dtype=np.float32))
        except braid.Error as e:
            err = {"type": type(e).__name__, "msg": str(e), "peer": e.peer}
    return {"err": err}


@scenario
def kill(rank, p, spec):
    """The last rank dies (SIGKILL) during a loop of collectives; the others
    get an exception naming it."""
    comm = comm_of(rank, p, spec, timeout=spec.get("timeout"))
    victim = p - 1
    x = np.ones(1 << 16, dtype=np.float32)
    for i in range(1_000_000):
        if rank == victim and i == 50:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.all_reduce(x, op=braid.MAX)
        except braid.Error as e:
            t_err = time.monotonic()
            return {
                "type": type(e).__name__,
                "bases": [c.__name__ for c in type(e).__mro__],
                "peer": e.peer,
                "op": e.op,
                "msg": str(e),
                "iteration": i,
                "t_err": t_err,
            }
    raise AssertionError("no error")


@scenario
def stop(rank, p, spec):
    """Rank 1 stops (SIGSTOP); rank 0 gets a TimeoutError naming it."""
    comm = comm_of(rank, p, spec, timeout=spec["timeout"])
    x = np.ones(8)
    comm.all_reduce(x)
    if rank == 1:
        with open(os.path.join(spec["tmp"], "stopped"), "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
    except braid.TimeoutError as e:
        res = {"peer": e.peer, "msg": str(e), "after": time.monotonic() - t0,
               "builtin": isinstance(e, TimeoutError)}
    else:
        raise AssertionError("no timeout")
    # Done: end the stopped rank (its pid is in the file it wrote).
    os.kill(int(open(os.path.join(spec["tmp"], "stopped")).read()), signal.SIGKILL)
    return res


@scenario
def elastic(rank, p, spec):
    """The last rank dies mid-loop; the others find it gone, shrink it out
    and go on; then rank 1 revokes while ranks 0 and 2 wait in an
    all_reduce, and all shrink again; then they grow back to ``p`` with a
    new process that rank 0 starts (``elastic_join``). Every result is
    checked against numpy."""
    comm = comm_of(rank, p, spec, timeout=20)
    victim = p - 1
    x = np.full(1 << 14, rank + 1, dtype=np.float32)
    err = None
    for i in range(1_000_000):
        if rank == victim and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.all_reduce(x.copy())
        except braid.PeerFailedError as e:
            err = type(e).__name__
            break
    gone = []
    for _ in range(1000):
        gone = comm.gone_ranks()
        if gone:
            break
        time.sleep(0.005)
    s = comm.shrink(gone)
    y = np.full(1000, rank + 1, dtype=np.int64)
    s.all_reduce(y)
    assert (y == sum(r + 1 for r in range(p) if r != victim)).all(), y[:4]
    # Revoke: ranks 0 and 2 wait for rank 1, which revokes instead.
    revoked = None
    if s.rank == 1:
        time.sleep(0.3)
        s.revoke()
    else:
        t0 = time.monotonic()
        try:
            s.all_reduce(np.ones(8))
        except braid.RevokedError as e:
            revoked = {"msg": str(e), "after": time.monotonic() - t0,
                       "unusable": isinstance(e, braid.UnusableError)}
    assert s.is_revoked()
    s2 = s.shrink([])
    # Grow back to p ranks with a new process.
    child = None
    if s2.rank == 0:
        uid = s2.grow_id()
        child = subprocess.Popen(
            [sys.executable, __file__, "elastic_join", str(p - 1), str(p),
             json.dumps({"uid": str(uid)})],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    g = s2.grow(p)
    z = np.full(100, g.rank + 1, dtype=np.int64)
    g.all_reduce(z)
    assert (z == p * (p + 1) // 2).all(), z[:4]
    joined = None
    if child is not None:
        so, se = child.communicate(timeout=60)
        assert child.returncode == 0, se
        joined = json.loads(so.split("RESULT:")[1])
    return {"error": err, "gone": gone, "new_rank": s.rank, "revoked": revoked,
            "grown": [g.rank, g.size], "joined": joined}


@scenario
def elastic_join(rank, p, spec):
    """A process that joins a grown communicator (started by ``elastic``)."""
    g = braid.Communicator.init(spec["uid"], rank, p, timeout=20)
    z = np.full(100, g.rank + 1, dtype=np.int64)
    g.all_reduce(z)
    return {"rank": g.rank, "size": g.size, "sum": int(z[0])}


@scenario
def mismatch(rank, p, spec):
    comm = comm_of(rank, p, spec)
    try:
        if rank == 0:
            comm.all_reduce(np.ones(8, dtype=np.float32))
        else:
            comm.broadcast(np.ones(8, dtype=np.float32), root=0)
    except braid.Error as e:
        return {"type": type(e).__name__, "msg": str(e)}
    raise AssertionError("no error")


@scenario
def from_env(rank, p, spec):
    """Communicator.from_env() under torchrun's variables."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(p),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(p),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec["port"]),
        TORCHELASTIC_RUN_ID="pytest",
    )
    comm = braid.Communicator.from_env()
    x = np.array([rank], dtype=np.int64)
    comm.all_reduce(x)
    return {"rank": comm.rank, "size": comm.size, "sum": int(x[0])}


@scenario
def libraries(rank, p, spec):
    """Which of the hardware libraries (libibverbs, libcuda, NVML) this
    process has mapped after importing braid and running collectives."""
    comm = comm_of(rank, p, spec)
    x = np.arange(1024, dtype=np.float32)
    comm.all_reduce(x)
    comm.all_gather(np.ones(4, dtype=np.int32), np.zeros(4 * p, dtype=np.int32))
    names = ("libibverbs", "libcuda.so", "libnvidia-ml")
    with open("/proc/self/maps") as f:
        mapped = sorted({n for line in f for n in names if n in line})
    ok = bool(np.array_equal(x, np.arange(1024, dtype=np.float32) * p))
    return {"mapped": mapped, "ok": ok, "transports": comm.transports}


@scenario
def rank0_uid(rank, p, spec):
    """The usual pattern: rank 0 creates the id and shares its text."""
    path = os.path.join(spec["tmp"], "uid")
    if rank == 0:
        uid = braid.UniqueId.create()
        assert uid.hosts_root
        with open(path + ".tmp", "w") as f:
            f.write(str(uid))
        os.rename(path + ".tmp", path)
    else:
        for _ in range(600):
            if os.path.exists(path):
                break
            time.sleep(0.05)
        uid = braid.UniqueId(open(path).read())
    comm = braid.Communicator.init(uid, rank, p)
    x = np.ones(3)
    comm.all_reduce(x)
    assert (x == p).all()
    return {"ok": True}


@scenario
def latency(rank, p, spec):
    """Microseconds per blocking 8-byte all_reduce through the Python API."""
    comm = comm_of(rank, p, spec)
    x = np.zeros(2, dtype=np.float32)
    n = spec.get("iters", 20000)
    for _ in range(2000):
        comm.all_reduce(x)
    best = float("inf")
    for _ in range(5):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            comm.all_reduce(x)
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return {"us": best}


# ---------------------------------------------------------------------------


def main():
    name, rank, p, spec = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    if name.startswith("torch_"):
        import torch_workers

        fn = torch_workers.SCENARIOS[name]
    else:
        fn = SCENARIOS[name]
    res = fn(rank, p, spec)
    print("RESULT:" + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
