"""Scripted faults as values: one readable line per failure, usable from tests and the CLI.

Grammar (one fault per line; several joined with ``;`` on the command line)::

    kill at round R during STAGE [in a group of N]
    hang for S s at round R during STAGE [in a group of N]
    drop for S s at round R during STAGE [in a group of N]
    poison at round R with nan|flip|scale X|climb [N]|diverge
    lie at round R with ahead|state|weight|shard|sketch|hash|quorum
    malform at round R with KIND

A *round R* is the round that produces global version R of a fragment (the R-th outer step). A fault
fires once, the first time the learner reaches its STAGE in round R **or a later one**: a learner
that took version R from its peers (it started late, or its round failed) meets the fault in its
next round instead of never. STAGE names where in the learner's life the fault fires:

=============  ===========================================================================
inner          during the inner steps that lead up to round R
matchmaking    after the learner declared itself in the DHT for round R, before all-reduce
send           while sending its own outer-gradient parts to the reducers
reduce         while reducing a shard for its groupmates (after the first reply went out)
receive        while receiving averaged shards back (after the first one arrived)
commit         after every averaged shard arrived, before the learner applies the round (the
               others commit it with this learner's outer gradient in it)
checkpoint     in the middle of writing the checkpoint after round R (temporary file written)
serve          while serving its global state to a learner that downloads it
=============  ===========================================================================

``in a group of N`` (``commit`` only): the fault waits for the first round from R on whose group has at
least N members (a test that needs the others to commit without this learner's signature needs a
group of 3 or more, whatever the phases the learners happen to start in).
``kill`` is SIGKILL of the learner process (its DHT, averager and p2pd die with it).
``hang`` stops the learner's whole process group with SIGSTOP for S seconds, then resumes it
(a helper process sends SIGCONT), like a machine that freezes and comes back.
``drop`` freezes only the learner's p2pd daemon for S seconds: all of its traffic stops while
the learner itself trains on, like a machine whose network link goes down.
``poison`` corrupts the learner's outer gradient Δ where the round computes it, in **every** round
from R on (a broken learner stays broken): ``nan`` makes every value NaN (training that diverged),
``flip`` negates Δ (a learner that climbs the loss), ``scale X`` multiplies it by X (exploding
updates). The round then gathers the corrupted Δ's norm, as an honest but broken learner would.
``climb`` leaves Δ alone and negates the loss gradient of every inner step before it is clipped (a learner
that climbs the loss through all its inner steps: its Δ has an ordinary norm and points uphill);
``climb N`` climbs only in the inner steps toward rounds R, R + N, R + 2N, ... and trains honestly in the
others (a member that switches between honest and hostile rounds). ``diverge`` makes the gradients of
one inner step toward round R NaN (training that diverges once: the learner heals, learner/healing.py).
``scale 0`` is a free rider: no progress sent, full tokens claimed.
``lie`` makes the learner a malicious member from round R on: ``ahead`` signs progress records that
claim 1,000 versions more than it holds (a forged "the swarm is ahead"); ``state`` serves a poisoned
global state, Θ scaled by −50 at a version 3 ahead, whose history lists the states its victims hold
(it is its own lineage's history), hash recomputed, and advertises it in its progress record;
``weight`` gathers a weight of 1e15 for its outer gradient (its tokens as it reports them); ``shard``
returns the shard it reduces scaled by −50 to every member, itself included (a malicious reducer; the
members' sketches catch it, :mod:`p2p_diloco.core.shard_sketches`); ``sketch`` never publishes its reducer
sketch (its groupmates cannot check their shards); ``hash`` signs each commit with another hash of the new
state; ``quorum`` gathers a majority quorum of 1,000,000 (the largest that is well-formed). Each of the last
three fails the rounds it joins unless its groupmates name it and leave it out (docs/security.md, "Every
failure has an owner").
``malform`` makes the learner a hostile peer on the wire from round R on (until a later ``malform``):
every outer-gradient part it sends and every averaged shard it returns is malformed as KIND says
(NaN values, a wrong size, a lying codec tag, a part too many, ...: :mod:`p2p_diloco.sim.malformed`).

Example, as a test would write it::

    >>> FaultPlan.parse("kill at round 3 during reduce").faults[0]
    Fault(action='kill', round=3, stage='reduce', seconds=0.0, mode='', factor=1.0, group=0)
    >>> FaultPlan.parse("poison at round 2 with scale 1e6").faults[0]
    Fault(action='poison', round=2, stage='delta', seconds=0.0, mode='scale', factor=1000000.0, group=0)
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from p2p_diloco.hooks import FaultHooks

if TYPE_CHECKING:  # the CLI checks a plan without loading torch
    import torch

STAGES = ("inner", "matchmaking", "send", "reduce", "receive", "commit", "checkpoint", "serve")
_LINE = re.compile(
    r"^\s*(?P<action>kill|hang|drop)(?:\s+for\s+(?P<seconds>\d+(?:\.\d+)?)\s*s)?\s+at\s+round\s+(?P<round>\d+)"
    r"\s+during\s+(?P<stage>[a-z]+)(?:\s+in\s+a\s+group\s+of\s+(?P<group>\d+))?\s*$"
)
_POISON = re.compile(
    r"^\s*poison\s+at\s+round\s+(?P<round>\d+)\s+with\s+(?P<mode>nan|flip|scale|climb|diverge)"
    r"(?:\s+(?P<factor>\S+))?\s*$"
)
LIE_MODES = ("ahead", "state", "weight", "shard", "sketch", "hash", "quorum")
_LIE = re.compile(r"^\s*lie\s+at\s+round\s+(?P<round>\d+)\s+with\s+(?P<mode>" + "|".join(LIE_MODES) + r")\s*$")
_MALFORM = re.compile(r"^\s*malform\s+at\s+round\s+(?P<round>\d+)\s+with\s+(?P<kind>\S+)\s*$")
MALFORM_KINDS = ("nan", "inf", "ninf", "huge", "size-empty", "size-neg", "size-2e62", "shape", "short", "long",
                 "float64", "no-dtype", "block-0", "block-neg", "other-codec", "block-huge", "extra-part",
                 "missing-part")  # what each does: p2p_diloco/sim/malformed.py
LIE_WEIGHT = 1e15  # the weight a learner lying "with weight" gathers for its outer gradient
LIE_VERSIONS = {"ahead": 1000, "state": 3}  # how far ahead each lie claims to be
LIE_SHARD_FACTOR = -50.0  # what a reducer lying "with shard" multiplies its averaged shard by
LIE_QUORUM = 1_000_000  # the majority quorum a learner lying "with quorum" gathers (the most that is well-formed)


class FaultPlanError(ValueError):
    """A fault line that does not follow the module's grammar; the CLI reports it as a configuration error."""


