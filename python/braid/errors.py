"""braid's errors as Python exceptions.

Every exception braid raises is a :class:`braid.Error`, carrying braid's
message (which names the rank, the operation, the peer and the cause, and
says what to do) and, where known, the facts as attributes:

``rank``
    the rank that raised it;
``op`` and ``seq``
    the operation (``"AllReduce"``, ...) and its sequence number on the
    communicator;
``peer``
    the rank whose failure, silence or disagreement caused it.

The subclasses say what happened:

- :class:`InvalidArgumentError` (also a ``ValueError``): a bad call, caught
  before anything was sent; the communicator is still usable.
- :class:`TimeoutError` (also the built-in ``TimeoutError``): a peer did not
  answer within the communicator's timeout (``BRAID_TIMEOUT``).
- :class:`PeerFailedError`: a peer died, closed its links or aborted.
- :class:`MismatchError`: the ranks issued different operations (kind,
  count, datatype, root).
- :class:`UnusableError`: the communicator was aborted or broken by an
  earlier error; create a new one (or ``shrink`` it to the ranks left).
- :class:`RevokedError` (an :class:`UnusableError`): a rank revoked the
  communicator (``Communicator.revoke``); shrink it or drop it.
- :class:`BootstrapError`: the rendezvous failed (wrong secret, ranks that
  never came).
- :class:`ConfigError`: a ``BRAID_*`` variable or the launch environment is
  unusable.
- :class:`CudaError`: CUDA is unavailable or failed.

After a :class:`TimeoutError`, :class:`PeerFailedError` or
:class:`MismatchError` in an operation the communicator is unusable, like
NCCL's after an error: drop it and create a new one.
"""

from __future__ import annotations

import builtins

__all__ = [
    "Error",
    "InvalidArgumentError",
    "TimeoutError",
    "PeerFailedError",
    "MismatchError",
    "UnusableError",
    "RevokedError",
    "BootstrapError",
    "ConfigError",
    "CudaError",
]


class Error(Exception):
    """Base class of every exception braid raises."""

    #: The rank that raised it, if known.
    rank: int | None
    #: The operation ("AllReduce", "Send", ...), if the error came from one.
    op: str | None
    #: The operation's sequence number on its communicator, if known.
    seq: int | None
    #: The peer rank that caused it, if known.
    peer: int | None

    def __init__(
        self,
        message: str = "",
        *,
        peer: int | None = None,
        rank: int | None = None,
        op: str | None = None,
        seq: int | None = None,
    ) -> None:
        super().__init__(message)
        self.peer = peer
        self.rank = rank
        self.op = op
        self.seq = seq

    def __reduce__(self):  # picklable with its attributes (multiprocessing)
        return (
            _rebuild,
            (type(self), str(self), self.peer, self.rank, self.op, self.seq),
        )


def _rebuild(cls, message, peer, rank, op, seq):
    return cls(message, peer=peer, rank=rank, op=op, seq=seq)


class InvalidArgumentError(Error, ValueError):
    """A bad call (buffer, datatype, length, root, peer); nothing was sent
    and the communicator is still usable."""


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 - braid.TimeoutError
    """A peer did not answer within the communicator's timeout."""


class PeerFailedError(Error):
    """A peer died, closed its links or aborted."""


class MismatchError(Error):
    """The ranks issued different operations (kind, count, datatype, root)."""


class UnusableError(Error):
    """The communicator was aborted or broken by an earlier error."""


class RevokedError(UnusableError):
    """A rank revoked the communicator (``Communicator.revoke``)."""


class BootstrapError(Error):
    """The rendezvous failed (wrong secret, missing ranks, network)."""


class ConfigError(Error):
    """A BRAID_* variable or the launch environment is unusable."""


class CudaError(Error):
    """CUDA is unavailable on this machine, or a CUDA call failed."""
