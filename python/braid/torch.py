"""The ``torch.distributed`` backend ``"braid"``.

After ``pip install``, torch finds it through the ``torch.distributed.backends``
entry point, so a program written for gloo runs on braid by changing the
backend name::

    import torch.distributed as dist
    dist.init_process_group("braid")        # torchrun, or init_method=..., rank=, world_size=

``import braid.torch`` registers it explicitly (older torch versions without
entry-point discovery, or to pass ``braid.torch.register`` around).

What it does:

- Every collective ``torch.distributed`` has on CPU tensors: all_reduce (and
  coalesced), broadcast, reduce, all_gather, all_gather_into_tensor (and
  coalesced), gather, scatter, reduce_scatter, reduce_scatter_tensor (and
  coalesced), all_to_all, all_to_all_single (with split sizes: any sequence
  of ints), send, recv, isend, irecv, batch_isend_irecv (tags, and receives
  from any source), barrier; all_reduce of sparse COO tensors (SUM, as
  gloo's: a coalesced sparse result); ``async_op=True`` returns a Work
  with ``wait()``, ``is_completed()`` and ``get_future()``; operations run in
  issue order, like a CUDA stream.
- ReduceOp SUM, PRODUCT, MIN, MAX, AVG and PREMUL_SUM (the input is scaled,
  then summed); BAND/BOR on bool tensors. Every braid datatype; bool is moved
  as bytes; movement-only collectives take any dtype.
- ``init_process_group(timeout=...)`` becomes braid's deadline for every wait
  (a dead or silent peer is an error naming it, never a hang).
- Rank 0 of each group creates the rendezvous with a random secret and
  shares it through torch's store; ``new_group`` makes a communicator of its
  own the same way.
- CUDA tensors: all_reduce, broadcast, reduce, all_gather_into_tensor,
  reduce_scatter_tensor and all_to_all_single (equal splits) run on the GPU
  through braid's device communicator (``braid.CudaComm``), on the current
  CUDA stream; the other calls are staged through host memory. Not yet run
  on a GPU. Without CUDA they raise ``braid.CudaError``.

isend/irecv are issued together: point-to-point operations wait until their
Work is waited on or polled, a blocking send/recv follows, or any other
operation is issued, and then run together (so two ranks that isend to each
other before they irecv do not deadlock, whatever the size). They travel
through the group's braid mailbox (``braid::Mailbox``, a communicator of
their own), which matches messages by source and tag as gloo does and
receives from any source (``recv`` without ``src``; the Work's
``_source_rank()`` says who sent).
"""

from __future__ import annotations

import datetime
import operator
import os
import socket
import threading
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import ProcessGroup as _ProcessGroup

from . import _braid
from .errors import CudaError, InvalidArgumentError

__all__ = ["register", "BraidProcessGroup", "BraidBackend", "BraidWork", "NAME"]

#: The backend's name in ``init_process_group``.
NAME = "braid"

# Datatypes and operators cross into braid by name (braid.datatypes(),
# braid.Op), converted to braid's own in one place, the binding.
# torch dtype -> braid datatype.
_DT: dict[torch.dtype, str] = {
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "half",
    torch.bfloat16: "bfloat16",
    torch.float32: "float",
    torch.float64: "double",
}
for _name in ("uint32", "uint64"):
    if hasattr(torch, _name):
        _DT[getattr(torch, _name)] = _name
_U8 = "uint8"
# Dimensions a sparse all_reduce's metadata has room for.
_SPARSE_DIMS = 64
# Complex tensors reduce as pairs of real numbers (SUM, AVG, PREMUL_SUM only).
_COMPLEX = {torch.complex64: "float", torch.complex128: "double"}

# torch ReduceOp (by its name) -> braid operator.
_BRAID_OP = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max"}
# bool: logical or / and as max / min of bytes.
_BOOL_OP = {"SUM": "max", "MAX": "max", "BOR": "max", "PRODUCT": "min", "MIN": "min", "BAND": "min"}


def _op_name(reduce_op: Any) -> str:
    """torch's name of a ReduceOp, RedOpType or its value ("SUM", "PREMUL_SUM", ...)."""
    op = getattr(reduce_op, "op", reduce_op)
    name = getattr(op, "name", None)
    if name is None:
        name = dist.ReduceOp.RedOpType(int(op)).name
    return name


