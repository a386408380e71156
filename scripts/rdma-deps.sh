#!/usr/bin/env bash
# Installs what running braid's IB transport needs (Debian 12): libibverbs
# and its providers (Soft-RoCE is rdma_rxe's librxe), plus perftest and the
# verbs utilities for the benchmark and the probes. Building braid needs
# none of it: libibverbs is loaded at run time.
#   scripts/rdma-deps.sh              the run-time packages
#   scripts/rdma-deps.sh --abi-check  also what the layout test needs
#                                     (cargo test -p braid-transport-ib
#                                     --features abi-check: ibverbs-sys
#                                     configures rdma-core with cmake, which
#                                     wants libnl, pkg-config and python3,
#                                     and runs bindgen, which wants libclang)
set -euo pipefail
pkgs=(libibverbs1 ibverbs-providers perftest ibverbs-utils)
if [ "${1:-}" = --abi-check ]; then
    pkgs+=(libibverbs-dev cmake clang libclang-dev libnl-3-dev libnl-route-3-dev pkg-config python3)
fi
need=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need+=("$p")
done
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "rdma-deps: missing Debian packages ${need[*]} and not root: install them first" >&2
    exit 1
fi
echo "rdma-deps: installing ${need[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
