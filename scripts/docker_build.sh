#!/usr/bin/env bash
# Builds the project image p2p-diloco:latest on a machine that cannot pull from Docker Hub or reach
# the PyTorch index (elsewhere `docker compose up --build` is all it takes): the base image from
# scripts/docker_base_image.sh, and every wheel the image needs downloaded here first, with this
# machine's pip configuration, into .docker-wheels/ (ignored by git), so that pip in the build
# installs offline. apt-get in the build (iproute2, nftables) uses the host's network.
#
# Usage: scripts/docker_build.sh [extra docker build arguments]
#   BASE_IMAGE=p2p-diloco-base:bookworm  IMAGE=p2p-diloco:latest (defaults)
#   PIP="python3 -m pip" (default: .venv/bin/pip where it exists)
# One build at a time (flock): a second call waits for the first, then finds every layer cached.
set -euo pipefail
cd "$(dirname "$0")/.."

base=${BASE_IMAGE:-p2p-diloco-base:bookworm}
image=${IMAGE:-p2p-diloco:latest}
if [ -x .venv/bin/pip ]; then default_pip=.venv/bin/pip; else default_pip="python3 -m pip"; fi
read -r -a pip <<<"${PIP:-$default_pip}"
wheels=.docker-wheels

exec 9>"${TMPDIR:-/tmp}/p2p-diloco-docker-build.lock"
flock 9

scripts/docker_base_image.sh "$base"

# Download again only when the dependencies changed.
stamp=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$wheels/.stamp" 2>/dev/null)" != "$stamp" ]; then
    echo "docker_build: downloading wheels into $wheels/"
    rm -rf "$wheels"
    mkdir -p "$wheels"
    # The project's dependencies (not the project: no build in the source tree) and its build backend.
    reqs=$(mktemp)
    python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        >"$reqs"
    "${pip[@]}" download -q -d "$wheels" -c constraints.txt -r "$reqs" setuptools wheel
    rm -f "$reqs"
    # The few pure-Python sdists become wheels here, so the build needs no build step for them.
    shopt -s nullglob
    sdists=("$wheels"/*.tar.gz "$wheels"/*.zip)
    if [ ${#sdists[@]} -gt 0 ]; then
        "${pip[@]}" wheel -q --no-deps -w "$wheels" "${sdists[@]}"
        rm -f "${sdists[@]}"
    fi
    echo "$stamp" >"$wheels/.stamp"
fi

export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}
docker build --network host -t "$image" \
    --build-arg BASE_IMAGE="$base" \
    --build-arg PIP_EXTRA="--no-index --find-links /tmp/wheels" \
    "$@" .
# Earlier builds of the image, untagged by this one (their shared layers stay cached).
docker image prune -f --filter label=org.p2p-diloco.image=p2p-diloco >/dev/null
