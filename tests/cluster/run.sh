#!/usr/bin/env bash
# Cluster test kit: every collective, then braid-perf bandwidth, over the IB
# transport on a real InfiniBand / RoCE cluster, under Slurm (srun) or Open
# MPI (mpirun). Run it from a checkout on a shared file system, on a login
# node (it builds, then launches):
#
#   tests/cluster/run.sh srun   -N 2 --ntasks-per-node 2      # Slurm
#   tests/cluster/run.sh mpirun -np 4 --host a:2,b:2          # Open MPI
#
# Everything after the launcher name is passed to it. braid reads the rank
# and the rendezvous from the launcher's environment (SLURM_* / OMPI_*);
# with mpirun set BRAID_ROOT_ADDR to the first host's address. Put the
# BRAID_IB_* settings you want (BRAID_IB_HCA=mlx5_0:1, ...) in the
# environment; BRAID_DEBUG=INFO logs the device and the transport per peer.
set -euo pipefail
cd "$(dirname "$0")/../.."
launcher=${1:?usage: tests/cluster/run.sh srun|mpirun LAUNCHER-ARGS...}
shift
export BRAID_PORT=${BRAID_PORT:-29650}
cargo build --release -p braid-tests --bin braid-testrank
cargo build --release -p braid-perf
tr=target/release/braid-testrank
perf=target/release/braid-perf

echo "== 1. correctness: every collective x datatype x op, in and out of place"
"$launcher" "$@" "$tr" matrix env 0 0 0 1 7 1023 1048579 | tee cluster-matrix.log
echo "== 2. bandwidth: AllReduce, AllGather, ReduceScatter, 8 B to 1 GiB"
for c in all_reduce all_gather reduce_scatter alltoall; do
    BRAID_PORT=$((BRAID_PORT + 1)) "$launcher" "$@" "$perf" "$c" -b 8 -e 1G -f 2 -n 20 -w 5 -c 1 \
        -J "cluster-$c.json" | tee "cluster-$c.log"
    BRAID_PORT=$((BRAID_PORT + 1))
done
echo "== done: logs in cluster-*.log, JSON in cluster-*.json"
