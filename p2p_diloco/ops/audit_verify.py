"""``p2p-diloco audit verify DIR...``: check learners' audit logs (:mod:`p2p_diloco.learner.audit`), each alone and
against each other, and summarise what the swarm did.

Each chain alone: every line is JSON (but a torn line that the next line's ``torn`` event names), ``seq``
is the line's index, ``prev`` the hash of the line before, every ``head`` is signed by the key of the peer
ID the log declares (that key must hash to it). An edited line is named by the line after it, which holds
another hash of it; a removed, added or reordered line breaks ``seq``.

Across learners: every member of a committed round (fragment, version) that logged it logged the same
result hash and contributors; every state a learner adopted or merged with was committed (or merged) in a
given log, or its adopter checked its commit certificate; else it is *unverifiable* (an error with
``--strict``). The joins and leaves the learners saw (``peer_joined``, ``peer_left``, ``peer_gone``) are
counted, not checked: they are what each learner read from the DHT.

What it cannot see: lines after a log's last signed head can be removed (or the tail rewritten) without a
trace, as a kill leaves an unsigned tail too; and a learner that rewrites its whole log and signs it
again with its own key is caught only where other learners' logs contradict it.

Example::

    $ p2p-diloco audit verify runs/local-swarm/learner-*
    3 audit log(s) consistent ...
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2p_diloco.errors import UserError
from p2p_diloco.learner.audit import FILENAME, GENESIS, PEER_EVENTS, head_body, line_hash, parse_line


class Inconsistent(Exception):
    """The first inconsistency found: ``FILE:LINE: what``."""


@dataclass
class Chain:
    """One learner's log, checked on its own: its entries with their line numbers (1-based)."""

    name: str
    peer_id: str = ""
    entries: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    lines: int = 0
    heads: int = 0
    signed_through: int = 0  # the line number of the last head whose signature verifies
    segments: int = 0  # started + resumed
    torn: list[int] = field(default_factory=list)

    def events(self, *kinds: str) -> list[tuple[int, dict[str, Any]]]:
        return [(n, e) for n, e in self.entries if e.get("event") in kinds]


def _signer(public_key: Any, signature: Any, body: bytes) -> str | None:
    """The peer ID whose key made ``signature`` of ``body``; None if it does not verify."""
    from hivemind.utils.crypto import RSAPublicKey  # crypto: only when a log is checked

    from p2p_diloco.trust.signed_records import peer_id_of_public_key

    if not isinstance(public_key, str) or not isinstance(signature, str):
        return None
    try:
        key = RSAPublicKey.from_bytes(public_key.encode())
        if not key.verify(body, signature.encode()):
            return None
    except Exception:  # noqa: BLE001 - a malformed key or signature is a bad head, whatever the library raises
        return None
    return str(peer_id_of_public_key(key))


def read_chain(path: Path, name: str | None = None) -> Chain:
    """Check one ``audit.jsonl`` on its own; :class:`Inconsistent` names its first bad line."""
    name = name or str(path)
    raws = path.read_bytes().split(b"\n")
    tail = raws.pop()
    if tail:
        raws.append(tail)
    chain = Chain(name, lines=len(raws))
    hashes = [line_hash(r) for r in raws]
    parsed = [parse_line(r) for r in raws]

    def bad(n: int, what: str) -> Inconsistent:
        return Inconsistent(f"{name}:{n}: {what}")

    for i, entry in enumerate(parsed):
        n = i + 1
        if entry is None:
            nxt = parsed[i + 1] if i + 1 < len(parsed) else None
            if i + 1 == len(parsed):  # the writer died in it; the tail after the last head is unsigned anyway
                chain.torn.append(n)
                break
            if nxt is None or nxt.get("event") != "torn" or nxt.get("line") != n:
                raise bad(n, "not a JSON object, and no 'torn' event names it")
            chain.torn.append(n)
            continue
        if entry.get("seq") != i:
            raise bad(n, f"seq {entry.get('seq')!r} where {i} was expected: lines before it were removed, "
                         "added or reordered")
        expected = hashes[i - 1] if i else GENESIS
        if entry.get("prev") != expected:
            nxt = parsed[i + 1] if i + 1 < len(parsed) else None
            if i == 0 or (nxt is not None and nxt.get("prev") != hashes[i]):
                raise bad(n, "changed after it was written (its prev does not chain, nor does the next line's)")
            raise bad(i, f"changed after it was written (line {n} holds another hash of it)")
        event = entry.get("event")
        if event in ("started", "resumed"):
            chain.segments += 1
            peer = entry.get("peer_id")
            if not chain.peer_id and isinstance(peer, str):
                chain.peer_id = peer
            elif peer != chain.peer_id:
                raise bad(n, f"{event} as peer {peer!r}, but the log is {chain.peer_id}'s")
        elif not chain.peer_id:
            if event != "torn":
                raise bad(n, "the log does not begin with a 'started' event declaring its peer ID")
        elif event == "head":
            chain.heads += 1
            if entry.get("peer_id") != chain.peer_id:
                raise bad(n, f"head signed as {entry.get('peer_id')!r}, but the log is {chain.peer_id}'s")
            signer = _signer(entry.get("public_key"), entry.get("signature"), head_body(chain.peer_id, i, expected))
            if signer != chain.peer_id:
                raise bad(n, "the head's signature does not verify with the key of " + chain.peer_id
                          if signer is None else f"the head is signed by {signer}, not by {chain.peer_id}")
            chain.signed_through = n
        chain.entries.append((n, entry))
    if not chain.peer_id:
        raise Inconsistent(f"{name}:1: no 'started' event declares the log's peer ID")
    return chain


