"""Keeping a learner's processes small: what they hold beyond the model, its optimizer and the data.

A learner is four processes: itself, hivemind's DHT and averager processes (forks of it, sharing its pages
copy-on-write) and p2pd. Measured with ``benchmarks/scale_swarm.py`` (docs/scale.md, "What a learner
costs"), their proportional share of the machine's memory was about 370 MB, and is about 340 MB with the two
knobs below; most of it is torch's own import (about 140 MB of anonymous memory, shared with the forks) and
p2pd (60 MB idle, 65-67 MB in a swarm with the knob, 77-87 MB without).

Two knobs, each measured side by side there:

- :func:`limit_malloc_arenas`: glibc gives every thread that meets contention its own malloc arena, up to 8
  per core, and each keeps the memory it once held. A learner runs a dozen threads (heartbeat, catch-up,
  downloads, torch's); two arenas serve them as well.
- ``P2PD_GOGC`` (p2p_diloco/net/dht.py): p2pd is a Go program; a lower GOGC collects its garbage sooner.
"""

from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8  # glibc's <malloc.h>: the option number of mallopt for the arena limit
MALLOC_ARENAS = 2


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas for this process and the processes it forks from now on; True if set.

    A ``MALLOC_ARENA_MAX`` in the environment (glibc reads it at start) is the user's choice and is kept.
    Elsewhere than glibc (no ``mallopt``, or one that refuses the option) nothing changes."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_ARENA_MAX, arenas) == 1
