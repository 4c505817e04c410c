#!/usr/bin/env bash
# Builds a local stand-in for python:3.11-slim on a machine that cannot pull from Docker Hub: a
# Debian bookworm rootfs made by debootstrap (Python 3.11, python3-venv, iproute2, CA
# certificates), imported as the image NAME (default p2p-diloco-base:bookworm). Skips the build
# when that image exists already. Needs root, debootstrap and a reachable Debian mirror.
#
# Usage: scripts/docker_base_image.sh [NAME]
#   MIRROR=http://deb.debian.org/debian (default)
# Then: scripts/docker_build.sh  (builds p2p-diloco:latest FROM this image)
set -euo pipefail

name=${1:-p2p-diloco-base:bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$name" >/dev/null 2>&1; then
    echo "docker_base_image: $name exists"
    exit 0
fi
command -v debootstrap >/dev/null || {
    echo "docker_base_image: debootstrap is missing (apt-get install -y debootstrap)" >&2
    exit 1
}

rootfs=$(mktemp -d /var/tmp/p2p-diloco-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
echo "docker_base_image: debootstrap bookworm into $rootfs (a few minutes)"
debootstrap --variant=minbase --include=python3,python3-venv,iproute2,ca-certificates \
    bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
    tail -n 20 "$rootfs.log" >&2
    echo "docker_base_image: debootstrap failed (full log: $rootfs.log)" >&2
    exit 1
}
rm -f "$rootfs.log"
# Like the official images: no apt caches, and apt-get works in a later RUN without an update
# racing the mirror's index.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' - "$name" >/dev/null
echo "docker_base_image: built $name"
