"""Robust merging: the exclusion rule, bans, agreed rules, bounded weights, and a reducer that leaves an excluded
sender out."""

import asyncio
import itertools
import logging
import threading
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.compression import CompressionInfo
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from p2p_diloco.config import ConfigError, ModelConfig, OuterConfig, load_learner_config
from p2p_diloco.core import directions
from p2p_diloco.core.bans import Bans
from p2p_diloco.core.exclusion import (
    Rules,
    RulesDisagree,
    agreed_rules,
    group_rules,
    judge,
)
from p2p_diloco.core.merging import global_norm, token_weight
from p2p_diloco.core.outer import GlobalState, OuterOptimizer
from p2p_diloco.hooks import NO_FAULTS
from p2p_diloco.learner.round import OuterRound
from p2p_diloco.net import allreduce
from p2p_diloco.net.allreduce import ExactAllReduceRunner
from p2p_diloco.net.averaging import HivemindAveraging
from p2p_diloco.net.codecs import decode, get_codec
from p2p_diloco.train.models.registry import build_model
from tests.unit.fake_averaging import FakeGroup

NAN, INF = float("nan"), float("inf")


def _group(*norms, **extra) -> dict:
    """Members "a", "b", ... with these norms (finite flag as an honest learner computes it)."""
    return {chr(ord("a") + i): {"norm": n, "finite": n == n and n != INF, "weight": 1.0, **extra}
            for i, n in enumerate(norms)}


def _out(gathered: dict, rules: Rules | None = None) -> set[str]:
    return set(judge(gathered, rules or Rules(8.0)).excluded)


def test_an_outlier_above_factor_times_the_median_of_the_others_is_excluded():
    verdict = judge(_group(1.0, 1.2, 0.9, 1.1, 100.0), Rules(8.0))
    assert set(verdict.excluded) == {"e"}
    why = verdict.excluded["e"].why
    assert why.startswith("norm per √(inner steps at the peak lr) 1e+02 is 95x the median 1.1 of the others'"), why
    assert verdict.contributors(_group(*range(5))) == ["a", "b", "c", "d"]
    assert _out(_group(1.0, 1.2, 0.9, 1.1, 7.0)) == set()  # 7 ≤ 8 × 1.05
    assert _out(_group(1.0, 1.2, 0.9, 1.1, 100.0), Rules(0.0)) == set()  # 0 disables the outlier rule


def test_norms_are_compared_per_square_root_of_the_inner_steps():
    """An honest learner that missed rounds sends many steps' progress at once, one that just joined few:
    not outliers for that. Adam's steps add up like a random walk: the norm grows like √steps."""
    group = _group(0.36, 7.0)  # the second one's outer gradient holds 70 inner steps, the first one's 7
    group["a"]["steps"], group["b"]["steps"] = 7, 70
    assert _out(group) == set()  # 7 / √70 = 0.84 is 6.1x 0.36 / √7 = 0.136
    group["b"]["steps"] = 7  # the same norm from as few steps: 19x the other's rate
    assert _out(group) == {"b"}
    # A learner restarted from nothing that met a round after 1 step, beside three of 80 (chaos benchmark,
    # 2026-12-05): 8.4x their median per inner step, 0.93x per √step.
    joined = {p: {"norm": n, "finite": True, "steps": k} for p, n, k in
              [("a", 8.8, 80), ("b", 8.6, 80), ("c", 9.1, 80), ("new", 0.92, 1)]}
    assert _out(joined) == set()
    assert _out({**joined, "new": {**joined["new"], "norm": 0.92 * 9}}) == {"new"}  # 8.4x per √step


