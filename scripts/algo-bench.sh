#!/usr/bin/env bash
# The emulated-host table of docs/algorithms.md: every algorithm forced
# (BRAID_ALGO) and the tuner's pick, side by side in one run, on hosts
# emulated with network namespaces (one braid-perf process per rank, each
# host's link delayed 0.5 ms each way — a 1 ms round trip — and limited to
# 200 Mbit/s): AllReduce at 8 B, 64 KiB, 1 MiB and 64 MiB, Broadcast and
# AllGather at 64 KiB on 8 and 16 hosts of one rank, and the AllReduce
# cells on 2 hosts of 4 ranks (the hierarchical form).
#
#   scripts/algo-bench.sh [OUT.md] [braid-algo-bench options]   (root)
#
# e.g. scripts/algo-bench.sh /tmp/t.md --hosts 4 --hier "" --cells all_reduce:64K
# Takes about half an hour on the 2-core VM (the 64 MiB cells move 2 GB
# through the emulated links per algorithm). Needs iproute2, util-linux
# and, where the kernel has no sch_netem, iptables (installed if missing).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-/dev/stdout}
shift || true
if [ "$(id -u)" != 0 ]; then
    echo "algo-bench: needs root (network namespaces)" >&2
    exit 2
fi
need=()
command -v ip >/dev/null || need+=(iproute2)
command -v nsenter >/dev/null || need+=(util-linux)
command -v iptables >/dev/null || need+=(iptables)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
cargo build --release -q -p braid-perf -p braid-tests --bins --manifest-path "$here/Cargo.toml"
bin=$here/target/release
{
    echo "<!-- $(date -u +%Y-%m-%dT%H:%MZ) at $(git -C "$here" rev-parse --short HEAD), $(nproc) CPUs: scripts/algo-bench.sh $* -->"
    "$bin/braid-algo-bench" --perf "$bin/braid-perf" "$@"
} >"$out"
