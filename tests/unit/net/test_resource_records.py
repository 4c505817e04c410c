"""The resource fields of progress records (hardware, throughput, contribution) and the lineage index."""

from types import SimpleNamespace

import msgpack
import pytest

from p2p_diloco.net.progress_records import ProgressRecord, RecordError, decode_lineage

BASE = {"version": 2, "sha256": "a" * 64, "tokens": 10, "versions": [2], "shas": ["a" * 64]}


def test_resource_fields_roundtrip():
    r = ProgressRecord(2, "a" * 64, 10, versions=(2,), shas=("a" * 64,), device_kind="cuda",
                       device_name="cuda:0 (NVIDIA H200)", workers=8, cpu_cores=16, tokens_per_second=1234.5,
                       tokens_contributed=777, bytes_sent=10**9, bytes_received=3 * 10**9, uptime=3600.0, eval_loss=2.5,
                       reach="client", address="/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWexample",
                       excluded=(("Ab3dEf9Z", 12), ("x1", 1)), heals=2, loss_rises=1)
    assert ProgressRecord.decode(r.encode()) == r


def test_a_record_of_an_older_version_takes_the_defaults():
    r = ProgressRecord.decode(msgpack.packb(BASE))
    assert (r.device_kind, r.workers, r.tokens_per_second, r.tokens_contributed, r.eval_loss) == ("", 0, 0.0, 0, None)
    assert (r.bytes_received, r.address, r.excluded, r.heals) == (0, "", (), 0)


@pytest.mark.parametrize("field", [
    {"device_name": "x" * 129},
    {"device_kind": 3},
    {"reach": "everywhere"},
    {"reach": 1},
    {"device_name": "evil\x1b[2J"},  # terminal escapes are refused: status prints these names
    {"workers": -1},
    {"workers": True},
    {"cpu_cores": 2**63},
    {"cpu_cores": 1.5},
    {"tokens_contributed": "lots"},
    {"bytes_sent": -5},
    {"bytes_received": -1},
    {"bytes_received": 2**62},
    {"bytes_received": 1.5},
    {"bytes_received": False},
    {"address": "/ip4/1.2.3.4/tcp/1/" + "x" * 200},
    {"address": "/ip4/1.2.3.4\n/tcp/1"},
    {"address": "\x1b]8;;http://evil\x07"},
    {"address": b"/ip4/1.2.3.4"},
    {"tokens_per_second": float("nan")},
    {"tokens_per_second": float("inf")},
    {"uptime": -1.0},
    {"uptime": "long"},
    {"eval_loss": float("nan")},
    {"eval_loss": -0.5},
    {"eval_loss": "low"},
    {"excluded": [["peer", 1]] * 9},  # more than MAX_EXCLUDED
    {"excluded": [["x" * 9, 1]]},
    {"excluded": [["", 1]]},
    {"excluded": [["evil\x1b[2J", 1]]},
    {"excluded": [["peer", 0]]},
    {"excluded": [["peer", True]]},
    {"excluded": [["peer", 1, 2]]},
    {"excluded": "peer"},
    {"heals": -1},
    {"heals": 0.5},
    {"loss_rises": -1},
])
def test_hostile_resource_fields_are_refused(field):
    with pytest.raises(RecordError):
        ProgressRecord.decode(msgpack.packb({**BASE, **field}))


@pytest.mark.parametrize(("raw", "expected"), [
    (b"run-1a2b3c4d", "run-1a2b3c4d"),
    (b"", None),
    (b"a" * 129, None),
    (b"run/../x", None),
    ("run-abc", None),  # not bytes
    (b"\xff\xfe", None),
])
def test_lineage_index_values_are_checked(raw, expected):
    assert decode_lineage(raw) == expected


def test_an_address_of_200_characters_is_kept():
    address = "/dns4/" + "a" * 194
    assert ProgressRecord.decode(msgpack.packb({**BASE, "address": address})).address == address


def test_first_address_skips_what_a_record_cannot_carry():
    from p2p_diloco.learner.metrics import first_address

    long, ok = "/ip4/10.0.0.1/tcp/1/" + "x" * 200, "/ip4/10.0.0.2/tcp/31337/p2p/12D3KooWexample"
    assert first_address(SimpleNamespace(get_visible_maddrs=lambda: [long, ok])) == ok
    assert first_address(SimpleNamespace(get_visible_maddrs=lambda: [long])) == ""

    def none_visible():
        raise ValueError("No multiaddrs found for peer 12D3KooW...")  # what hivemind raises

    assert first_address(SimpleNamespace(get_visible_maddrs=none_visible)) == ""


def test_the_lineage_index_is_stored_once_per_ttl_for_twice_as_long(monkeypatch):
    from types import SimpleNamespace

    from p2p_diloco.net import progress_records
    from p2p_diloco.net.progress_records import LineageIndex

    stores = []
    dht = SimpleNamespace(store=lambda key, value, expiration, subkey: stores.append((value, expiration)) or True)
    clock = [100.0]
    monkeypatch.setattr(progress_records.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(progress_records, "get_dht_time", lambda: 1000.0)
    index = LineageIndex(dht, "run", ttl=15.0, owner=b"[owner:me]")
    for _ in range(7):  # a heartbeat every ttl / 3, for 2 ttl + a bit
        assert index.publish("run-abcd1234")
        clock[0] += 5.0
    assert [e for _, e in stores] == [1030.0] * 3  # at 0, 15 and 30 s: each living 30 s, never a gap
    assert index.publish("run-other") and len(stores) == 4  # another lineage at once
