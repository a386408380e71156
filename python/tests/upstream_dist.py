"""PyTorch's own distributed test suite (DistributedTest, the suite behind
test/distributed/test_distributed_spawn.py, shipped in the torch wheel as
torch.testing._internal.distributed.distributed_test) run on the "braid"
backend through its plugin hook.

    BACKEND=braid WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) python upstream_dist.py -k <pattern>

The suite gates tests by backend: braid joins DistTestCases.backend_feature
"plugin" (available), "ddp" and "subgroup" (it receives from any source, as
gloo does, so it is not in skip_collective "sendrecv anysource"); tests
written only for gloo or nccl (by name) skip themselves.
test_torch_upstream.py runs a selection.
"""

import os
import sys

os.environ.setdefault("BACKEND", "braid")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:
    raise SystemExit("set TEMP_DIR to an empty directory")
os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)
# torch's run_tests() writes JUnit XML through the optional xmlrunner package
# whenever CI is set (any value, as CI systems set it); this runner reports to
# the terminal, so the result must not depend on the machine's CI variable.
os.environ.pop("CI", None)

import torch  # noqa: E402

import braid.torch  # noqa: E402,F401  registers the backend in every spawned rank

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

for feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[feature].add("braid")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestBraidDistributed(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    sys.exit(run_tests())
