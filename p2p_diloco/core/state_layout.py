"""The global state as served to peers: one layout, used by serving, slicing, parsing and the averager.

A learner serves its global state as ``(metadata, tensors)``:

- ``metadata = {"fragments": [GlobalState.to_dict(tensors=False) + {"sha256": ...}, ...], "sha256": whole}``,
  one entry per fragment, in fragment order;
- ``tensors``: for each fragment in order, its parameters then its momentum buffers
  (:meth:`GlobalState.tensors`).

A download of some fragments only carries the same metadata (every fragment) and the tensors of the
fragments asked for, in the same order. :func:`fragment_slices` is the only place that knows where
a fragment's tensors sit in that list; :func:`parse_download` the only place that reads it back.

Everything a peer sends is hostile until checked: :func:`parse_download` returns the problem as a
value instead of raising, and checks every fragment's tensors against its advertised hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2p_diloco.core.outer import GlobalState, StateFormatError, state_sha256
from p2p_diloco.hooks import NO_FAULTS, FaultHooks

Served = tuple[dict[str, Any], list[torch.Tensor]]


def whole_sha256(states: Sequence[GlobalState]) -> str:
    """One hash for all fragments: what learners compare to tell that they hold the same model."""
    return hashlib.sha256("".join(s.sha256() for s in states).encode()).hexdigest()


def fragment_slices(tensor_counts: Sequence[int], wanted: Sequence[int] | None = None) -> list[slice]:
    """Where each wanted fragment's tensors (parameters then momentum) sit in a served tensor list.

    ``tensor_counts[f]``: how many parameter tensors fragment f has. The list holds only the wanted
    fragments (all when ``wanted`` is None), in fragment order.

    >>> fragment_slices([2, 1, 3])
    [slice(0, 4, None), slice(4, 6, None), slice(6, 12, None)]
    >>> fragment_slices([2, 1, 3], wanted=[2, 0])  # fragment 0's tensors, then fragment 2's
    [slice(0, 4, None), slice(4, 10, None)]
    """
    keep = set(range(len(tensor_counts)) if wanted is None else wanted)
    out, start = [], 0
    for f, n in enumerate(tensor_counts):
        if f in keep:
            out.append(slice(start, start + 2 * n))
            start += 2 * n
    return out


def select_fragments(tensors: Sequence[torch.Tensor], tensor_counts: Sequence[int],
                     wanted: Sequence[int]) -> list[torch.Tensor]:
    """The tensors of ``wanted`` fragments, cut out of a whole served tensor list."""
    whole = fragment_slices(tensor_counts)
    return [t for f in sorted(set(wanted)) for t in tensors[whole[f]]]


def parameter_indices(tensor_counts: Sequence[int]) -> list[tuple[int, ...]]:
    """Fragment f's parameters laid out consecutively (the averager's buffers): their indices."""
    out, start = [], 0
    for n in tensor_counts:
        out.append(tuple(range(start, start + n)))
        start += n
    return out


def snapshot(states: Sequence[GlobalState]) -> Served:
    """What to serve for ``states``: metadata and a private copy of the tensors."""
    meta = {
        "fragments": [{**s.to_dict(tensors=False), "sha256": s.sha256()} for s in states],
        "sha256": whole_sha256(states),
    }
    return meta, [t.clone() for s in states for t in s.tensors()]


@dataclass
class ServedState:
    """The snapshot peers download. Replaced whole after each change of the global state, never
    mutated in place, so the averager's thread may hand it out while the learner goes on."""

    faults: FaultHooks = NO_FAULTS  # a test's serve faults, and what a lying learner serves instead
    _current: Served | None = None
    _version: int = 0

    def refresh(self, states: Sequence[GlobalState]) -> None:
        """Serve a snapshot of ``states`` from now on (copies: later changes to them are not served)."""
        self._version = min((s.version for s in states), default=0)
        self._current = snapshot(self.faults.served_states(states, self._version))

    @property
    def metadata(self) -> dict[str, Any] | None:
        """The served metadata; None before the first :meth:`refresh`."""
        return None if self._current is None else self._current[0]

    def __call__(self) -> Served:
        """The averager's state provider."""
        current = self._current
        if current is None:
            raise RuntimeError("no state to serve yet")
        self.faults.fire("serve", self._version)
        return current


def parse_download(
    meta: Any, tensors: list[torch.Tensor], current: Sequence[GlobalState], fragments: Sequence[int] | None = None
) -> tuple[dict[int, GlobalState], str]:
    """Per-fragment states from a peer's download, each verified against its advertised hash.

    ``fragments``: the fragments whose tensors the download holds (all when None); the metadata
    always describes every fragment. Returns ``(states, "")`` or ``({}, what is wrong)``.
    """
    p = len(current)
    entries = meta.get("fragments") if isinstance(meta, dict) else None
    if not (isinstance(entries, list) and len(entries) == p and all(isinstance(e, dict) for e in entries)):
        return {}, "metadata does not describe every fragment"
    wanted = sorted(set(range(p) if fragments is None else fragments))
    counts = [len(s.params) for s in current]
    expected = [t for f in wanted for t in current[f].tensors()]
    if len(tensors) != len(expected):
        return {}, f"expected {len(expected)} tensors, got {len(tensors)}"
    for t, ref in zip(tensors, expected, strict=True):
        if t.shape != ref.shape:
            return {}, f"tensor of shape {tuple(t.shape)} where {tuple(ref.shape)} was expected"
        if not torch.isfinite(t).all():
            return {}, "tensor holds NaN or Inf"
    states = {}
    for f, where in zip(wanted, fragment_slices(counts, wanted), strict=True):
        chunk, n = [t.float().clone() for t in tensors[where]], counts[f]
        try:
            state = GlobalState.from_dict({**entries[f], "params": chunk[:n], "momentum": chunk[n:]})
        except StateFormatError as e:
            return {}, f"fragment {f}: {e}"
        sha = state_sha256(chunk, state.version, state.momentum_initialized, state.tokens, state.standing)
        if sha != entries[f].get("sha256"):
            return {}, f"hash of fragment {f} does not match the advertised sha256"
        states[f] = state
    return states, ""
