"""torchft's DDP training example (train_ddp.py: its CIFAR-10 convnet,
torchft's Manager, DistributedDataParallel and optimizer wrapper), with
synthetic CIFAR-shaped data (no download) and one replica group's process
killed once mid-step. Run by ``torchft_run.py``, one process per replica
group.

Environment: REPLICA_GROUP_ID, TORCHFT_LIGHTHOUSE, MASTER_ADDR/MASTER_PORT
(this replica group's store), BACKEND ("braid": braid's own process group
in torch's reconfigure regime; "gloo": torchft's ProcessGroupGloo, as the
example), STEPS, KILL_AT (the step at which replica group 1 kills itself on
its first life; RESTARTED set on the second), OUT (a folder for results).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn, optim
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo


class Net(nn.Module):
    """The example's convnet."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `replica` at `step`: the same on every run."""
    g = torch.Generator().manual_seed(step * 1000 + replica)
    return torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    backend = os.environ["BACKEND"]
    steps = int(os.environ.get("STEPS", "30"))
    kill_at = int(os.environ.get("KILL_AT", "-1"))
    out = os.environ["OUT"]
    restarted = "RESTARTED" in os.environ
    torch.manual_seed(0)  # the same initial model everywhere
    m = Net()
    opt = optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    def load_state_dict(sd: dict) -> None:
        m.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def state_dict() -> dict:
        return {"model": m.state_dict(), "optim": opt.state_dict()}

    if backend == "braid":
        import braid.torch  # noqa: F401  (the backend; its entry point registers it too)

        # braid's process group in torch's reconfigure regime: the Manager
        # reconfigures it among the replica groups of each quorum.
        dist.init_process_group(
            "braid", store=dist.HashStore(), rank=0, world_size=1,
            timeout=timedelta(seconds=5), enable_reconfigure=True,
        )
        pg = dist.group.WORLD
    else:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    # torchrun's agent hosts the replica group's store; a group of one
    # process started without torchrun hosts it itself.
    group_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=True,
        wait_for_workers=False,
    )
    manager = Manager(
        pg=pg,
        min_replica_size=2,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{replica}",
        timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
    )
    if restarted:
        with open(os.path.join(out, "rejoined"), "w") as f:
            f.write(repr(time.time()))
    model = DistributedDataParallel(manager, m)
    optimizer = Optimizer(manager, opt)
    commits = []
    while manager.current_step() < steps:
        step = manager.current_step()
        optimizer.zero_grad()
        x, y = batch(step, replica)
        loss = F.cross_entropy(model(x), y)
        if replica == 1 and not restarted and step == kill_at:
            with open(os.path.join(out, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        optimizer.step()
        if manager.current_step() > step:
            commits.append([step, time.time()])
    params = torch.cat([p.detach().flatten() for p in m.parameters()])
    torch.save(params, os.path.join(out, f"params{replica}.pt"))
    with open(os.path.join(out, f"commits{replica}.json"), "w") as f:
        json.dump(commits, f)
    manager.shutdown(wait=False)
    del group_store
    if backend == "braid":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
