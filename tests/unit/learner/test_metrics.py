"""The learner's Prometheus metrics, read back from its private registry."""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from p2p_diloco.learner.metrics import Metrics, resources
from p2p_diloco.learner.round import RoundOutcome, Stage
from p2p_diloco.learner.state import Counters
from p2p_diloco.net.averager_process import OuterGradientAverager
from p2p_diloco.net.averaging import HivemindAveraging
from p2p_diloco.net.progress_records import ProgressRecord


def _state(counters, versions):
    return SimpleNamespace(counters=counters, states=[SimpleNamespace(version=v) for v in versions])


def test_counters_follow_the_learner_counters():
    m, c = Metrics(), Counters(inner_steps=10, tokens=640, bytes_sent=1000, bytes_received=4000, compute_seconds=1.5)
    c.resize(2)
    m.update(_state(c, [1, 2]), train_loss=3.0, lr=1e-3)
    c.inner_steps, c.tokens, c.syncs = 30, 1920, 1
    c.count_received(500)
    m.update(_state(c, [2, 2]), eval_loss=2.5)
    m.update(_state(c, [2, 2]))  # nothing new: counters unchanged
    get = m.registry.get_sample_value
    assert get("p2p_diloco_inner_steps_total") == 30
    assert get("p2p_diloco_tokens_total") == 1920
    assert get("p2p_diloco_bytes_sent_total") == 1000
    assert get("p2p_diloco_bytes_received_total") == 4500
    assert get("p2p_diloco_syncs_total") == 1
    assert get("p2p_diloco_compute_seconds_total") == 1.5
    assert get("p2p_diloco_version", {"fragment": "0"}) == 2
    assert get("p2p_diloco_train_loss") == 3.0 and get("p2p_diloco_eval_loss") == 2.5
    assert get("p2p_diloco_inner_lr") == 1e-3
    assert m.last_eval_loss == 2.5


def test_rounds_by_fragment_and_outcome():
    m = Metrics()
    m.round(0, RoundOutcome(Stage.APPLIED, group_size=3, allreduce_seconds=0.4, round_seconds=2.0))
    m.round(0, RoundOutcome(Stage.FAILED, reason="no group", round_seconds=3.0))
    m.round(1, RoundOutcome(Stage.APPLIED, group_size=2, allreduce_seconds=0.2, round_seconds=1.0))
    get = m.registry.get_sample_value
    assert get("p2p_diloco_rounds_total", {"fragment": "0", "outcome": "committed"}) == 1
    assert get("p2p_diloco_rounds_total", {"fragment": "0", "outcome": "failed"}) == 1
    assert get("p2p_diloco_rounds_total", {"fragment": "1", "outcome": "committed"}) == 1
    assert get("p2p_diloco_round_seconds_count") == 3 and get("p2p_diloco_round_seconds_sum") == 6.0
    assert get("p2p_diloco_allreduce_seconds_count") == 2
    assert get("p2p_diloco_group_size") == 2


def test_info_and_registries_are_private():
    a, b = Metrics(), Metrics()
    a.describe(run_id="r", lineage="r-1234", peer_id="12D3", codec="fp16", version="0.1.0")
    assert a.registry.get_sample_value("p2p_diloco_learner_info", {"run_id": "r", "lineage": "r-1234",
                                       "peer_id": "12D3", "codec": "fp16", "version": "0.1.0"}) == 1
    assert b.registry.get_sample_value("p2p_diloco_learner_info", {"run_id": "r"}) is None


