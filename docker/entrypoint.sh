#!/bin/sh
# Entrypoint of the bootstrap and learner containers (docker-compose.yml, generated from
# regions/topology.toml). Routes the other regions' subnets through this region's gateway, and for
# a learner adds what only the container knows (its address, its slot in the region, the
# bootstrap node's multiaddr), then runs `p2p-diloco "$@"`.
#
# Environment: WAN_GATEWAY, WAN_ROUTES (subnets), WAN_UNREACHABLE (subnets of regions behind NAT),
# and for learners REGION, BOOTSTRAP_MADDRS_FILE, LEARNER_PORT, SLOTS_DIR, SHARD_BASE,
# SHARD_STRIDE, NUM_SHARDS.
set -eu

if [ -n "${WAN_GATEWAY:-}" ]; then
    for net in ${WAN_ROUTES:-}; do
        ip route replace "$net" via "$WAN_GATEWAY"
    done
fi
# Regions behind NAT: nobody outside can address them (the default route, the Docker host, would).
for net in ${WAN_UNREACHABLE:-}; do
    ip route replace unreachable "$net"
done

if [ "${1:-}" = learner ]; then
    ip=$(ip -4 -o addr show scope global | awk '{ split($4, a, "/"); print a[1]; exit }')
    port=${LEARNER_PORT:-41000}
    # The first free slot of the region, locked (fd 9) for as long as this learner runs, so
    # replicas added with --scale get distinct slots and therefore distinct data shards.
    command -v flock >/dev/null || { echo "entrypoint: flock (util-linux) is missing" >&2; exit 1; }
    mkdir -p "$SLOTS_DIR"
    n=0
    while :; do
        exec 9>"$SLOTS_DIR/slot-$n.lock"
        if flock -n 9; then break; fi
        n=$((n + 1))
        if [ "$n" -ge 1000 ]; then echo "entrypoint: no free slot in $SLOTS_DIR" >&2; exit 1; fi
    done
    shard=$(( (SHARD_BASE + n % SHARD_STRIDE) % NUM_SHARDS ))
    boot=$(grep -v '/ip4/127\.' "$BOOTSTRAP_MADDRS_FILE" | head -n 1)
    ckpt=/var/lib/p2p-diloco/checkpoint
    set -- "$@" --initial-peers "$boot" \
        --host-maddrs "/ip4/0.0.0.0/tcp/$port" --announce-maddrs "/ip4/$ip/tcp/$port" \
        --shard-index "$shard" --checkpoint-dir "$ckpt" --summary "$ckpt/summary.json"
    # A learner restarted (docker compose stop / start) continues from its own checkpoint.
    if [ -f "$ckpt/latest.pt" ]; then
        set -- "$@" --resume
    fi
    echo "entrypoint: region ${REGION:-?} slot $n address $ip shard $shard bootstrap $boot"
fi

exec p2p-diloco "$@"
