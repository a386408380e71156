"""A group's rendezvous: rank 0 creates braid's unique id (with a random
secret) on an address the other ranks reach and shares it through torch's
store; every rank joins with it."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch.distributed as dist

from .. import _braid


def join(store: dist.Store, rank: int, size: int, secs: float | None) -> _braid.Communicator:
    """This rank's braid communicator of the group whose store is `store`
    (`secs`: the deadline of every wait, None for braid's default)."""
    key = "braid/unique_id"
    if rank == 0:
        uid = _braid.UniqueId.create(host=root_ip(store), timeout=secs)
        store.set(key, str(uid))
        return _braid.Communicator.init(uid, rank, size, timeout=secs)
    text = store.get(key).decode()
    return _braid.Communicator.init(text, rank, size, timeout=secs)


def unwrap_store(store: Any) -> Any:
    s = store
    for _ in range(16):
        inner = getattr(s, "underlying_store", None)
        if inner is None:
            break
        s = inner
    return s


def root_ip(store: Any) -> str:
    """The address rank 0 hosts the rendezvous on: BRAID_ROOT_ADDR if set,
    else this host's address on the route to torch's store (the other ranks
    reach that host), else loopback."""
    forced = os.environ.get("BRAID_ROOT_ADDR", "").strip()
    target = forced
    if not target:
        s = unwrap_store(store)
        target = getattr(s, "host", "") if isinstance(s, dist.TCPStore) else ""
    if not target:
        target = os.environ.get("MASTER_ADDR", "").strip()
    if not target:
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(target, None, socket.AF_INET, socket.SOCK_DGRAM)
        ip = infos[0][4][0]
    except OSError:
        try:
            infos = socket.getaddrinfo(target, None, socket.AF_INET6, socket.SOCK_DGRAM)
            ip = infos[0][4][0]
        except OSError:
            return "127.0.0.1"
    if forced:
        return ip
    fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0]
    except OSError:
        return ip
