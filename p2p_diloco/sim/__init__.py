"""Swarms on one machine and the failures they are tested with.

- :mod:`.local_swarm`: ``p2p-diloco swarm``, a bootstrap node and N learners on loopback.
- :mod:`.processes`: child processes, each in its own process group, stopped without leftovers.
- :mod:`.faults`: scripted faults as values (``kill at round 3 during reduce``), the
  :class:`~p2p_diloco.hooks.FaultHooks` that tests and ``--faults`` pass to a learner.
- :mod:`.malformed`: malformed all-reduce messages, as a hostile peer would send them.
- :mod:`.sybils`: fresh identities of one attacker that announce themselves training and never contribute.
- :mod:`.regions`: a multi-region swarm in network namespaces or Docker Compose.
"""
