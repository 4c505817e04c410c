"""Scripted faults as values: one readable line per failure, usable from tests and the CLI.

Grammar (one fault per line; several joined with ``;`` on the command line)::

    kill at round R during STAGE
    hang for S s at round R during STAGE

A *round R* is the round that produces global version R of a fragment (the R-th outer step).
STAGE names where in the learner's life the fault fires:

=============  ===========================================================================
inner          during the inner steps that lead up to round R
matchmaking    after the learner declared itself in the DHT for round R, before all-reduce
send           while sending its own outer-gradient parts to the reducers
reduce         while reducing a shard for its groupmates (after the first reply went out)
receive        while receiving averaged shards back (after the first one arrived)
checkpoint     in the middle of writing the checkpoint after round R (temporary file written)
serve          while serving its global state to a learner that downloads it (any round >= R)
=============  ===========================================================================

``kill`` is SIGKILL of the learner process (its DHT, averager and p2pd die with it).
``hang`` stops the learner's whole process group with SIGSTOP for S seconds, then resumes it
(a helper process sends SIGCONT), like a machine that freezes and comes back.

Example, as a test would write it::

    >>> FaultPlan.parse("kill at round 3 during reduce").faults[0]
    Fault(action='kill', round=3, stage='reduce', seconds=0.0)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field

STAGES = ("inner", "matchmaking", "send", "reduce", "receive", "checkpoint", "serve")
_LINE = re.compile(
    r"^\s*(?P<action>kill|hang)(?:\s+for\s+(?P<seconds>\d+(?:\.\d+)?)\s*s)?\s+at\s+round\s+(?P<round>\d+)"
    r"\s+during\s+(?P<stage>[a-z]+)\s*$"
)


class FaultPlanError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    action: str
    round: int
    stage: str
    seconds: float = 0.0


@dataclass
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)
    _fired: set[int] = field(default_factory=set, repr=False)

    @classmethod
    def parse(cls, text: str | None) -> FaultPlan:
        faults = []
        for line in (text or "").replace(";", "\n").splitlines():
            if not line.strip():
                continue
            m = _LINE.match(line)
            if not m:
                raise FaultPlanError(f"fault {line.strip()!r}: expected 'kill|hang [for S s] at round R during STAGE'")
            stage = m["stage"]
            if stage not in STAGES:
                raise FaultPlanError(f"fault {line.strip()!r}: stage must be one of {', '.join(STAGES)}")
            if m["action"] == "hang" and not m["seconds"]:
                raise FaultPlanError(f"fault {line.strip()!r}: hang needs a duration ('hang for 20 s ...')")
            faults.append(Fault(m["action"], int(m["round"]), stage, float(m["seconds"] or 0)))
        return cls(faults)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def fire(self, stage: str, round_: int) -> None:
        """Carry out the first matching fault that has not fired yet (each fires once)."""
        for i, f in enumerate(self.faults):
            matches = f.round == round_ or (stage == "serve" and round_ >= f.round)
            if f.stage == stage and matches and i not in self._fired:
                self._fired.add(i)
                _execute(f)
                return


def _execute(fault: Fault) -> None:
    print(f"fault injection: {fault.action} at round {fault.round} during {fault.stage}", file=sys.stderr, flush=True)
    learner = int(os.environ.get("P2P_DILOCO_LEARNER_PID", os.getpid()))
    if fault.action == "kill":
        os.kill(learner, signal.SIGKILL)
        os._exit(137)  # in a child process whose parent we just killed
    group = os.getpgid(learner)
    # Someone outside the group has to wake us up again.
    waker = f"import os, signal, time; time.sleep({fault.seconds}); os.killpg({group}, signal.SIGCONT)"
    subprocess.Popen([sys.executable, "-c", waker], start_new_session=True)
    os.killpg(group, signal.SIGSTOP)