def test_steps_count_as_much_as_their_learning_rate_allows():
    """Under a warm-up or a decay, steps count as (lr / peak lr)² each (``lr_steps``): many steps at a high lr are
    no outlier beside a few at a low lr. The CI run of 2026-12-05 (warm-up over W = 20 steps, H = 20): a learner
    with 20 warm-up steps (norm 3.5) beside two that met the round after 1 and 2 steps (0.035, 0.05) was 22x their
    median per √step, left out, then banned."""
    warm = Rules(8.0).bounded_by(None, 20, "tokens2_per_step", warmup_steps=20)
    ramp = [((k + 1) / 20) ** 2 for k in range(20)]  # lr at positions 0..19 of the warm-up, over its peak, squared
    group = {"a": {"norm": 3.5, "steps": 20, "lr_steps": sum(ramp)},
             "b": {"norm": 0.035, "steps": 1, "lr_steps": ramp[0]},
             "c": {"norm": 0.05, "steps": 2, "lr_steps": ramp[0] + ramp[1]}}
    for meta in group.values():
        meta.update(finite=True, version=0)
    assert _out(group, warm) == set()
    assert _out({p: {k: v for k, v in m.items() if k != "lr_steps"} for p, m in group.items()}, warm) == {"a"}
    # Later in a cosine decay: 122 unmerged steps, most at a high lr, beside groupmates' 20 at a quarter of it
    # (like the same run at version 6: 14x per √step).
    decayed = {"a": {"norm": 1.8 * 40 ** 0.5, "steps": 122, "lr_steps": 67.0},
               "b": {"norm": 0.13 * 20 ** 0.5, "steps": 20, "lr_steps": 20 * 0.25 ** 2},
               "c": {"norm": 0.13 * 20 ** 0.5, "steps": 20, "lr_steps": 20 * 0.25 ** 2}}
    for meta in decayed.values():
        meta.update(finite=True, version=6)
    assert _out(decayed, warm) == set()
    assert _out({p: {k: v for k, v in m.items() if k != "lr_steps"} for p, m in decayed.items()}, warm) == {"a"}


def test_claimed_lr_steps_are_bounded_by_the_steps_and_the_warm_up():
    """A liar gains nothing by claiming its steps ran at a higher lr than the run allows: lr_steps count at most as
    its steps (at most S = 2H), and during a warm-up at most as the lr of position (version + 1) · H allows."""
    warm = Rules(8.0).bounded_by(None, 20, "tokens2_per_step", warmup_steps=200)
    honest = {p: {"norm": 0.1, "finite": True, "version": 0, "steps": 20, "lr_steps": 20 * 0.05 ** 2} for p in "abc"}
    # Position 21 of a 200-step warm-up: lr at most 0.105 of the peak, so 20 steps count as 20 · 0.105² at most.
    assert warm.peak_share(0) == pytest.approx(0.105 ** 2)
    liar = {"norm": 0.1 * 8 * 0.105 / 0.05 * 1.01, "finite": True, "version": 0, "steps": 20, "lr_steps": 20.0}
    assert _out({**honest, "d": liar}, warm) == {"d"}
    assert _out({**honest, "d": {**liar, "norm": liar["norm"] / 1.02}}, warm) == set()
    assert _out({**honest, "d": {**liar, "lr_steps": 1e300}}, warm) == {"d"}
    # More lr_steps than steps count as the steps, without a warm-up too.
    plain = {p: {"norm": 1.0, "finite": True, "steps": 20, "lr_steps": 20.0} for p in "abc"}
    assert _out({**plain, "d": {"norm": 8.1, "finite": True, "steps": 20, "lr_steps": 1e300}}) == {"d"}
    # A version the warm-up has passed: the full lr.
    assert warm.peak_share(9) == 1.0 and Rules(8.0).peak_share(0) == 1.0
    # Zero lr_steps count as a millionth of a step each (a finite rate): a zero norm is no outlier, a whole one is.
    zero = {"norm": 0.0, "finite": True, "steps": 3, "lr_steps": 0.0}
    assert _out({**plain, "d": zero}) == set() and _out({**plain, "d": {**zero, "norm": 1.0}}) == {"d"}
    for bad in (-1.0, NAN, INF, "1", True, None):
        assert judge({**plain, "d": {**plain["a"], "lr_steps": bad}}, Rules(8.0)).excluded["d"].why == \
            f"its lr_steps {bad!r} are invalid"


def test_non_finite_outer_gradients_are_excluded_and_do_not_count_in_the_median():
    for bad in (NAN, INF):
        verdict = judge(_group(1.0, 1.0, bad, 20.0), Rules(8.0))
        assert verdict.excluded["c"].why == "its outer gradient is not finite"
        assert set(verdict.excluded) == {"c", "d"}  # d: 20 vs median(1, 1) = 1
    lying = _group(1.0, 1.0, 1.0)
    lying["b"]["finite"] = False  # a finite norm, but the learner says its Δ is not finite
    assert _out(lying) == {"b"}


def test_a_norm_exactly_at_the_limit_stays_in():
    assert _out(_group(2.0, 2.0, 16.0)) == set()
    assert _out(_group(2.0, 2.0, 16.000001)) == {"c"}
    assert _out(_group(3.0, 3.0, 3.0, 3.0)) == set()  # all equal: nobody is an outlier


