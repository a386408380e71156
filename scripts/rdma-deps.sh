#!/usr/bin/env bash
# Installs what building braid with the IB transport needs (Debian 12):
# ibverbs-sys links libibverbs, configures its vendored rdma-core with cmake
# (which wants libnl, pkg-config and python3) and runs bindgen (libclang).
# Running IB code also needs a verbs provider (ibverbs-providers: Soft-RoCE
# is rdma_rxe's librxe) and, for the benchmark, perftest.
set -euo pipefail
pkgs=(libibverbs-dev ibverbs-providers cmake clang libclang-dev libnl-3-dev libnl-route-3-dev
      pkg-config python3 perftest ibverbs-utils)
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
