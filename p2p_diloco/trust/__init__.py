"""Who may take part and what they signed: the swarm's defences that are not arithmetic.

- :mod:`.admission`: private swarms, which peers may talk to this one.
- :mod:`.signed_records`: DHT records signed by, and bound to, the peer ID of their owner.
- :mod:`.signed_matchmaking`: hivemind's matchmaking and download-priority keys, signed.
- :mod:`.signed_metadata`: the metadata a member gathers into a round, signed by that member.
- :mod:`.certificates`: commit certificates, what the members of a round committed.
- :mod:`.commit_board`: collecting a commit's signatures through the DHT.

The rules that leave contributions out of a round are math (:mod:`p2p_diloco.core.exclusion`,
:mod:`p2p_diloco.core.shard_sketches`); what the wire refuses is in :mod:`p2p_diloco.net.allreduce`.
"""
