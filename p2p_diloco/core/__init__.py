"""The DiLoCo math, free of networking: what a learner computes, not how it talks.

Modules here import only :mod:`p2p_diloco.config`, :mod:`p2p_diloco.errors`, :mod:`p2p_diloco.peer_log`,
:mod:`p2p_diloco.hooks` and each other (``tests/unit/core/test_layers.py`` walks the folder and fails on
any import of hivemind, ``torch.distributed`` or another subpackage).

- :mod:`.outer`: the outer step (pseudo-gradients, Nesterov SGD), the global state Θ and its hash.
- :mod:`.fragments`: parameter fragments and their staggered sync schedule.
- :mod:`.merging`: how contributions are weighted (tokens) and combined.
- :mod:`.aggregators`: robust aggregators (mean, median, trimmed mean) a reducer applies to its shard.
- :mod:`.exclusion`: which contributions a round leaves out, decided alike by every member.
- :mod:`.bans`: the peers this learner caught, banned from its next rounds (a vote in each group).
- :mod:`.directions`: a count sketch of each outer gradient, and who points away from the others.
- :mod:`.shard_sketches`: random projections that check what a reducer returned.
- :mod:`.standing`: how many certified rounds each identity contributed to; who is established (open swarms).
- :mod:`.grace`: the adaptive grace window after the quorum.
- :mod:`.pace`: the round period and overlap from measurements (``sync.pace = "auto"``).
- :mod:`.quantization`: low-bit wire formats for outer gradients (the arithmetic).
- :mod:`.inner_optim`: AdamW for the inner steps; :mod:`.lr_schedule`: the inner learning rate.
- :mod:`.state_layout`: the global state as served to peers (one layout for serving, slicing, parsing).
- :mod:`.averaging_api`: the interface a round talks to (:mod:`p2p_diloco.net.averaging` implements it).
"""
