"""Commit certificates: what the members of a round committed, signed by each of them.

When a round's group has computed the new state of a fragment, every contributor signs a
:class:`Commit` (lineage, fragment, new version, new sha256, the sha256 of the state it was applied
to, the sorted contributors) with its identity key, and the round commits only once it holds the
signatures of at least K distinct contributors (K = ``averaging.min_group_size``, the quorum), and of at
least half the quorum a round needs today (:func:`needed_signers`; see
:mod:`p2p_diloco.trust.commit_board` for the exchange). A state carries the certificates of its newest
versions (:attr:`p2p_diloco.core.outer.GlobalState.certificates`, not part of its hash), and a learner
adopts a downloaded state only if its certificate verifies (:class:`Verifier`): a peer cannot make
others take a state that no quorum committed, nor lie about who contributed to it.

A merge of sibling lineages (split brain) is certified the same way, by the learners that compute it
(the merge is deterministic): ``contributors`` is empty and any K admitted learners may sign, one of them
established (:meth:`Certificate.signers`).

Everything here is pure: formats, signatures, checks (hivemind's RSA types are imported when a
signature is made or checked, so that the round imports no hivemind). Input from peers is hostile:
every decoder checks types and sizes and reports a problem as a value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from p2p_diloco.core.outer import is_sha256

if TYPE_CHECKING:  # the round imports this module; the math stays free of hivemind (crypto: on use)
    from hivemind.utils.crypto import RSAPrivateKey

MAX_SIGNATURES = 64
MAX_CONTRIBUTORS = 256
_MAX_KEY_BYTES = 2048
_MAX_SIG_BYTES = 2048


@dataclass(frozen=True)
class Commit:
    """What a round (or a merge) committed: the members sign :meth:`body`."""

    lineage: str
    fragment: int
    version: int  # the new version
    sha256: str  # the new state's hash
    parent: str  # the hash of the state the round was applied to ("" for a merge: two parents)
    contributors: tuple[str, ...] = ()  # sorted peer IDs whose outer gradients the average holds

    def body(self) -> bytes:
        """The canonical bytes that are signed."""
        return msgpack.packb(["p2p-diloco commit 1", self.lineage, self.fragment, self.version, self.sha256,
                              self.parent, list(self.contributors)], use_bin_type=True)

    def to_dict(self) -> dict[str, Any]:
        return {"lineage": self.lineage, "fragment": self.fragment, "version": self.version,
                "sha256": self.sha256, "parent": self.parent, "contributors": list(self.contributors)}

    @classmethod
    def from_dict(cls, d: Any) -> Commit:
        """ValueError naming what is wrong."""
        if not isinstance(d, dict):
            raise ValueError("commit is not a map")
        lineage, fragment, version = d.get("lineage"), d.get("fragment"), d.get("version")
        sha, parent, contributors = d.get("sha256"), d.get("parent"), d.get("contributors")
        if not (isinstance(lineage, str) and len(lineage) <= 128):
            raise ValueError("bad lineage")
        if not (isinstance(fragment, int) and 0 <= fragment < 2**16):
            raise ValueError(f"bad fragment {fragment!r}")
        if not (isinstance(version, int) and 0 < version < 2**40):
            raise ValueError(f"bad version {version!r}")
        if not is_sha256(sha) or not (parent == "" or is_sha256(parent)):
            raise ValueError("bad sha256")
        if not (isinstance(contributors, list) and len(contributors) <= MAX_CONTRIBUTORS
                and all(isinstance(p, str) and 0 < len(p) <= 128 for p in contributors)):
            raise ValueError("bad contributors")
        return cls(lineage, fragment, version, str(sha), str(parent), tuple(contributors))


@dataclass(frozen=True)
class Signature:
    """One peer's signature of a commit body: its RSA public key (OpenSSH bytes) and the signature (base64)."""

    public_key: bytes
    signature: bytes

    @classmethod
    def make(cls, key: RSAPrivateKey, commit: Commit) -> Signature:
        return cls(key.get_public_key().to_bytes(), key.sign(commit.body()))

    def signer(self, commit: Commit) -> str | None:
        """The peer ID that made this signature of ``commit``; None if it does not verify."""
        from hivemind.utils.crypto import RSAPublicKey

        from p2p_diloco.trust.signed_records import peer_id_of_public_key

        if len(self.public_key) > _MAX_KEY_BYTES or len(self.signature) > _MAX_SIG_BYTES:
            return None
        try:
            key = RSAPublicKey.from_bytes(self.public_key)
        except Exception:  # noqa: BLE001 - a malformed key from a peer
            return None
        if not key.verify(commit.body(), self.signature):
            return None
        return str(peer_id_of_public_key(key))

    def to_list(self) -> list[bytes]:
        return [self.public_key, self.signature]

    @classmethod
    def from_list(cls, x: Any) -> Signature:
        if not (isinstance(x, list | tuple) and len(x) == 2 and all(isinstance(b, bytes) for b in x)):
            raise ValueError("bad signature entry")
        return cls(x[0], x[1])


