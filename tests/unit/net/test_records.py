import msgpack
import pytest

from p2p_diloco.net.progress_records import ProgressRecord, RecordError


def test_roundtrip():
    r = ProgressRecord(version=3, sha256="a" * 64, tokens=99, status="done", wall_time=1.5)
    assert ProgressRecord.decode(r.encode()) == r


@pytest.mark.parametrize("raw", [
    b"\xc1",  # invalid msgpack
    msgpack.packb([1, 2]),
    msgpack.packb({"version": -1, "sha256": "a" * 64, "tokens": 0}),
    msgpack.packb({"version": 1, "sha256": "xyz", "tokens": 0}),
    msgpack.packb({"version": 1, "sha256": "a" * 64, "tokens": "many"}),
    msgpack.packb({"version": 1, "sha256": "a" * 64, "tokens": 1, "status": "evil"}),
    b"x" * 5000,
    "not bytes",
])
def test_malformed_records_are_rejected(raw):
    with pytest.raises(RecordError):
        ProgressRecord.decode(raw)


def test_a_malformed_record_is_logged_once_per_peer_and_reason_not_at_every_read(caplog, monkeypatch):
    import logging
    from types import SimpleNamespace

    from hivemind.dht.crypto import RSASignatureValidator

    from p2p_diloco.net import progress_records
    from p2p_diloco.net.progress_records import ProgressBoard
    from p2p_diloco.trust.signed_records import owner_marker, peer_id_of_owner

    marker = owner_marker(RSASignatureValidator())
    stored = {marker: SimpleNamespace(value=b"\xc1")}
    dht = SimpleNamespace(get=lambda key, latest: SimpleNamespace(value=stored))
    board = ProgressBoard(dht, "lin", 60.0, b"")  # type: ignore[arg-type]
    clock = [1000.0]
    monkeypatch.setattr(progress_records.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.net.progress_records"):
        for _ in range(50):  # a round's matchmaking reads every second
            assert board.read() == {}
        stored[marker] = SimpleNamespace(value=msgpack.packb([1, 2]))  # another reason: logged again
        board.read()
        clock[0] += progress_records.REJECTION_LOG_SECONDS  # and again after a while
        board.read()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(line.startswith(f"rejected progress record from {peer_id_of_owner(marker)}")
                                   for line in lines)


def test_in_a_private_swarm_records_under_keys_off_the_allow_list_do_not_count(caplog):
    # A member may store records signed by fresh keys (valid DHT values): they would raise the majority quorum
    # until nothing commits. Only the keys on the list count.
    import logging
    from types import SimpleNamespace

    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.crypto import RSAPrivateKey

    from p2p_diloco.net.progress_records import ProgressBoard
    from p2p_diloco.trust.admission import Admission
    from p2p_diloco.trust.signed_records import owner_marker, peer_id_of_owner

    member, fresh = (owner_marker(RSASignatureValidator(RSAPrivateKey())) for _ in range(2))
    record = ProgressRecord(version=3, sha256="a" * 64, tokens=99, status="training")
    stored = {m: SimpleNamespace(value=record.encode()) for m in (member, fresh)}
    dht = SimpleNamespace(get=lambda key, latest: SimpleNamespace(value=stored))
    admission = Admission(frozenset({str(peer_id_of_owner(member))}))
    board = ProgressBoard(dht, "lin", 60.0, b"", members=admission.lists)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.net.progress_records"):
        assert list(board.read()) == [str(peer_id_of_owner(member))]
    assert "its key is not on the allow-list" in caplog.text
    public = ProgressBoard(dht, "lin", 60.0, b"", members=Admission(None).lists)  # type: ignore[arg-type]
    assert len(public.read()) == 2
