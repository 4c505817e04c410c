# One image for every service of docker-compose.yml: region gateways, the bootstrap node, learners.
#   docker compose up --build
# No BuildKit-only syntax: docker-compose 1.29's classic builder builds it too. Two build arguments
# let a machine without Docker Hub or without the PyTorch index build it from local parts
# (scripts/docker_build.sh does that):
#   BASE_IMAGE  a Debian bookworm image with Python 3.11 and its venv module
#               (default python:3.11-slim; scripts/docker_base_image.sh makes one with debootstrap)
#   PIP_EXTRA   extra pip arguments (default: torch from the PyTorch CPU index, since the default
#               one on PyPI brings several GB of CUDA libraries); wheels put in .docker-wheels/ of
#               the build context are at /tmp/wheels, e.g. PIP_EXTRA="--no-index --find-links /tmp/wheels"
# hivemind 1.1.12 ships p2pd only in its x86_64 wheel: on arm64 hosts this runs under emulation.
ARG BASE_IMAGE=python:3.11-slim
FROM --platform=linux/amd64 ${BASE_IMAGE}
ARG PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu"

# iproute2: `ip route` to the other regions and `tc` (netem + tbf) on the gateways' WAN links;
# nftables: a NAT region's gateway (masquerade out, drop new connections in). util-linux (flock)
# is part of both base images.
RUN apt-get update \
    && apt-get install -y --no-install-recommends iproute2 nftables \
    && rm -rf /var/lib/apt/lists/*

# A venv first on PATH: the same `python` and `pip` on python:3.11-slim and on a Debian image
# whose system Python refuses pip installs (PEP 668).
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1

WORKDIR /app
# The wildcard matches nothing where .docker-wheels/ does not exist: then only constraints.txt lands there.
COPY constraints.txt .docker-wheel[s] /tmp/wheels/
COPY pyproject.toml constraints.txt ./
# Dependencies in their own layer, so that editing the code does not reinstall torch.
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir $PIP_EXTRA -c constraints.txt -r /tmp/requirements.txt \
    && rm -rf /root/.cache
COPY README.md ./
COPY p2p_diloco ./p2p_diloco
RUN pip install --no-cache-dir --no-deps $PIP_EXTRA . \
    && rm -rf /root/.cache /tmp/wheels /tmp/requirements.txt
COPY peers ./peers
COPY bootstrap ./bootstrap
COPY regions ./regions
COPY docker ./docker
RUN chmod +x docker/*.sh

# Each learner container gets its own anonymous volume here (its checkpoints and peer identity).
VOLUME ["/var/lib/p2p-diloco/checkpoint"]
ENTRYPOINT ["/app/docker/entrypoint.sh"]
CMD ["--help"]
# scripts/docker_build.sh removes this image's superseded builds by this label.
LABEL org.p2p-diloco.image=p2p-diloco
