#!/usr/bin/env bash
# Runs inside the Soft-RoCE guests of tools/rdma-vm/run (called by
# scripts/rdma-tests.sh and scripts/ib-bench.sh, not by hand):
#
#   rdma-guest.sh one PROBE CONFORMANCE IBTESTS   one guest: the IB probe, the
#                                                 transport conformance suite,
#                                                 tests/ib.rs (ranks forced onto IB)
#   rdma-guest.sh two TESTRANK                    two guests: every collective on
#                                                 2+2 ranks (shm inside a guest, IB
#                                                 across), then a rank killed
#                                                 mid-collective across guests
#   rdma-guest.sh torch PYTHON                    two guests: a torchrun DDP job, one
#                                                 rank per guest, braid forced onto IB,
#                                                 beside the same model on gloo (TCP):
#                                                 parameters must be equal
#   rdma-guest.sh bench PERF SIZE                 two guests: ib_write_bw, then
#                                                 braid-perf AllReduce at SIZE, then
#                                                 ib_write_bw again
#
# Ranks in different guests meet through BRAID_UNIQUE_ID at node 0
# (10.77.0.1); RDMA_TEST_SECRET (32 hex digits) comes from the host.
set -uo pipefail

node=${RDMA_VM_NODE:-0}
say() { echo "== [node$node] $*"; }
die() {
    echo "!! [node$node] RDMA TEST FAILED: $*"
    exit 1
}

# Common settings. The ACK timeout stays long (4.096 us * 2^20 = 4.3 s):
# a timer that fires while an ACK is only late makes rdma_rxe retransmit,
# and the 6.1 kernel's rdma_rxe can then break the connection ("remote
# invalid request"; see the crate docs of braid-transport-ib). With 3
# retries a dead peer shows up within about 17 s. The guests run emulated,
# so waits are generous; more ranks than vCPUs, so waiting ranks yield.
# BRAID_REQUIRE_IB=1: a test that finds no RDMA port here fails instead of
# passing as skipped.
export BRAID_IB_TIMEOUT=20 BRAID_IB_RETRY_CNT=3 BRAID_SPIN=0 BRAID_TIMEOUT=120 BRAID_REQUIRE_IB=1

one() {
    local probe=$1 conf=$2 ibtests=$3
    say "IB probe"
    "$probe" || die "the IB probe found no usable RDMA port"
    say "transport conformance suite over IB (3 geometries)"
    "$conf" --test-threads 1 || die "conformance suite over IB"
    say "collectives with 3 ranks forced onto IB (tests/ib.rs)"
    "$ibtests" --test-threads 1 || die "tests/ib.rs"
    say "one guest: all passed"
}

# Waits for every pid given; false if any failed.
wait_all() {
    local ok=0
    for p in "$@"; do
        wait "$p" || ok=1
    done
    return $ok
}

