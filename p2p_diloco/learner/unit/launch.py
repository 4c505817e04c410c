"""The entry of a torchrun worker: join the unit, then lead it (rank 0, the learner) or follow it.

Separate from :mod:`p2p_diloco.learner.unit.group` (the protocol both sides speak), which the leader and the
follower import: this module is the only one that knows both.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
from collections.abc import Callable

from p2p_diloco.config import LearnerConfig
from p2p_diloco.learner.unit.follower import follow
from p2p_diloco.learner.unit.group import Topology, UnitBroken, join
from p2p_diloco.learner.unit.rank0 import Leader


def run_unit(cfg: LearnerConfig, lead: Callable[[Leader], int]) -> int:
    """This process as one worker of a torchrun unit: rank 0 runs ``lead`` (the learner), the others
    :func:`p2p_diloco.learner.unit.follower.follow`. A broken unit is one line on stderr and exit code 1.

    A worker that dies of a signal (a C++ abort in a collective's threads) prints its Python stacks
    first (faulthandler). The other ranks leave with ``os._exit`` once the process group is destroyed:
    nothing of theirs needs the interpreter's finalization, where the process group's objects that DDP
    still holds would be freed with gloo's threads (one such exit was seen to abort, exit code -6,
    after the unit's work was done, and torchrun counts that as a failed unit).
    """
    topology = Topology.from_env()
    assert topology is not None, "run_unit outside torchrun"
    faulthandler.enable()
    group = join(topology, cfg.run)
    try:
        if topology.rank == 0:
            return lead(Leader(group))
        code = follow(cfg, group)
    except UnitBroken as e:
        print(f"error: rank {topology.rank}: {e}", file=sys.stderr)
        code = 1
    finally:
        group.close()
    if topology.rank == 0:
        return code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
