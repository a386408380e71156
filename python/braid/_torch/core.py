"""The braid communicator behind a process group and its backend, and the
batching of point-to-point operations (issued together on the group's
mailbox)."""

from __future__ import annotations

import datetime
import os
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import _braid
from ..errors import InvalidArgumentError, UnusableError
from . import rendezvous
from .tensors import host
from .work import BraidWork, seconds


class _Unconfigured:
    """The communicator of a group created with ``enable_reconfigure=True``
    until ``reconfigure()`` gives it one: every use says so."""

    def refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise UnusableError(
            "braid: this process group was created with enable_reconfigure=True and has "
            "no communicator until reconfigure() is called (torch.distributed._reconfigure)"
        )

    def __getattr__(self, name: str) -> Any:
        return self.refuse()


def threads_advice(comm: Any) -> str | None:
    """What to do when torch runs more intra-op threads per rank than this
    rank's share of the CPUs it shares with the other ranks of its host
    (``comm.cpu_share``: ``cpus // ranks``, at least one), and the user set
    neither ``OMP_NUM_THREADS`` nor ``OMP_WAIT_POLICY``; None otherwise.
    torch's default is one thread per core in every process, so ranks
    started without torchrun (``mp.spawn``, a plain ``python``) run that
    many threads each, and OpenMP's waiting threads spin: on a 2-CPU host,
    2 ranks of 2 threads took 3-4x longer per DDP step than with one thread
    each, on braid and on gloo alike (docs/python.md, "Training steps")."""
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("OMP_WAIT_POLICY"):
        return None
    ranks, cpus = comm.cpu_share
    threads = torch.get_num_threads()
    # Each rank's fair share (at least one thread, even where ranks
    # outnumber the CPUs: braid's waits yield then).
    each = max(1, cpus // ranks)
    if ranks < 2 or threads <= each:
        return None
    return (
        f"braid: {ranks} ranks of this host share {cpus} CPUs and torch runs {threads} "
        f"intra-op threads in each ({ranks * threads} threads for {cpus} CPUs); OpenMP's "
        "waiting threads spin on the CPUs the other ranks and the collectives need, which "
        "can make a training step several times slower. Set OMP_NUM_THREADS="
        f"{each} (as torchrun does), or call torch.set_num_threads({each}) before "
        "init_process_group, or set OMP_WAIT_POLICY=passive"
    )


# Whether this process said `threads_advice` once already.
_advised = False


def advise_threads(comm: Any) -> None:
    """Warn once per process with `threads_advice`, if it has any."""
    global _advised
    if _advised:
        return
    msg = threads_advice(comm)
    if msg is not None:
        _advised = True
        warnings.warn(msg, RuntimeWarning, stacklevel=2)


class Core:
    """One braid communicator behind a process group and its backend."""

    def __init__(
        self,
        comm: _braid.Communicator,
        rank: int,
        size: int,
        timeout: float | None,
        mbox: _braid.Communicator,
    ) -> None:
        self.install(comm, mbox, rank, size)
        self.timeout = timeout
        # Where this process would host a reconfigured group's rendezvous
        # (its reconfigure handle names it); made on first use.
        self.slot: _braid.RootSlot | None = None
        self.handle_id = ""
        self.store: dist.Store | None = None
        # Point-to-point operations not yet issued (see flush):
        # (is_send, peer or -1 for any source, tag, address, bytes).
        self.p2p_ops: list[tuple[bool, int, int, int, int]] = []
        self.p2p_recvs = 0
        self.p2p_keep: list[torch.Tensor] = []
        self.p2p_works: list[BraidWork] = []
        self.coalescing = False
        self.lock = threading.RLock()

    def install(self, comm: Any, mbox: Any, rank: int, size: int) -> None:
        """Run on `comm` (and its mailbox `mbox`) as `rank` of `size` from
        now on (creation, reconfigure)."""
        self.comm = comm
        self.mbox = mbox
        if isinstance(comm, _Unconfigured):
            self.raw = self.raw_seq = self.raw_blocks = self.raw_tagged = comm.refuse
        else:
            self.raw = comm._raw
            self.raw_seq = comm._raw_seq
            self.raw_blocks = comm._raw_blocks
            # Point to point: the group's mailbox (tags, any source), on a
            # communicator and worker of its own.
            self.raw_tagged = mbox._raw_tagged
        self.rank = rank
        self.size = size

    @classmethod
    def unconfigured(
        cls, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta | None
    ) -> Core:
        """The core of a group created with ``enable_reconfigure=True``:
        no communicator until ``reconfigure()``."""
        u = _Unconfigured()
        core = cls(u, rank, size, seconds(timeout), u)
        core.store = store
        return core

    @classmethod
    def create(
        cls, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta | None
    ) -> Core:
        secs = seconds(timeout)
        comm = rendezvous.join(store, rank, size, secs)
        # Every rank of the group creates the mailbox (a collective).
        core = cls(comm, rank, size, secs, comm._mailbox())
        core.store = store
        advise_threads(comm)
        return core

    # ---- point-to-point batching --------------------------------------

    def add_p2p(
        self, is_send: bool, tensors: Sequence[torch.Tensor], peer: int | None, tag: Any = 0
    ) -> BraidWork:
        """Queue sends to / receives from `peer` (None: a receive from any
        source) with `tag`; checked here, before anything is sent."""
        if peer is None:
            peer = -1
        elif not isinstance(peer, int) or not 0 <= peer < self.size or peer == self.rank:
            raise InvalidArgumentError(
                f"braid: peer {peer} is not another rank of this group (0..{self.size - 1}, "
                f"this rank is {self.rank})"
            )
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 1 << 63:
            raise InvalidArgumentError(
                f"braid: tag {tag!r} is not a non-negative integer (as gloo's tags)"
            )
        bufs = [host(t) for t in tensors]
        with self.lock:
            # A receive needs memory of its own within the batch.
            for i, (addr, n) in enumerate(bufs):
                mine = ([] if is_send else bufs[:i]) + [
                    op[3:] for op in self.p2p_ops if not is_send or not op[0]
                ]
                if n and any(b and addr < a + b and a < addr + n for a, b in mine):
                    raise InvalidArgumentError(
                        "braid: this tensor overlaps another tensor of the point-to-point "
                        "operations not yet run; a receive needs memory of its own"
                    )
            first = self.p2p_recvs
            for t, (addr, n) in zip(tensors, bufs, strict=True):
                self.p2p_ops.append((is_send, peer, tag, addr, n))
                self.p2p_keep.append(t)
            w = BraidWork(None, list(tensors), core=self)
            if not is_send:
                w._src_index = first
                self.p2p_recvs += len(bufs)
            self.p2p_works.append(w)
        return w

    def flush(self) -> _braid.Handle | None:
        """Issue the pending point-to-point operations together, on the
        mailbox (they run on its worker, beside the collectives)."""
        with self.lock:
            if not self.p2p_ops:
                return None
            ops, keep, works = self.p2p_ops, self.p2p_keep, self.p2p_works
            self.p2p_ops, self.p2p_keep, self.p2p_works = [], [], []
            self.p2p_recvs = 0
            try:
                h = self.raw_tagged(ops, keep)
            except BaseException as e:
                for w in works:  # their wait() raises it
                    w._core = None
                    w._exc = e
                raise
            for w in works:
                w._attach(h)
            return h
