"""Standing: how many certified rounds each identity has contributed to, and who counts as established.

An open swarm cannot count people, only keys, and a key costs nothing. What does cost something is a
contribution that a round's group took in and a quorum certified: the outer gradient of real inner steps,
checked by every rule of :mod:`p2p_diloco.core.exclusion` and signed by its groupmates. Each fragment's
global state carries its **standing**: for every peer, the number of committed versions of that fragment
whose contributors included it. A round that commits credits its contributors (:func:`credited`); a merge
of two lineages keeps the larger count of each (:func:`merged`). The standing is part of the state's hash
(:func:`p2p_diloco.core.outer.state_sha256`), so the learners at one version hold the same standing, the
commit certificate covers it, and a downloaded state's standing is checked with the rest.

A peer is **established** once its standing reaches ``after`` (``averaging.established_after``). Until at
least ``floor`` peers are established (a swarm's first rounds), everyone counts as established: somebody
has to found the swarm. Past that:

- the majority quorum counts established learners only, and a round needs that many established
  contributors: fresh keys that announce themselves do not raise the quorum until nothing commits;
- a certificate counts established signers only: fresh keys cannot certify a state of their choosing;
- a contribution's weight ramps with its standing (:func:`ramp`): a fresh key's outer gradient counts
  1/(after + 1) of its weight, full weight once established.

Pure: no networking, no torch. Input from peers is hostile: :func:`parsed` checks a served standing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgpack

MAX_ENTRIES = 4096  # identities a standing remembers; the lowest counts are forgotten first
MAX_COUNT = 2**40  # a count beyond this is a peer's lie (a version cannot be that large either)


def credited(standing: Mapping[str, int], contributors: Iterable[str]) -> dict[str, int]:
    """``standing`` with one more certified round for each of ``contributors``.

    >>> credited({"a": 2}, ["a", "b"])
    {'a': 3, 'b': 1}
    """
    out = dict(standing)
    for peer in set(contributors):
        out[peer] = out.get(peer, 0) + 1
    return bounded(out)


def merged(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    """The standing of a merge of two lineages: each peer's larger count (the same whichever side is ``a``).

    >>> merged({"a": 2, "b": 1}, {"b": 3, "c": 1}) == {"a": 2, "b": 3, "c": 1}
    True
    """
    out = dict(a)
    for peer, n in b.items():
        out[peer] = max(out.get(peer, 0), n)
    return bounded(out)


def bounded(standing: Mapping[str, int]) -> dict[str, int]:
    """At most :data:`MAX_ENTRIES` peers, the lowest counts dropped first (ties by peer ID): the same on every
    learner. Sorted by peer ID, so the serialised form is canonical."""
    if len(standing) > MAX_ENTRIES:
        keep = sorted(standing.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_ENTRIES]
        standing = dict(keep)
    return {p: int(standing[p]) for p in sorted(standing)}


def established(standing: Mapping[str, int], after: int, floor: int) -> frozenset[str] | None:
    """The established peers: a standing of at least ``after``; None while fewer than ``floor`` are (or with
    ``after`` 0, the rule switched off): then everyone counts.

    >>> sorted(established({"a": 4, "b": 4, "c": 1}, after=4, floor=2)), established({"a": 4}, 4, 2)
    (['a', 'b'], None)
    """
    if after <= 0:
        return None
    out = frozenset(p for p, n in standing.items() if n >= after)
    return out if len(out) >= max(floor, 1) else None


def ramps(standing: Mapping[str, int], peers: Iterable[str], after: int, floor: int) -> dict[str, float]:
    """The share of its weight each of ``peers``' contributions counts with: (standing + 1) / (after + 1), at
    most 1; 1 for everyone while :func:`established` says everyone counts.

    >>> ramps({"a": 4, "b": 4, "c": 1}, ["a", "c", "new"], after=4, floor=2)
    {'a': 1.0, 'c': 0.4, 'new': 0.2}
    """
    if established(standing, after, floor) is None:
        return {p: 1.0 for p in peers}
    return {p: min(1.0, (standing.get(p, 0) + 1) / (after + 1)) for p in peers}


def counted(peers: Iterable[str], established_peers: frozenset[str] | None) -> int:
    """How many of ``peers`` count toward a quorum: the established ones (all while everyone counts)."""
    peers = set(peers)
    return len(peers) if established_peers is None else len(peers & established_peers)


def to_bytes(standing: Mapping[str, int]) -> bytes:
    """The canonical bytes hashed into the state (sorted by peer ID)."""
    return msgpack.packb(sorted((str(p), int(n)) for p, n in standing.items()), use_bin_type=True)


def parsed(value: object) -> dict[str, int]:
    """A standing from a checkpoint or a peer, checked; ValueError naming what is wrong."""
    if not isinstance(value, dict):
        raise ValueError("standing is not a map")
    if len(value) > MAX_ENTRIES:
        raise ValueError(f"standing of {len(value)} peers, more than {MAX_ENTRIES}")
    for peer, n in value.items():
        if not (isinstance(peer, str) and 0 < len(peer) <= 128):
            raise ValueError("standing names a malformed peer")
        if not (isinstance(n, int) and not isinstance(n, bool) and 0 < n < MAX_COUNT):
            raise ValueError(f"standing of {peer[-6:]} is {n!r}")
    return {p: int(value[p]) for p in sorted(value)}
