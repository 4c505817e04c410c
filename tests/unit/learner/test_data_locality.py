"""Local data stays local: what a learner serves to peers, and what it publishes, holds model state and
numbers about it, never training text.

A learner answers exactly the RPCs listed here (hivemind's DHT and our averager); each returns
records, pseudo-gradient parts or the global state. Adding an RPC, a served field, a gathered field
or a record field makes this test fail, so that someone checks it carries no data before it ships.
"""

import dataclasses

import torch
from hivemind.dht.protocol import DHTProtocol

from p2p_diloco.config import OuterConfig
from p2p_diloco.core.outer import GlobalState, OuterOptimizer
from p2p_diloco.core.state_layout import snapshot
from p2p_diloco.learner.round import OuterRound
from p2p_diloco.net.averager_process import OuterGradientAverager
from p2p_diloco.net.progress_records import ProgressRecord
from tests.unit.fake_averaging import FakeAveraging

SERVED_RPCS = {
    "averager": {"rpc_aggregate_part", "rpc_download_fragments", "rpc_download_state", "rpc_join_group"},
    "dht": {"rpc_find", "rpc_ping", "rpc_store"},
}


def test_a_learner_serves_only_these_rpcs():
    OuterGradientAverager._collect_rpc_handlers()
    DHTProtocol._collect_rpc_handlers()
    assert {h.method_name for h in OuterGradientAverager._rpc_handlers} == SERVED_RPCS["averager"]
    assert {h.method_name for h in DHTProtocol._rpc_handlers} == SERVED_RPCS["dht"]


def test_the_served_state_is_the_global_model_and_numbers_about_it():
    model = torch.nn.Linear(4, 3)
    state = GlobalState.from_module(model)
    OuterOptimizer(OuterConfig()).apply(state, [torch.ones_like(p) for p in state.params], tokens=7)
    meta, tensors = snapshot([state])
    assert set(meta) == {"fragments", "sha256"}
    assert set(meta["fragments"][0]) == {"version", "momentum_initialized", "tokens", "history", "contributors",
                                         "certificates", "standing", "sha256"}
    # The tensors: Θ then the outer momentum, the model's own shapes.
    assert [tuple(t.shape) for t in tensors] == [tuple(p.shape) for p in model.parameters()] * 2


def test_a_round_gathers_numbers_about_its_outer_gradient():
    state = GlobalState(params=[torch.zeros(3)], momentum=[torch.zeros(3)])
    rnd = OuterRound(state=state, optimizer=None, averaging=FakeAveraging(), local_params=[torch.ones(3)],
                     tokens=10, inner_steps=2)
    assert set(rnd.metadata()) == {"version", "sha256", "tokens", "steps", "weight", "norm", "finite", "unit"}
    rnd.lr_steps = 0.5  # the learner's rounds also say what their steps count as at the peak lr (exclusion.py)
    assert rnd.metadata()["lr_steps"] == 0.5 and rnd.metadata()["steps"] == 2


def test_a_progress_record_holds_progress_and_resources():
    assert {f.name for f in dataclasses.fields(ProgressRecord)} == {
        "version", "sha256", "tokens", "status", "wall_time", "versions", "shas", "device_kind", "device_name",
        "workers", "cpu_cores", "tokens_per_second", "tokens_contributed", "bytes_sent", "uptime", "eval_loss",
        "reach", "bytes_received", "address", "period", "switch_period", "switch_at",
        "excluded", "heals", "loss_rises"}  # what it saw go wrong: peers its rounds left out, its own divergences
