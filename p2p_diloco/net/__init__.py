"""Everything over hivemind and p2pd: the DHT, the averager process, the butterfly all-reduce, the wire.

- :mod:`.dht`: starting the DHT (and child processes that die with their parent).
- :mod:`.averaging`: :class:`~.averaging.HivemindAveraging`, the averaging interface
  (:mod:`p2p_diloco.core.averaging_api`) implemented over a hivemind averager.
- :mod:`.averager_process`: hivemind's ``DecentralizedAverager``, subclassed to all-reduce one
  fragment per round exactly; it runs in its own process.
- :mod:`.allreduce`: the butterfly all-reduce whose result is bit-identical on every member.
- :mod:`.patient_matchmaking`: how long a member waits for its matchmaking leader.
- :mod:`.early_close`: a leader starts once everyone training has joined its group, not at its window's end.
- :mod:`.codecs`: the wire formats of :mod:`p2p_diloco.core.quantization` as hivemind compressions.
- :mod:`.downloads`: serving and fetching the global state between averagers.
- :mod:`.progress_records`: the progress records learners publish to the DHT (msgpack).
- :mod:`.reach`: can other peers dial this learner? If not, it takes part as a client.
- :mod:`.record_quota`: how many records one identity may keep on this learner's DHT node.
- :mod:`.replica_reads`: reads a DHT node answers from its own replica of the key, when it holds one.
- :mod:`.traffic`: RPC traffic of a learner's DHT process.
- :mod:`.message_caps`, :mod:`.strong_tasks`, :mod:`.lazy_imports`: patches to hivemind's runtime.
- :mod:`.hivemind_surface`: every private hivemind method this package overrides, with the hivemind
  version they were checked against (a unit test fails when the installed one differs).

Where the wire is decoded: :mod:`.codecs` (``decode``), :mod:`.allreduce` (parts and headers),
:mod:`.message_caps` (a message's size, before it is read), :mod:`.progress_records` (records),
:mod:`.downloads` (a served state); outside this folder only :mod:`p2p_diloco.core.state_layout`
(parsing a download's layout) and :mod:`p2p_diloco.trust.commit_board` (signatures).
"""