two() {
    local tr=$1
    [ -n "${RDMA_TEST_SECRET:-}" ] || die "RDMA_TEST_SECRET is not set"
    export BRAID_HOST_ID=rdma-node$node
    local sizes="0 1 7 1023 70001"

    say "matrix: every collective on 4 ranks, 2 per guest"
    export BRAID_UNIQUE_ID=10.77.0.1:29611/$RDMA_TEST_SECRET BRAID_NRANKS=4
    local pids=() mine
    if [ "$node" = 0 ]; then mine="0 1"; else mine="2 3"; fi
    for r in $mine; do
        BRAID_RANK=$r "$tr" matrix env 0 0 $sizes >/tmp/matrix.$r 2>&1 &
        pids+=($!)
    done
    local ok=0
    wait_all "${pids[@]}" || ok=1
    for r in $mine; do cat /tmp/matrix.$r; done
    [ $ok = 0 ] || die "matrix across two guests"
    # Peers in the other guest are reached over IB, peers in this one
    # over shared memory.
    for r in $mine; do
        local want
        case $r in
        0) want="self,shm,ib,ib" ;;
        1) want="shm,self,ib,ib" ;;
        2) want="ib,ib,self,shm" ;;
        3) want="ib,ib,shm,self" ;;
        esac
        grep -q "rank $r transports: $want\$" /tmp/matrix.$r ||
            die "rank $r: expected transports $want (IB across guests, shm inside)"
    done

    say "matrix again, every link forced onto IB (BRAID_TRANSPORT=ib: inside a guest too)"
    export BRAID_UNIQUE_ID=10.77.0.1:29616/$RDMA_TEST_SECRET
    pids=()
    for r in $mine; do
        BRAID_RANK=$r BRAID_TRANSPORT=ib "$tr" matrix env 0 0 $sizes >/tmp/forced.$r 2>&1 &
        pids+=($!)
    done
    ok=0
    wait_all "${pids[@]}" || ok=1
    for r in $mine; do grep -E "transports|cases" /tmp/forced.$r; done
    [ $ok = 0 ] || { for r in $mine; do tail -20 /tmp/forced.$r; done; die "forced-IB matrix across two guests"; }
    for r in $mine; do
        grep -Eq "rank $r transports: (self|ib)(,(self|ib))*\$" /tmp/forced.$r ||
            die "rank $r: a link not on IB with BRAID_TRANSPORT=ib"
    done

    say "a rank killed mid-collective in the other guest: an error naming it, no hang"
    export BRAID_UNIQUE_ID=10.77.0.1:29612/$RDMA_TEST_SECRET BRAID_NRANKS=2 BRAID_TIMEOUT=60
    if [ "$node" = 0 ]; then
        BRAID_RANK=0 "$tr" loop env 0 0 1000000 65536 >/tmp/kill.0 2>&1 &
        local pid=$! t0 t1 code
        for _ in $(seq 600); do grep -q ready /tmp/kill.0 && break; sleep 0.2; done
        t0=$(date +%s)
        wait $pid
        code=$?
        t1=$(date +%s)
        cat /tmp/kill.0
        [ $code = 3 ] || die "rank 0 exited with $code, expected 3 (a failed AllReduce)"
        grep -q "rank 1" /tmp/kill.0 || die "rank 0's error does not name rank 1"
        say "rank 0 failed $((t1 - t0)) s after its first AllReduce (rank 1 killed about 2 s in; BRAID_TIMEOUT=60)"
        [ $((t1 - t0)) -lt 50 ] || die "rank 0 took $((t1 - t0)) s: it waited for the timeout instead of noticing"
    else
        BRAID_RANK=1 "$tr" loop env 0 0 1000000 65536 >/tmp/kill.1 2>&1 &
        local pid=$!
        for _ in $(seq 600); do grep -q ready /tmp/kill.1 && break; sleep 0.2; done
        grep -q ready /tmp/kill.1 || die "rank 1 never got ready: $(cat /tmp/kill.1)"
        sleep 2
        kill -9 $pid
        say "killed rank 1"
        wait $pid 2>/dev/null
    fi
    say "two guests: all passed"
}

torch() {
    local py=$1
    export BRAID_HOST_ID=rdma-node$node GLOO_SOCKET_IFNAME=eth0 BRAID_TRANSPORT=ib
    export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 BRAID_DEBUG=INFO
    # The model of python/tests/test_torch_nodes.py: several buckets, so the
    # backward overlaps its all-reduces; 2 ranks, so every summation order
    # gives the same bits and braid's parameters must equal gloo's exactly.
    local spec='{"width": 128, "depth": 3, "inputs": 256, "batch": 16, "bucket_mb": 0.1, "steps": 4, "warmup": 1, "threads": 1, "kinds": ["ddp"], "backends": ["braid", "gloo"]}'
    say "torch DDP across the guests: braid forced onto IB, beside gloo over TCP (braid from $("$py" -c 'import braid; print(braid.__file__)'))"
    # The variables torchrun sets for one rank per node (torchrun itself
    # would import torch once more: minutes under emulation).
    RANK=$node LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 GROUP_RANK=$node \
        MASTER_ADDR=10.77.0.1 MASTER_PORT=29615 TORCHELASTIC_RUN_ID=rdma-guests \
        "$py" -m braid._train worker "$spec" >/tmp/torch.out 2>/tmp/torch.err
    local code=$?
    cat /tmp/torch.out
    [ $code = 0 ] || { tail -40 /tmp/torch.err; die "the torch job failed (exit $code)"; }
    grep -m1 "braid: IB transport" /tmp/torch.err || die "braid did not create its IB transport"
    if [ "$node" = 0 ]; then
        "$py" - /tmp/torch.out <<'PY' || die "braid's DDP over IB did not end with gloo's parameters"
import json, sys
line = next(l for l in open(sys.argv[1]) if l.startswith("BRAID-TRAIN-RESULT:"))
r = json.loads(line.split(":", 1)[1])["kinds"]["ddp"]
print(f"== DDP over IB: {r['params']} parameters, max |braid - gloo| = {r['max_diff']}, "
      f"step medians braid {sorted(r['braid_s'])[len(r['braid_s']) // 2] * 1e3:.0f} ms, "
      f"gloo {sorted(r['gloo_s'])[len(r['gloo_s']) // 2] * 1e3:.0f} ms (emulated CPUs: not a benchmark)")
sys.exit(0 if r["max_diff"] == 0.0 else 1)
PY
    fi
    say "torch: passed"
}

