"""The DHT process's RPC counts (p2p_diloco/net/traffic.py) and their Prometheus counters."""

import asyncio

import pytest
from hivemind.proto import dht_pb2

from p2p_diloco.core.shard_sketches import sketch_key
from p2p_diloco.learner.metrics import Metrics
from p2p_diloco.net.averaging import download_priority_key, group_key
from p2p_diloco.net.progress_records import lineages_key, progress_key
from p2p_diloco.net.traffic import KeyKinds, TrafficCounts, counting_p2p, key_kind, rpc_of, totals
from p2p_diloco.trust.commit_board import commit_key


class _Base:
    """Stands in for hivemind's P2P: a handler table and a canned reply."""

    def __init__(self):
        self.handlers = {}
        self.fail = False

    async def add_protobuf_handler(self, name, handler, input_protobuf_type, *, stream_input=False,
                                   stream_output=False, balanced=False):
        self.handlers[name] = handler

    async def call_protobuf_handler(self, peer_id, name, input, output_protobuf_type):
        if self.fail:
            raise TimeoutError("no reply")
        return dht_pb2.PingResponse(dht_time=1.0, available=True)


def test_rpc_names_drop_the_namespace_and_totals_add_up_the_dhts_own():
    assert rpc_of("DHTProtocol.rpc_find") == "DHTProtocol.rpc_find"
    assert rpc_of("lineage_outer::DHTProtocol.rpc_store") == "DHTProtocol.rpc_store"
    snapshot = {"DHTProtocol.rpc_find": {"calls_made": 2, "bytes_out": 10},
                "DHTProtocol.rpc_store": {"calls_made": 1, "calls_served": 4, "bytes_in": 7},
                "p2p_diloco.reach.check": {"calls_made": 5}}
    assert totals(snapshot) == {"calls_made": 3, "calls_failed": 0, "calls_served": 4, "bytes_out": 10, "bytes_in": 7}
    assert totals(snapshot, "p2p_diloco.reach")["calls_made"] == 5


def test_calls_made_failed_and_served_are_counted_with_their_bytes():
    p2p = counting_p2p(_Base)()
    request = dht_pb2.PingRequest(validate=True)
    reply = dht_pb2.PingResponse(dht_time=1.0, available=True)

    async def go():
        async def handler(req, ctx):
            return reply

        await p2p.add_protobuf_handler("DHTProtocol.rpc_ping", handler, dht_pb2.PingRequest)
        await p2p.handlers["DHTProtocol.rpc_ping"](request, None)  # a peer calls us
        await p2p.call_protobuf_handler(None, "DHTProtocol.rpc_ping", request, dht_pb2.PingResponse)
        p2p.fail = True
        with pytest.raises(TimeoutError):
            await p2p.call_protobuf_handler(None, "DHTProtocol.rpc_ping", request, dht_pb2.PingResponse)

    asyncio.run(go())
    t = p2p.traffic.snapshot()["DHTProtocol.rpc_ping"]
    assert t == {"calls_made": 2, "calls_failed": 1, "calls_served": 1,
                 "bytes_out": reply.ByteSize() + 2 * request.ByteSize(),
                 "bytes_in": request.ByteSize() + reply.ByteSize()}


def test_metrics_follow_the_counts_and_start_again_after_a_dht_restart():
    m = Metrics()
    get = m.registry.get_sample_value
    m.dht_traffic({"DHTProtocol.rpc_find": {"calls_made": 3, "calls_failed": 0, "calls_served": 5,
                                            "bytes_out": 100, "bytes_in": 700}})
    m.dht_traffic({"DHTProtocol.rpc_find": {"calls_made": 4, "calls_failed": 1, "calls_served": 5,
                                            "bytes_out": 150, "bytes_in": 700}})
    assert get("p2p_diloco_dht_calls_total", {"rpc": "DHTProtocol.rpc_find", "kind": "made"}) == 4
    assert get("p2p_diloco_dht_calls_total", {"rpc": "DHTProtocol.rpc_find", "kind": "failed"}) == 1
    assert get("p2p_diloco_dht_bytes_total", {"rpc": "DHTProtocol.rpc_find", "direction": "out"}) == 150
    # A client's DHT starts again: its counts begin at zero, and the counters keep growing.
    m.dht_traffic({"DHTProtocol.rpc_find": {"calls_made": 2, "calls_failed": 0, "calls_served": 0,
                                            "bytes_out": 40, "bytes_in": 60}})
    assert get("p2p_diloco_dht_calls_total", {"rpc": "DHTProtocol.rpc_find", "kind": "made"}) == 6
    assert get("p2p_diloco_dht_bytes_total", {"rpc": "DHTProtocol.rpc_find", "direction": "in"}) == 760


def test_keys_are_told_apart_by_the_end_of_their_names():
    assert key_kind(progress_key("run_abc")) == "progress"
    assert key_kind(lineages_key("run")) == "lineages"
    assert key_kind(download_priority_key("run_abc")) == "download"
    assert key_kind(group_key("run_abc_outer", 1, 7)) == "group"
    assert key_kind(commit_key("run_abc", 0, 12)) == "commit"
    assert key_kind(sketch_key("run_abc_outer", "f" * 64)) == "sketch"
    assert key_kind("something_else") == key_kind(b"\xff") == key_kind(42) == "other"


def test_a_find_and_a_store_are_split_among_the_kinds_of_their_keys():
    kinds = KeyKinds(size=2)
    kinds.remember(b"P", "run_progress")
    kinds.remember(b"G", "run_outer.0b0101")
    kinds.is_node = lambda key_id: key_id == b"N"
    counts = TrafficCounts(kinds)
    find = dht_pb2.FindRequest(keys=[b"P", b"G", b"N"])
    found = dht_pb2.FindResponse(results=[dht_pb2.FindResult(value=b"v" * 900), dht_pb2.FindResult(value=b"w" * 90),
                                          dht_pb2.FindResult()])
    counts.count_keys("ns::DHTProtocol.rpc_find", find, found, made=True)
    by = counts.key_snapshot()
    assert set(by) == {"progress", "group", "routing"} and by["progress"]["finds"] == 1
    assert by["progress"]["bytes_in"] > 900 > by["group"]["bytes_in"] > 90
    assert sum(t["bytes_in"] for t in by.values()) == pytest.approx(found.ByteSize(), abs=3)
    assert sum(t["bytes_out"] for t in by.values()) == pytest.approx(find.ByteSize(), abs=3)
    store = dht_pb2.StoreRequest(keys=[b"P", b"?"], subkeys=[b"s", b"t"], values=[b"x" * 500, b"y"],
                                 expiration_time=[1.0, 2.0])
    counts.count_keys("DHTProtocol.rpc_store", store, dht_pb2.StoreResponse(store_ok=[True, True]), made=False)
    by = counts.key_snapshot()
    assert by["progress"]["stores"] == 1 and by["other"]["stores"] == 1
    assert by["progress"]["bytes_in"] > 900 + 500 and by["other"]["bytes_in"] < 100  # served: its request came in
    counts.count_keys("DHTProtocol.rpc_ping", dht_pb2.PingRequest(), dht_pb2.PingResponse(), made=True)
    kinds.remember(b"X", "a_commit_0_1")  # the oldest (P) is forgotten past the size
    assert kinds.of(b"P") == "other" and kinds.of(b"X") == "commit"
