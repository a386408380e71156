"""The parts of the ``torch.distributed`` backend, one job each
(:mod:`braid.torch` is the public module and its documentation):

- ``tables``: torch dtypes and ReduceOps as braid's datatypes and operators
  (by name).
- ``tensors``: what braid takes from a tensor (its address and length,
  its device), CUDA tensors staged through host memory, split sizes.
- ``work``: ``BraidWork``, torch's Work and future over a braid handle.
- ``rendezvous``: where rank 0 hosts a group's rendezvous, and joining it
  through torch's store.
- ``core``: the braid communicator behind a group, and the batching of
  point-to-point operations.
- ``ops``: the collectives (the methods of torch's ProcessGroup and Backend).
- ``elastic``: shrink_group and the reconfigure API (new communicators
  among the ranks left, or the handles given).
- ``backend``: the process group and backend classes, and registration.
"""

#: The backend's name in ``init_process_group``.
NAME = "braid"
