"""torch dtypes and ReduceOps as braid's datatypes and operators.

They cross into braid by name (``braid.datatypes()``, ``braid.Op``); the
binding converts names to braid's own in one place, so no numeric code is
kept here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import InvalidArgumentError

# torch dtype -> braid datatype.
DT: dict[torch.dtype, str] = {
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
        DT[getattr(torch, _name)] = _name
U8 = "uint8"
# Complex tensors reduce as pairs of real numbers (SUM, AVG, PREMUL_SUM only).
COMPLEX = {torch.complex64: "float", torch.complex128: "double"}

# torch ReduceOp (by its name) -> braid operator.
BRAID_OP = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max"}
# bool: logical or / and as max / min of bytes.
BOOL_OP = {"SUM": "max", "MAX": "max", "BOR": "max", "PRODUCT": "min", "MIN": "min", "BAND": "min"}


def op_name(reduce_op: Any) -> str:
    """torch's name of a ReduceOp, RedOpType or its value ("SUM", "PREMUL_SUM", ...)."""
    op = getattr(reduce_op, "op", reduce_op)
    name = getattr(op, "name", None)
    if name is None:
        name = dist.ReduceOp.RedOpType(int(op)).name
    return name


def datatype(t: torch.Tensor) -> str:
    """The braid datatype for moving `t` (any dtype moves as bytes)."""
    return DT.get(t.dtype, U8)


# (torch dtype, RedOpType value) -> (braid datatype, braid operator). Keyed
# by the value, which reads in a fraction of the name's time (the name cost
# a small all_reduce about a microsecond).
_BY_CODE: dict[tuple[torch.dtype, int], tuple[str, str]] = {}
# The SUM entries by dtype alone (the torch backend's all_reduce reads it).
SUM_OF: dict[torch.dtype, tuple[str, str]] = {}
_PREMUL = int(dist.ReduceOp.RedOpType.PREMUL_SUM.value)
SUM_OP = dist.ReduceOp.RedOpType.SUM
_SUM_CODE = int(SUM_OP.value)


def reduction(t: torch.Tensor, reduce_op: Any) -> tuple[str, str, Any]:
    """(braid datatype, braid operator, PREMUL_SUM factor or None) for
    reducing `t` with torch's `reduce_op`; raises for what braid cannot."""
    if reduce_op == SUM_OP:  # cheaper than reading the op (the usual case)
        code: Any = _SUM_CODE
    else:
        code = getattr(getattr(reduce_op, "op", reduce_op), "value", None)
    if code is not None and code != _PREMUL:
        hit = _BY_CODE.get((t.dtype, code))
        if hit is not None:
            return hit[0], hit[1], None
        dt, bop, _ = _reduction(t, reduce_op)
        if type(code) is int:
            _BY_CODE[(t.dtype, code)] = (dt, bop)
            if code == _SUM_CODE:
                SUM_OF[t.dtype] = (dt, bop)
        return dt, bop, None
    return _reduction(t, reduce_op)


def _reduction(t: torch.Tensor, reduce_op: Any) -> tuple[str, str, Any]:
    name = op_name(reduce_op)
    if name == "PREMUL_SUM":
        dt, _, _ = reduction(t, dist.ReduceOp.SUM)
        return dt, "sum", reduce_op.factor
    dtype = t.dtype
    if dtype == torch.bool:
        if name not in BOOL_OP:
            raise InvalidArgumentError(
                f"braid: ReduceOp.{name} is not defined on bool tensors"
            )
        res = (U8, BOOL_OP[name])
    elif dtype in COMPLEX:
        if name not in ("SUM", "AVG"):
            raise InvalidArgumentError(
                f"braid: ReduceOp.{name} is not defined on complex tensors"
            )
        res = (COMPLEX[dtype], BRAID_OP[name])
    else:
        dt = DT.get(dtype)
        if dt is None:
            raise InvalidArgumentError(
                f"braid: {dtype} is not a braid datatype; braid reduces int8, uint8, int32, "
                "uint32, int64, uint64, float16, bfloat16, float32 and float64"
            )
        if name not in BRAID_OP:
            raise InvalidArgumentError(
                f"braid: ReduceOp.{name} is not supported on {dtype} "
                "(braid has SUM, PRODUCT, MIN, MAX, AVG and PREMUL_SUM; BAND/BOR on bool)"
            )
        res = (dt, BRAID_OP[name])
    return res[0], res[1], None
