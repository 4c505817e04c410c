"""Three learners' audit logs, one of them killed and resumed, verify together; an edited line is named."""

import json
import signal
import subprocess
import sys

import pytest

from p2p_diloco.learner.audit import FILENAME

TARGET = 6  # long enough for the killed learner to come back before the others finish


def _verify(*dirs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2p_diloco", "audit", "verify", *map(str, dirs)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(300)
def test_audit_logs_of_a_swarm_with_a_kill_and_a_resume_verify(swarm):
    swarm.start_bootstrap()
    learners = [swarm.start_learner(i, max_outer_steps=TARGET) for i in range(2)]
    victim = swarm.start_learner(2, max_outer_steps=TARGET, extra=["--fault", "kill at round 2 during inner"])
    assert victim.wait(200) == -signal.SIGKILL, victim.text()
    back = swarm.start_learner(2, max_outer_steps=TARGET, extra=["--resume"])
    for p in [*learners, back]:
        assert p.wait(240) == 0, p.text()
    dirs = [swarm.tmp / f"ckpt-{i}" for i in range(3)]

    ok = _verify(*dirs)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "3 audit log(s) consistent" in ok.stdout, ok.stdout
    victim_log = [json.loads(line) for line in (dirs[2] / FILENAME).read_text().splitlines()]
    events = [e["event"] for e in victim_log]
    assert events[0] == "started" and "committed" in events and events[-1] == "head", events
    resumed = [e for e in victim_log if e["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["clean"] is False and resumed[0]["checkpoint"] is True
    for d in dirs[:2]:
        log = [json.loads(line) for line in (d / FILENAME).read_text().splitlines()]
        assert sum(e["event"] == "committed" for e in log) >= 1 and log[-1]["event"] == "head"

    path = dirs[0] / FILENAME
    lines = path.read_bytes().splitlines()
    edited = next(i for i, line in enumerate(lines) if b'"event":"committed"' in line)
    lines[edited] = lines[edited].replace(b'"group_size":', b'"group_size":1', 1)
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    bad = _verify(*dirs)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"ckpt-0/{FILENAME}:{edited + 1}: changed after it was written" in bad.stdout, bad.stdout