def _seconds(timeout: Any) -> float | None:
    """A torch timeout (timedelta, or ms) as seconds; None for none."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        s = timeout.total_seconds()
    else:
        s = float(timeout) / 1000.0
    return s if s > 0 else None


class _Cuda:
    """CUDA tensors are staged through host memory."""

    checked = False

    @classmethod
    def available(cls) -> None:
        if not torch.cuda.is_available():
            raise CudaError(
                "braid: a CUDA tensor was passed, but CUDA is unavailable on this machine "
                "(torch.cuda.is_available() is False); move the tensor to the CPU, or use "
                "init_process_group('cpu:braid,cuda:nccl') to route CUDA tensors elsewhere"
            )

    @classmethod
    def check(cls) -> None:
        if not torch.cuda.is_available():
            raise CudaError(
                "braid: a CUDA tensor was passed, but CUDA is unavailable on this machine "
                "(torch.cuda.is_available() is False); move the tensor to the CPU, or use "
                "init_process_group('cpu:braid,cuda:nccl') to route CUDA tensors elsewhere"
            )
        if not cls.checked:
            cls.checked = True
            warnings.warn(
                "braid: this collective on CUDA tensors is staged through host memory "
                "(all_reduce, broadcast, reduce, all_gather_into_tensor, reduce_scatter_tensor and "
                "all_to_all_single run on the GPU)",
                stacklevel=4,
            )


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    return obj


def _any_cuda(*objs: Any) -> bool:
    """Whether any tensor is on a CUDA device (other devices raise)."""
    for o in objs:
        if isinstance(o, torch.Tensor):
            if not o.is_cpu:
                _check_device(o)
                return True
        elif isinstance(o, (list, tuple)):
            if _any_cuda(*o):
                return True
    return False


def _check_device(t: torch.Tensor) -> None:
    """Raise for a tensor braid cannot move: neither on the CPU nor on a
    CUDA device (the CUDA path then says whether CUDA is there)."""
    kind = t.device.type
    if kind in ("cpu", "cuda"):
        return
    if kind == "meta":
        raise InvalidArgumentError(
            "braid: a meta tensor was passed: it has a shape but no data, so there is nothing "
            "to communicate; pass a CPU (or CUDA) tensor"
        )
    raise InvalidArgumentError(
        f"braid: a tensor on device {t.device} was passed; braid takes CPU and CUDA tensors "
        "(move it with tensor.cpu())"
    )


def _split_sizes(sizes: Any, what: str) -> list[int]:
    """Split sizes as any sequence of non-negative ints (list, tuple, numpy
    array, 1-d integer tensor; None or empty: equal splits)."""
    if sizes is None:
        return []
    if isinstance(sizes, torch.Tensor):
        if sizes.dim() > 1 or sizes.is_floating_point() or sizes.is_complex():
            raise InvalidArgumentError(
                f"braid: all_to_all: {what} must be a sequence of ints, not a {sizes.dim()}-d "
                f"{sizes.dtype} tensor"
            )
        sizes = sizes.tolist()
    try:
        items = list(sizes)
    except TypeError:
        raise InvalidArgumentError(
            f"braid: all_to_all: {what} must be a sequence of ints, not {type(sizes).__name__}"
        ) from None
    out = []
    for x in items:
        try:
            if isinstance(x, bool):
                raise TypeError
            v = operator.index(x)
        except TypeError:
            raise InvalidArgumentError(
                f"braid: all_to_all: {what} must hold ints, not {x!r} ({type(x).__name__})"
            ) from None
        if v < 0:
            raise InvalidArgumentError(f"braid: all_to_all: {what} {items} holds a negative size")
        out.append(v)
    return out


_Work = dist._Work


class BraidWork(_Work):
    """The Work of one braid operation: ``wait()``, ``is_completed()``,
    ``get_future()`` (whose value is the operation's output tensors, as
    gloo's), ``exception()``."""

    # Defaults as class attributes: a blocking call's Work sets two.
    _finish: Callable[[], None] | None = None
    _exc: BaseException | None = None
    _fut: torch.futures.Future | None = None
    # Deferred point-to-point work: issued by the core's flush.
    _core: _Core | None = None
    # A receive's place among its batch's receives (for _source_rank).
    _src_index: int | None = None

    def __init__(
        self,
        handle: _braid.Handle | None,
        result: Any,
        finish: Callable[[], None] | None = None,
        core: _Core | None = None,
    ) -> None:
        _Work.__init__(self)
        self._h = handle
        self._result = result
        if core is not None:
            self._core = core
        if finish is not None:
            self._finish = finish
            if handle is not None:
                handle.add_done_callback(self._on_done)

    # Set by the core's flush on deferred point-to-point works.
    def _attach(self, handle: _braid.Handle) -> None:
        self._core = None
        self._h = handle
        if self._fut is not None:
            handle.add_done_callback(self._complete_future)

    def _issue(self) -> None:
        core = self._core
        if core is not None and self._h is None:
            core.flush()

    def _on_done(self, err: BaseException | None) -> None:
        if err is None and self._finish is not None:
            try:
                self._finish()
            except BaseException as e:  # surfaces through wait() / the future
                self._exc = e
        self._finish = None

    def _complete_future(self, err: BaseException | None) -> None:
        fut = self._fut
        if fut is None or fut.done():
            return
        err = err or self._exc
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(self._result)

    def wait(self, timeout: Any = None) -> bool:
        self._issue()
        h = self._h
        if h is not None:
            h.wait(_seconds(timeout))
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        self._issue()
        h = self._h
        return h is None or h.done()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        h = self._h
        if h is not None:
            e = h.exception()
            if e is not None:
                return e
        return self._exc

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def _source_rank(self) -> int:
        """The rank a receive's message came from (torch calls it after a
        receive from any source, as on gloo)."""
        i = self._src_index
        if i is None:
            raise RuntimeError(
                "sourceRank() may only be called on work objects that correspond to a recv "
                "or recv-from-any call."
            )
        self.wait()
        h = self._h
        srcs = h._sources() if h is not None else None
        if not srcs or i >= len(srcs):
            raise RuntimeError("braid: this receive has no sender (it did not complete)")
        return srcs[i]

    def get_future(self) -> torch.futures.Future:
        self._issue()
        if self._fut is None:
            self._fut = torch.futures.Future()
            h = self._h
            if h is None:
                if self._core is None:
                    self._complete_future(None)
                # else: completed when the deferred operation is issued
            else:
                h.add_done_callback(self._complete_future)
        return self._fut


class _Core:
    """One braid communicator behind a process group and its backend."""

    def __init__(
        self,
        comm: _braid.Communicator,
        rank: int,
        size: int,
        timeout: float | None,
        mbox: _braid.Communicator,
    ) -> None:
        self.comm = comm
        self.raw = comm._raw
        self.raw_seq = comm._raw_seq
        self.raw_blocks = comm._raw_blocks
        # Point to point: the group's mailbox (tags, any source), on a
        # communicator and worker of its own.
        self.mbox = mbox
        self.raw_tagged = mbox._raw_tagged
        self.rank = rank
        self.size = size
        self.timeout = timeout
        # Point-to-point operations not yet issued (see flush):
        # (is_send, peer or -1 for any source, tag, address, bytes).
        self.p2p_ops: list[tuple[bool, int, int, int, int]] = []
        self.p2p_recvs = 0
        self.p2p_keep: list[torch.Tensor] = []
        self.p2p_works: list[BraidWork] = []
        self.coalescing = False
        self.lock = threading.RLock()
        self.red_cache: dict[torch.dtype, dict[str, tuple[str, str]]] = {}

    @classmethod
    def create(
        cls, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta | None
    ) -> _Core:
        secs = _seconds(timeout)
        key = "braid/unique_id"
        if rank == 0:
            uid = _braid.UniqueId.create(host=_root_ip(store), timeout=secs)
            store.set(key, str(uid))
            comm = _braid.Communicator.init(uid, rank, size, timeout=secs)
        else:
            text = store.get(key).decode()
            comm = _braid.Communicator.init(text, rank, size, timeout=secs)
        # Every rank of the group creates the mailbox (a collective).
        return cls(comm, rank, size, secs, comm._mailbox())

    # ---- argument checks ----------------------------------------------

    @staticmethod
    def host(t: torch.Tensor, what: str = "tensor") -> tuple[int, int]:
        """(address, bytes) of a contiguous dense tensor."""
        if t.layout != torch.strided:
            kind = "sparse" if t.is_sparse or "sparse" in str(t.layout) else "not dense"
            raise InvalidArgumentError(
                f"braid: the {what} is {kind} ({t.layout}); braid takes dense (strided) tensors "
                "here (all_reduce also takes sparse COO tensors, as gloo); pass tensor.to_dense()"
            )
        if not t.is_contiguous():
            raise InvalidArgumentError(
                f"braid: the {what} is not contiguous; pass tensor.contiguous()"
            )
        return t.data_ptr(), t.numel() * t.element_size()

    @staticmethod
    def dtype(t: torch.Tensor) -> str:
        """The braid datatype for moving `t` (any dtype moves as bytes)."""
        return _DT.get(t.dtype, _U8)

    def reduction(self, t: torch.Tensor, reduce_op: Any) -> tuple[str, str, Any]:
        """(braid datatype, braid operator, PREMUL_SUM factor or None)."""
        name = _op_name(reduce_op)
        per = self.red_cache.get(t.dtype)
        hit = per.get(name) if per is not None else None
        if hit is not None:
            return hit[0], hit[1], None
        if name == "PREMUL_SUM":
            dt, _, _ = self.reduction(t, dist.ReduceOp.SUM)
            return dt, "sum", reduce_op.factor
        dtype = t.dtype
        if dtype == torch.bool:
            if name not in _BOOL_OP:
                raise InvalidArgumentError(
                    f"braid: ReduceOp.{name} is not defined on bool tensors"
                )
            res = (_U8, _BOOL_OP[name])
        elif dtype in _COMPLEX:
            if name not in ("SUM", "AVG"):
                raise InvalidArgumentError(
                    f"braid: ReduceOp.{name} is not defined on complex tensors"
                )
            res = (_COMPLEX[dtype], _BRAID_OP[name])
        else:
            dt = _DT.get(dtype)
            if dt is None:
                raise InvalidArgumentError(
                    f"braid: {dtype} is not a braid datatype; braid reduces int8, uint8, int32, "
                    "uint32, int64, uint64, float16, bfloat16, float32 and float64"
                )
            if name not in _BRAID_OP:
                raise InvalidArgumentError(
                    f"braid: ReduceOp.{name} is not supported on {dtype} "
                    "(braid has SUM, PRODUCT, MIN, MAX, AVG and PREMUL_SUM; BAND/BOR on bool)"
                )
            res = (dt, _BRAID_OP[name])
        self.red_cache.setdefault(dtype, {})[name] = res
        return res[0], res[1], None

    @staticmethod
    def premul(t: torch.Tensor, factor: Any, in_place: bool) -> torch.Tensor:
        f = factor
        if isinstance(f, torch.Tensor):
            f = f.to(device=t.device, dtype=t.dtype)
        if in_place:
            return t.mul_(f)
        return (t * f).contiguous()

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
        bufs = [self.host(t) for t in tensors]
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


def _unwrap_store(store: Any) -> Any:
    s = store
    for _ in range(16):
        inner = getattr(s, "underlying_store", None)
        if inner is None:
            break
        s = inner
    return s


def _root_ip(store: Any) -> str:
    """The address rank 0 hosts the rendezvous on: BRAID_ROOT_ADDR if set,
    else this host's address on the route to torch's store (the other ranks
    reach that host), else loopback."""
    forced = os.environ.get("BRAID_ROOT_ADDR", "").strip()
    target = forced
    if not target:
        s = _unwrap_store(store)
        target = getattr(s, "host", "") if isinstance(s, dist.TCPStore) else ""
    if not target:
        target = os.environ.get("MASTER_ADDR", "").strip()
    if not target:
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(target, None, socket.AF_INET, socket.SOCK_DGRAM)
        ip = infos[0][4][0]
    except OSError:
        try:
            infos = socket.getaddrinfo(target, None, socket.AF_INET6, socket.SOCK_DGRAM)
            ip = infos[0][4][0]
        except OSError:
            return "127.0.0.1"
    if forced:
        return ip
    fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0]
    except OSError:
        return ip


