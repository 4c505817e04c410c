"""The learner's Prometheus metrics, read back from its private registry."""

from types import SimpleNamespace

from p2p_diloco.learner_state import Counters
from p2p_diloco.metrics import Metrics, resources
from p2p_diloco.round import RoundOutcome, Stage


def _state(counters, versions):
    return SimpleNamespace(counters=counters, states=[SimpleNamespace(version=v) for v in versions])


def test_counters_follow_the_learner_counters():
    m, c = Metrics(), Counters(inner_steps=10, tokens=640, bytes_sent=1000, compute_seconds=1.5)
    c.resize(2)
    m.update(_state(c, [1, 2]), train_loss=3.0, lr=1e-3)
    c.inner_steps, c.tokens, c.syncs = 30, 1920, 1
    m.update(_state(c, [2, 2]), eval_loss=2.5)
    m.update(_state(c, [2, 2]))  # nothing new: counters unchanged
    get = m.registry.get_sample_value
    assert get("p2p_diloco_inner_steps_total") == 30
    assert get("p2p_diloco_tokens_total") == 1920
    assert get("p2p_diloco_bytes_sent_total") == 1000
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
    c = Counters(tokens=1000, compute_seconds=8.0, wait_seconds=2.0, bytes_sent=55)
    c.resize(2)
    c.tokens_since_merge = [200, 400]
    trainer = SimpleNamespace(placement=SimpleNamespace(device=SimpleNamespace(type="cpu"), name="cpu"), workers=1)
    m = Metrics()
    m.last_eval_loss = 2.0
    out = resources(trainer, c, started=0.0, metrics=m)
    assert out["tokens_per_second"] == 100.0 and out["tokens_contributed"] == 700
    assert out["device_kind"] == "cpu" and out["cpu_cores"] >= 1 and out["bytes_sent"] == 55
    assert out["eval_loss"] == 2.0 and out["uptime"] > 0


def test_a_diverged_eval_loss_is_left_out_of_the_record():
    c = Counters()
    c.resize(1)
    trainer = SimpleNamespace(placement=SimpleNamespace(device=SimpleNamespace(type="cpu"), name="cpu"), workers=1)
    m = Metrics()
    m.last_eval_loss = float("inf")
    assert resources(trainer, c, started=0.0, metrics=m)["eval_loss"] is None
