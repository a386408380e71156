"""Type stubs of braid's native module (``braid._braid``); the public names
are re-exported by :mod:`braid`."""

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from typing_extensions import Buffer, Self

__version__: str

class _DLPack(Protocol):
    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...

#: What braid's collectives take: a contiguous buffer-protocol object
#: (numpy array, bytearray, memoryview, array.array; bytes as a send
#: buffer) or a DLPack producer in host memory (torch CPU tensor).
BufferLike = Buffer | _DLPack
#: An operator: a ``braid.Op``, its value, or its name ("sum", "max", ...).
OpLike = int | str

def datatypes() -> list[tuple[int, str, int]]:
    """The datatypes braid has, as ``(code, name, size in bytes)``."""

def _operators() -> list[tuple[int, str]]:
    """The reduction operators as ``(code, name)`` (``braid.Op`` is built
    from it)."""

def datatype_of(obj: BufferLike) -> str:
    """The braid datatype of a buffer (``"float"``, ``"half"``,
    ``"bfloat16"``, ``"int32"``, ...); raises ``InvalidArgumentError`` when it
    has none (int16, complex, bool, big-endian, ...)."""

class RootSlot:
    """A port reserved for a rendezvous root whose secret comes later
    (torch's reconfigure)."""

    def __init__(self, host: str = "127.0.0.1") -> None: ...
    @property
    def address(self) -> str:
        """The reserved address, ``"ip:port"``."""
    def start(self, secret: str, timeout: float | None = None) -> UniqueId:
        """Start the root there with ``secret`` (32 hex digits)."""

class UniqueId:
    """The rendezvous of one communicator: the root's address and a random
    secret every rank must prove (NCCL's ``ncclUniqueId``).

    One process creates it with :meth:`create` (the rendezvous root then runs
    in that process), shares ``str(uid)`` with the other ranks over a trusted
    channel (it carries the secret), and every rank calls
    :meth:`Communicator.init`.
    """

    def __init__(self, text: str) -> None:
        """Parse the text form ``<ip>:<port>/<32 hex digits>``."""
    @staticmethod
    def create(host: str = "127.0.0.1", port: int = 0, timeout: float | None = None) -> UniqueId:
        """A new id with a random secret; its rendezvous root runs in this
        process on ``host`` (an IP address of this host the other ranks
        reach) and ``port`` (0: any free port), waiting at most ``timeout``
        seconds (default ``BRAID_TIMEOUT``, 120) for the ranks."""
    @property
    def address(self) -> str:
        """The root's address, ``"ip:port"``."""
    @property
    def hosts_root(self) -> bool:
        """Whether this process hosts the rendezvous root (until a
        communicator created from this object takes it over)."""
    def __str__(self) -> str:
        """The text form, secret included."""
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class Handle:
    """An asynchronous operation (``async_op=True``). Operations of one
    communicator run in issue order, like a CUDA stream (Rust:
    ``braid::Stream``). The buffers stay in use until it is done; dropping
    an unfinished handle waits for it."""

    def wait(self, timeout: float | None = None) -> None:
        """Block (GIL released) until done and raise the operation's error
        if it failed. With ``timeout`` (seconds) give up after that long
        with ``braid.TimeoutError``, leaving the handle valid."""
    def done(self) -> bool:
        """Whether the operation finished (successfully or not)."""
    def is_completed(self) -> bool:
        """``done()`` under torch.distributed's name."""
    def exception(self) -> BaseException | None:
        """The operation's exception; None if it succeeded or is running."""
    def add_done_callback(self, fn: Callable[[BaseException | None], Any]) -> None:
        """Call ``fn(error_or_None)`` when the operation finishes (on the
        thread that finishes it), or now if it has."""
    def _sources(self) -> list[int] | None:
        """Private (torch backend): the sender of each receive of a tagged
        batch (``_raw_tagged``) once it succeeded; None otherwise."""

class Group:
    """Point-to-point operations that run together (``Communicator.group()``)."""

    def send(self, buf: BufferLike, peer: int) -> None:
        """Add a send of ``buf`` to ``peer``."""
    def recv(self, buf: BufferLike, peer: int) -> None:
        """Add a receive into ``buf`` from ``peer``."""
    def run(self, *, async_op: bool = False) -> Handle | None:
        """Run the operations added so far."""
    def __enter__(self) -> Self: ...
    def __exit__(self, exc_type: Any, exc: Any = None, tb: Any = None) -> bool: ...