def test_tiny_groups():
    # Alone: nothing to compare with, only the finiteness check.
    assert _out(_group(1e9)) == set() and _out(_group(NAN)) == {"a"}
    # A pair: the larger norm against the other one (the plain median, their mean, could never be exceeded 8x).
    assert _out(_group(1.0, 8.0)) == set()
    assert _out(_group(1.0, 8.5)) == {"b"} and _out(_group(8.5, 1.0)) == {"a"}
    assert _out(_group(5.0, 5.0)) == set()
    # Three: each against the mean of the other two.
    assert _out(_group(1.0, 3.0, 16.0)) == set() and _out(_group(1.0, 3.0, 16.5)) == {"c"}
    # Two outliers among five: each still compared with a median of honest norms.
    assert _out(_group(1.0, 1.0, 1.0, 50.0, 60.0)) == {"d", "e"}


def test_the_verdict_does_not_depend_on_the_order_members_are_listed_in():
    gathered = _group(1.0, 2.0, NAN, 40.0, 1.5)
    gathered["a"]["bans"] = ["e"]
    gathered["b"]["bans"] = ["e"]
    verdicts = {repr(judge(dict(order), Rules(8.0))) for order in itertools.permutations(gathered.items())}
    assert len(verdicts) == 1


def test_malformed_metadata_excludes_its_sender_only():
    gathered = _group(1.0, 1.0)
    gathered["c"] = "not a dict"
    gathered["d"] = {"norm": 1.0, "weight": -1.0}
    gathered["e"] = {"norm": 1.0, "weight": True}
    gathered["f"] = {"norm": "x", "weight": 1.0}
    gathered["g"] = {"norm": -2.0, "weight": 1.0}
    verdict = judge(gathered, Rules(8.0))
    assert set(verdict.excluded) == {"c", "d", "e", "f", "g"}
    assert verdict.excluded["d"].why == "its weight -1.0 is invalid"
    assert verdict.excluded["f"].why == "its norm 'x' is invalid"


def test_weights_come_from_the_gathered_metadata():
    gathered = _group(1.0, 1.0, 1.0)
    gathered["b"]["weight"] = 7.5
    del gathered["c"]["weight"]  # gathered none: hivemind's default weight
    assert judge(gathered, Rules()).weights == {"a": 1.0, "b": 7.5, "c": 1.0}


def test_a_ban_needs_a_strict_majority_of_the_other_members_that_passed_the_checks():
    gathered = _group(1.0, 1.0, 1.0, 1.0)
    gathered["a"]["bans"] = ["d"]
    assert _out(gathered) == set()  # 1 of 3
    gathered["b"]["bans"] = ["d"]
    verdict = judge(gathered, Rules())  # 2 of 3
    assert set(verdict.excluded) == {"d"} and verdict.excluded["d"].banned
    assert verdict.excluded["d"].why == "banned by 2 of 3 groupmates after an earlier exclusion"
    gathered["b"]["bans"] = "d"  # malformed: no vote
    assert _out(gathered) == set()


def test_a_single_member_cannot_ban_the_others_and_an_excluded_one_has_no_vote():
    gathered = _group(1.0, 1.0, 1.0, 1.0)
    gathered["d"]["bans"] = ["a", "b", "c"]
    assert _out(gathered) == set()
    gathered = _group(1.0, 1.0, NAN)
    gathered["c"]["bans"] = ["a"]
    gathered["b"]["bans"] = ["a"]  # b is a's only elector: c, excluded, has no vote
    assert _out(gathered) == {"a", "c"}
    pair = _group(1.0, 1.0)
    pair["a"]["bans"] = ["b"]
    assert _out(pair) == {"b"}


def test_a_member_whose_relayed_metadata_was_changed_is_left_out_but_not_banned():
    # The leader relays every member's gathered entry: flipping a byte of an honest member's makes it "forged".
    # That member is left out of the round (what it said cannot be counted), but the evidence points at
    # whoever relayed it as much as at the member, so no learner bans it: the leader cannot get the honest
    # members banned by each other.
    why = "its gathered metadata was changed after it signed it"
    verdict = judge(_group(1.0, 1.1, 0.9), Rules(8.0), forged={"b": why})
    assert sorted(verdict.excluded) == ["b"] and not verdict.excluded["b"].evidence
    bans = Bans(rounds=3)
    assert bans.after_round(verdict, me="a") == [] and bans.listed() == []


