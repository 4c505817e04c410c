#!/bin/sh
# A region's gateway container: it sits on the region's network (GATEWAY_ADDR) and on the
# backbone (BACKBONE_ADDR), forwards between them (sysctl net.ipv4.ip_forward=1 in
# docker-compose.yml), routes each other region's subnet to that region's gateway (ROUTES:
# "subnet=backbone-address ..."), and shapes both directions of the region's WAN link with tc:
# egress to the backbone (upload: WAN_BANDWIDTH, WAN_DELAY_MS, WAN_LOSS_PCT) and egress into the
# region (download: WAN_BANDWIDTH, WAN_DELAY_MS). Without netem in the host kernel it says so
# and shapes bandwidth only.
#
# UNREACHABLE: subnets of regions behind NAT, routed nowhere (without it the packets would take the
# default route, the Docker host, which forwards between its bridges around the gateways).
# NAT_SUBNET (this region is behind NAT): traffic from that subnet leaves with BACKBONE_ADDR as its
# source (nftables snat), and new connections from the backbone, to the region or to the gateway
# itself, are dropped; replies to connections made from inside pass.
set -eu

dev_with() {
    ip -4 -o addr show | awk -v want="$1" '{ split($4, a, "/"); if (a[1] == want) print $2 }'
}
wan=$(dev_with "$BACKBONE_ADDR")
lan=$(dev_with "$GATEWAY_ADDR")
if [ -z "$wan" ] || [ -z "$lan" ]; then
    echo "gateway: cannot find the interfaces with $BACKBONE_ADDR and $GATEWAY_ADDR" >&2
    exit 1
fi

for r in ${ROUTES:-}; do
    ip route replace "${r%%=*}" via "${r#*=}"
done
for net in ${UNREACHABLE:-}; do
    ip route replace unreachable "$net"
done

if [ -n "${NAT_SUBNET:-}" ]; then
    nft -f - <<EOF
table ip p2p_diloco_nat
delete table ip p2p_diloco_nat
table ip p2p_diloco_nat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "$wan" ip saddr $NAT_SUBNET snat to $BACKBONE_ADDR
    }
    chain forward {
        type filter hook forward priority filter; policy accept;
        iifname "$wan" ct state established,related accept
        iifname "$wan" drop
    }
    chain input {
        type filter hook input priority filter; policy accept;
        iifname "$wan" ct state established,related accept
        iifname "$wan" drop
    }
}
EOF
    echo "gateway: region $REGION behind NAT: $NAT_SUBNET leaves as $BACKBONE_ADDR, no new connection comes in"
fi

python -m p2p_diloco.sim.regions.shape --dev "$wan" --rate "$WAN_BANDWIDTH" \
    --delay-ms "${WAN_DELAY_MS:-0}" --loss-pct "${WAN_LOSS_PCT:-0}"
python -m p2p_diloco.sim.regions.shape --dev "$lan" --rate "$WAN_BANDWIDTH" --delay-ms "${WAN_DELAY_MS:-0}"
touch /tmp/wan-ready
echo "gateway: region $REGION up; WAN link $WAN_BANDWIDTH via $wan, region side $lan"

# Stay up until stopped; exit at once on SIGTERM (docker compose stop / down).
trap 'exit 0' TERM INT
while :; do sleep 3600 & wait $!; done
