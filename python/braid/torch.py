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

from ._torch import NAME
from ._torch.backend import BraidBackend, BraidProcessGroup, register
from ._torch.work import BraidWork

__all__ = ["register", "BraidProcessGroup", "BraidBackend", "BraidWork", "NAME"]

# The public names are this module's (reprs, pickles, documentation).
for _obj in (register, BraidProcessGroup, BraidBackend, BraidWork):
    _obj.__module__ = __name__
del _obj

register()