def test_clipping_scales_contributions_above_the_cap():
    gathered = _group(1.0, 4.0, 2.0)
    gathered["c"]["unit"] = True  # RDA: parts are unit vectors, the round scales the norm instead
    verdict = judge(gathered, Rules(8.0, max_contribution_norm=1.5))
    assert verdict.scale("a") == 1.0 and verdict.scale("b") == 1.5 / 4.0 and verdict.scale("c") == 0.75
    assert verdict.part_scale("b") == 1.5 / 4.0 and verdict.part_scale("c") == 1.0


def _rules(factor=4.0, cap=None, aggregator="mean", per_step=1024, max_steps=40, weighting="tokens2_per_step",
           warmup=0, direction=False):
    return [factor, cap, aggregator, per_step, max_steps, weighting, warmup, direction]


def test_members_must_agree_on_the_rules():
    same = {"a": {"rules": _rules(aggregator="median")}, "b": {"rules": _rules(aggregator="median")}}
    assert agreed_rules(same, Rules()) == Rules(4.0, None, "median", 1024, 40, "tokens2_per_step")
    assert agreed_rules(same, Rules()).gathered() == _rules(aggregator="median")
    unbounded = _rules(per_step=None, max_steps=None)
    assert agreed_rules({"a": {"rules": unbounded}}, Rules()) == Rules(4.0)
    assert agreed_rules({"a": {}, "b": {}}, Rules(3.0)) == Rules(3.0)  # nobody gathered any: ours
    for bad in ({"a": {"rules": _rules()}, "b": {"rules": _rules(factor=8.0)}},
                {"a": {"rules": _rules()}, "b": {"rules": _rules(aggregator="median")}},
                {"a": {"rules": _rules()}, "b": {}},
                {"a": {"rules": [4.0, None, "mean"]}}, {"a": {"rules": _rules(aggregator="mode")}},
                {"a": {"rules": _rules(factor=-1.0)}}, {"a": {"rules": _rules(cap=0.0)}}, {"a": {"rules": "x"}}):
        with pytest.raises(RulesDisagree):
            agreed_rules(bad, Rules())


def test_members_must_agree_on_what_bounds_a_contribution():
    """A member with another batch (tokens per step), H (steps) or weighting rule fails the group's round."""
    for theirs in (_rules(per_step=2048), _rules(max_steps=80), _rules(weighting="tokens"),
                   _rules(per_step=None, max_steps=None), _rules(warmup=100), _rules(direction=True)):
        with pytest.raises(RulesDisagree, match="different robust-merging rules"):
            agreed_rules({"a": {"rules": _rules()}, "b": {"rules": theirs}}, Rules())
    for bad in (_rules(per_step=0), _rules(per_step=-1), _rules(per_step=1024.0), _rules(per_step=True),
                _rules(max_steps=None), _rules(max_steps=2**64 - 1),
                _rules(weighting="tokens3"), _rules(warmup=-1), _rules(warmup=None), _rules(warmup=1.5),
                _rules()[:7], _rules(direction=1), _rules(direction=None)):
        with pytest.raises(RulesDisagree, match="malformed"):
            agreed_rules({"a": {"rules": bad}, "b": {"rules": bad}}, Rules())


def test_the_averaging_layer_gathers_bounds_from_the_learners_config():
    cfg = load_learner_config(None, ["inner.batch_size=8", "model.seq_len=32", "inner.steps_per_outer=20",
                                     "sync.weighting=tokens", "inner.warmup_steps=30"])
    averaging = SimpleNamespace(cfg=cfg.averaging, limits=cfg.contribution_limits)
    rules = HivemindAveraging._rules(averaging)  # type: ignore[arg-type]
    # No swarm-wide tokens per step by default: each round takes the lower median of what members gathered.
    assert (rules.tokens_per_step, rules.max_steps, rules.weighting, rules.warmup_steps) == (None, 2 * 20, "tokens", 30)
    assert agreed_rules({"a": {"rules": rules.gathered()}}, Rules()) == rules
    assert (rules.norm_outlier_factor, rules.aggregator) == (8.0, "mean")
    units = load_learner_config(None, ["averaging.max_tokens_per_step=4096"])  # a swarm with units sets its largest
    assert HivemindAveraging._rules(SimpleNamespace(cfg=units.averaging,
                                                    limits=units.contribution_limits)).tokens_per_step == 4096  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_tokens_per_step"):
        load_learner_config(None, ["averaging.max_tokens_per_step=0"])