def test_metrics_are_served_over_http():
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = Metrics()
    stop = m.serve(port, "127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "p2p_diloco_inner_steps_total" in text
    finally:
        stop()


def test_resource_fields_of_the_record():
    c = Counters(tokens=1000, compute_seconds=8.0, wait_seconds=2.0, bytes_sent=55, bytes_received=66)
    c.resize(2)
    c.tokens_since_merge = [200, 400]
    trainer = SimpleNamespace(placement=SimpleNamespace(device=SimpleNamespace(type="cpu"), name="cpu"), workers=1)
    m = Metrics()
    m.last_eval_loss = 2.0
    out = resources(trainer, c, started=0.0, metrics=m, address="/ip4/10.0.0.1/tcp/1")
    assert out["tokens_per_second"] == 100.0 and out["tokens_contributed"] == 700
    assert out["device_kind"] == "cpu" and out["cpu_cores"] >= 1 and out["bytes_sent"] == 55
    assert out["eval_loss"] == 2.0 and out["uptime"] > 0
    assert out["bytes_received"] == 66 and out["address"] == "/ip4/10.0.0.1/tcp/1"
    ProgressRecord.decode(ProgressRecord(1, "a" * 64, 0, **out).encode())  # what a reader accepts


def test_a_diverged_eval_loss_is_left_out_of_the_record():
    c = Counters()
    c.resize(1)
    trainer = SimpleNamespace(placement=SimpleNamespace(device=SimpleNamespace(type="cpu"), name="cpu"), workers=1)
    m = Metrics()
    m.last_eval_loss = float("inf")
    assert resources(trainer, c, started=0.0, metrics=m)["eval_loss"] is None


def test_refusals_by_kind():
    m = Metrics()
    get = m.registry.get_sample_value
    assert get("p2p_diloco_refusals_total", {"kind": "download_rejected"}) == 0  # scrapeable before any refusal
    m.audited("download_rejected", {"peer": "p1", "reason": "sha mismatch"})
    m.audited("download_rejected", {"peer": "any", "reason": "bad metadata"})
    m.audited("distrusted", {"peer": "p2"})
    m.audited("committed", {"fragment": 0})  # not a refusal
    m.round(0, RoundOutcome(Stage.APPLIED, group_size=2, excluded={"p3": "norm outlier", "p4": "banned"}))
    assert get("p2p_diloco_refusals_total", {"kind": "download_rejected"}) == 2
    assert get("p2p_diloco_refusals_total", {"kind": "distrusted"}) == 1
    assert get("p2p_diloco_refusals_total", {"kind": "excluded"}) == 2
    assert get("p2p_diloco_refusals_total", {"kind": "committed"}) is None


def test_matchmaking_histogram_and_peers_visible():
    m = Metrics()
    m.matchmaking(0.3)
    m.matchmaking(4.0)
    m.peers_visible(3)
    get = m.registry.get_sample_value
    assert get("p2p_diloco_matchmaking_seconds_count") == 2 and get("p2p_diloco_matchmaking_seconds_sum") == 4.3
    assert get("p2p_diloco_matchmaking_seconds_bucket", {"le": "0.5"}) == 1
    assert get("p2p_diloco_peers_visible") == 3


def test_received_bytes_survive_a_checkpoint():
    c = Counters()
    c.count_received(3)
    c.count_received(4)
    assert Counters(**vars(c).copy()).bytes_received == 7  # what startup.restore does with a checkpoint's counters
    assert Counters(**{k: v for k, v in vars(c).items() if k != "bytes_received"}).bytes_received == 0  # older one


def _served_stream(tensors, metadata: bytes):

    messages = []
    for t in tensors:
        for part in split_for_streaming(serialize_torch_tensor(t), chunk_size_bytes=256):
            messages.append(averaging_pb2.DownloadData(tensor_part=part, metadata=metadata))
            metadata = b""
    return messages


def _downloader(messages, cap: int):
    """An OuterGradientAverager's attributes that its _download uses, around a peer serving ``messages``."""

    async def stream():
        for m in messages:
            yield m

    async def rpc_download_fragments(_request):
        return stream()

    stub = SimpleNamespace(rpc_download_fragments=rpc_download_fragments)
    return SimpleNamespace(get_stub=lambda *a, **k: stub, _p2p=None, prefix="x", serializer=MSGPackSerializer,
                           download_cap=lambda _fragments: cap, _fragments=[(0,)])  # fragment 0: Θ and momentum


def test_a_download_counts_every_byte_it_received_even_when_cut():

    messages = _served_stream([torch.arange(300.0), torch.ones(50)], MSGPackSerializer.dumps({"sha256": "a"}))
    total = sum(m.ByteSize() for m in messages)
    peer = PeerID(b"\x00" * 34)
    counted = [0]
    meta, tensors = asyncio.run(OuterGradientAverager._download(_downloader(messages, 10**6), peer, 5.0, [0], counted))
    assert meta == {"sha256": "a"} and torch.equal(tensors[0], torch.arange(300.0)) and len(tensors) == 2
    assert counted == [total] and total > 1400  # 350 fp32 values and framing
    cut = [0]
    with pytest.raises(ValueError, match="exceeds"):
        asyncio.run(OuterGradientAverager._download(_downloader(messages, 600), peer, 5.0, [0], cut))
    assert 600 < cut[0] < total  # what came in before the cut counts
    # A stream that ends between two tensors (the connection closed): a broken download, not a short state.
    first = _served_stream([torch.arange(300.0)], MSGPackSerializer.dumps({"sha256": "a"}))
    with pytest.raises(ConnectionError, match="after 1 of 2 tensors"):
        asyncio.run(OuterGradientAverager._download(_downloader(first, 10**6), peer, 5.0, [0], [0]))


def test_the_learner_is_told_of_downloaded_bytes_failed_or_not():
    got: list[int] = []
    averaging = HivemindAveraging.__new__(HivemindAveraging)  # only _await_download's own attributes
    averaging.on_received = got.append

    class Done:
        def __init__(self, value):
            self.value = value

        def result(self, timeout=None):
            return self.value

    assert averaging._await_download(Done((({"m": 1}, ("t",)), 1234)), 1.0) == ({"m": 1}, ["t"])
    assert averaging._await_download(Done((None, 99)), 1.0) is None
    assert got == [1234, 99]


def test_recent_exclusions_count_the_last_rounds_most_often_first():
    from p2p_diloco.learner.metrics import EXCLUSION_ROUNDS

    m = Metrics()
    m.round(0, RoundOutcome(Stage.APPLIED, group_size=4, excluded={"12D3KooWclimberAB": "points away"}))
    m.round(0, RoundOutcome(Stage.APPLIED, group_size=4, excluded={"12D3KooWclimberAB": "x", "12D3KooWnanNANNAN": "y"}))
    m.round(0, RoundOutcome(Stage.FAILED, reason="no group"))
    assert m.recent_exclusions() == (("limberAB", 2), ("anNANNAN", 1))  # ids' last 8 characters
    for _ in range(EXCLUSION_ROUNDS):  # rounds that left nobody out push the old ones out
        m.round(0, RoundOutcome(Stage.APPLIED, group_size=3))
    assert m.recent_exclusions() == ()
