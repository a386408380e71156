#!/usr/bin/env bash
# braid's AllReduce between two emulated hosts (network namespaces joined by
# veth pairs through a bridge, each with its own /dev/shm) against the raw TCP
# stream throughput between the same namespaces, in the same run.
#
#   scripts/netns-bench.sh [SIZE] [ITERS]      (root; default 64M, 20)
#
# Raw TCP: iperf3 (installed if missing), one stream and 4 parallel streams.
# PERF=/path/to/braid-perf runs that binary instead of building this tree's
# (to compare two builds side by side).
set -euo pipefail
size=${1:-64M}
iters=${2:-20}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
command -v iperf3 >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iperf3 >/dev/null; }
if [ -n "${PERF:-}" ]; then
    perf=$PERF
else
    cargo build --release -q -p braid-perf --manifest-path "$here/Cargo.toml"
    perf=$here/target/release/braid-perf
fi
tag=$$; br=bnb$tag; net=10.214.$((tag % 200 + 20))
holders=()
cleanup() {
    for p in "${holders[@]}"; do kill "$p" 2>/dev/null || true; done
    for h in 0 1; do ip link del "bnv${tag}h$h" 2>/dev/null || true; ip netns del "braidb-$tag-h$h" 2>/dev/null || true; done
    ip link del "$br" 2>/dev/null || true
}
trap cleanup EXIT
ip link add "$br" type bridge && ip link set "$br" up
for h in 0 1; do
    ns=braidb-$tag-h$h
    ip netns add "$ns"
    ip link add "bnv${tag}h$h" type veth peer name eth0 netns "$ns"
    ip link set "bnv${tag}h$h" master "$br" up
    ip -n "$ns" addr add "$net.$((h + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up; ip -n "$ns" link set lo up
    ip netns exec "$ns" unshare -m --propagation private sh -c 'mount -t tmpfs braid-shm /dev/shm && exec sleep 100000' &
    holders+=($!)
done
sleep 0.5
in_host() { local h=$1; shift; nsenter -t "${holders[$h]}" -m -n -- "$@"; }

echo "== raw TCP between the namespaces (iperf3, 5 s)"
in_host 1 iperf3 -s -1 -D -B "$net.2" >/dev/null; sleep 0.3
tcp1=$(in_host 0 iperf3 -c "$net.2" -t 5 -J | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/8e9)')
in_host 1 iperf3 -s -1 -D -B "$net.2" >/dev/null; sleep 0.3
tcp4=$(in_host 0 iperf3 -c "$net.2" -t 5 -P 4 -J | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/8e9)')
in_host 1 iperf3 -s -1 -D -B "$net.2" >/dev/null; sleep 0.3
# Both directions at once, as an AllReduce between two hosts loads the link.
tcpbi=$(in_host 0 iperf3 -c "$net.2" -t 5 --bidir -J | python3 -c 'import json,sys; e=json.load(sys.stdin)["end"]; print((e["sum_received"]["bits_per_second"]+e["sum_received_bidir_reverse"]["bits_per_second"])/2/8e9)')
echo "iperf3: 1 stream $tcp1 GB/s, 4 streams $tcp4 GB/s, both directions at once $tcpbi GB/s each way"

echo "== braid AllReduce, 1 rank per host, over the socket transport"
secret=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
id="$net.1:29611/$secret"
out=$(mktemp)
ranks=()
for r in 0 1; do
    in_host $r env BRAID_UNIQUE_ID="$id" BRAID_RANK=$r BRAID_NRANKS=2 BRAID_LOCAL_RANK=0 \
        "$perf" all_reduce -b "$size" -e "$size" -n "$iters" -w 3 -c 1 >"$out.$r" 2>&1 &
    ranks+=($!)
done
rc=0
for p in "${ranks[@]}"; do wait "$p" || rc=$?; done
cat "$out.1" >&2
cat "$out.0"
[ "$rc" = 0 ] || { echo "a rank failed (exit $rc)" >&2; exit "$rc"; }
busbw=$(awk '/^ +[0-9]/ {print $8; exit}' "$out.0")
python3 -c "b=$busbw; t1=$tcp1; t4=$tcp4; tb=$tcpbi; print(f'braid busbw {b:.3f} GB/s; raw TCP: 1 stream {t1:.3f} GB/s (ratio {b/t1:.2f}), 4 streams {t4:.3f} GB/s (ratio {b/t4:.2f}), bidirectional {tb:.3f} GB/s each way (ratio {b/tb:.2f})')"