BOUNDS = Rules(8.0).bounded_by(tokens_per_step=1000, steps_per_outer=10, weighting="tokens2_per_step")  # ≤ 20 steps


def _learner(inner_steps: int, missed: int = 0, workers: int = 1, **lie) -> dict:
    """The metadata an honest learner of BOUNDS gathers after ``inner_steps`` (as rounds.py weighs it), then ``lie``."""
    tokens = inner_steps * 1000 * workers
    meta = {"norm": 0.1 * inner_steps, "finite": True, "tokens": tokens, "steps": inner_steps,
            "weight": token_weight(tokens, inner_steps, missed, BOUNDS.weighting)}
    return {**meta, **lie}


def test_honest_weights_are_what_token_weight_gives():
    gathered = {"a": _learner(10), "b": _learner(7), "c": _learner(20, missed=1), "d": _learner(14, missed=3),
                "e": _learner(1)}
    verdict = judge(gathered, BOUNDS)
    assert verdict.weights == {p: m["weight"] for p, m in gathered.items()} and verdict.bounded == {}
    assert verdict.weights["a"] == 10 * 1000.0**2  # tokens · tokens / steps
    tokens_rule = Rules(8.0).bounded_by(1000, 10, "tokens")
    gathered = {p: {**m, "weight": token_weight(m["tokens"], m["steps"], 0, "tokens")} for p, m in gathered.items()}
    assert judge(gathered, tokens_rule).weights == {p: float(m["tokens"]) for p, m in gathered.items()}


def test_a_weight_of_1e15_counts_as_what_its_steps_allow(caplog):
    gathered = {"a": _learner(10), "b": _learner(10), "c": _learner(10), "liar": _learner(10, weight=1e15)}
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.core.exclusion"):
        verdict = judge(gathered, BOUNDS)
    assert verdict.excluded == {}
    assert verdict.weights == {p: 1e7 for p in gathered}  # the liar counts like any learner of 10 steps
    assert set(verdict.bounded) == {"liar"}
    assert [r.getMessage() for r in caplog.records] == [
        "bounded the weight of liar: it claimed weight 1e+15 for 10000 tokens in 10 inner steps; counted as 10000 "
        "tokens in 10 steps, weight 1e+07 (at most 1000 tokens a step: averaging.max_tokens_per_step; 20 steps: 2·H)"]
    # Without bounds in the rules the claim stands (rules gathered by members without bounds).
    assert judge(gathered, Rules()).weights["liar"] == 1e15


def test_tokens_are_bounded_by_steps_times_tokens_per_step_and_steps_by_the_cap():
    lie = _learner(10, tokens=10**9, weight=token_weight(10**9, 10))
    verdict = judge({"a": _learner(10), "liar": lie}, BOUNDS)
    assert verdict.weights["liar"] == token_weight(10 * 1000, 10) == verdict.weights["a"]
    assert "for 1000000000 tokens in 10 inner steps; counted as 10000 tokens in 10 steps" in verdict.bounded["liar"]
    # Claiming many steps as well: at most 2·H steps of 1000 tokens, twice an honest learner in phase.
    lie = _learner(10**6, weight=token_weight(10**9, 10**6), norm=1.0)
    assert judge({"a": _learner(10), "liar": lie}, BOUNDS).weights["liar"] == token_weight(20 * 1000, 20) == 2e7
    # A learner that claims tokens above its steps but a modest weight keeps it, and is still reported.
    odd = _learner(10, workers=2, weight=5.0)
    verdict = judge({"a": _learner(10), "unit": odd}, BOUNDS)
    assert verdict.weights["unit"] == 5.0 and "for 20000 tokens in 10 inner steps" in verdict.bounded["unit"]
    # An honest learner absent for many rounds: its steps count as 2·H, its work stays in.
    verdict = judge({"a": _learner(10), "slow": _learner(50)}, BOUNDS)
    assert verdict.excluded == {} and verdict.weights["slow"] == token_weight(20 * 1000, 20)
    assert "counted as 20000 tokens in 20 steps" in verdict.bounded["slow"]
    # ... unless the versions it missed already bring its weight below that: nothing to report.
    verdict = judge({"a": _learner(10), "slow": _learner(50, missed=4)}, BOUNDS)
    assert verdict.weights["slow"] == token_weight(50 * 1000, 50, 4) and verdict.bounded == {}
    # No tokens or steps gathered: the most 2·H steps can hold.
    assert judge({"x": {"norm": 1.0, "weight": 1e15}}, BOUNDS).weights["x"] == 2e7
    assert judge({"x": {"norm": 1.0, "weight": 3.0}}, BOUNDS).weights["x"] == 3.0


