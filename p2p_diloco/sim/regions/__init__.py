"""A multi-region swarm on one machine: network namespaces (``p2p-diloco regions``) or Docker Compose.

Both read one topology file (``regions/topology.toml``): :mod:`.topology` loads it, :mod:`.netns`
builds the namespaces, bridges and shaped links, :mod:`.simulator` runs the swarm inside them and
:mod:`.compose` writes the matching ``docker-compose.yml``.
"""