class Communicator:
    """A group of ranks that run collectives together.

    Create one with :meth:`from_env` under a launcher or with :meth:`init`
    from a :class:`UniqueId`. Every rank must issue the same operations in
    the same order. Every operation checks its arguments completely before
    anything is sent: a bad call raises ``InvalidArgumentError`` and leaves
    the communicator usable. Blocking calls release the GIL; with
    ``async_op=True`` they return a :class:`Handle` at once.

    ``recvbuf=None`` selects the in-place form of each collective.
    """

    @staticmethod
    def from_env() -> Communicator:
        """Create the communicator from the launcher's environment:
        braid-run (``BRAID_*``), torchrun (``RANK``, ``WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT``; the root listens on
        ``MASTER_PORT + 1``), Slurm or Open MPI."""
    @staticmethod
    def init(uid: UniqueId | str, rank: int, nranks: int, timeout: float | None = None) -> Communicator:
        """Join the communicator of ``uid`` as ``rank`` of ``nranks``.
        ``timeout`` (seconds, default ``BRAID_TIMEOUT`` or 120) bounds every
        wait of this communicator: a dead or silent peer becomes an error
        naming it."""
    @property
    def rank(self) -> int:
        """This rank, ``0 .. size-1``."""
    @property
    def size(self) -> int:
        """The number of ranks."""
    @property
    def transports(self) -> list[str]:
        """The transport to each rank (``"shm"``, ``"socket"``, ``"ib"``,
        ``"self"``)."""
    @property
    def cpu_share(self) -> tuple[int, int]:
        """``(ranks, cpus)``: the ranks of this host that may run on this
        rank's CPUs (itself included) and how many CPUs they have together.
        More threads per rank than ``cpus / ranks`` (torch's intra-op
        threads, OpenMP) oversubscribe them."""
    @property
    def pending(self) -> int:
        """Asynchronous operations issued and not yet finished."""
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
    def all_reduce(
        self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, op: OpLike | None = None, *, async_op: bool = False
    ) -> Handle | None:
        """``recvbuf[i] = op over ranks of sendbuf[i]`` (default SUM); in
        place on ``sendbuf`` with ``recvbuf=None``."""
    def reduce_scatter(
        self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, op: OpLike | None = None, *, async_op: bool = False
    ) -> Handle | None:
        """``sendbuf`` holds ``size * n`` elements; ``recvbuf`` (``n``)
        receives block ``rank`` of their reduction. In place: the result
        lands in block ``rank`` of ``sendbuf``."""
    def all_gather(self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, *, async_op: bool = False) -> Handle | None:
        """``recvbuf`` (``size * n``) receives every rank's ``sendbuf``
        (``n``) in rank order. In place: ``sendbuf`` is the whole buffer,
        this rank's contribution in block ``rank``."""
    def broadcast(
        self, sendbuf: BufferLike | None, recvbuf: BufferLike | None = None, root: int = 0, *, async_op: bool = False
    ) -> Handle | None:
        """The root's data to every rank: in place on ``sendbuf``, or into
        ``recvbuf`` (non-roots may pass ``sendbuf=None``)."""
    def reduce(
        self,
        sendbuf: BufferLike,
        recvbuf: BufferLike | None = None,
        op: OpLike | None = None,
        root: int = 0,
        *,
        async_op: bool = False,
    ) -> Handle | None:
        """The reduction of every rank's ``sendbuf`` into the root's
        ``recvbuf`` (in place: the root's ``sendbuf``); other ranks'
        ``recvbuf`` is not used."""
    def all_to_all(self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, *, async_op: bool = False) -> Handle | None:
        """Block ``j`` of ``sendbuf`` (``size`` equal blocks) goes to rank
        ``j``, landing in block ``rank`` of its ``recvbuf``."""
    def all_to_allv(
        self,
        sendbuf: BufferLike,
        sendcounts: Sequence[int],
        recvbuf: BufferLike,
        recvcounts: Sequence[int],
        sdispls: Sequence[int] | None = None,
        rdispls: Sequence[int] | None = None,
        *,
        async_op: bool = False,
    ) -> Handle | None:
        """``sendcounts[j]`` elements at ``sdispls[j]`` go to rank ``j``;
        ``recvcounts[i]`` elements from rank ``i`` land at ``rdispls[i]``
        (displacements in elements; default: running sums of the counts)."""
    def gather(self, sendbuf: BufferLike, recvbuf: BufferLike | None = None, root: int = 0, *, async_op: bool = False) -> Handle | None:
        """The root's ``recvbuf`` (``size * n``) receives every rank's
        ``sendbuf`` (``n``) in rank order; others pass ``recvbuf=None``."""
    def scatter(self, sendbuf: BufferLike | None, recvbuf: BufferLike, root: int = 0, *, async_op: bool = False) -> Handle | None:
        """Block ``j`` of the root's ``sendbuf`` (``size * n``) lands in
        rank ``j``'s ``recvbuf`` (``n``); others pass ``sendbuf=None``."""
    def send(self, buf: BufferLike, peer: int, *, async_op: bool = False) -> Handle | None:
        """Send ``buf`` to ``peer``. Two ranks that send to each other must
        use :meth:`group`."""
    def recv(self, buf: BufferLike, peer: int, *, async_op: bool = False) -> Handle | None:
        """Receive into ``buf`` from ``peer``."""
    def group(self) -> Group:
        """Point-to-point operations issued together: ``with comm.group()
        as g: g.send(a, 1); g.recv(b, 1)``."""
    def barrier(self, *, async_op: bool = False) -> Handle | None:
        """Return once every rank called ``barrier``."""
    def synchronize(self) -> None:
        """Block until every asynchronous operation issued so far is done."""
    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """Like ``MPI_Comm_split``: ranks with the same ``color`` form a new
        communicator ordered by ``key``; ``color=None`` gets None."""
    def shrink(self, exclude: Sequence[int]) -> Communicator:
        """Drop the ranks ``exclude``; every rank that stays calls it with the
        same list (``ncclCommShrink``). Works after a peer failed."""
    def revoke(self) -> None:
        """Fail every pending and later operation on every rank with
        ``RevokedError`` (``ncclCommRevoke``); any thread, not collective."""
    def is_revoked(self) -> bool:
        """Whether this communicator was revoked, here or by another rank."""
    def gone_ranks(self) -> list[int]:
        """The ranks whose process is gone (for ``shrink``)."""
    def grow_id(self) -> UniqueId:
        """On rank 0: the id new processes join a ``grow`` with."""
    def grow(self, nranks: int) -> Communicator:
        """Grow to ``nranks``: every rank here calls it, the new processes
        ``Communicator.init(grow_id, rank, nranks)`` (``ncclCommGrow``)."""
    def abort(self) -> None:
        """Fail every pending and later operation promptly (any thread)."""
    def async_error(self) -> str | None:
        """The error that broke this communicator, or None."""
    def close(self) -> None:
        """Finish pending asynchronous operations and refuse new ones."""
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: Any) -> bool: ...
    # Private entry points of the torch backend (raw host addresses).
    # Datatypes and operators by name (or code): "float", "sum", ...
    def _raw(
        self,
        kind: str,
        dt: str | int,
        send_addr: int,
        send_len: int,
        recv_addr: int,
        recv_len: int,
        op: OpLike | None = None,
        root: int = 0,
        async_op: bool = False,
        keep: Any = None,
    ) -> Handle | None: ...
    def _raw_seq(self, calls: list[tuple[str, str | int, int, int, int, int, OpLike, int]], async_op: bool = False, keep: Any = None) -> Handle | None: ...
    def _raw_blocks(
        self,
        kind: str,
        dt: str | int,
        sends: list[tuple[int, int]],
        recvs: list[tuple[int, int]],
        root: int = 0,
        async_op: bool = False,
        keep: Any = None,
    ) -> Handle | None:
        """Private (torch backend): gather, scatter or all_to_all_v on
        blocks ``(addr, len)`` that live apart (lists of tensors)."""
    def _cuda(
        self,
        kind: str,
        dt: str | int,
        send_addr: int,
        send_len: int,
        recv_addr: int,
        recv_len: int,
        op: OpLike | None = None,
        root: int = 0,
        stream: int = 0,
        device: int = 0,
    ) -> int: ...
    def _mailbox(self) -> Communicator:
        """Private (torch backend): the group's mailbox for tagged
        point-to-point messages, as the communicator it owns (a
        collective: every rank calls it)."""
    def _raw_tagged(self, ops: list[tuple[bool, int, int, int, int]], keep: Any = None) -> Handle:
        """Private (torch backend): tagged sends and receives ``(is_send,
        peer, tag, addr, len)`` run together on a ``_mailbox()``
        communicator (peer -1: a receive from any rank)."""