class _Ops:
    """The collectives, shared by the process group (what torch.distributed's
    Python functions call) and the backend (what C++ callers reach through
    ``pg._get_backend(device)``)."""

    _core: _Core

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    # ---- helpers ------------------------------------------------------

    def _staged(self, method: Callable[..., Any], *args: Any) -> BraidWork:
        """Run `method` on host copies of CUDA tensors, copy results back."""
        _Cuda.check()
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def to_host(t: torch.Tensor) -> torch.Tensor:
            if t.is_cpu:
                return t
            h = t.detach().to("cpu").contiguous()
            pairs.append((t, h))
            return h

        host_args = [_map_tensors(a, to_host) for a in args]
        w = method(*host_args)
        w.wait()
        back = {id(h): dev for dev, h in pairs}
        for dev, h in pairs:
            dev.copy_(h)
        return BraidWork(None, _map_tensors(w.result(), lambda t: back.get(id(t), t)))

    def _device(
        self,
        kind: str,
        send: torch.Tensor,
        recv: torch.Tensor,
        dt: str,
        op: str | None,
        root: int,
        result: Any,
    ) -> BraidWork:
        """A collective on CUDA tensors through braid's device communicator,
        on the current CUDA stream (stream-ordered, like NCCL's)."""
        _check_device(send)
        _check_device(recv)
        _Cuda.available()
        c = self._core
        if c.p2p_ops:
            c.flush()
        if send.device != recv.device:
            raise InvalidArgumentError(f"braid: tensors on {send.device} and {recv.device}")
        sa, sn = c.host(send, "input")
        ra, rn = c.host(recv, "output")
        stream = torch.cuda.current_stream(recv.device).cuda_stream
        c.comm._cuda(kind, dt, sa, sn, ra, rn, op, root, stream, recv.device.index or 0)
        return BraidWork(None, result)

    def _flush(self) -> None:
        if self._core.p2p_ops:
            self._core.flush()

    # ---- reductions ---------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> BraidWork:
        c = self._core
        if c.p2p_ops:
            c.flush()
        if opts is None:
            opts = AllreduceOptions()
        if len(tensors) != 1:
            if any(t.layout == torch.sparse_coo for t in tensors):
                return self._sparse_allreduce(tensors, opts)
            return self.allreduce_coalesced(tensors, opts)
        t = tensors[0]
        try:
            addr, n = c.host(t)
        except InvalidArgumentError:
            if t.layout == torch.sparse_coo:
                return self._sparse_allreduce(tensors, opts)
            raise
        dt, op, factor = c.reduction(t, opts.reduceOp)
        if factor is not None:
            c.premul(t, factor, True)
        if not t.is_cpu:
            return self._device("all_reduce", t, t, dt, op, 0, tensors)
        a = opts.asyncOp
        h = c.raw("all_reduce", dt, addr, n, addr, n, op, 0, a, tensors if a else None)
        return BraidWork(h, tensors)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], opts: Any) -> BraidWork:
        """all_reduce of sparse COO tensors, as gloo's: the (summed,
        coalesced) input's indices and values are gathered from every rank
        (padded to the largest count), summed in rank order and coalesced;
        the result replaces each input tensor (a coalesced sparse tensor).
        The sum is torch's own sparse addition in gloo's order, so the values
        are gloo's bit for bit."""
        c = self._core
        name = _op_name(opts.reduceOp)
        if name != "SUM":
            raise InvalidArgumentError(
                "braid: all_reduce of sparse tensors takes ReduceOp.SUM only (as gloo), not "
                f"ReduceOp.{name}"
            )
        for t in tensors:
            if t.layout != torch.sparse_coo:
                raise InvalidArgumentError(
                    f"braid: all_reduce of sparse tensors takes sparse COO tensors, not {t.layout}"
                )
            if not t.is_cpu:
                _check_device(t)
                _Cuda.check()
        with torch.no_grad():
            inp = tensors[0].cpu()
            for t in tensors[1:]:
                inp = inp + t.cpu()
            inp = inp.coalesce()
            shape = list(inp.shape)
            sd, nnz = inp.sparse_dim(), inp._nnz()
            dense = shape[sd:]
            dtype_id = zlib.crc32(str(inp.dtype).encode())
            mine = [sd, inp.dense_dim(), len(shape), dtype_id, nnz] + shape
            if len(shape) > _SPARSE_DIMS:
                raise InvalidArgumentError(
                    f"braid: all_reduce of sparse tensors takes at most {_SPARSE_DIMS} dimensions"
                )
            meta = torch.zeros(5 + _SPARSE_DIMS, dtype=torch.int64)
            meta[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
            metas = torch.empty(c.size, meta.numel(), dtype=torch.int64)
            self._gather_raw(meta, metas)
            rows = [row[: 5 + int(row[2])].tolist() for row in metas]
            for r, row in enumerate(rows):
                if row[:4] + row[5:] != mine[:4] + mine[5:]:
                    raise InvalidArgumentError(
                        "braid: all_reduce of sparse tensors: the tensors differ across ranks "
                        f"(rank {c.rank}: shape {shape}, sparse_dim {sd}, {inp.dtype}; rank {r}: "
                        f"shape {row[5:]}, sparse_dim {row[0]}); every rank needs the same"
                    )
            counts = [row[4] for row in rows]
            most = max(counts)
            gidx = torch.zeros(c.size, sd, most, dtype=torch.int64)
            gval = torch.zeros([c.size, most] + dense, dtype=inp.dtype)
            if most > 0:
                pidx = torch.zeros(sd, most, dtype=torch.int64)
                pidx[:, :nnz] = inp._indices()
                pval = torch.zeros([most] + dense, dtype=inp.dtype)
                pval[:nnz] = inp._values()
                self._gather_raw(pidx, gidx)
                self._gather_raw(pval, gval)
            parts = [
                torch.sparse_coo_tensor(
                    gidx[r][:, : counts[r]], gval[r][: counts[r]], shape, check_invariants=False
                )
                for r in range(c.size)
            ]
            out = parts[0]
            for part in parts[1:]:
                out += part
            out = out.coalesce()
            for t in tensors:
                t.copy_(out if t.is_cpu else out.to(t.device))
        return BraidWork(None, tensors)

    def _gather_raw(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        """Blocking all_gather of a contiguous CPU tensor (as bytes)."""
        c = self._core
        sa, sn = c.host(inp, "input")
        ra, rn = c.host(out, "output")
        c.raw("all_gather", _U8, sa, sn, ra, rn, None, 0, False, None)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = AllreduceCoalescedOptions()
        if _any_cuda(tensors):
            return self._staged(self.allreduce_coalesced, tensors, opts)
        calls = []
        for t in tensors:
            dt, op, factor = c.reduction(t, opts.reduceOp)
            if factor is not None:
                c.premul(t, factor, True)
            addr, n = c.host(t)
            calls.append(("all_reduce", dt, addr, n, addr, n, op, 0))
        a = opts.asyncOp
        h = c.raw_seq(calls, a, list(tensors) if a else None)
        return BraidWork(h, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = ReduceOptions()
        t = tensors[0] if len(tensors) == 1 else None
        if t is None:
            raise InvalidArgumentError("braid: reduce takes exactly one tensor")
        addr, n = c.host(t)  # before PREMUL_SUM scales a tensor braid refuses
        dt, op, factor = c.reduction(t, opts.reduceOp)
        if factor is not None:
            c.premul(t, factor, True)
        if not t.is_cpu:
            return self._device("reduce", t, t, dt, op, opts.rootRank, tensors)
        a = opts.asyncOp
        h = c.raw("reduce", dt, addr, n, addr, n, op, opts.rootRank, a, tensors if a else None)
        return BraidWork(h, tensors)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = ReduceScatterOptions()
        if output.dtype != input.dtype:
            raise InvalidArgumentError(
                f"braid: reduce_scatter: input is {input.dtype}, output {output.dtype}"
            )
        dt, op, factor = c.reduction(input, opts.reduceOp)
        if factor is not None:
            input = c.premul(input, factor, False)
        if _any_cuda(output, input):
            return self._device("reduce_scatter", input, output, dt, op, 0, [output])
        sa, sn = c.host(input, "input")
        ra, rn = c.host(output, "output")
        a = opts.asyncOp
        keep = [output, input] if a else None
        h = c.raw("reduce_scatter", dt, sa, sn, ra, rn, op, 0, a, keep)
        return BraidWork(h, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = ReduceScatterOptions()
        if _any_cuda(outputs, inputs):
            return self._staged(self.reduce_scatter_single_coalesced, outputs, inputs, opts)
        calls = []
        keep: list[torch.Tensor] = []
        for out, inp in zip(outputs, inputs, strict=True):
            dt, op, factor = c.reduction(inp, opts.reduceOp)
            if factor is not None:
                inp = c.premul(inp, factor, False)
            sa, sn = c.host(inp, "input")
            ra, rn = c.host(out, "output")
            calls.append(("reduce_scatter", dt, sa, sn, ra, rn, op, 0))
            keep += [out, inp]
        a = opts.asyncOp
        h = c.raw_seq(calls, a, keep if a else None)
        return BraidWork(h, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> BraidWork:
        self._flush()
        if opts is None:
            opts = ReduceScatterOptions()
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise InvalidArgumentError("braid: reduce_scatter takes one output tensor")
        if len(input_tensors[0]) != self._core.size:
            raise InvalidArgumentError(
                f"braid: reduce_scatter takes one input tensor per rank "
                f"({self._core.size}), not {len(input_tensors[0])}"
            )
        out = output_tensors[0]
        for t in input_tensors[0]:
            if t.layout != torch.strided:
                self._core.host(t, "input")  # raises, naming the layout
            if t.numel() != out.numel() or t.dtype != out.dtype:
                raise InvalidArgumentError(
                    "braid: reduce_scatter: every input tensor must match the output's "
                    f"size and dtype ({out.numel()} x {out.dtype})"
                )
        flat = torch.cat([t.reshape(-1) for t in input_tensors[0]])
        w = self.reduce_scatter_single(out, flat, opts)
        w._result = output_tensors
        return w

    # ---- data movement ------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> BraidWork:
        c = self._core
        if c.p2p_ops:
            c.flush()
        if opts is None:
            opts = BroadcastOptions()
        if len(tensors) != 1:
            raise InvalidArgumentError("braid: broadcast takes exactly one tensor")
        t = tensors[0]
        if not t.is_cpu:
            return self._device("broadcast", t, t, c.dtype(t), None, opts.rootRank, tensors)
        addr, n = c.host(t)
        a = opts.asyncOp
        h = c.raw("broadcast", c.dtype(t), addr, n, addr, n, None, opts.rootRank, a,
                  tensors if a else None)
        return BraidWork(h, tensors)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = AllgatherOptions()
        if output.dtype != input.dtype:
            raise InvalidArgumentError(
                f"braid: all_gather: input is {input.dtype}, output {output.dtype}"
            )
        if _any_cuda(output, input):
            return self._device("all_gather", input, output, c.dtype(input), None, 0, [output])
        sa, sn = c.host(input, "input")
        ra, rn = c.host(output, "output")
        a = opts.asyncOp
        h = c.raw("all_gather", c.dtype(input), sa, sn, ra, rn, None, 0, a,
                  [output, input] if a else None)
        return BraidWork(h, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = AllgatherOptions()
        if _any_cuda(outputs, inputs):
            return self._staged(self.all_gather_single_coalesced, outputs, inputs, opts)
        calls = []
        for out, inp in zip(outputs, inputs, strict=True):
            sa, sn = c.host(inp, "input")
            ra, rn = c.host(out, "output")
            calls.append(("all_gather", c.dtype(inp), sa, sn, ra, rn, "sum", 0))
        a = opts.asyncOp
        h = c.raw_seq(calls, a, list(outputs) + list(inputs) if a else None)
        return BraidWork(h, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = AllgatherOptions()
        if _any_cuda(output_tensors, input_tensors):
            return self._staged(self.allgather, output_tensors, input_tensors, opts)
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise InvalidArgumentError("braid: all_gather takes one input tensor")
        inp, outs = input_tensors[0], output_tensors[0]
        if len(outs) != c.size:
            raise InvalidArgumentError(
                f"braid: all_gather needs one output tensor per rank ({c.size}), not {len(outs)}"
            )
        for o in outs:
            if o.numel() != inp.numel() or o.dtype != inp.dtype:
                raise InvalidArgumentError(
                    "braid: all_gather: every output tensor must match the input's size and "
                    f"dtype ({inp.numel()} x {inp.dtype})"
                )
        inp = inp.contiguous()
        flat = torch.empty(c.size * inp.numel(), dtype=inp.dtype)
        sa, sn = c.host(inp, "input")
        ra, rn = c.host(flat)

        def finish() -> None:
            for o, part in zip(outs, flat.view(c.size, -1), strict=True):
                o.copy_(part.view_as(o))

        a = opts.asyncOp
        h = c.raw("all_gather", c.dtype(inp), sa, sn, ra, rn, None, 0, a, [flat, inp] if a else None)
        if h is None:
            finish()
            return BraidWork(None, output_tensors)
        return BraidWork(h, output_tensors, finish)

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> BraidWork:
        # output_lists[r][j] receives rank r's input_list[j].
        c = self._core
        if len(output_lists) != c.size or any(len(o) != len(input_list) for o in output_lists):
            raise InvalidArgumentError(
                f"braid: all_gather_coalesced needs {c.size} output lists (one per rank) of "
                f"{len(input_list)} tensors (one per input)"
            )
        works = [
            self.allgather([[output_lists[r][j] for r in range(c.size)]], [inp], opts)
            for j, inp in enumerate(input_list)
        ]
        last = works[-1] if works else BraidWork(None, output_lists)
        last._result = output_lists
        return last

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = GatherOptions()
        if _any_cuda(output_tensors, input_tensors):
            return self._staged(self.gather, output_tensors, input_tensors, opts)
        root = opts.rootRank
        inp = input_tensors[0]
        send = c.host(inp, "input")
        recvs: list[tuple[int, int]] = []
        keep = [inp]
        if c.rank == root:
            outs = output_tensors[0] if output_tensors else []
            if len(outs) != c.size:
                raise InvalidArgumentError(
                    f"braid: gather: the root needs one output tensor per rank ({c.size})"
                )
            for o in outs:
                if o.numel() != inp.numel() or o.dtype != inp.dtype:
                    raise InvalidArgumentError(
                        "braid: gather: every output tensor must match the input's size and dtype"
                    )
                recvs.append(c.host(o, "output"))
                keep.append(o)
        a = opts.asyncOp
        h = c.raw_blocks("gather", c.dtype(inp), [send], recvs, root, a, keep if a else None)
        return BraidWork(h, output_tensors)

    def gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = GatherOptions()
        if _any_cuda(output, input):
            return self._staged(self.gather_single, output, input, opts)
        root = opts.rootRank
        sa, sn = c.host(input, "input")
        ra, rn = 0, 0
        if c.rank == root:
            ra, rn = c.host(output, "output")
            if rn != sn * c.size:
                raise InvalidArgumentError(
                    f"braid: gather: the output must hold {c.size} x the input's elements"
                )
        a = opts.asyncOp
        h = c.raw("gather", c.dtype(input), sa, sn, ra, rn, None, root, a,
                  [output, input] if a else None)
        return BraidWork(h, [output])

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = ScatterOptions()
        if _any_cuda(output_tensors, input_tensors):
            return self._staged(self.scatter, output_tensors, input_tensors, opts)
        root = opts.rootRank
        out = output_tensors[0]
        recv = c.host(out, "output")
        sends: list[tuple[int, int]] = []
        keep = [out]
        if c.rank == root:
            ins = input_tensors[0] if input_tensors else []
            if len(ins) != c.size:
                raise InvalidArgumentError(
                    f"braid: scatter: the root needs one input tensor per rank ({c.size})"
                )
            for t in ins:
                if t.numel() != out.numel() or t.dtype != out.dtype:
                    raise InvalidArgumentError(
                        "braid: scatter: every input tensor must match the output's size and dtype"
                    )
                sends.append(c.host(t, "input"))
                keep.append(t)
        a = opts.asyncOp
        h = c.raw_blocks("scatter", c.dtype(out), sends, [recv], root, a, keep if a else None)
        return BraidWork(h, output_tensors)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = AllToAllOptions()
        output_split_sizes = _split_sizes(output_split_sizes, "output_split_sizes")
        input_split_sizes = _split_sizes(input_split_sizes, "input_split_sizes")
        if _any_cuda(output, input):
            if not output_split_sizes and not input_split_sizes and output.dtype == input.dtype:
                return self._device("all_to_all", input, output, c.dtype(input), None, 0, [output])
            return self._staged(
                self.all_to_all_single, output, input, output_split_sizes, input_split_sizes, opts
            )
        if output.dtype != input.dtype:
            raise InvalidArgumentError(
                f"braid: all_to_all: input is {input.dtype}, output {output.dtype}"
            )
        sa, sn = c.host(input, "input")
        ra, rn = c.host(output, "output")
        a = opts.asyncOp
        keep = [output, input] if a else None
        p = c.size
        if not output_split_sizes and not input_split_sizes:
            h = c.raw("all_to_all", c.dtype(input), sa, sn, ra, rn, None, 0, a, keep)
            return BraidWork(h, [output])
        # Split sizes count rows (the first dimension).
        in_rows = input.shape[0] if input.dim() > 0 else 1
        out_rows = output.shape[0] if output.dim() > 0 else 1
        in_row = sn // in_rows if in_rows else 0
        out_row = rn // out_rows if out_rows else 0
        isz = input_split_sizes or [in_rows // p] * p
        osz = output_split_sizes or [out_rows // p] * p
        if len(isz) != p or len(osz) != p:
            raise InvalidArgumentError(f"braid: all_to_all: split sizes need {p} entries")
        if sum(isz) != in_rows or sum(osz) != out_rows:
            raise InvalidArgumentError(
                f"braid: all_to_all: split sizes {isz} / {osz} do not add up to the tensors' "
                f"first dimensions ({in_rows} / {out_rows})"
            )
        # Block q of each tensor: its rows for / from rank q.
        sends, recvs = [], []
        so = ro = 0
        for q in range(p):
            sb, rb = isz[q] * in_row, osz[q] * out_row
            sends.append((sa + so, sb))
            recvs.append((ra + ro, rb))
            so += sb
            ro += rb
        h = c.raw_blocks("all_to_all_v", c.dtype(input), sends, recvs, 0, a, keep)
        return BraidWork(h, [output])

    alltoall_base = all_to_all_single

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = AllToAllOptions()
        if _any_cuda(output_tensors, input_tensors):
            return self._staged(self.alltoall, output_tensors, input_tensors, opts)
        if len(output_tensors) != c.size or len(input_tensors) != c.size:
            raise InvalidArgumentError(
                f"braid: all_to_all takes one input and one output tensor per rank ({c.size})"
            )
        dtypes = {t.dtype for t in output_tensors} | {t.dtype for t in input_tensors}
        if any(o.dtype != i.dtype for o, i in zip(output_tensors, input_tensors, strict=True)):
            raise InvalidArgumentError("braid: all_to_all: input and output dtypes differ")
        sends = [c.host(i, "input") for i in input_tensors]
        recvs = [c.host(o, "output") for o in output_tensors]
        # One datatype for the whole call: the tensors' own when they share
        # one, else bytes.
        dt = c.dtype(input_tensors[0]) if len(dtypes) == 1 and input_tensors else _U8
        a = opts.asyncOp
        keep = list(output_tensors) + list(input_tensors)
        h = c.raw_blocks("all_to_all_v", dt, sends, recvs, 0, a, keep if a else None)
        return BraidWork(h, output_tensors)

    # ---- point to point -----------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> BraidWork:
        if _any_cuda(tensors):
            _Cuda.check()
            host = [t.detach().to("cpu").contiguous() for t in tensors]
            w = self._core.add_p2p(True, host, dst, tag)
            w.wait()
            return BraidWork(None, tensors)
        return self._core.add_p2p(True, tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int | None, tag: int = 0) -> BraidWork:
        if _any_cuda(tensors):
            _Cuda.check()
            host = [torch.empty_like(t, device="cpu") for t in tensors]
            w = self._core.add_p2p(False, host, src, tag)
            w.wait()
            for t, h in zip(tensors, host, strict=True):
                t.copy_(h)
            w._result = tensors
            return w
        return self._core.add_p2p(False, tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> BraidWork:
        # The Work's _source_rank() says who sent (torch's recv returns it).
        return self.recv(tensors, None, tag)

    def start_coalescing(self, device: Any = None) -> None:
        self._flush()
        self._core.coalescing = True

    def end_coalescing(self, device: Any = None) -> BraidWork:
        c = self._core
        c.coalescing = False
        works = list(c.p2p_works)
        h = c.flush()
        return BraidWork(h, [t for w in works for t in (w.result() or [])])

    # ---- synchronisation and life cycle --------------------------------

    def barrier(self, opts: Any = None) -> BraidWork:
        c = self._core
        self._flush()
        a = bool(getattr(opts, "asyncOp", False)) if opts is not None else False
        h = c.comm.barrier(async_op=a)
        return BraidWork(h, [])

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        self.barrier(opts).wait()

    def abort(self) -> None:
        self._core.comm.abort()
        self._core.mbox.abort()

    def shutdown(self) -> None:
        c = self._core
        try:
            c.flush()
        finally:
            c.mbox.close()
            c.comm.close()

    def eager_connect_single_device(self, device: Any = None) -> None:
        return None

    def get_error(self) -> Any:
        from torch._C._distributed_c10d import ErrorType

        c = self._core
        ok = c.comm.async_error() is None and c.mbox.async_error() is None
        return ErrorType.SUCCESS if ok else ErrorType.COMM_ERROR

    def set_timeout(self, timeout: Any) -> None:
        # braid's deadline is fixed when the communicator is created.
        self._core.requested_timeout = _seconds(timeout)

    @property
    def braid_communicator(self) -> _braid.Communicator:
        """The braid communicator under this group (for braid's own API)."""
        return self._core.comm


class BraidBackend(_Ops, _C10dBackend):
    """The braid backend object (``pg._get_backend(torch.device("cpu"))``)."""

    def __init__(self, core: _Core, timeout: datetime.timedelta | None = None) -> None:
        _C10dBackend.__init__(self, core.rank, core.size)
        self._core = core
        self._options = _C10dBackend.Options(NAME, timeout=timeout or datetime.timedelta(minutes=30))

    @property
    def options(self) -> Any:
        return self._options

    @property
    def supports_splitting(self) -> bool:
        return False

    @property
    def supports_coalescing(self) -> bool:
        return True

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False


class BraidProcessGroup(_Ops, _ProcessGroup):
    """The process group ``init_process_group("braid")`` and ``new_group``
    return; its methods run braid's collectives."""

    def __init__(self, store: dist.Store, core: _Core) -> None:
        _ProcessGroup.__init__(self, store, core.rank, core.size)
        self._core = core


def _create(opts: Any, backend_options: Any = None) -> BraidProcessGroup:
    core = _Core.create(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    pg = BraidProcessGroup(opts.store, core)
    be = BraidBackend(core, opts.timeout)
    kind = _ProcessGroup.BackendType.CUSTOM
    pg._register_backend(torch.device("cpu"), kind, be)
    if torch.cuda.is_available():
        pg._register_backend(torch.device("cuda"), kind, be)
    pg._set_default_backend(kind)
    # Kept alive with the group (torch holds the group, the group its core).
    pg._braid_backend = be  # type: ignore[attr-defined]
    return pg


def register() -> None:
    """Register the backend "braid" with torch.distributed (idempotent; the
    entry point calls it)."""
    if NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])


register()
