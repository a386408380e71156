"""torch's fault-tolerance APIs on braid: ``shrink_group`` (braid's
``Communicator.shrink``) and the reconfigure API (``enable_reconfigure``,
``_get_reconfigure_handle``, ``_reconfigure``: a new braid communicator
among the handles given)."""

from __future__ import annotations

import hashlib
import json
import uuid as _uuid
from typing import TYPE_CHECKING, Any

from .. import _braid
from ..errors import InvalidArgumentError
from . import rendezvous
from .work import BraidWork, seconds

if TYPE_CHECKING:
    from .core import Core

#: The version of braid's reconfigure handles.
HANDLE_VERSION = 1


class Elastic:
    """The reconfigure API of braid's process group and backend (both
    answer it: torch asks the group, torchft-like wrappers the backend)."""

    _core: Core

    @property
    def supports_reconfigure(self) -> bool:
        return True

    def get_reconfigure_handle(self) -> str:
        """This process's handle: an id of its own and the address where it
        hosts the rendezvous if it becomes rank 0 (a port reserved now)."""
        c = self._core
        if c.slot is None:
            host = rendezvous.root_ip(c.store) if c.store is not None else "127.0.0.1"
            c.slot = _braid.RootSlot(host)
            c.handle_id = _uuid.uuid4().hex
        return json.dumps({"braid": HANDLE_VERSION, "id": c.handle_id, "root": c.slot.address})

    def reconfigure(self, opts: Any) -> BraidWork:
        """A new communicator among ``opts.handles`` (a list: ranks by
        position; a set: ranks in sorted order), identified by ``opts.uuid``;
        this process is the rank of its own handle. The old communicator (if
        any) is aborted first. Blocks until every rank has joined (within
        ``opts.timeout``, else the group's timeout)."""
        c = self._core
        if c.slot is None:
            raise InvalidArgumentError(
                "braid: reconfigure needs this process's own handle among the handles: "
                "call get_reconfigure_handle() first and share it with the other ranks"
            )
        handles = opts.handles
        ordered = sorted(handles) if isinstance(handles, (set, frozenset)) else list(handles)
        peers = []
        for h in ordered:
            try:
                p = json.loads(h)
                if p.get("braid") != HANDLE_VERSION:
                    raise ValueError(p.get("braid"))
                peers.append((str(p["id"]), str(p["root"])))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise InvalidArgumentError(
                    f"braid: {h!r} is not a braid reconfigure handle (version {HANDLE_VERSION}); "
                    "every rank's handle comes from get_reconfigure_handle()"
                ) from None
        ids = [p[0] for p in peers]
        if ids.count(c.handle_id) != 1:
            raise InvalidArgumentError(
                "braid: this process's handle is not among the handles (exactly once)"
            )
        rank, size = ids.index(c.handle_id), len(peers)
        timeout = seconds(getattr(opts, "timeout", None)) or c.timeout
        # Everyone with the uuid and the handles derives the secret, as
        # everyone with a unique id's text knows its secret.
        secret = hashlib.sha256(
            f"braid-reconfigure\n{int(opts.uuid)}\n".encode() + "\n".join(ids).encode()
        ).hexdigest()[:32]
        if rank == 0:
            uid: Any = c.slot.start(secret, timeout)
            c.slot = None  # a slot hosts one root; the next handle reserves anew
            c.handle_id = ""
        else:
            uid = f"{peers[0][1]}/{secret}"
        old = c.comm
        try:
            old.abort()
            c.mbox.abort()
        except Exception:  # an unconfigured group has nothing to abort
            pass
        comm = _braid.Communicator.init(uid, rank, size, timeout=timeout)
        c.install(comm, comm._mailbox(), rank, size)
        return BraidWork(None, [])

    @property
    def supports_shrinking(self) -> bool:
        return True


def shrunk_core(core: Core, ranks_to_exclude: list[int], abort_first: bool) -> Core:
    """The core of the group without `ranks_to_exclude` (braid's shrink);
    `abort_first` (torch's SHRINK_ABORT) revokes the old communicator so that
    operations still pending on it, on every rank, end at once."""
    from .core import Core

    if abort_first:
        core.comm.revoke()
    comm = core.comm.shrink(list(ranks_to_exclude))
    new = Core(comm, comm.rank, comm.size, core.timeout, comm._mailbox())
    new.store = core.store
    return new
