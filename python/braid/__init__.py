"""braid: collective communication for Python programs.

An mpi4py-style communicator over braid's runtime (shared memory between
processes of one host, TCP or InfiniBand between hosts)::

    import numpy as np
    import braid

    comm = braid.Communicator.from_env()     # under braid-run, torchrun, srun, mpirun
    grads = np.ones(1 << 20, dtype=np.float32)
    comm.all_reduce(grads, op=braid.Op.AVG)  # in place
    full = np.empty(4 * comm.size, dtype=np.float64)
    comm.all_gather(np.full(4, comm.rank, dtype=np.float64), full)
    h = comm.all_reduce(grads, async_op=True)
    h.wait()

Buffers are contiguous buffer-protocol objects (numpy arrays, bytearray,
memoryview, array.array) or DLPack producers in host memory (torch CPU
tensors; bfloat16 only this way); the datatype comes from the buffer.
Blocking calls release the GIL while braid works; ``async_op=True`` returns a
:class:`Handle`, and operations run in the order they were issued.

PyTorch programs use braid through ``torch.distributed``:
``dist.init_process_group("braid")`` (see :mod:`braid.torch`).
"""

from __future__ import annotations

import enum as _enum

from . import errors
from ._braid import (
    Communicator,
    Group,
    Handle,
    UniqueId,
    __version__,
    _operators,
    datatype_of,
    datatypes,
)
from .errors import (
    BootstrapError,
    ConfigError,
    CudaError,
    Error,
    InvalidArgumentError,
    MismatchError,
    PeerFailedError,
    RevokedError,
    TimeoutError,
    UnusableError,
)

__all__ = [
    "Communicator",
    "Group",
    "Handle",
    "UniqueId",
    "Op",
    "SUM",
    "PROD",
    "MIN",
    "MAX",
    "AVG",
    "datatypes",
    "datatype_of",
    "errors",
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
    "__version__",
]


# The operators' values are braid's own codes, by name (one table: the
# binding's).
_OP_CODE = {name: code for code, name in _operators()}


class Op(_enum.IntEnum):
    """Reduction operators (``MPI_SUM``/``ncclSum`` and friends). Every
    operator works on every datatype; ``AVG`` is the sum divided by the
    number of ranks (integer division for integer datatypes)."""

    SUM = _OP_CODE["sum"]
    PROD = _OP_CODE["prod"]
    MIN = _OP_CODE["min"]
    MAX = _OP_CODE["max"]
    AVG = _OP_CODE["avg"]


SUM = Op.SUM
PROD = Op.PROD
MIN = Op.MIN
MAX = Op.MAX
AVG = Op.AVG
