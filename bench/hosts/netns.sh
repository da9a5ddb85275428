#!/usr/bin/env bash
# Two "hosts" on one machine, to measure what the hierarchical all_reduce
# buys when the link between hosts is slower than memory: ranks 0..H-1 in
# one network namespace, H..2H-1 in another, joined by a veth pair shaped
# with tbf to RATE in each direction. Each side claims its own host
# (WEFT_HOST_ID), so `auto` runs shm within a side and cpu-tcp between
# leaders; `cpu-tcp` runs flat over every rank. Needs root and iproute2.
#
# Usage: bench/hosts/netns.sh [RATE=2gbit] [RANKS_PER_HOST=2] [weft bench args...]
# Example: bench/hosts/netns.sh 2gbit 2 --ops all_reduce -b 32K -e 16M -f 8 -n 10
set -euo pipefail
cd "$(dirname "$0")/../.."
rate=${1:-2gbit}
per=${2:-2}
shift $(( $# >= 2 ? 2 : $# ))
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--ops all_reduce -b 32K -e 16M -f 8 -n 10)
weft=${WEFT_BIN:-target/release/weft}
[ -x "$weft" ] || cargo build --release -q -p weft-cli

a=weft-hosts-a; b=weft-hosts-b
cleanup() { ip netns delete $a 2>/dev/null || true; ip netns delete $b 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add $a
ip netns add $b
ip link add wh-a type veth peer name wh-b
for side in a b; do
    ns=weft-hosts-$side
    dev=wh-$side
    ip link set $dev netns $ns
    ip -n $ns addr add 10.249.0.$([ $side = a ] && echo 1 || echo 2)/24 dev $dev
    ip -n $ns link set $dev up
    ip -n $ns link set lo up
    tc -n $ns qdisc replace dev $dev root tbf rate "$rate" burst 512kb latency 10ms
done

world=$((2 * per))
run() { # backend port
    for r in $(seq 0 $((world - 1))); do
        ns=$a; [ $r -ge $per ] && ns=$b
        ip netns exec $ns env RANK=$r WORLD_SIZE=$world LOCAL_RANK=$((r % per)) LOCAL_WORLD_SIZE=$per \
            MASTER_ADDR=10.249.0.1 MASTER_PORT=$2 WEFT_HOST_ID=host$((r / per)) \
            timeout 600 "$weft" bench --backend "$1" "${args[@]}" >"${TMPDIR:-/tmp}/weft-hosts-$r.log" 2>&1 &
    done
    wait
    cat "${TMPDIR:-/tmp}/weft-hosts-0.log"
}
echo "# 2 hosts x $per ranks, $rate between hosts"
run auto 29771
run cpu-tcp 29772
