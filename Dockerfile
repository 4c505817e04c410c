# One image for every service of docker-compose.yml: region gateways, the bootstrap node, learners.
#   docker compose up --build
# hivemind 1.1.12 ships p2pd only in its x86_64 wheel: on arm64 hosts this runs under emulation.
FROM --platform=linux/amd64 python:3.11-slim

# iproute2: `ip route` to the other regions and `tc` (netem + tbf) on the gateways' WAN links.
# util-linux (flock) is part of the base image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends iproute2 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY p2p_diloco ./p2p_diloco
# torch from the CPU wheel index: the default one on PyPI brings several GB of CUDA libraries.
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt . \
    && rm -rf /root/.cache
COPY peers ./peers
COPY bootstrap ./bootstrap
COPY regions ./regions
COPY docker ./docker
RUN chmod +x docker/*.sh

# Each learner container gets its own anonymous volume here (its checkpoints and peer identity).
VOLUME ["/var/lib/p2p-diloco/checkpoint"]
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["/app/docker/entrypoint.sh"]
CMD ["--help"]
