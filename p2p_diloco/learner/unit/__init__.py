"""A learner unit of several workers: ``torchrun --nproc-per-node N -m p2p_diloco learner ...``.

- :mod:`.launch`: the entry of a torchrun worker (join the unit, then lead or follow).
- :mod:`.group`: the unit's process group and what its workers exchange.
- :mod:`.rank0`: rank 0, the hooks the learner's loop calls to drive the other workers.
- :mod:`.follower`: the other workers, the same inner steps on their own part of the batch.
"""
