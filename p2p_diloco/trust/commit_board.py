"""Collecting a commit's signatures through the DHT (:mod:`p2p_diloco.trust.certificates` says why).

Each member of a round that computed the new state signs its :class:`~p2p_diloco.trust.certificates.Commit`
and stores ``{commit, signature}`` under ``{lineage}_commit_{fragment}_{version}``, subkey = its own
public key marker (a signed record: nobody else can write or replace it,
:mod:`p2p_diloco.trust.signed_records`). It then reads that key until it holds valid signatures of the
same commit from every contributor, or from at least the quorum (K, and half a round's quorum today:
:func:`~p2p_diloco.trust.certificates.needed_signers`) and a short settling time has passed, or the
deadline comes: then the round fails (nothing is committed; the learner's outer gradient stays in the
exactly-once ledger, as for any round that may have committed elsewhere).

A member that signs and then fails to collect the quorum's signatures may see the others commit (with its
signature among theirs); it then adopts their certified state like any learner that missed a round.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
from hivemind.utils import get_dht_time

from p2p_diloco.trust.certificates import Certificate, Commit, Signature, needed_signers
from p2p_diloco.trust.signed_records import IdentityKey, peer_id_of_owner, replica_first

logger = logging.getLogger(__name__)

_RECORD_SECONDS = 300.0  # how long a signature stays in the DHT: long enough for late groupmates
_MAX_VALUE_BYTES = 64 * 1024


class NotCertified(str):
    """Why a commit was not certified (one line, as before), and ``blamed``: the contributors whose doing it was,
    on evidence this member checked itself: no sketch of theirs came (it cannot check its shards without
    one), or they signed the same round's commit with another hash of the new state."""

    blamed: tuple[str, ...]

    def __new__(cls, why: str, blamed: tuple[str, ...] | list[str] = ()) -> NotCertified:
        self = super().__new__(cls, why)
        self.blamed = tuple(blamed)
        return self


def commit_key(lineage: str, fragment: int, version: int) -> str:
    """The DHT key under which a round's members store their signatures of its commit."""
    return f"{lineage}_commit_{fragment}_{version}"


def _peer_of(subkey: Any) -> str | None:
    peer = peer_id_of_owner(subkey)
    return None if peer is None else str(peer)