def _cause(reason: str) -> str:
    """A failure's reason without its peer IDs and numbers, to count failures by cause."""
    reason = re.sub(r"\b[1-9A-HJ-NP-Za-km-z]{30,}\b|\b[0-9a-f]{8,}\b", "…", reason)
    return re.sub(r"\d+(\.\d+)?", "N", reason)[:80]


@dataclass
class Report:
    """What the logs say, once consistent."""

    chains: list[Chain]
    rounds: dict[tuple[Any, ...], dict[str, Any]]  # (fragment, version, sha) → its members
    commit_records: int
    failures: Counter[str]
    downloads: int
    rejected: int
    distrusted: int
    merges: int
    traced: int
    certified: int
    unverifiable: list[str]
    excluded: set[tuple[Any, ...]]  # (fragment, version, peer) whose contribution a round left out
    healed: Counter[str] = field(default_factory=Counter)  # learner → inner steps whose loss was not finite
    # what learners saw others do: event ("joined", "left", "gone") → {peer → how many logs saw it, how often}
    peers_seen: dict[str, Counter[str]] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"{len(self.chains)} audit log(s) consistent"]
        for c in self.chains:
            unsigned = c.lines - c.signed_through
            out.append(f"  {c.peer_id[-8:]}  {c.name}: {c.lines} lines, {c.heads} signed head(s), "
                       f"{c.segments} segment(s)" + (f", torn lines {c.torn}" if c.torn else "")
                       + (f", {unsigned} unsigned line(s) at the end" if unsigned else ""))
        out.append(f"rounds committed: {len(self.rounds)} ({self.commit_records} commit records); "
                   f"failed: {sum(self.failures.values())}")
        out += [f"  {n} × {cause}" for cause, n in self.failures.most_common()]
        out.append(f"downloads: {self.downloads} ({self.rejected} rejected, {self.distrusted} distrusting a peer); "
                   f"adopted states: {self.traced} traced to a logged commit, {self.certified} certified only, "
                   f"{len(self.unverifiable)} unverifiable; merges: {self.merges}")
        out += [f"  unverifiable: {u}" for u in self.unverifiable]
        if self.excluded:
            who = Counter(str(peer)[-8:] for _, _, peer in self.excluded)
            out.append(f"contributions excluded from rounds: {len(self.excluded)} ("
                       + ", ".join(f"{p} × {n}" for p, n in who.most_common()) + ")")
        if self.healed:
            out.append("learners whose training diverged and took the global state back: "
                       + ", ".join(f"{p[-8:]} × {n}" for p, n in self.healed.most_common()))
        if any(self.peers_seen.values()):
            seen = {e: self.peers_seen.get(e, Counter()) for e in PEER_EVENTS}
            out.append("seen by the learners: " + ", ".join(
                f"{sum(c.values())} {e} ({len(c)} peer{'s' * (len(c) != 1)})" for e, c in seen.items()))
        tokens: dict[str, int] = defaultdict(int)
        rounds: dict[str, int] = defaultdict(int)
        for members in self.rounds.values():
            for peer, m in members.items():
                tokens[peer] += int(m.get("tokens", 0)) if isinstance(m, dict) else 0
                rounds[peer] += 1
        total = sum(tokens.values())
        out.append("contributions (share of the tokens merged in committed rounds):")
        for peer, t in sorted(tokens.items(), key=lambda kv: -kv[1]):
            out.append(f"  {peer[-8:]}  {t / max(1, total):6.1%}  {t} tokens in {rounds[peer]} round(s)")
        return out


