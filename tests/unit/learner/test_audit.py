"""The audit log (learner/audit.py) and its verifier (ops/audit_verify.py): the chain, signed heads,
tampering (an edited, removed or swapped line is named), resuming a chain, a torn last line, cross-checks."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from p2p_diloco.cli import main as cli_main
from p2p_diloco.errors import LearnerError
from p2p_diloco.learner.audit import FILENAME, Audit
from p2p_diloco.learner.round import RoundOutcome, Stage
from p2p_diloco.learner.state import Counters
from p2p_diloco.ops.audit_verify import Inconsistent, read_chain, verify
from p2p_diloco.trust.signed_records import IdentityKey, peer_id_of_public_key

SHA0, SHA1, SHA2 = "0" * 64, "1" * 64, "2" * 64


def _key() -> tuple[IdentityKey, str]:
    key = IdentityKey(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    return key, str(peer_id_of_public_key(key.get_public_key()))


@pytest.fixture(scope="module")
def keys() -> list[tuple[IdentityKey, str]]:
    return [_key() for _ in range(3)]


def _log(directory: Path, key, peer, events: int = 7, sign_every: int = 3) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    audit = Audit.open(directory, key, peer, sign_every, lineage="run-x")
    for i in range(events):
        audit.record("note", i=i)
    audit.close()
    return directory / FILENAME


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


def _write(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def test_a_chain_with_signed_heads_verifies(tmp_path, keys):
    key, peer = keys[0]
    path = _log(tmp_path / "a", key, peer, events=7, sign_every=3)
    entries = [json.loads(line) for line in _lines(path)]
    assert [e["seq"] for e in entries] == list(range(len(entries)))
    assert entries[0]["event"] == "started" and entries[0]["peer_id"] == peer
    heads = [e for e in entries if e["event"] == "head"]
    assert len(heads) == 3 and heads[-1]["exit"] is True and entries[-1] is heads[-1]  # every 3 lines, and at exit
    chain = read_chain(path)
    assert chain.peer_id == peer and chain.heads == 3 and chain.signed_through == len(entries)


def _edited(tmp_path: Path, keys, n: int, edit) -> Path:
    """A signed log whose line ``n`` (0-based) went through ``edit`` (bytes → bytes)."""
    key, peer = keys[0]
    path = _log(tmp_path / "a", key, peer)
    lines = _lines(path)
    lines[n] = edit(lines[n])
    _write(path, lines)
    return path


@pytest.mark.parametrize("line", [2, 5, 8])
def test_an_edited_line_is_named(tmp_path, keys, line):
    path = _edited(tmp_path, keys, line - 1, lambda raw: raw.replace(b'"time":', b'"time":1'))
    with pytest.raises(Inconsistent, match=rf"{FILENAME}:{line}: changed after it was written"):
        read_chain(path)


def test_an_edited_prev_is_named(tmp_path, keys):
    def new_prev(raw: bytes) -> bytes:
        return json.dumps({**json.loads(raw), "prev": "f" * 64}, separators=(",", ":")).encode()

    path = _edited(tmp_path, keys, 3, new_prev)
    with pytest.raises(Inconsistent, match=rf"{FILENAME}:4: changed"):
        read_chain(path)


def test_a_removed_or_swapped_line_is_named(tmp_path, keys):
    key, peer = keys[0]
    path = _log(tmp_path / "a", key, peer)
    lines = _lines(path)
    _write(path, lines[:3] + lines[4:])
    with pytest.raises(Inconsistent, match=rf"{FILENAME}:4: seq 4 where 3 was expected"):
        read_chain(path)
    _write(path, lines[:3] + [lines[4], lines[3]] + lines[5:])
    with pytest.raises(Inconsistent, match=rf"{FILENAME}:4: seq 4 where 3"):
        read_chain(path)
    _write(path, [b"not json", *lines[1:]])
    with pytest.raises(Inconsistent, match=rf"{FILENAME}:1: not a JSON object"):
        read_chain(path)


def test_a_head_signed_with_another_key_is_refused(tmp_path, keys):
    (key, peer), (other, _) = keys[0], keys[1]
    path = _log(tmp_path / "a", key, peer)
    forged = Audit(path, other, peer, sign_every=3)  # claims to be `peer`: the same chain, another key
    lines = _lines(path)
    _write(path, lines[:3])
    forged._file, forged._seq = path.open("ab"), 3
    from p2p_diloco.learner.audit import line_hash

    forged._prev = line_hash(lines[2])
    forged.record("note", i=99)
    forged.close()
    with pytest.raises(Inconsistent, match=r"is signed by .*, not by"):
        read_chain(path)


def test_a_resumed_learner_continues_its_chain(tmp_path, keys):
    key, peer = keys[0]
    path = _log(tmp_path / "a", key, peer, events=2)
    audit = Audit.open(tmp_path / "a", key, peer, sign_every=3, checkpoint=True)
    audit.record("note", i=2)
    assert audit._file is not None
    audit._file.close()  # killed: no head at exit
    audit = Audit.open(tmp_path / "a", key, peer, sign_every=3, checkpoint=True)
    audit.close()
    resumed = [json.loads(line) for line in _lines(path) if b'"resumed"' in line]
    assert [r["clean"] for r in resumed] == [True, False]
    chain = read_chain(path)
    assert chain.segments == 3 and chain.signed_through == chain.lines


def test_another_identity_may_not_continue_a_log(tmp_path, keys):
    (key, peer), (other, other_peer) = keys[0], keys[1]
    _log(tmp_path / "a", key, peer)
    with pytest.raises(LearnerError, match="move it away"):
        Audit.open(tmp_path / "a", other, other_peer)


def test_a_torn_last_line_is_kept_and_named(tmp_path, keys):
    key, peer = keys[0]
    path = _log(tmp_path / "a", key, peer)
    with path.open("ab") as f:
        f.write(b'{"seq":11,"time":1.0,"ev')  # killed in the middle of a line
    chain = read_chain(path)  # a torn tail is what a kill leaves: not an inconsistency
    assert chain.torn == [12]
    audit = Audit.open(tmp_path / "a", key, peer)
    audit.close()
    lines = _lines(path)
    assert lines[11] == b'{"seq":11,"time":1.0,"ev'  # kept in place
    torn = json.loads(lines[12])
    assert torn["event"] == "torn" and torn["line"] == 12 and torn["seq"] == 12
    assert json.loads(lines[13])["event"] == "resumed"
    chain = read_chain(path)
    assert chain.torn == [12] and chain.signed_through == len(lines)
    lines[11] = b'{"seq":11,"time":1.0,"eX'  # the torn line is in the chain too
    _write(path, lines)
    with pytest.raises(Inconsistent, match=rf"{FILENAME}:12: changed"):
        read_chain(path)


def _committed(version: int, sha: str, members: dict[str, int]) -> RoundOutcome:
    weights = {p: {"tokens": t, "weight": float(t)} for p, t in members.items()}
    return RoundOutcome(Stage.APPLIED, group_size=len(members), group_tokens=sum(members.values()), version=version,
                        parent=SHA0, sha256=sha, members=weights)


def _swarm_logs(tmp_path, keys, b_sha: str = SHA1) -> list[Path]:
    (ka, a), (kb, b), (kc, c) = keys
    dirs = [tmp_path / n for n in "abc"]
    for d in dirs:
        d.mkdir()
    la, lb, lc = (Audit.open(d, k, p, 20) for d, (k, p) in zip(dirs, keys, strict=True))
    la.round(0, _committed(1, SHA1, {a: 300, b: 100}), "fp32", 300)
    lb.round(0, _committed(1, b_sha, {a: 300, b: 100}), "fp32", 100)
    la.round(0, RoundOutcome(Stage.FAILED, reason=f"groupmate {b} holds version 0 sha 0123456789ab", version=1,
                             excluded={c: "norm 1e9 is far above the group's"}), "fp32", 50)
    lc.record("downloaded", peer=a, fragments={"0": [1, SHA1]}, certificate="verified")
    lc.record("adopted", fragment=0, version_before=0, sha_before=SHA0, version=1, sha=SHA1, version_after=1,
              sha_after=SHA1, certificate="verified")
    lc.record("adopted", fragment=0, version_before=1, sha_before=SHA1, version=2, sha=SHA2, version_after=2,
              sha_after=SHA2, certificate="not checked")
    lc.record("healed", step=17, loss="nan", versions=[2])
    for log in (la, lb, lc):
        log.close()
    return dirs


def test_learners_are_cross_checked_and_summarised(tmp_path, keys, capsys):
    dirs = _swarm_logs(tmp_path, keys)
    report = verify(dirs)
    assert len(report.rounds) == 1 and report.commit_records == 2 and report.traced == 1
    assert sum(report.failures.values()) == 1 and len(report.unverifiable) == 1
    text = "\n".join(report.lines())
    assert "75.0%" in text and "25.0%" in text, text  # contribution shares by group tokens
    assert "contributions excluded from rounds: 1" in text and "groupmate … holds version N sha …" in text, text
    assert f"took the global state back: {keys[2][1][-8:]} × 1" in text, text
    assert cli_main(["audit", "verify", *map(str, dirs)]) == 0
    assert "3 audit log(s) consistent" in capsys.readouterr().out
    assert cli_main(["audit", "verify", "--strict", *map(str, dirs)]) == 1
    assert f"c/{FILENAME}:4: fragment 0 version 2" in capsys.readouterr().out


def test_members_of_one_round_that_disagree_are_named(tmp_path, keys, capsys):
    dirs = _swarm_logs(tmp_path, keys, b_sha=SHA2)
    with pytest.raises(Inconsistent, match=rf"b/{FILENAME}:2: fragment 0 version 1 committed as 222222222222"):
        verify(dirs)
    assert cli_main(["audit", "verify", *map(str, dirs)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("inconsistent: ")


def test_verify_without_a_log_is_a_user_error(tmp_path, capsys):
    assert cli_main(["audit", "verify", str(tmp_path)]) == 2
    assert "no audit log" in capsys.readouterr().err


def test_joins_and_leaves_seen_are_logged_and_summarised(tmp_path, keys):
    (ka, pa), (kb, pb), (_, pc) = keys
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = Audit.open(tmp_path / "a", ka, pa, 20)
    a.peer_seen(pb, "joined", version=0, reach="direct", already_there=True)
    a.peer_seen(pc, "joined", version=1, reach="client", already_there=False)
    a.peer_seen(pc, "gone", unseen_seconds=20.5)
    a.peer_seen(pc, "joined", version=3, reach="client", already_there=False)
    a.peer_seen(pb, "left", version=4)
    with pytest.raises(ValueError):
        a.peer_seen(pb, "vanished")
    a.close()
    b = Audit.open(tmp_path / "b", kb, pb, 20)
    b.peer_seen(pa, "joined", version=0, reach="direct", already_there=False)
    b.close()
    events = [json.loads(line) for line in _lines(tmp_path / "a" / FILENAME)]
    assert [(e["event"], e["peer"]) for e in events if e["event"].startswith("peer_")] == [
        ("peer_joined", pb), ("peer_joined", pc), ("peer_gone", pc), ("peer_joined", pc), ("peer_left", pb)]
    report = verify([tmp_path / "a", tmp_path / "b"])
    assert sum(report.peers_seen["joined"].values()) == 4 and len(report.peers_seen["joined"]) == 3
    assert report.peers_seen["left"] == {pb[-8:]: 1} and report.peers_seen["gone"] == {pc[-8:]: 1}
    assert "seen by the learners: 4 joined (3 peers), 1 left (1 peer), 1 gone (1 peer)" in report.lines()


def test_an_observer_sees_every_event_and_cannot_break_the_log(tmp_path, keys):
    key, peer = keys[0]
    seen: list[str] = []

    def observer(event, fields):
        seen.append(event)
        raise RuntimeError("a bug in the observer")

    audit = Audit.open(tmp_path, key, peer, 20, on_record=observer)
    audit.record("download_rejected", peer="p", reason="bad sha")
    audit.record("distrusted", peer="p")
    audit.close()
    assert seen == ["started", "download_rejected", "distrusted"]  # (heads are the log's own, not events)
    events = [json.loads(line)["event"] for line in _lines(tmp_path / FILENAME)]
    assert events[1:3] == ["download_rejected", "distrusted"]
    read_chain(tmp_path / FILENAME)


def test_an_outer_step_logs_the_traffic_both_ways(tmp_path, keys):
    key, peer = keys[0]
    audit = Audit.open(tmp_path, key, peer, 20)
    c = Counters(tokens=640, bytes_sent=1000, bytes_received=2500)
    audit.outer_step(SimpleNamespace(version=3, counters=c), train_loss=3.1, eval_loss=None, train_seconds=9.0)
    audit.close()
    step = [json.loads(line) for line in _lines(tmp_path / FILENAME)][1]
    assert (step["event"], step["bytes_sent"], step["bytes_received"], step["version"]) == ("outer_step", 1000, 2500, 3)
