#!/usr/bin/env bash
# Compile every GPU kernel braid ships (each datatype x operator, and the
# Avg divide) with NVIDIA's real NVRTC and assemble it with ptxas, for sm_80
# and sm_90, on a machine without a GPU; print registers and spills per
# kernel, and exit non-zero on any failure.
#
# NVRTC and ptxas come from the Python package index (nvidia-cuda-nvrtc-cu12,
# nvidia-cuda-nvcc-cu12), installed with pip into a venv under the cache
# directory and reused when present. Both are pinned to one CUDA release, so
# that ptxas accepts the PTX version NVRTC emits; 12.4 is the API braid's
# cudarc bindings are built for (feature cuda-12040).
#
# The compile is braid's own: examples/kernel-check.rs in crates/cuda calls
# braid_cuda::driver::compile_ptx (the device-free half of Kernels::compile:
# kernels::source(), the same NVRTC options but the architecture, through
# cudarc with libnvrtc.so.12 from the venv on LD_LIBRARY_PATH), then runs
# `ptxas -arch=sm_XY -v` on the PTX.
#
# Usage: scripts/cuda-kernels.sh [extra kernel-check arguments, e.g. --arch 80]
# Environment: BRAID_CUDA_VENV (default ${XDG_CACHE_HOME:-$HOME/.cache}/braid/cuda-venv),
#              BRAID_KERNEL_OUT (where PTX, cubins and ptxas output go;
#              default target/cuda-kernels).
set -euo pipefail
cd "$(dirname "$0")/.."

# One CUDA release for both: 12.4 update 1.
NVRTC_PKG="nvidia-cuda-nvrtc-cu12==12.4.127"
NVCC_PKG="nvidia-cuda-nvcc-cu12==12.4.131"
CUDA_RELEASE="12.4"

cache="${XDG_CACHE_HOME:-${HOME:-/root}/.cache}"
venv="${BRAID_CUDA_VENV:-$cache/braid/cuda-venv}"
out="${BRAID_KERNEL_OUT:-target/cuda-kernels}"

fail() {
    echo "cuda-kernels: FAIL: $*" >&2
    exit 1
}

python=""
for p in python3.11 python3; do
    if command -v "$p" >/dev/null; then
        python="$p"
        break
    fi
done
[ -n "$python" ] || fail "no python3 to install NVRTC and ptxas with (pip packages $NVRTC_PKG $NVCC_PKG)"

# The venv is reused when it already holds the pinned versions (a marker
# written after a complete install says which).
marker="$venv/.braid-installed"
want="$NVRTC_PKG $NVCC_PKG"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$marker" 2>/dev/null)" != "$want" ]; then
    echo "== installing NVRTC and ptxas ($want) into $venv"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv" ||
        fail "cannot create a venv at $venv with $python (is the venv module installed?)"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-input \
        "$NVRTC_PKG" "$NVCC_PKG" ||
        fail "pip could not install $NVRTC_PKG $NVCC_PKG (is the package index reachable?)"
    echo "$want" >"$marker"
else
    echo "== NVRTC and ptxas from $venv ($want)"
fi

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
nvrtc_lib="$site/nvidia/cuda_nvrtc/lib"
ptxas="$site/nvidia/cuda_nvcc/bin/ptxas"
ls "$nvrtc_lib"/libnvrtc.so.12* >/dev/null 2>&1 ||
    fail "the venv has no libnvrtc.so.12 under $nvrtc_lib (remove $venv to reinstall)"
[ -x "$ptxas" ] || fail "the venv has no ptxas at $ptxas (remove $venv to reinstall)"
ptxas_version=$("$ptxas" --version | grep -o 'release [0-9.]*' || true)
[ "$ptxas_version" = "release $CUDA_RELEASE" ] ||
    fail "ptxas reports '$ptxas_version', expected release $CUDA_RELEASE"
echo "   ptxas: $ptxas ($ptxas_version); NVRTC: $(ls "$nvrtc_lib" | grep '^libnvrtc\.so' | tr '\n' ' ')"

mkdir -p "$out"
# Built as `cargo test --workspace` (the test step) builds: the test profile,
# and features resolved for the whole workspace with dev-dependencies (which
# `--workspace` with an example selected does), so that after that step
# only the example itself is left to build.
echo "== building crates/cuda/examples/kernel-check.rs"
cargo build -q --profile test --workspace --example kernel-check
target_dir=$(cargo metadata -q --format-version 1 --no-deps |
    "$venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
echo "== compiling with NVRTC, assembling with ptxas"
LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$target_dir/debug/examples/kernel-check" --ptxas "$ptxas" --out "$out" "$@"
