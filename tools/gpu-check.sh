#!/usr/bin/env bash
# GPU check for braid's device collectives, from prebuilt binaries.
#
# On a machine with one (or more) NVIDIA GPUs, the CUDA driver and NVRTC
# (libcuda.so.1, libnvrtc.so.12 or libnvrtc.so) -- no Rust toolchain and no
# network needed -- it runs every collective with 2 and 4 ranks as separate
# processes sharing GPU 0 through CUDA IPC (nvlink transport: same GPU; the
# stream engine: GPU-side synchronisation with stream memory operations),
# AllReduce and AllGather again with the proxy engine (BRAID_CUDA_ENGINE=proxy)
# and with P2P disabled (pcie transport, staged through shared host memory,
# which uses the proxy engine), and AllReduce over every datatype and
# operator. The header line of each run names the engine it used. Every run
# checks the results against braid's host reference (braid-perf -c 1: inputs written
# before each checked run, the output poisoned first) and prints busbw next
# to the device-to-device copy bandwidth measured in the same run.
#
# Build elsewhere (any x86-64 Linux with Rust; no CUDA needed):
#   cargo build --release -p braid-perf
#   scp target/release/braid-perf tools/gpu-check.sh gpu-host:some/dir/
# Run:
#   some/dir/gpu-check.sh            # finds braid-perf next to itself
#   BRAID_PERF=/path/to/braid-perf tools/gpu-check.sh
#
# Exit status: 0 all passed, 1 a run failed or computed wrong values,
# 2 CUDA unavailable here (the message says why). Takes 1-3 minutes.
set -u

here=$(cd "$(dirname "$0")" && pwd)
perf=${BRAID_PERF:-}
if [ -z "$perf" ]; then
    for c in "$here/braid-perf" "$here/../target/release/braid-perf"; do
        if [ -x "$c" ]; then perf=$c; break; fi
    done
fi
if [ -z "$perf" ] || [ ! -x "$perf" ]; then
    echo "gpu-check: braid-perf not found next to this script or in ../target/release; set BRAID_PERF" >&2
    exit 2
fi
limit=${GPU_CHECK_RUN_TIMEOUT:-120}
export BRAID_CUDA_DEVICE=${BRAID_CUDA_DEVICE:-0}
export BRAID_TIMEOUT=${BRAID_TIMEOUT:-60}

echo "# gpu-check: $perf"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | sed 's/^/# gpu: /'

pass=0
fail=0
failed=()
log=$(mktemp)
trap 'rm -f "$log"' EXIT

run() { # label, env..., -- braid-perf args
    local label=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    local t0=$SECONDS
    env "${envs[@]}" timeout "$limit" "$perf" "$@" --device cuda -c 1 >"$log" 2>&1
    local rc=$?
    if grep -q "CUDA unavailable" "$log"; then
        echo "gpu-check: $(grep -m1 'CUDA unavailable' "$log")" >&2
        echo "gpu-check: CUDA unavailable on this machine; nothing was checked" >&2
        exit 2
    fi
    echo "## $label ($((SECONDS - t0)) s, exit $rc)"
    grep -oE "\([a-z]+ engine\)" "$log" | head -1 | sed 's/^/# /'
    grep -E "copy bandwidth|^ +[0-9]" "$log" | sed -e 's/^# device: .*copy bandwidth/# d2d copy bandwidth/'
    grep -E "Out of bounds|Avg bus" "$log"
    if [ $rc -eq 0 ] && grep -q "Out of bounds values : 0 OK" "$log"; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1)); failed+=("$label")
        tail -n 15 "$log" | sed 's/^/    | /'
    fi
}

for np in 2 4; do
    for coll in all_reduce reduce_scatter all_gather broadcast reduce alltoall sendrecv; do
        run "$coll np=$np (nvlink: IPC on one GPU)" BRAID_GPU_CHECK=1 -- \
            "$coll" -np "$np" -b 4K -e 64M -f 16 -n 5 -w 1
    done
done
run "all_reduce np=2 every datatype x op" BRAID_GPU_CHECK=1 -- \
    all_reduce -np 2 -b 4K -e 1M -f 256 -d all -o all -n 2 -w 1
run "all_reduce np=3 every op, f16 (odd ranks, odd pieces)" BRAID_GPU_CHECK=1 -- \
    all_reduce -np 3 -b 1000 -e 3M -f 3000 -d half -o all -n 2 -w 1
run "all_reduce np=2 proxy engine (BRAID_CUDA_ENGINE=proxy)" BRAID_CUDA_ENGINE=proxy -- \
    all_reduce -np 2 -b 4K -e 64M -f 16 -n 5 -w 1
run "all_gather np=4 proxy engine" BRAID_CUDA_ENGINE=proxy -- \
    all_gather -np 4 -b 4K -e 16M -f 64 -n 3 -w 1
run "all_reduce np=2 staged through host memory (pcie, BRAID_P2P_DISABLE=1)" BRAID_P2P_DISABLE=1 -- \
    all_reduce -np 2 -b 4K -e 64M -f 16 -n 5 -w 1
run "all_gather np=4 staged through host memory" BRAID_P2P_DISABLE=1 -- \
    all_gather -np 4 -b 4K -e 16M -f 64 -n 3 -w 1

echo
echo "gpu-check: $pass passed, $fail failed"
for f in "${failed[@]}"; do echo "gpu-check: FAILED: $f"; done
[ "$fail" -eq 0 ]
