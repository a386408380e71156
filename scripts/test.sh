#!/usr/bin/env bash
# The test suite, with what it needs installed first (README's test command).
# The multi-host tests emulate hosts with network namespaces: they need root,
# iproute2 (ip, tc) and util-linux (unshare, nsenter); without root they skip
# and say so. On kernels without sch_netem the delayed-link test delays
# packets through a netfilter queue, which needs iptables.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ]; then
    need=()
    command -v ip >/dev/null || need+=(iproute2)
    command -v nsenter >/dev/null || need+=(util-linux)
    command -v iptables >/dev/null || need+=(iptables)
    if [ ${#need[@]} -gt 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
fi
exec cargo test --workspace "$@"