def test_claimed_steps_do_not_hide_a_norm_from_the_outlier_rule():
    """Norms are compared per √(inner steps): the steps are bounded there too."""
    gathered = {p: _learner(10) for p in "abc"} | {"liar": _learner(10, steps=2**63 - 1, norm=1e6)}
    assert set(judge(gathered, BOUNDS).excluded) == {"liar"}
    assert set(judge(gathered, Rules()).excluded) == set()  # unbounded: 1e6 / 2^63 per step looks tiny


def test_hostile_token_and_step_counts_exclude_their_sender_without_an_exception():
    hostile = {"neg_tokens": {"tokens": -1}, "big_tokens": {"tokens": 2**64 - 1}, "bool_tokens": {"tokens": True},
               "float_tokens": {"tokens": 1e4}, "nan_tokens": {"tokens": NAN}, "str_tokens": {"tokens": "10000"},
               "neg_steps": {"steps": -1}, "big_steps": {"steps": 2**64 - 1}, "bool_steps": {"steps": False},
               "float_steps": {"steps": 10.0}, "none_steps": {"steps": None}, "list_steps": {"steps": [10]}}
    gathered = {"a": _learner(10), "b": _learner(10)} | {p: _learner(10, **v) for p, v in hostile.items()}
    for rules in (BOUNDS, Rules()):
        verdict = judge(gathered, rules)
        assert set(verdict.excluded) == set(hostile) and verdict.contributors(gathered) == ["a", "b"]
    assert verdict.excluded["big_tokens"].why == "its tokens 18446744073709551615 are invalid"
    assert verdict.excluded["float_steps"].why == "its steps 10.0 are invalid"
    # The largest valid count is bounded, not excluded; zero steps bound the weight to zero.
    no_outliers = Rules(0.0).bounded_by(1000, 10, "tokens2_per_step")
    verdict = judge({"a": _learner(10), "max": _learner(10, tokens=2**63 - 1, steps=2**63 - 1, weight=1e300),
                     "zero": _learner(10, steps=0)}, no_outliers)
    assert verdict.excluded == {} and verdict.weights["max"] == 2e7 and verdict.weights["zero"] == 0.0


def test_config_fields():
    cfg = load_learner_config(None, [])
    assert (cfg.averaging.norm_outlier_factor, cfg.averaging.max_contribution_norm, cfg.averaging.ban_rounds,
            cfg.averaging.aggregator) == (8.0, None, 3, "mean")
    with pytest.raises(ConfigError, match="aggregator"):
        load_learner_config(None, ["averaging.aggregator=mode"])
    assert load_learner_config(None, ["averaging.norm_outlier_factor=0"]).averaging.norm_outlier_factor == 0
    with pytest.raises(ConfigError, match="norm_outlier_factor"):
        load_learner_config(None, ["averaging.norm_outlier_factor=0.5"])


def _peer(i: int) -> PeerID:
    return PeerID(bytes([0, 36]) + bytes([i + 1]) * 36)


def _aux_reducer(me, a, b, x, codec) -> ExactAllReduceRunner:
    """A pure reducer (auxiliary, whole vector of 6) with senders a (weight 1) and b (weight 3, clipped by
    half); x is an excluded contributor."""
    return ExactAllReduceRunner(
        p2p=SimpleNamespace(peer_id=me), servicer_type=AllReduceRunner, prefix=None, group_id=b"g",
        tensors=[torch.zeros(6)], ordered_peer_ids=[me, a, b, x], peer_fractions=(6, 0, 0, 0),
        modes=(AveragingMode.AUX, AveragingMode.CLIENT, AveragingMode.CLIENT, AveragingMode.AUX),
        sender_weights=[1.0, 3.0], sender_scales=[1.0, 0.5], compression=codec,
    )


def _one_part(codec, values: torch.Tensor):
    async def parts():
        part = codec.compress(values, CompressionInfo.from_tensor(values))
        yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g",
                                          tensor_part=part, weight=1e15)
    return parts()


