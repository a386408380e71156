"""What braid takes from a tensor: its address and length (contiguous,
dense), its device (CPU; CUDA through the device communicator or staged
through host memory), PREMUL_SUM's scaling, all_to_all's split sizes."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CudaError, InvalidArgumentError


class Cuda:
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


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    return obj


def any_cuda(*objs: Any) -> bool:
    """Whether any tensor is on a CUDA device (other devices raise)."""
    for o in objs:
        if isinstance(o, torch.Tensor):
            if not o.is_cpu:
                check_device(o)
                return True
        elif isinstance(o, (list, tuple)):
            if any_cuda(*o):
                return True
    return False


def check_device(t: torch.Tensor) -> None:
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


def split_sizes(sizes: Any, what: str) -> list[int]:
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


STRIDED = torch.strided


def host(t: torch.Tensor, what: str = "tensor") -> tuple[int, int]:
    """(address, bytes) of a contiguous dense tensor."""
    if t.layout is not STRIDED:
        kind = "sparse" if t.is_sparse or "sparse" in str(t.layout) else "not dense"
        raise InvalidArgumentError(
            f"braid: the {what} is {kind} ({t.layout}); braid takes dense (strided) tensors "
            "here (all_reduce also takes sparse COO tensors, as gloo); pass tensor.to_dense()"
        )
    if not t.is_contiguous():
        raise InvalidArgumentError(
            f"braid: the {what} is not contiguous; pass tensor.contiguous()"
        )
    return t.data_ptr(), t.nbytes


def premul(t: torch.Tensor, factor: Any, in_place: bool) -> torch.Tensor:
    """`t` scaled by PREMUL_SUM's `factor` (in place, or a contiguous copy)."""
    f = factor
    if isinstance(f, torch.Tensor):
        f = f.to(device=t.device, dtype=t.dtype)
    if in_place:
        return t.mul_(f)
    return (t * f).contiguous()