@dataclass(frozen=True)
class Certificate:
    """A commit and the signatures collected for it."""

    commit: Commit
    signatures: tuple[Signature, ...]

    def signers(self, admitted: frozenset[str] | None = None, established: frozenset[str] | None = None) -> set[str]:
        """Distinct peers whose signatures verify, who may sign this commit (its contributors; anyone for a
        merge), who are ``admitted`` (None: everyone) and, for a round's commit, ``established`` (None: everyone;
        :mod:`p2p_diloco.core.standing`). A merge's signers are any admitted peers, as long as one of them is
        ``established``: after a partition each side has credited only its own members, so a rule of established
        signers only would keep either side from taking a merge the other side's newcomers signed, while K fresh
        keys that call a state of their choosing a merge certify nothing without one identity that earned its
        standing. (Learners of our side that see the sibling compute the same merge and sign it too.)"""
        out = set()
        for s in self.signatures[:MAX_SIGNATURES]:
            peer = s.signer(self.commit)
            if peer is None or (admitted is not None and peer not in admitted):
                continue
            if established is not None and self.commit.contributors and peer not in established:
                continue  # a merge's signers are not filtered: the two sides of a healed partition must meet
            if self.commit.contributors and peer not in self.commit.contributors:
                continue
            out.add(peer)
        if established is not None and not self.commit.contributors and not out & established:
            return set()
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"commit": self.commit.to_dict(), "signatures": [s.to_list() for s in self.signatures]}

    @classmethod
    def from_dict(cls, d: Any) -> Certificate:
        """ValueError naming what is wrong."""
        if not isinstance(d, dict):
            raise ValueError("certificate is not a map")
        sigs = d.get("signatures")
        if not (isinstance(sigs, list) and len(sigs) <= MAX_SIGNATURES):
            raise ValueError("bad signatures")
        return cls(Commit.from_dict(d.get("commit")), tuple(Signature.from_list(s) for s in sigs))

    def merged_with(self, signatures: Iterable[Signature]) -> Certificate:
        """This certificate with more signatures (duplicates by public key dropped)."""
        seen = {s.public_key: s for s in self.signatures}
        for s in signatures:
            seen.setdefault(s.public_key, s)
        return Certificate(self.commit, tuple(seen.values())[:MAX_SIGNATURES])


