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
