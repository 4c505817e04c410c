"""Catching up: deciding that the swarm is ahead (or holds a sibling lineage), downloading the newer
state of those fragments from peers, and taking it: adopt a descendant, merge a sibling (split brain),
and rebase local progress onto the result without contributing an outer gradient twice.

A downloaded state is taken only with a valid commit certificate (:class:`~p2p_diloco.trust.certificates.Verifier`):
a peer whose state is refused is distrusted for :data:`DISTRUST_SECONDS` (its progress records are
ignored meanwhile, so a forged "ahead" record costs at most one download). The contributors that
decide exactly-once contributions are read from the certificates, never from the served list alone.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from p2p_diloco.config import LearnerConfig
from p2p_diloco.core.averaging_api import Averaging
from p2p_diloco.core.fragments import Fragment
from p2p_diloco.core.outer import GlobalState, apply_result, merge_lineages
from p2p_diloco.core.state_layout import parse_download
from p2p_diloco.learner.audit import Audit
from p2p_diloco.learner.progress import Progress
from p2p_diloco.learner.state import LearnerState, same_or_behind
from p2p_diloco.learner.swarm_end import SwarmEnd
from p2p_diloco.net.progress_records import ProgressRecord
from p2p_diloco.net.reach import reduces_and_serves
from p2p_diloco.trust.certificates import Certifier, Commit, Verifier

logger = logging.getLogger(__name__)

DISTRUST_SECONDS = 300.0


@dataclass
class Download:
    """A state download running in the background while inner steps go on."""

    fragments: tuple[int, ...]  # the fragments the swarm is ahead on (or holds a sibling of)
    started: float
    thread: threading.Thread | None = None
    result: dict[int, GlobalState] | None = None


@dataclass
class Behind:
    """What the progress records say we lack: peers to download from (newest first), and why."""

    peers: list[str]
    fragments: list[int]
    reason: str
    claims: dict[str, dict[int, int]] = field(default_factory=dict)  # peer → fragment → version its record claims


class CatchUp:
    """Brings the learner's fragments up to the swarm's: finds what it lacks, downloads it, adopts or merges it.

    Used from the training thread; only :meth:`fetch` runs on the background download thread.
    """
    def __init__(self, cfg: LearnerConfig, state: LearnerState, averaging: Averaging, progress: Progress,
                 should_stop: Callable[[], bool], verifier: Verifier | None = None,
                 certifier: Certifier | None = None, audit: Audit | None = None,
                 on_adopt: Callable[[], None] | None = None):
        self.cfg, self.state, self.averaging, self.progress = cfg, state, averaging, progress
        self.audit = audit or Audit.disabled()  # audit.jsonl: downloads, rejections, adoptions, merges
        self.should_stop = should_stop
        self.verifier = verifier  # None: downloads are taken on their hashes alone (tests without a swarm)
        self.certifier = certifier  # signs the merges this learner computes
        # After a state is adopted or merged (the learner checkpoints, so that a kill does not redo it)
        self.on_adopt = on_adopt or (lambda: None)
        self.download: Download | None = None
        self.end = SwarmEnd(cfg, len(state.states))  # what the records said of the run's end

    def downloading(self, fragment: int) -> bool:
        """Whether a background download holding ``fragment`` is pending (running, or arrived and not adopted yet)."""
        return self.download is not None and fragment in self.download.fragments

    def start(self, background: bool = False) -> list[int]:
        """Before contributing: take newer state from peers, and heal sibling lineages (split brain).

        Returns the fragments that changed. ``background``: start the download in a thread and
        return at once; inner steps go on, and :meth:`poll` adopts the state when it has arrived
        (rounds of those fragments wait for it).
        """
        if self.download is not None:
            return []
        behind = self.look(fresh=not background)
        if not behind.fragments:
            return []
        logger.info(f"the swarm {behind.reason} our version {self.state.version} of fragments {behind.fragments}: "
                    f"downloading{' in the background' if background else ''}")
        if not background:
            return self.adopt(self.fetch(behind.peers, behind.fragments, behind.claims))
        task = Download(fragments=tuple(behind.fragments), started=time.perf_counter())

        def fetch() -> None:
            task.result = self.fetch(behind.peers, behind.fragments, behind.claims)

        task.thread = threading.Thread(target=fetch, daemon=True, name="state-download")
        self.download = task
        task.thread.start()
        return []

    def poll(self, busy: int | None) -> None:
        """Adopt a background download once it has arrived and no round of its fragments (``busy``) runs."""
        task = self.download
        if task is None or task.thread is None or task.thread.is_alive():
            return
        if busy is not None and busy in task.fragments:
            return  # that round holds the fragment's state; adopt after it
        self.download = None
        self.state.counters.download_seconds += time.perf_counter() - task.started
        theirs = {f: state for f, state in (task.result or {}).items() if f != busy}
        if theirs:
            self.adopt(theirs)

    def finish(self) -> None:
        """Wait (bounded) for a background download and adopt it: the training loop has ended."""
        if self.download is not None and self.download.thread is not None:
            self.download.thread.join(timeout=self.cfg.averaging.next_chunk_timeout)
            self.poll(busy=None)

    def look(self, fresh: bool = True) -> Behind:
        """Read the others' progress records once (looked up now unless ``fresh`` is False): which peers hold
        newer state (or a sibling lineage) of which fragments.

        What the same read says of the run's end goes to :attr:`end` (:meth:`SwarmEnd.observe`), which raises
        :class:`LearnerError` if the swarm finished the run without us and nobody serves its state.
        """
        records = self.progress.others(fresh)
        live = {p: r for p, r in records.items() if r.status != "left"}
        behind = self._behind(live)
        self.end.observe(records, live, self.state.versions, bool(behind.fragments), self._others_training)
        return behind

    def _behind(self, live: dict[str, ProgressRecord]) -> Behind:
        # A client or relayed learner (net.reach) serves no state: what its record shows is held by a reachable
        # peer too, or by nobody who can serve it (a client keeps no merge that no such peer signed, see _reconcile).
        ahead, siblings, fragments = self._compare({p: r for p, r in live.items() if reduces_and_serves(r.reach)})
        if not (ahead or siblings):
            return Behind([], [], "")
        # Newest first; random among equals, so that many joiners spread over the peers that serve.
        peers = [p for p, _ in sorted(ahead.items(), key=lambda kv: kv[1], reverse=True)]
        peers += [p for p, _ in sorted(siblings.items(), key=lambda kv: kv[1], reverse=True) if p not in ahead]
        reason = "is ahead of" if ahead else "holds a sibling lineage of"
        claims = {p: {f: live[p].fragment_version(f) for f in fragments} for p in peers}
        return Behind(peers, sorted(fragments), reason, claims)

    def _others_training(self) -> set[str]:
        return set(self.progress.recently_training(trusted_only=False)) - {self.state.peer_id}

    def _compare(self, live: dict[str, ProgressRecord]) -> tuple[dict, dict, set[int]]:
        ahead: dict[str, tuple[int, float]] = {}
        siblings: dict[str, tuple[int, float]] = {}
        fragments: set[int] = set()
        states = self.state.states
        mine_shas = [s.sha256() for s in states] if live else []  # hashing a fragment is not free
        for p, r in live.items():
            for f in range(len(states)):
                v, sha = r.fragment_version(f), r.fragment_sha(f)
                if v > states[f].version:
                    ahead[p] = max(ahead.get(p, (0, 0.0)), (v, random.random()))
                    fragments.add(f)
                elif v == states[f].version and sha and sha != mine_shas[f]:
                    siblings[p] = max(siblings.get(p, (0, 0.0)), (v, random.random()))
                    fragments.add(f)
        return ahead, siblings, fragments

    def fetch(self, peers: Sequence[str] = (), fragments: Sequence[int] | None = None,
              claims: dict[str, dict[int, int]] | None = None) -> dict[int, GlobalState]:
        """Download and verify ``fragments`` (all when None) from the first of ``peers`` that serves them,
        else the whole state from any peer. Touches no learner state: safe in a background thread.

        ``claims``: the versions each peer's record claimed; a peer that serves less than it claimed, or a
        state that fails verification, is distrusted (:meth:`Progress.distrust`)."""
        attempts: list[str | None] = [*peers[:3], None]  # None: any peer, newest first (hivemind's priority)
        for peer in attempts:
            if self.should_stop():
                return {}
            timeout = self.cfg.averaging.next_chunk_timeout
            wanted = None if peer is None else fragments
            loaded = (self.averaging.download_state(timeout) if peer is None
                      else self.averaging.download_state_from(peer, timeout, wanted))
            if loaded is None:
                logger.warning(f"no state from {peer or 'any peer'}")
                continue
            theirs, problem = parse_download(*loaded, self.state.states, wanted)
            problem = problem or self._uncertified(theirs)
            if problem:
                logger.warning(f"rejected state from {peer or 'a peer'}: {problem}")
                self.audit.record("download_rejected", peer=peer or "any", reason=problem, distrusted=peer is not None)
                if peer is not None:
                    self.progress.distrust(peer, DISTRUST_SECONDS)
                continue
            claimed = (claims or {}).get(peer or "", {})
            short = [f for f, v in claimed.items() if f in theirs and theirs[f].version < v]
            if short:  # versions only grow: its record lied
                logger.warning(f"{peer} claimed version {claimed[short[0]]} of fragment {short[0]} but serves "
                               f"{theirs[short[0]].version}; ignoring its records for {DISTRUST_SECONDS:.0f} s")
                self.progress.distrust(str(peer), DISTRUST_SECONDS)
                self.audit.record("distrusted", peer=peer, reason=f"claimed version {claimed[short[0]]} of fragment "
                                  f"{short[0]}, served {theirs[short[0]].version}", seconds=DISTRUST_SECONDS)
                continue
            if any(not same_or_behind(self.state.states[f], s) for f, s in theirs.items()):
                self.audit.downloaded(peer or "any", theirs, self._how_checked)
                return theirs
        return {}

    @property
    def _how_checked(self) -> str:
        """How a downloaded state was checked, as the audit log says it."""
        return "verified" if self.verifier is not None else "not checked"

    def _uncertified(self, theirs: dict[int, GlobalState]) -> str:
        """Why a downloaded state may not be taken ("" if it may): a fragment ahead of ours or beside it
        without a valid certificate."""
        if self.verifier is None:
            return ""
        for f, s in sorted(theirs.items()):
            if not same_or_behind(self.state.states[f], s):
                problem = self.verifier.check(f, s.version, s.sha256(), s.certificates)
                if problem:
                    return problem
        return ""

    def adopt(self, theirs: dict[int, GlobalState]) -> list[int]:
        """Take the fragments of ``theirs`` that are ahead of ours; returns those that changed."""
        changed = [f for f, state in sorted(theirs.items()) if self._reconcile(self.state.fragments[f], state)]
        if changed:
            self.state.counters.syncs += 1
            self.state.refresh_served()
            self.averaging.set_state_priority(self.state.version)
            logger.info(f"synced global state v{self.state.version} (fragments {changed}) sha "
                        f"{self.state.whole_sha256()[:12]} from peers (local progress kept)")
            self.on_adopt()
        return changed

    def _reconcile(self, frag: Fragment, theirs: GlobalState) -> bool:
        """Take a peer's state of one fragment if it is ahead of ours; merge if it is a sibling lineage."""
        ours = self.state.states[frag.index]
        if same_or_behind(ours, theirs):
            return False
        if self._descends(frag.index, theirs, ours):
            new = theirs  # ahead of us on our own lineage: catch up
        else:
            new = merge_lineages(ours, theirs)
            split = (f"split brain on fragment {frag.index}: ours v{ours.version} {ours.sha256()[:12]}, a peer's "
                     f"v{theirs.version} {theirs.sha256()[:12]}")
            why_not = self._certify_merge(frag.index, new)
            if not why_not:
                self.state.counters.merges += 1
                logger.warning(f"{split}; merged into v{new.version} {new.sha256()[:12]} weighted by tokens")
            else:
                # Kept, the merge would be a third lineage: without a quorum's certificate no peer takes it
                # from us, and a merge that only clients hold nobody can serve; we would merge again each
                # time we saw their state. Their state is certified: we take it, keep our local progress,
                # and adopt the merge the others make, which descends from it.
                new = theirs
                logger.warning(f"{split}; {why_not}, so we take theirs")
        self.audit.adopted(frag.index, ours, theirs, new, self._how_checked)
        self._rebase_onto(frag, ours, self.state.pin(new))
        self.state.counters.missed_versions[frag.index] += max(0, new.version - ours.version)
        self.state.states[frag.index] = new
        return True

    def _descends(self, fragment: int, theirs: GlobalState, ours: GlobalState) -> bool:
        """Whether ``theirs`` descends from ``ours``: its served history says so and, when we verify, the
        certificates it carries do not link it to another state at our version (the history is not part
        of the state's hash; the certificates are signed). Beyond the certificates it carries, or across
        a merge, the history's word stands: the state itself is certified either way."""
        if not theirs.descends_from(ours.version, ours.sha256()):
            return False
        if self.verifier is None:
            return True
        linked = self.verifier.linked(fragment, (theirs.version, theirs.sha256()), (ours.version, ours.sha256()),
                                      theirs.certificates)
        if linked is False:
            logger.warning(f"fragment {fragment}: a peer's v{theirs.version} {theirs.sha256()[:12]} lists our "
                           f"v{ours.version} {ours.sha256()[:12]} in its history, but its certificates link it to "
                           "another state at that version: treated as a sibling lineage")
        return linked is not False

    def _certify_merge(self, fragment: int, merged: GlobalState) -> str:
        """Sign the merge and collect the signatures of the others that compute it (it is deterministic):
        why we may not keep it ("" if we may). A quorum must have signed and, if we are a client, a learner
        that serves state among them (always kept without a certifier: tests without a swarm)."""
        if self.certifier is None:
            return ""
        cert = self.certifier.certify(Commit(self.certifier.lineage, fragment, merged.version, merged.sha256(), ""))
        if isinstance(cert, str):
            logger.info(f"merged state of fragment {fragment} is not certified ({cert})")
            return "no quorum computed the same merge"
        if self.progress.client:
            servers = {p for p, r in self.progress.others(fresh=False).items() if reduces_and_serves(r.reach)}
            if not servers & cert.signers():
                return "no learner that serves state signed the same merge"
        merged.add_certificate(merged.version, cert.to_dict())
        return ""

    def _contributed(self, new: GlobalState, version: int) -> bool | None:
        """Whether our outer gradient is in ``version`` of ``new``: from its certificate when we verify, else
        from its contributors list; None when it cannot tell."""
        if self.verifier is None:
            return new.contributed(version, self.state.peer_id)
        peers = self.verifier.contributors(version, new.certificates)
        return None if peers is None else self.state.peer_id in peers

    def _rebase_onto(self, frag: Fragment, ours: GlobalState, new: GlobalState) -> None:
        """Move our progress on ``frag`` onto ``new``, minus an outer gradient that is already in it."""
        f, local = frag.index, self.state.local(frag)
        self.state.changed.add(f)
        pending = self.state.unconfirmed.pop(f, None)
        included = None
        if pending is not None and pending.version == ours.version and new.version > ours.version:
            included = self._contributed(new, ours.version + 1)
        if pending is None or not included:
            if included is None and pending is not None and new.version > ours.version:
                logger.warning(f"fragment {f}: cannot tell whether our outer gradient from version {ours.version} "
                               f"reached version {ours.version + 1} (its contributors are not known); keeping our "
                               "progress")
            apply_result(local, new.params, ours.params, "mix")
            return
        # θ ← Θ_new + (θ − snapshot): what we trained since the round started is kept, what we sent is
        # in Θ_new already. (Overwriting would drop steps that are not.)
        apply_result(local, new.params, pending.snapshot, "mix")
        self.state.counters.merged(f, pending.tokens, pending.steps, len(self.state.fragments), pending.lr_steps)
        self.state.counters.contributions_confirmed += 1
        logger.info(f"fragment {f}: our outer gradient from version {ours.version} ({pending.steps} steps) is in "
                    f"version {ours.version + 1}, committed by the others without us seeing it; not contributing "
                    "it again")
