"""What an operator runs beside the swarm: reading it, checking it, taking the model out.

- :mod:`.status`: ``p2p-diloco status``, the swarm as one table read from the DHT.
- :mod:`.plot`: ``p2p-diloco plot``, a run's story from its learners' audit logs.
- :mod:`.audit_verify`: ``p2p-diloco audit verify``, checking learners' audit logs.
- :mod:`.export`: ``p2p-diloco export``, the global model Θ of a checkpoint.
"""