def cross_check(chains: list[Chain], strict: bool = False) -> Report:
    """Check the learners' logs against each other; :class:`Inconsistent` names the first contradiction."""
    by_peer = {c.peer_id: c for c in chains}
    commits: dict[tuple[Any, ...], list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    rounds: dict[tuple[Any, ...], dict[str, Any]] = {}
    made: set[tuple[Any, ...]] = set()  # states some log committed or merged into
    for c in chains:
        for n, e in c.events("committed"):
            key = (e.get("fragment"), e.get("version_after"), e.get("sha_after"))
            commits[(c.peer_id, key[0], key[1])].append((n, e))
            rounds.setdefault(key, {}).update(e.get("members") or {})
            made.add(key)
        for _, e in c.events("merged"):
            made.add((e.get("fragment"), e.get("version_after"), e.get("sha_after")))
    for c in chains:
        for n, e in c.events("committed"):
            f, v = e.get("fragment"), e.get("version_after")
            for peer in e.get("contributors") or []:
                other = by_peer.get(peer)
                if other is None or other is c:
                    continue
                for m, theirs in commits.get((peer, f, v), []):
                    if theirs.get("sha_after") != e.get("sha_after") or theirs.get("contributors") != e.get(
                            "contributors"):
                        raise Inconsistent(
                            f"{other.name}:{m}: fragment {f} version {v} committed as "
                            f"{str(theirs.get('sha_after'))[:12]} by {theirs.get('contributors')}, but "
                            f"{c.name}:{n} (a member of that round) logged {str(e.get('sha_after'))[:12]} by "
                            f"{e.get('contributors')}")
    traced = certified = 0
    unverifiable: list[str] = []
    for c in chains:
        for n, e in c.events("adopted", "merged"):
            key = (e.get("fragment"), e.get("version"), e.get("sha"))
            if key in made:
                traced += 1
            elif e.get("certificate") == "verified":
                certified += 1
            else:
                what = f"{c.name}:{n}: fragment {key[0]} version {key[1]} {str(key[2])[:12]} was {e.get('event')} " \
                       "without a certificate check, and no given log committed it"
                if strict:
                    raise Inconsistent(what)
                unverifiable.append(what)
    failures = Counter(_cause(str(e.get("cause", ""))) for c in chains for _, e in c.events("failed"))
    excluded = {(e.get("fragment"), e.get("version_before", e.get("version")), peer) for c in chains
                for _, e in c.events("committed", "failed") for peer in (e.get("excluded") or {})}
    return Report(chains, rounds, sum(len(v) for v in commits.values()), failures,
                  downloads=sum(len(c.events("downloaded")) for c in chains),
                  rejected=sum(len(c.events("download_rejected")) for c in chains),
                  distrusted=sum(len(c.events("distrusted")) for c in chains)
                  + sum(bool(e.get("distrusted")) for c in chains for _, e in c.events("download_rejected")),
                  merges=sum(len(c.events("merged")) for c in chains),
                  traced=traced, certified=certified, unverifiable=unverifiable, excluded=excluded,
                  healed=Counter({c.peer_id: len(c.events("healed")) for c in chains if c.events("healed")}),
                  peers_seen={e: Counter(str(x.get("peer"))[-8:] for c in chains for _, x in c.events(f"peer_{e}"))
                              for e in PEER_EVENTS})


def log_path(where: str | Path) -> Path:
    """A checkpoint directory's ``audit.jsonl`` (or the file itself); UserError if there is none."""
    p = Path(where)
    path = p / FILENAME if p.is_dir() else p
    if not path.is_file():
        raise UserError(f"no audit log at {path}: give learners' checkpoint directories (or their {FILENAME})")
    return path


def verify(paths: list[str | Path], strict: bool = False) -> Report:
    """Check the logs in ``paths`` (checkpoint directories or ``audit.jsonl`` files) alone and together."""
    chains = [read_chain(p) for p in map(log_path, paths)]
    seen: dict[str, str] = {}
    for c in chains:
        if c.peer_id in seen:
            raise UserError(f"{seen[c.peer_id]} and {c.name} are the logs of the same peer {c.peer_id}")
        seen[c.peer_id] = c.name
    return cross_check(chains, strict)


def main(paths: list[str], strict: bool = False) -> int:
    """The command: the summary and exit 0, or one line naming the first inconsistency and exit 1."""
    try:
        report = verify(list(paths), strict)
    except Inconsistent as e:
        print(f"inconsistent: {e}")
        return 1
    print("\n".join(report.lines()))
    return 0
