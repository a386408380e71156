#!/usr/bin/env bash
# Bandwidth check over IB between two Soft-RoCE guests (tools/rdma-vm/run
# --nodes 2, or the harness in RDMA_VM_RUN): ib_write_bw (perftest) one way
# and both ways, braid-perf AllReduce busbw with one rank per guest at SIZE
# (default 64M), then ib_write_bw again, all in the same guest run. Both
# measure the emulator (every guest instruction is emulated), so only their
# ratio means something.
#   scripts/ib-bench.sh [SIZE]
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-64M}
VM=${RDMA_VM_RUN:-tools/rdma-vm/run}
[ -x "$VM" ] || { echo "ib-bench: the guest harness $VM is missing"; exit 1; }
scripts/rdma-deps.sh
cargo build -q --release -p braid-perf
RDMA_TEST_SECRET=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
export RDMA_TEST_SECRET
"$VM" --nodes 2 --timeout 900 -- scripts/rdma-guest.sh bench target/release/braid-perf "$size"