@dataclass
class CommitBoard:
    """Signs commits with this learner's identity key and collects its groupmates' signatures."""

    dht: Any  # a LinkedDHT started with signed records (``owner`` is its marker)
    lineage: str
    key: IdentityKey
    quorum: int
    timeout: float = 10.0
    settle: float = 1.0  # after the quorum, wait this long for the other contributors' signatures
    poll: float = 0.2
    should_stop: Callable[[], bool] = lambda: False
    owner_of: Callable[[Any], str | None] = field(default=lambda subkey: _peer_of(subkey))  # subkey → peer id
    round_quorum: Callable[[], int] | None = None  # today's round quorum: a certificate needs half of it too
    # fragment → the peers whose signatures count (p2p_diloco/core/standing.py); None: everyone's
    established: Callable[[int], frozenset[str] | None] | None = None
    _me: Signature | None = field(default=None, init=False, repr=False)

    def certify(self, commit: Commit, sketch: dict[str, Any] | None = None,
                verify: Callable[[dict[str, Any]], str] | None = None, sketch_key: str = "",
                patience: float = 0.0) -> Certificate | str:
        """Sign ``commit``, publish the signature, collect the others'; the certificate, or why it failed.

        The wait lasts ``timeout`` seconds, or ``patience`` (the round's all-reduce seconds) when longer: the
        sketches and signatures are DHT records that cross the same links as the all-reduce, behind whatever
        else is queued there. At 1 Mbit/s, after all-reduces of 30–40 s, one member of a group of four gave up
        after 10 s ("no sketch from … within 10 s") while the three others committed, and it spent the next
        six minutes behind the swarm (WAN benchmark); a constant is right for one link only.

        With ``verify`` (a round's reducers are checked, :mod:`p2p_diloco.core.shard_sketches`): first wait for the
        sketch of every contributor under ``sketch_key`` (each member's averager published its own there right
        after the all-reduce; ``sketch`` is ours), and sign only if ``verify(sketches by peer id)`` returns ""
        (else fail with its reason): an honest member never signs a commit whose shards do not match what
        their senders sent.
        """
        mine = Signature.make(self.key, commit)
        cert = Certificate(commit, (mine,))
        quorum = needed_signers(self.quorum, self.round_quorum)  # what a verifier will ask for (Verifier.needed)
        established = self.established(commit.fragment) if self.established is not None else None
        # A merge of lineages names no contributors: it waits for a quorum like a round of K. Signers that do not
        # count (not established) are not waited for.
        counting = [p for p in commit.contributors if established is None or p in established]
        everyone = max(len(counting), quorum, 1)
        if everyone <= 1:
            return cert  # a round of one: our own signature is the whole certificate
        key = commit_key(self.lineage, commit.fragment, commit.version)
        started, reached = time.monotonic(), None
        limit = max(self.timeout, patience) if math.isfinite(patience) else self.timeout
        if verify is not None:
            why = self._verified(sketch_key, commit, sketch, verify, started, limit)
            if why:
                return why
        value = msgpack.packb({"commit": commit.to_dict(), "signature": mine.to_list()}, use_bin_type=True)
        if not self.dht.store(key, value, get_dht_time() + _RECORD_SECONDS, subkey=self.dht.owner):
            logger.debug(f"could not store our signature of {key} (continuing: peers may still read it)")
        while True:
            cert = cert.merged_with(self._read(key, commit))
            signers = len(cert.signers(established=established))
            now = time.monotonic()
            if signers >= quorum and reached is None:
                reached = now
            if signers >= everyone or (reached is not None and now - reached >= self.settle):
                return cert
            if now - started >= limit or self.should_stop():
                if reached is not None:
                    return cert
                which = "" if established is None else " established"
                why = (f"commit of fragment {commit.fragment} version {commit.version} not certified: "
                       f"{signers} of the quorum {quorum}{which} signatures within {limit:g} s")
                dissent = self._dissenters(key, commit)
                if dissent:
                    why += f"; {', '.join(p[-6:] for p in dissent)} signed another hash of the new state"
                return NotCertified(why, dissent)
            time.sleep(self.poll)

    def _verified(self, sketch_key: str, commit: Commit, sketch: dict[str, Any] | None,
                  verify: Callable[[dict[str, Any]], str], started: float, limit: float) -> str:
        """Wait for every contributor's sketch; ``verify``'s verdict on them, or why they did not come."""
        me = self.owner_of(self.dht.owner)
        while True:
            found = self._sketches(sketch_key) if sketch_key else {}
            if me is not None and sketch is not None:
                found[me] = sketch
            missing = [p for p in commit.contributors if p not in found]
            if not missing:
                return verify(found)
            if time.monotonic() - started >= limit or self.should_stop():
                return NotCertified(f"commit of fragment {commit.fragment} version {commit.version} not signed: its "
                                    f"reducers could not be checked, no sketch from "
                                    f"{', '.join(p[-6:] for p in missing)} within {limit:g} s",
                                    [] if self.should_stop() else missing)
            time.sleep(self.poll)

    def _sketches(self, key: str) -> dict[str, Any]:
        """The sketches stored under ``key``, by the peer id their owner marker names (unsigned ones are ignored)."""
        out: dict[str, Any] = {}
        for subkey, raw in self._raw_entries(key):
            peer = self.owner_of(subkey)
            if peer is None:
                continue
            try:
                out[peer] = msgpack.unpackb(raw, raw=False)
            except Exception:  # noqa: BLE001 - a peer's malformed entry: the check names it as missing or malformed
                continue
        return out

    def _raw_entries(self, key: str) -> list[tuple[Any, bytes]]:
        try:
            found = self.dht.get(key, latest=True, **replica_first(self.dht))  # polled: p2p_diloco/net/replica_reads.py
        except Exception as e:  # noqa: BLE001 - a DHT hiccup: try again at the next poll
            logger.debug(f"could not read {key}: {e!r}")
            return []
        if found is None or not isinstance(found.value, dict):
            return []
        return [(subkey, item.value) for subkey, item in found.value.items()
                if isinstance(getattr(item, "value", None), bytes) and len(item.value) <= _MAX_VALUE_BYTES]

    def _dissenters(self, key: str, commit: Commit) -> list[str]:
        """The contributors whose valid signature under ``key`` is of this round (same parent and contributors)
        with another hash of the new state: after an all-reduce that gave every member the same sum, a state
        that differs is the signer's doing (it is signed, so anyone can check the claim)."""
        out = set()
        for _, raw in self._raw_entries(key):
            try:
                entry = msgpack.unpackb(raw, raw=False)
                theirs = Commit.from_dict(entry["commit"])
                signer = Signature.from_list(entry["signature"]).signer(theirs)
            except Exception:  # noqa: BLE001 - a peer's malformed entry: no evidence of anything
                continue
            if signer in commit.contributors and theirs != commit and replace(theirs, sha256=commit.sha256) == commit:
                out.add(signer)
        return sorted(out)

    def _read(self, key: str, commit: Commit) -> list[Signature]:
        """The signatures of exactly ``commit`` stored under ``key`` (anything else is ignored)."""
        out = []
        for _, raw in self._raw_entries(key):
            try:
                entry = msgpack.unpackb(raw, raw=False)
                if Commit.from_dict(entry["commit"]) == commit:
                    out.append(Signature.from_list(entry["signature"]))
            except Exception:  # noqa: BLE001 - a peer's malformed entry: not a signature of ours
                continue
        return out