def test_a_reducer_refuses_an_excluded_sender_and_weighs_by_gathered_weights(monkeypatch):
    """Every part claims weight 1e15; a counts with weight 1, b with 3 and clipped by half, x is refused
    unread."""
    monkeypatch.setattr(allreduce, "_REPLY_HOLD", 0.0)  # the handlers return at once (held: the next test)
    me, a, b, x = (_peer(i) for i in range(4))
    codec = get_codec("none")
    inputs = {a: torch.full((6,), 1.0), b: torch.full((6,), 4.0), x: torch.full((6,), 1e9)}

    async def send(runner, peer):
        return [m async for m in runner.rpc_aggregate_part(_one_part(codec, inputs[peer]),
                                                           SimpleNamespace(remote_id=peer))]

    async def scenario():
        runner = _aux_reducer(me, a, b, x, codec)
        replies = await asyncio.wait_for(asyncio.gather(send(runner, a), send(runner, b), send(runner, x)), 10)
        received = list(runner.tensor_part_reducer.num_parts_received)
        runner.finalize()
        return replies, received

    replies, received = asyncio.run(scenario())
    assert [m.code for m in replies[2]] == [averaging_pb2.PROTOCOL_VIOLATION]
    assert received == [1, 1]
    expected = torch.full((6,), (1.0 * 1.0 + 3.0 * 0.5 * 4.0) / 4.0)
    for reply in replies[:2]:
        assert [m.code for m in reply] == [averaging_pb2.AVERAGED_PART]
        assert torch.equal(decode(reply[0].tensor_part), expected)


def test_a_reducer_holds_its_reply_stream_open_until_the_sender_closes_it():
    """p2pd may reset a stream whose handler returned before the caller read the last reply (2 of 554
    reply streams in a 16-learner run): the reducer's handler stays open after its reply, for the sender
    to close."""
    me, a, b, x = (_peer(i) for i in range(4))
    codec = get_codec("none")

    async def scenario():
        runner = _aux_reducer(me, a, b, x, codec)
        handlers = {peer: runner.rpc_aggregate_part(_one_part(codec, torch.ones(6)), SimpleNamespace(remote_id=peer))
                    for peer in (a, b)}
        replies = await asyncio.wait_for(asyncio.gather(*(anext(h) for h in handlers.values())), 10)
        rest = [asyncio.ensure_future(anext(h, None)) for h in handlers.values()]
        done, _ = await asyncio.wait(rest, timeout=0.3)
        for task in rest:  # the senders close their streams: hivemind cancels the handlers
            task.cancel()
        ended, _ = await asyncio.wait(rest, timeout=1)
        runner.finalize()
        return replies, len(done), len(ended)

    replies, ended_by_themselves, ended_when_closed = asyncio.run(scenario())
    assert [m.code for m in replies] == [averaging_pb2.AVERAGED_PART] * 2
    assert (ended_by_themselves, ended_when_closed) == (0, 2)


def test_radial_averaging_weighs_norms_by_the_bounded_weights():
    """RDA's mean norm is weighted too: by the verdict's bounded weights, not the 1e15 a member claims."""
    def learner(shift: float):
        model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, seq_len=8), seed=0)
        state = GlobalState.from_module(model)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(shift * 1e-3)
        return state, list(model.parameters())

    applied = []

    class Capture(OuterOptimizer):
        def apply(self, state, deltas, tokens=0, work=1.0, span=1.0):
            applied.append(global_norm(deltas))
            super().apply(state, deltas, tokens=tokens, work=work, span=span)

    group = FakeGroup(2, Rules(0.0).bounded_by(tokens_per_step=10, steps_per_outer=10, weighting="tokens"))
    pair = [learner(1.0), learner(4.0)]
    norms = [global_norm([g - p.detach() for g, p in zip(s.params, ps, strict=True)]) for s, ps in pair]
    outcomes = [None, None]

    def run(i: int) -> None:  # both hold 100 tokens in 10 steps; the second claims weight 1e15
        state, params = pair[i]
        outcomes[i] = OuterRound(state, Capture(OuterConfig()), group.member(str(i)), params, 100, 10,
                                 weight=[100.0, 1e15][i], rda=True).run()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    assert all(o is not None and o.committed for o in outcomes)
    assert all(o.members["1"]["weight"] == 100.0 for o in outcomes if o is not None)
    mean = (norms[0] + norms[1]) / 2  # equal weights; unbounded, the mean norm would be the claimer's, 4x
    assert len(applied) == 2 and all(abs(n - mean) <= 1e-5 * mean for n in applied), (applied, norms)


