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

# The Python package as users get it: a wheel, then its tests (python/tests:
# the Python API and the torch.distributed backend across real processes,
# against numpy and gloo) against that wheel installed in a fresh venv.
# With arguments (a cargo test filter) only the Rust tests run.
#
# 1. The wheel: maturin and zig (both from the package index, in a tools
#    venv, BRAID_WHEEL_TOOLS, reused) build crates/python for manylinux2014
#    (glibc >= 2.17), abi3 (CPython >= 3.11): one wheel for every cluster,
#    linked against nothing but libc (libibverbs, libcuda and NVML are
#    loaded at run time when present). It lands in target/wheels.
# 2. A fresh venv (BRAID_PY_VENV, default ~/.cache/braid/wheel-venv,
#    removed and created anew each run) gets torch, numpy, pytest,
#    expecttest and torchft from the default index (torch is about 3 GB
#    with its CUDA wheels: about a minute here) and the wheel, and runs the
#    tests with a
#    PATH that holds no cargo or rustc: nothing in them can build braid.
[ $# -eq 0 ] || exit 0
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
cache="${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/braid"
tools="${BRAID_WHEEL_TOOLS:-$cache/wheel-build}"
venv="${BRAID_PY_VENV:-$cache/wheel-venv}"
[ -x "$tools/bin/python" ] || { mkdir -p "$(dirname "$tools")" && "$python" -m venv "$tools"; }
pip_q=(-m pip install -q --disable-pip-version-check --no-input)
echo "== python: the wheel (maturin --zig, manylinux2014 x86-64, abi3) into target/wheels"
"$tools/bin/python" "${pip_q[@]}" "maturin>=1.5,<2" ziglang
rm -f target/wheels/braid-*.whl
(cd python && PATH="$tools/bin:$PATH" maturin build --release --zig --compatibility manylinux2014 \
    --out ../target/wheels)
wheel=$(ls target/wheels/braid-*-abi3-manylinux2014_x86_64*.whl)
echo "== python: $wheel, $(stat -c %s "$wheel") bytes"
echo "== python: a fresh venv at $venv with torch, numpy, pytest, expecttest, torchft and the wheel"
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$python" -m venv "$venv"
# torchft (pinned: a nightly) and parameterized, which its test module
# imports: python/tests/test_torchft.py runs torchft's own reconfigure test
# and its DDP example on braid.
"$venv/bin/python" "${pip_q[@]}" "torch>=2.15" numpy pytest expecttest \
    torchft-nightly==2026.10.26 parameterized "$wheel"
echo "== python: pytest python/tests against the wheel (no cargo or rustc on PATH)"
# PATH: the venv first, then PATH without the folders that hold cargo or
# rustc (~/.cargo/bin); where a system folder holds them, stubs in front say
# so and fail, so nothing a test runs can build braid.
stubs="$venv/no-rust"
mkdir -p "$stubs"
for t in cargo rustc rustup maturin; do
    printf '#!/bin/sh\necho "%s: not available to the wheel'"'"'s tests" >&2\nexit 127\n' "$t" >"$stubs/$t"
    chmod +x "$stubs/$t"
done
clean=""
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do
    if [ -n "$d" ] && [ ! -x "$d/cargo" ] && [ ! -x "$d/rustc" ]; then clean="$clean:$d"; fi
    case $d in /usr/bin | /bin | /usr/local/bin) [ -x "$d/cargo" ] && clean="$clean:$d" ;; esac
done
export PATH="$venv/bin:$stubs$clean"
if cargo --version >/dev/null 2>&1 || rustc --version >/dev/null 2>&1; then
    echo "test.sh: cargo or rustc is still reachable from the wheel's tests" >&2
    exit 1
fi
# From the repository root: `braid` must come from the venv, not python/.
"$venv/bin/python" -c 'import braid, sys; f = braid.__file__; sys.exit(0 if "/site-packages/" in f else f"braid comes from {f}, not the wheel")'
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir python/tests python/tests
