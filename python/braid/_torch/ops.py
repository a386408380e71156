"""The collectives: the methods of torch's ProcessGroup and Backend
(``Ops``), each checked and issued as one braid operation."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
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

from .. import _braid
from ..errors import InvalidArgumentError, UnusableError
from . import NAME
from .core import Core
from .tables import SUM_OF, SUM_OP, U8, datatype, op_name, reduction
from .tensors import (
    STRIDED,
    Cuda,
    any_cuda,
    check_device,
    host,
    map_tensors,
    premul,
    split_sizes,
)
from .work import BraidWork, seconds

# Dimensions a sparse all_reduce's metadata has room for.
_SPARSE_DIMS = 64


class Ops:
    """The collectives, shared by the process group (what torch.distributed's
    Python functions call) and the backend (what C++ callers reach through
    ``pg._get_backend(device)``)."""

    _core: Core

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    # ---- helpers ------------------------------------------------------

    def _staged(self, method: Callable[..., Any], *args: Any) -> BraidWork:
        """Run `method` on host copies of CUDA tensors, copy results back."""
        Cuda.check()
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def to_host(t: torch.Tensor) -> torch.Tensor:
            if t.is_cpu:
                return t
            h = t.detach().to("cpu").contiguous()
            pairs.append((t, h))
            return h

        host_args = [map_tensors(a, to_host) for a in args]
        w = method(*host_args)
        # The result before the wait: a blocking call's shared Work drops it
        # when waited on.
        res = w.result()
        w.wait()
        back = {id(h): dev for dev, h in pairs}
        for dev, h in pairs:
            dev.copy_(h)
        return BraidWork(None, map_tensors(res, lambda t: back.get(id(t), t)))

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
        check_device(send)
        check_device(recv)
        Cuda.available()
        c = self._core
        if c.p2p_ops:
            c.flush()
        if send.device != recv.device:
            raise InvalidArgumentError(f"braid: tensors on {send.device} and {recv.device}")
        sa, sn = host(send, "input")
        ra, rn = host(recv, "output")
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
        if len(tensors) == 1:
            # The usual call, one dense contiguous CPU tensor summed, without
            # the helpers' calls (each Python call or attribute read is about
            # 0.1 µs of an 8-byte all_reduce's 4); its datatype and operator
            # are in SUM_OF once `reduction` has seen its dtype.
            t = tensors[0]
            if t.layout is STRIDED and t.is_contiguous() and t.is_cpu and opts.reduceOp == SUM_OP:
                hit = SUM_OF.get(t.dtype)
                if hit is not None:
                    a = opts.asyncOp
                    addr, n = t.data_ptr(), t.nbytes
                    keep = tensors if a else None
                    h = c.raw("all_reduce", hit[0], addr, n, addr, n, hit[1], 0, a, keep)
                    return BraidWork.of(h, tensors)
        return self._allreduce(tensors, opts)

    def _allreduce(self, tensors: list[torch.Tensor], opts: Any) -> BraidWork:
        c = self._core
        if len(tensors) != 1:
            if any(t.layout == torch.sparse_coo for t in tensors):
                return self._sparse_allreduce(tensors, opts)
            return self.allreduce_coalesced(tensors, opts)
        t = tensors[0]
        try:
            addr, n = host(t)
        except InvalidArgumentError:
            if t.layout == torch.sparse_coo:
                return self._sparse_allreduce(tensors, opts)
            raise
        dt, op, factor = reduction(t, opts.reduceOp)
        if factor is not None:
            premul(t, factor, True)
        if not t.is_cpu:
            return self._device("all_reduce", t, t, dt, op, 0, tensors)
        a = opts.asyncOp
        h = c.raw("all_reduce", dt, addr, n, addr, n, op, 0, a, tensors if a else None)
        return BraidWork.of(h, tensors)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], opts: Any) -> BraidWork:
        """all_reduce of sparse COO tensors, as gloo's: the (summed,
        coalesced) input's indices and values are gathered from every rank
        (padded to the largest count), summed in rank order and coalesced;
        the result replaces each input tensor (a coalesced sparse tensor).
        The sum is torch's own sparse addition in gloo's order, so the values
        are gloo's bit for bit."""
        c = self._core
        name = op_name(opts.reduceOp)
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
                check_device(t)
                Cuda.check()
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
        sa, sn = host(inp, "input")
        ra, rn = host(out, "output")
        c.raw("all_gather", U8, sa, sn, ra, rn, None, 0, False, None)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = AllreduceCoalescedOptions()
        if any_cuda(tensors):
            return self._staged(self.allreduce_coalesced, tensors, opts)
        calls = []
        for t in tensors:
            dt, op, factor = reduction(t, opts.reduceOp)
            if factor is not None:
                premul(t, factor, True)
            addr, n = host(t)
            calls.append(("all_reduce", dt, addr, n, addr, n, op, 0))
        a = opts.asyncOp
        h = c.raw_seq(calls, a, list(tensors) if a else None)
        return BraidWork.of(h, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = ReduceOptions()
        t = tensors[0] if len(tensors) == 1 else None
        if t is None:
            raise InvalidArgumentError("braid: reduce takes exactly one tensor")
        addr, n = host(t)  # before PREMUL_SUM scales a tensor braid refuses
        dt, op, factor = reduction(t, opts.reduceOp)
        if factor is not None:
            premul(t, factor, True)
        if not t.is_cpu:
            return self._device("reduce", t, t, dt, op, opts.rootRank, tensors)
        a = opts.asyncOp
        h = c.raw("reduce", dt, addr, n, addr, n, op, opts.rootRank, a, tensors if a else None)
        return BraidWork.of(h, tensors)

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
        dt, op, factor = reduction(input, opts.reduceOp)
        if factor is not None:
            input = premul(input, factor, False)
        if any_cuda(output, input):
            return self._device("reduce_scatter", input, output, dt, op, 0, [output])
        sa, sn = host(input, "input")
        ra, rn = host(output, "output")
        a = opts.asyncOp
        keep = [output, input] if a else None
        h = c.raw("reduce_scatter", dt, sa, sn, ra, rn, op, 0, a, keep)
        return BraidWork.of(h, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = ReduceScatterOptions()
        if any_cuda(outputs, inputs):
            return self._staged(self.reduce_scatter_single_coalesced, outputs, inputs, opts)
        calls = []
        keep: list[torch.Tensor] = []
        for out, inp in zip(outputs, inputs, strict=True):
            dt, op, factor = reduction(inp, opts.reduceOp)
            if factor is not None:
                inp = premul(inp, factor, False)
            sa, sn = host(inp, "input")
            ra, rn = host(out, "output")
            calls.append(("reduce_scatter", dt, sa, sn, ra, rn, op, 0))
            keep += [out, inp]
        a = opts.asyncOp
        h = c.raw_seq(calls, a, keep if a else None)
        return BraidWork.of(h, outputs)

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
                host(t, "input")  # raises, naming the layout
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
            return self._device("broadcast", t, t, datatype(t), None, opts.rootRank, tensors)
        addr, n = host(t)
        a = opts.asyncOp
        h = c.raw("broadcast", datatype(t), addr, n, addr, n, None, opts.rootRank, a,
                  tensors if a else None)
        return BraidWork.of(h, tensors)

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
        if any_cuda(output, input):
            return self._device("all_gather", input, output, datatype(input), None, 0, [output])
        sa, sn = host(input, "input")
        ra, rn = host(output, "output")
        a = opts.asyncOp
        h = c.raw("all_gather", datatype(input), sa, sn, ra, rn, None, 0, a,
                  [output, input] if a else None)
        return BraidWork.of(h, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = AllgatherOptions()
        if any_cuda(outputs, inputs):
            return self._staged(self.all_gather_single_coalesced, outputs, inputs, opts)
        calls = []
        for out, inp in zip(outputs, inputs, strict=True):
            sa, sn = host(inp, "input")
            ra, rn = host(out, "output")
            calls.append(("all_gather", datatype(inp), sa, sn, ra, rn, "sum", 0))
        a = opts.asyncOp
        h = c.raw_seq(calls, a, list(outputs) + list(inputs) if a else None)
        return BraidWork.of(h, outputs)

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
        if any_cuda(output_tensors, input_tensors):
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
        sa, sn = host(inp, "input")
        ra, rn = host(flat)

        def finish() -> None:
            for o, part in zip(outs, flat.view(c.size, -1), strict=True):
                o.copy_(part.view_as(o))

        a = opts.asyncOp
        h = c.raw("all_gather", datatype(inp), sa, sn, ra, rn, None, 0, a, [flat, inp] if a else None)
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
        if any_cuda(output_tensors, input_tensors):
            return self._staged(self.gather, output_tensors, input_tensors, opts)
        root = opts.rootRank
        inp = input_tensors[0]
        send = host(inp, "input")
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
                recvs.append(host(o, "output"))
                keep.append(o)
        a = opts.asyncOp
        h = c.raw_blocks("gather", datatype(inp), [send], recvs, root, a, keep if a else None)
        return BraidWork.of(h, output_tensors)

    def gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = GatherOptions()
        if any_cuda(output, input):
            return self._staged(self.gather_single, output, input, opts)
        root = opts.rootRank
        sa, sn = host(input, "input")
        ra, rn = 0, 0
        if c.rank == root:
            ra, rn = host(output, "output")
            if rn != sn * c.size:
                raise InvalidArgumentError(
                    f"braid: gather: the output must hold {c.size} x the input's elements"
                )
        a = opts.asyncOp
        h = c.raw("gather", datatype(input), sa, sn, ra, rn, None, root, a,
                  [output, input] if a else None)
        return BraidWork.of(h, [output])

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
        if any_cuda(output_tensors, input_tensors):
            return self._staged(self.scatter, output_tensors, input_tensors, opts)
        root = opts.rootRank
        out = output_tensors[0]
        recv = host(out, "output")
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
                sends.append(host(t, "input"))
                keep.append(t)
        a = opts.asyncOp
        h = c.raw_blocks("scatter", datatype(out), sends, [recv], root, a, keep if a else None)
        return BraidWork.of(h, output_tensors)

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
        output_split_sizes = split_sizes(output_split_sizes, "output_split_sizes")
        input_split_sizes = split_sizes(input_split_sizes, "input_split_sizes")
        if any_cuda(output, input):
            if not output_split_sizes and not input_split_sizes and output.dtype == input.dtype:
                return self._device("all_to_all", input, output, datatype(input), None, 0, [output])
            return self._staged(
                self.all_to_all_single, output, input, output_split_sizes, input_split_sizes, opts
            )
        if output.dtype != input.dtype:
            raise InvalidArgumentError(
                f"braid: all_to_all: input is {input.dtype}, output {output.dtype}"
            )
        sa, sn = host(input, "input")
        ra, rn = host(output, "output")
        a = opts.asyncOp
        keep = [output, input] if a else None
        p = c.size
        if not output_split_sizes and not input_split_sizes:
            h = c.raw("all_to_all", datatype(input), sa, sn, ra, rn, None, 0, a, keep)
            return BraidWork.of(h, [output])
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
        h = c.raw_blocks("all_to_all_v", datatype(input), sends, recvs, 0, a, keep)
        return BraidWork.of(h, [output])

    alltoall_base = all_to_all_single

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> BraidWork:
        c = self._core
        self._flush()
        if opts is None:
            opts = AllToAllOptions()
        if any_cuda(output_tensors, input_tensors):
            return self._staged(self.alltoall, output_tensors, input_tensors, opts)
        if len(output_tensors) != c.size or len(input_tensors) != c.size:
            raise InvalidArgumentError(
                f"braid: all_to_all takes one input and one output tensor per rank ({c.size})"
            )
        dtypes = {t.dtype for t in output_tensors} | {t.dtype for t in input_tensors}
        if any(o.dtype != i.dtype for o, i in zip(output_tensors, input_tensors, strict=True)):
            raise InvalidArgumentError("braid: all_to_all: input and output dtypes differ")
        sends = [host(i, "input") for i in input_tensors]
        recvs = [host(o, "output") for o in output_tensors]
        # One datatype for the whole call: the tensors' own when they share
        # one, else bytes.
        dt = datatype(input_tensors[0]) if len(dtypes) == 1 and input_tensors else U8
        a = opts.asyncOp
        keep = list(output_tensors) + list(input_tensors)
        h = c.raw_blocks("all_to_all_v", dt, sends, recvs, 0, a, keep if a else None)
        return BraidWork.of(h, output_tensors)

    # ---- point to point -----------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> BraidWork:
        if any_cuda(tensors):
            Cuda.check()
            host = [t.detach().to("cpu").contiguous() for t in tensors]
            w = self._core.add_p2p(True, host, dst, tag)
            w.wait()
            return BraidWork(None, tensors)
        return self._core.add_p2p(True, tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int | None, tag: int = 0) -> BraidWork:
        if any_cuda(tensors):
            Cuda.check()
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
        return BraidWork.of(h, [])

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        self.barrier(opts).wait()

    def abort(self) -> None:
        c = self._core
        for comm in (c.comm, c.mbox):
            try:
                comm.abort()
            except UnusableError:  # no communicator yet (enable_reconfigure)
                pass

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
        self._core.requested_timeout = seconds(timeout)

    @property
    def braid_communicator(self) -> _braid.Communicator:
        """The braid communicator under this group (for braid's own API)."""
        return self._core.comm