@dataclass(frozen=True)
class Verifier:
    """The rule a learner applies to states from peers: a certificate for exactly that state, of this
    lineage, signed by at least :func:`needed_signers` distinct peers (``admitted`` ones, in a private swarm).

    ``round_quorum``: the quorum a round needs today (``HivemindAveraging.round_quorum``: a majority of the
    learners training); None: K alone. ``established``: fragment → the peers whose signatures count, by our own
    state's standing (:mod:`p2p_diloco.core.standing`; None from it, or no callable: everyone's)."""

    lineage: str
    quorum: int
    admitted: frozenset[str] | None = None
    round_quorum: Callable[[], int] | None = None
    established: Callable[[int], frozenset[str] | None] | None = None

    def needed(self) -> int:
        """How many valid signers a certificate needs now."""
        return needed_signers(self.quorum, self.round_quorum)

    def check(self, fragment: int, version: int, sha: str, certificates: Sequence[Any]) -> str:
        """"" if ``certificates`` (a state's, as served) certify (fragment, version, sha); else why not."""
        cert = find(certificates, version)
        if cert is None:
            return f"fragment {fragment} version {version} comes without a commit certificate"
        if isinstance(cert, str):
            return f"fragment {fragment} version {version}: malformed certificate ({cert})"
        c = cert.commit
        if (c.lineage, c.fragment, c.version, c.sha256) != (self.lineage, fragment, version, sha):
            return f"fragment {fragment} version {version}: the certificate is for another state"
        established = self.established(fragment) if self.established is not None else None
        signers, needed = cert.signers(self.admitted, established), self.needed()
        if len(signers) < needed:
            which = "valid" if established is None else "established"
            return (f"fragment {fragment} version {version}: certificate signed by {len(signers)} {which} "
                    f"signer(s), fewer than the quorum {needed}")
        return ""

    def linked(self, fragment: int, top: tuple[int, str], ancestor: tuple[int, str],
               certificates: Sequence[Any]) -> bool | None:
        """Whether the certificates a state carries link it (``top``: its version and sha) down to ``ancestor``.

        Walks parent hashes from ``top``'s certificate down, one version at a time, through certificates
        that pass :meth:`check`: True when the walk reaches ``ancestor``'s version at its sha, False when it
        reaches that version at another sha (the state does not descend from it, whatever its served
        history says), None when it cannot tell (a merge, whose commit names no parent, or a version
        whose certificate the state no longer carries or that does not verify).
        """
        version, sha = top
        while version > ancestor[0]:
            if self.check(fragment, version, sha, certificates):
                return None
            cert = find(certificates, version)
            assert isinstance(cert, Certificate)  # check() found it valid
            if not cert.commit.parent:
                return None
            version, sha = version - 1, cert.commit.parent
        return (version, sha) == tuple(ancestor) if version == ancestor[0] else None

    def contributors(self, version: int, certificates: Sequence[Any]) -> tuple[str, ...] | None:
        """The contributors of ``version`` as a valid certificate among ``certificates`` states them; else None."""
        cert = find(certificates, version)
        if not isinstance(cert, Certificate) or cert.commit.lineage != self.lineage:
            return None
        established = self.established(cert.commit.fragment) if self.established is not None else None
        if not cert.commit.contributors or len(cert.signers(self.admitted, established)) < self.needed():
            return None
        return cert.commit.contributors


def needed_signers(quorum: int, round_quorum: Callable[[], int] | None) -> int:
    """The signers a certificate needs: K (``quorum``), and at least half the quorum a round needs today
    (``round_quorum()``; None: K alone).

    Every honest round's group held at least the round quorum of its day (a majority of the learners
    training), and its members all sign, so half of today's leaves room for a swarm that has grown since
    (up to about twice) and for members too slow to sign before the others settle; a few colluding
    members, K of them and fewer than a quarter of the learners training, can no longer certify a state
    of their choosing.

    >>> [needed_signers(2, lambda: q) for q in (3, 5, 9)], needed_signers(2, None)
    ([2, 3, 5], 2)
    """
    return max(quorum, (round_quorum() + 1) // 2) if round_quorum is not None else quorum


class Certifier(Protocol):
    """Signs a commit and collects the other signers' signatures (:class:`.commit_board.CommitBoard`)."""

    lineage: str

    def certify(self, commit: Commit, sketch: dict[str, Any] | None = None,
                verify: Callable[[dict[str, Any]], str] | None = None, sketch_key: str = "",
                patience: float = 0.0) -> Certificate | str:
        """The certificate, once a quorum signed; or why not (the caller does not commit). With ``verify``,
        sign only if it passes on every contributor's sketch, ours ``sketch``, theirs under ``sketch_key``
        (:mod:`p2p_diloco.core.shard_sketches`). ``patience``: the round's all-reduce seconds; the wait for
        sketches and signatures lasts at least that long."""
        ...


def find(certificates: Sequence[Any], version: int) -> Certificate | str | None:
    """The certificate of ``version`` among a state's (dicts as served), decoded; a string if malformed; None
    if absent."""
    for entry in certificates:
        if isinstance(entry, dict) and isinstance(entry.get("commit"), dict) \
                and entry["commit"].get("version") == version:
            try:
                return Certificate.from_dict(entry)
            except ValueError as e:
                return str(e)
    return None