@dataclass(frozen=True)
class Fault:
    """One scripted failure: ``action`` at ``round`` during ``stage``; ``seconds``: how long a hang or drop lasts;
    ``mode`` and ``factor``: how a poison corrupts Δ (its stage is ``delta``)."""
    action: str
    round: int
    stage: str
    seconds: float = 0.0
    mode: str = ""
    factor: float = 1.0
    group: int = 0  # ``in a group of N``: only in a round whose group has at least N members


@dataclass
class FaultPlan(FaultHooks):
    """A learner's scripted faults, each carried out at most once: the :class:`~p2p_diloco.hooks.FaultHooks`
    a test or ``--faults`` passes to a learner.

    An empty plan is falsy and every hook on it leaves things as they are.
    """
    faults: list[Fault] = field(default_factory=list)
    _fired: set[int] = field(default_factory=set, repr=False)

    @classmethod
    def parse(cls, text: str | None) -> FaultPlan:
        """The plan in ``text`` (one fault a line or ``;``-separated; None or blank: no fault).

        Raises :class:`FaultPlanError` naming the first bad line (grammar, stage, hang or drop without duration).
        """
        faults = []
        for line in (text or "").replace(";", "\n").splitlines():
            if not line.strip():
                continue
            if line.strip().startswith("poison"):
                faults.append(_parse_poison(line))
                continue
            if line.strip().startswith("lie"):
                lie = _LIE.match(line)
                if not lie:
                    raise FaultPlanError(
                        f"fault {line.strip()!r}: expected 'lie at round R with {'|'.join(LIE_MODES)}'")
                faults.append(Fault("lie", int(lie["round"]), "record", mode=lie["mode"]))
                continue
            if line.strip().startswith("malform"):
                bad = _MALFORM.match(line)
                if not bad or bad["kind"] not in MALFORM_KINDS:
                    raise FaultPlanError(f"fault {line.strip()!r}: expected 'malform at round R with KIND', "
                                         f"KIND one of {', '.join(MALFORM_KINDS)}")
                faults.append(Fault("malform", int(bad["round"]), "wire", mode=bad["kind"]))
                continue
            m = _LINE.match(line)
            if not m:
                raise FaultPlanError(
                    f"fault {line.strip()!r}: expected 'kill|hang|drop [for S s] at round R during STAGE'"
                )
            stage = m["stage"]
            if stage not in STAGES:
                raise FaultPlanError(f"fault {line.strip()!r}: stage must be one of {', '.join(STAGES)}")
            if m["action"] in ("hang", "drop") and not m["seconds"]:
                raise FaultPlanError(f"fault {line.strip()!r}: {m['action']} needs a duration ('for 20 s')")
            if m["group"] and stage != "commit":
                raise FaultPlanError(f"fault {line.strip()!r}: 'in a group of N' is known only during commit")
            faults.append(Fault(m["action"], int(m["round"]), stage, float(m["seconds"] or 0),
                                group=int(m["group"] or 0)))
        return cls(faults)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def poison(self, deltas: Sequence[torch.Tensor], round_: int) -> list[torch.Tensor]:
        """``deltas`` as the plan's first poison due at ``round_`` (or any earlier round) corrupts them.

        Unchanged (the same tensors) when none is due; the first corruption by each poison is announced.
        """
        import torch
        for i, f in enumerate(self.faults):
            if f.action == "poison" and f.mode not in ("climb", "diverge") and f.round <= round_:
                if i not in self._fired:
                    self._fired.add(i)
                    print(f"fault injection: poison with {f.mode} from round {f.round}", file=sys.stderr, flush=True)
                if f.mode == "nan":
                    return [torch.full_like(d, float("nan")) for d in deltas]
                return [d * (-1.0 if f.mode == "flip" else f.factor) for d in deltas]
        return list(deltas)

    def climbing(self, round_: int) -> bool:
        """Whether a ``poison ... with climb [N]`` is due in the inner steps toward ``round_``."""
        for i, f in enumerate(self.faults):
            if f.action == "poison" and f.mode == "climb" and f.round <= round_ and (round_ - f.round) % f.factor == 0:
                if i not in self._fired:
                    self._fired.add(i)
                    print(f"fault injection: poison with climb from round {f.round}", file=sys.stderr, flush=True)
                return True
        return False

    def inner_gradients(self, params: Sequence[torch.Tensor], round_: int) -> None:
        for i, f in enumerate(self.faults):
            if f.action == "poison" and f.mode == "diverge" and f.round <= round_ and i not in self._fired:
                self._fired.add(i)
                print(f"fault injection: poison with diverge at round {f.round}", file=sys.stderr, flush=True)
                for p in params:
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
                return
        if self.climbing(round_):
            for p in params:
                if p.grad is not None:
                    p.grad.neg_()

    def lying(self, mode: str, round_: int) -> bool:
        """Whether a ``lie ... with mode`` is due at ``round_`` (it lasts from its round on)."""
        return any(f.action == "lie" and f.mode == mode and f.round <= round_ for f in self.faults)

    def malforming(self, round_: int) -> str:
        """The kind of malformation due at ``round_`` ("" for none): the latest ``malform`` whose round has come."""
        due = [f for f in self.faults if f.action == "malform" and f.round <= round_]
        return max(due, key=lambda f: f.round).mode if due else ""

    def outer_gradient(self, deltas: Sequence[torch.Tensor], round_: int) -> list[torch.Tensor]:
        return self.poison(deltas, round_)

    def gathered_weight(self, weight: float, round_: int) -> float:
        return LIE_WEIGHT if self.lying("weight", round_) else weight

    def claimed_versions(self, versions: tuple[int, ...]) -> tuple[int, ...]:
        if versions and self.lying("ahead", min(versions) + 1):
            return tuple(v + LIE_VERSIONS["ahead"] for v in versions)
        return versions

    def reduced_shard(self, averaged: torch.Tensor, round_: int) -> torch.Tensor:
        return averaged * LIE_SHARD_FACTOR if self.lying("shard", round_) else averaged

    def withholds_sketch(self, round_: int) -> bool:
        return self.lying("sketch", round_)

    def signed_sha(self, sha: str, round_: int) -> str:
        return hashlib.sha256(sha.encode()).hexdigest() if self.lying("hash", round_) else sha

    def gathered_quorum(self, quorum: int, round_: int) -> int:
        return LIE_QUORUM if self.lying("quorum", round_) else quorum

    def wire_messages(self, message: Any, index: int, round_: int) -> list[Any]:
        kind = self.malforming(round_)
        if not kind:
            return [message]
        from p2p_diloco.sim.malformed import malformed_messages
        return malformed_messages(kind, message, index)

    def served_states(self, states: Sequence[Any], version: int) -> Sequence[Any]:
        return forged_states(states) if self.lying("state", version + 1) else states

    def _next(self, stage: str, round_: int, group: int = 0) -> int | None:
        for i, f in enumerate(self.faults):
            if f.stage == stage and round_ >= f.round and group >= f.group and i not in self._fired:
                return i
        return None

    def due(self, stage: str, round_: int) -> bool:
        """Whether :meth:`fire` with these arguments would carry out a fault."""
        return self._next(stage, round_) is not None

    def fire(self, stage: str, round_: int, group: int = 0) -> None:
        """Carry out the first matching fault that has not fired yet (each fires once)."""
        i = self._next(stage, round_, group)
        if i is not None:
            self._fired.add(i)
            _execute(self.faults[i])


