"""The process group and backend classes ``init_process_group("braid")``
creates, and their registration with ``torch.distributed``."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import ProcessGroup as _ProcessGroup

from . import NAME
from .core import Core
from .elastic import Elastic, shrunk_core
from .ops import Ops


class BraidBackend(Elastic, Ops, _C10dBackend):
    """The braid backend object (``pg._get_backend(torch.device("cpu"))``)."""

    def __init__(self, core: Core, timeout: datetime.timedelta | None = None) -> None:
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

    def shrink(
        self, ranks_to_exclude: list[int], shrink_flags: int = 0, opts_override: Any = None
    ) -> BraidBackend:
        """``torch.distributed.shrink_group``: a backend on the ranks that
        stay (braid's ``Communicator.shrink``, which also works after a rank
        died in an operation); ``SHRINK_ABORT`` revokes this one first."""
        from torch.distributed.distributed_c10d import SHRINK_ABORT

        core = shrunk_core(self._core, ranks_to_exclude, shrink_flags == SHRINK_ABORT)
        timeout = getattr(opts_override, "_timeout", None) or self._options._timeout
        return BraidBackend(core, timeout)


class BraidProcessGroup(Elastic, Ops, _ProcessGroup):
    """The process group ``init_process_group("braid")`` and ``new_group``
    return; its methods run braid's collectives."""

    def __init__(self, store: dist.Store, core: Core) -> None:
        _ProcessGroup.__init__(self, store, core.rank, core.size)
        self._core = core

    # After reconfigure the group's rank and size are its communicator's.
    def rank(self) -> int:
        return self._core.rank

    def size(self) -> int:
        return self._core.size


def create(opts: Any, backend_options: Any = None) -> BraidProcessGroup:
    if getattr(opts, "enable_reconfigure", False):
        # torch's reconfigure regime: no communicator until reconfigure().
        core = Core.unconfigured(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    else:
        core = Core.create(opts.store, opts.group_rank, opts.group_size, opts.timeout)
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
    dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu", "cuda"])
