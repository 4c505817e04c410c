"""Modules that hivemind imports at start-up but a learner seldom runs, loaded on first use instead.

``hivemind.averaging.load_balancing`` imports ``scipy.optimize`` (and with it scipy.linalg, .special and
.fft: about 0.5 s of CPU on an idle core, more on a busy one) for one call, ``linprog``, which it makes
only when some groupmate declares a bandwidth. Learners declare none, so in an honest swarm the module
is never used, yet every learner (re)start paid for it before its first inner step.

:func:`defer` puts a stand-in module into ``sys.modules``: ``import scipy.optimize`` finds it and runs
nothing, and the first attribute read from it (``scipy.optimize.linprog``) imports the real module,
which from then on replaces the stand-in everywhere it can be reached by name. (The standard
library's ``importlib.util.LazyLoader`` does not serve here: the ``import`` statement itself reads the
module's ``__spec__``, which loads a lazy module at once.) Loading happens under a lock, so two
threads that first use the module together load it once.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

DEFERRED = ("scipy.optimize",)
_lock = threading.RLock()


class Deferred(types.ModuleType):
    """Stands for a module not imported yet; any attribute it lacks imports the real one."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):  # the import system's probes: not a use
            raise AttributeError(attr)
        return getattr(load(self.__name__), attr)


def defer(name: str) -> None:
    """Let ``name`` be imported for real only when first used (nothing if it is imported already)."""
    if name in sys.modules:
        return
    parent, _, child = name.rpartition(".")
    with _lock:
        if parent:
            importlib.import_module(parent)  # scipy itself: a few ms once numpy is loaded (torch loads it)
        sys.modules[name] = stand_in = Deferred(name)
        if parent:
            setattr(sys.modules[parent], child, stand_in)


def defer_all() -> None:
    """Defer every module in :data:`DEFERRED` whose parent package is installed."""
    for name in DEFERRED:
        parent = name.rpartition(".")[0]
        if not parent or importlib.util.find_spec(parent) is not None:
            defer(name)


def load(name: str) -> types.ModuleType:
    """The real module ``name``, imported now if a stand-in held its place."""
    with _lock:
        if isinstance(sys.modules.get(name), Deferred):
            del sys.modules[name]  # the import below runs the module and sets the parent's attribute to it
        return importlib.import_module(name)