bench() {
    local perf=$1 size=$2 peer=${RDMA_VM_PEER:-}
    export BRAID_HOST_ID=rdma-node$node
    # perftest's client gives up at once if the server is not listening yet;
    # its out-of-band exchange also fails now and then under emulation
    # ("Couldn't read remote address"): the server tries three times, the
    # client retries until one of them serves it.
    wbw() {
        if [ "$node" = 0 ]; then
            for _ in 1 2 3; do
                ib_write_bw -d rxe0 -x 1 -s 1048576 -D 6 "$@" && return 0
                sleep 1
            done
            return 1
        else
            for _ in $(seq 30); do
                ib_write_bw -d rxe0 -x 1 -s 1048576 -D 6 "$@" "$peer" && return 0
                sleep 1
            done
            return 1
        fi
    }
    # perftest's "BW average" (MB/sec, 2^20 bytes) of its result line, in
    # decimal MB/s; braid-perf's busbw is in GB/s (10^9), as nccl-tests.
    wbw_mbs() { awk '$1 == 1048576 && NF >= 5 { printf "%.1f", $4 * 1.048576 }' "$1"; }
    # (from the time column: its busbw column has 10 MB/s steps; with 2
    # ranks busbw = algbw = bytes / time)
    perf_mbs() { awk '$1 ~ /^[0-9]+$/ && $3 == "float" && $6 > 0 { printf "%.1f", $1 / $6 }' "$1"; }
    say "ib_write_bw (RC RDMA WRITE, 1 MiB messages, 6 s), one direction"
    wbw | tee /tmp/wbw1 || die "ib_write_bw"
    say "ib_write_bw, both directions at once (-b: the sum of both)"
    wbw -b | tee /tmp/wbw2 || die "ib_write_bw -b"
    export BRAID_NRANKS=2 BRAID_RANK=$node
    say "braid-perf AllReduce over IB, $size, 2 ranks (one per guest), BRAID_SPIN=0"
    BRAID_UNIQUE_ID=10.77.0.1:29613/$RDMA_TEST_SECRET \
        "$perf" all_reduce -b "$size" -e "$size" -n ${BENCH_ITERS:-5} -w 1 -c 1 | tee /tmp/perf1 || die "braid-perf"
    say "braid-perf AllReduce over IB, $size, 2 ranks (one per guest), default spinning"
    BRAID_UNIQUE_ID=10.77.0.1:29614/$RDMA_TEST_SECRET BRAID_SPIN=2000 \
        "$perf" all_reduce -b "$size" -e "$size" -n ${BENCH_ITERS:-5} -w 1 -c 1 | tee /tmp/perf2 || die "braid-perf"
    say "ib_write_bw again, one direction"
    wbw | tee /tmp/wbw3 || die "ib_write_bw"
    if [ "$node" = 0 ]; then
        local w1 w2 w3 p1 p2
        w1=$(wbw_mbs /tmp/wbw1) w2=$(wbw_mbs /tmp/wbw2) w3=$(wbw_mbs /tmp/wbw3)
        p1=$(perf_mbs /tmp/perf1) p2=$(perf_mbs /tmp/perf2)
        echo "== RESULT ($size AllReduce, 2 ranks, one per guest; MB/s = 10^6 bytes/s)"
        echo "==   ib_write_bw one way: $w1 before, $w3 after; both ways at once: $w2 in all"
        echo "==   braid AllReduce busbw (out of place): $p1 with BRAID_SPIN=0, $p2 with BRAID_SPIN=2000"
        awk -v w1="$w1" -v w2="$w2" -v w3="$w3" -v p1="$p1" -v p2="$p2" 'BEGIN {
            one = (w1 + w3) / 2; per = w2 / 2; best = (p1 > p2) ? p1 : p2
            if (one > 0) printf "==   ratio busbw / ib_write_bw one way: %.2f\n", best / one
            # Ring AllReduce on 2 ranks sends and receives at once: the
            # per-direction share of the bidirectional run is its ceiling.
            if (per > 0) printf "==   ratio busbw / (ib_write_bw -b / 2): %.2f\n", best / per
        }'
    fi
}

cmd=${1:-}
shift || true
case $cmd in
one) one "$@" ;;
two) two "$@" ;;
torch) torch "$@" ;;
bench) bench "$@" ;;
*) die "usage: rdma-guest.sh one|two|torch|bench ..." ;;
esac