PER_MEMBER = Rules(8.0).bounded_by(tokens_per_step=None, steps_per_outer=10, weighting="tokens2_per_step")


def test_without_a_swarm_wide_bound_the_lower_median_of_the_members_steps_bounds_everyone(caplog):
    """Learners with different batches meet; a liar's claimed step size cannot raise the bound."""
    small, large = _learner(10, step_tokens=1000), _learner(10, workers=2, step_tokens=2000)
    liar = _learner(10, weight=1e15, tokens=10**12, step_tokens=10**12)
    verdict = judge({"a": small, "b": small, "c": large, "liar": liar}, PER_MEMBER)
    assert verdict.excluded == {}
    assert verdict.weights["a"] == verdict.weights["b"] == small["weight"]
    assert verdict.weights["liar"] == token_weight(10 * 1000, 10)  # counted at the lower median, 1000 a step
    assert verdict.weights["c"] == token_weight(10 * 1000, 10)  # above the median: counted as it, and said so
    assert set(verdict.bounded) == {"c", "liar"}
    # A group of two larger learners keeps their whole weight: the bound follows the group.
    both = judge({"c": large, "d": large}, PER_MEMBER)
    assert both.weights == {"c": large["weight"], "d": large["weight"]} and both.bounded == {}
    # In a pair, the lower median is the smaller: a liar cannot raise its honest partner's yardstick.
    assert judge({"a": small, "liar": liar}, PER_MEMBER).weights["liar"] == token_weight(10 * 1000, 10)
    # Nobody gathered a step size (older members): claims stand, as without bounds.
    assert judge({"a": _learner(10), "x": _learner(10, weight=1e15)}, PER_MEMBER).weights["x"] == 1e15


def test_the_learner_gathers_its_own_step_size():
    cfg = load_learner_config(None, [])
    averaging = SimpleNamespace(cfg=cfg.averaging, step_tokens=16 * 128, _bans=None, _rules=lambda: PER_MEMBER,
                                dht=SimpleNamespace(), _quorum=2, client_mode=False, established_training=lambda: 3,
                                faults=NO_FAULTS)
    averaging._bans = SimpleNamespace(listed=lambda: [])
    meta = HivemindAveraging._gathered(averaging, [torch.ones(3)], 2.0, {"tokens": 5}, 0)  # type: ignore[arg-type]
    assert meta["step_tokens"] == 16 * 128 and meta["weight"] == 2.0
    assert meta["quorum"] == 2  # a majority quorum (the default) gathers its count
    assert meta["established"] == 3  # and how many established learners it sees training (core/standing.py)
    assert meta["reduces"] is True  # not a client: it reduces a share (averager_process.reducer_shares)
    assert len(meta["direction"]) == directions.DIM  # the direction check is on by default


def test_a_member_with_rules_of_its_own_is_left_out_and_banned_instead_of_failing_the_round():
    # Before, one member gathering other rules (or malformed ones) failed every round it joined, for everyone.
    group = _group(1.0, 1.1, 0.9, 1.2)
    for peer in "abc":
        group[peer]["rules"] = _rules()
    for theirs in (_rules(factor=1e9), _rules(direction=True), "x", None):
        group["d"]["rules"] = theirs
        rules, dissent = group_rules(group, Rules())
        assert rules == agreed_rules({p: group[p] for p in "abc"}, Rules()) and sorted(dissent) == ["d"]
        verdict = judge(group, rules, dissent=dissent)
        assert sorted(verdict.excluded) == ["d"] and verdict.excluded["d"].evidence
        assert "other robust-merging rules" in verdict.excluded["d"].why
        bans = Bans(rounds=3)
        assert bans.after_round(verdict, me="a") == ["d"]
    # Without a strict majority nobody can tell who is wrong: the round fails as before.
    with pytest.raises(RulesDisagree):
        group_rules({"a": {"rules": _rules()}, "b": {"rules": _rules(factor=9.0)}}, Rules())
    with pytest.raises(RulesDisagree, match="malformed"):  # a majority of malformed rules is no rule
        group_rules({"a": {"rules": "x"}, "b": {"rules": "x"}, "c": {"rules": _rules()}}, Rules())
