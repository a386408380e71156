#!/usr/bin/env bash
# The test suite, with what it needs installed first (README's test command):
# cargo test over the workspace, then the Python package and its tests.
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
cargo test --workspace "$@"

# The Python package (python/, built by maturin from crates/python) and its
# tests (python/tests: the Python API and the torch.distributed backend
# across real processes, against numpy and gloo). With arguments (a cargo
# test filter) only the Rust tests run. The venv (BRAID_PY_VENV, default
# ~/.cache/braid/py311) is created with python3 >= 3.11 and reused; pip
# fetches torch (about 3 GB with its CUDA wheels, under a minute here),
# numpy, pytest and expecttest (PyTorch's own test suite needs it) from the
# default index once, then finds them installed.
[ $# -eq 0 ] || exit 0
venv="${BRAID_PY_VENV:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/braid/py311}"
if [ ! -x "$venv/bin/python" ]; then
    python=""
    for p in python3.13 python3.12 python3.11 python3; do
        if command -v "$p" >/dev/null &&
            "$p" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            python="$p"
            break
        fi
    done
    if [ -z "$python" ]; then
        echo "test.sh: the Python tests need python3 >= 3.11 (with its venv module)" >&2
        exit 1
    fi
    if ! "$python" -m venv --help >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-input)
echo "== python: torch, numpy, pytest into $venv"
"${pip[@]}" "torch>=2.15" numpy pytest expecttest
echo "== python: pip install ./python (builds crates/python with maturin)"
"${pip[@]}" ./python
echo "== python: pytest python/tests"
# From the repository root: `braid` must come from the venv, not python/.
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir python/tests python/tests