def forged_states(states: Sequence[Any]) -> list[Any]:
    """What a learner lying ``with state`` serves instead of ``states`` (GlobalStates): each fragment's Θ
    scaled by −50, LIE_VERSIONS["state"] versions ahead, its real history (the victims' states) plus
    the forgery, the hash recomputed; its certificates are the real ones, for other versions."""
    out = []
    for s in states:
        fake = s.copy()
        fake.params = [p * -50.0 for p in fake.params]
        fake.version += LIE_VERSIONS["state"]
        fake.remember()
        out.append(fake)
    return out


def _parse_poison(line: str) -> Fault:
    m = _POISON.match(line)
    if not m:
        raise FaultPlanError(
            f"fault {line.strip()!r}: expected 'poison at round R with nan|flip|scale X|climb [N]|diverge'")
    takes_factor = m["mode"] in ("scale", "climb")
    if (m["factor"] is not None and not takes_factor) or (m["mode"] == "scale" and m["factor"] is None):
        raise FaultPlanError(f"fault {line.strip()!r}: 'scale' takes a factor ('scale 1e6'), 'climb' may take a "
                             f"period ('climb 2'), the others none")
    try:
        factor = float(m["factor"]) if m["factor"] is not None else 1.0
    except ValueError:
        raise FaultPlanError(f"fault {line.strip()!r}: {m['factor']!r} is not a number") from None
    if m["mode"] == "climb" and (factor < 1 or factor != int(factor)):
        raise FaultPlanError(f"fault {line.strip()!r}: 'climb N' takes a whole number of rounds N >= 1")
    return Fault("poison", int(m["round"]), "delta", mode=m["mode"], factor=factor)


def _execute(fault: Fault) -> None:
    print(f"fault injection: {fault.action} at round {fault.round} during {fault.stage}", file=sys.stderr, flush=True)
    learner = int(os.environ.get("P2P_DILOCO_LEARNER_PID", os.getpid()))
    if fault.action == "kill":
        os.kill(learner, signal.SIGKILL)
        os._exit(137)  # in a child process whose parent we just killed
    if fault.action == "drop":
        daemons = [pid for pid in _descendants(learner) if _comm(pid) == "p2pd"]
        for pid in daemons:
            os.kill(pid, signal.SIGSTOP)
        waker = f"import os, signal, time; time.sleep({fault.seconds}); [os.kill(p, signal.SIGCONT) for p in {daemons}]"
        subprocess.Popen([sys.executable, "-c", waker], start_new_session=True)
        return
    group = os.getpgid(learner)
    # Someone outside the group has to wake us up again.
    waker = f"import os, signal, time; time.sleep({fault.seconds}); os.killpg({group}, signal.SIGCONT)"
    subprocess.Popen([sys.executable, "-c", waker], start_new_session=True)
    os.killpg(group, signal.SIGSTOP)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
