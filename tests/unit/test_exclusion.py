"""Robust merging: the exclusion rule, bans, agreed rules, and a reducer that leaves an excluded sender out."""

import asyncio
import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.compression import CompressionInfo
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from p2p_diloco.allreduce import ExactAllReduceRunner
from p2p_diloco.codecs import decode, get_codec
from p2p_diloco.config import ConfigError, load_learner_config
from p2p_diloco.exclusion import Bans, Exclusion, Rules, RulesDisagree, Verdict, agreed_rules, judge

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
    assert why.startswith("norm per inner step 1e+02 is 95x the median 1.1 of the others'"), why
    assert verdict.contributors(_group(*range(5))) == ["a", "b", "c", "d"]
    assert _out(_group(1.0, 1.2, 0.9, 1.1, 7.0)) == set()  # 7 ≤ 8 × 1.05
    assert _out(_group(1.0, 1.2, 0.9, 1.1, 100.0), Rules(0.0)) == set()  # 0 disables the outlier rule


def test_norms_are_compared_per_inner_step():
    """An honest learner that missed rounds sends many steps' progress at once: not an outlier."""
    group = _group(0.36, 7.0)  # the second one's outer gradient holds 70 inner steps, the first one's 7
    group["a"]["steps"], group["b"]["steps"] = 7, 70
    assert _out(group) == set()
    group["b"]["steps"] = 7  # the same norm from as few steps: 19x the other's rate
    assert _out(group) == {"b"}


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


def test_bans_last_the_given_number_of_rounds_and_are_logged_once(caplog):
    bans = Bans(rounds=3)
    caught = Verdict(excluded={"peer-x": Exclusion("its outer gradient is not finite")})
    with caplog.at_level(logging.INFO, logger="p2p_diloco.exclusion"):
        assert bans.after_round(caught, me="me") == ["peer-x"]
        assert bans.after_round(caught, me="me") == []  # caught again: the ban restarts, no new line
    assert [r.getMessage() for r in caplog.records] == ["peer-x is banned from this learner's next 3 rounds"]
    listed = []
    for _ in range(4):
        listed.append(bans.listed())
        bans.after_round(Verdict(), me="me")
    assert listed == [["peer-x"], ["peer-x"], ["peer-x"], []]


def test_bans_skip_ourselves_and_ban_only_exclusions_and_can_be_off():
    verdict = Verdict(excluded={"a": Exclusion("its outer gradient is not finite"), "me": Exclusion("norm ..."),
                                "y": Exclusion("banned by 2 of 3 groupmates", banned=True)})
    bans = Bans(rounds=2)
    bans.after_round(verdict, me="me")
    assert bans.listed() == ["a"]  # a ban does not renew itself: it ends after its rounds
    off = Bans(rounds=0)
    off.after_round(verdict, me="me")
    assert off.listed() == []


def test_clipping_scales_contributions_above_the_cap():
    gathered = _group(1.0, 4.0, 2.0)
    gathered["c"]["unit"] = True  # RDA: parts are unit vectors, the round scales the norm instead
    verdict = judge(gathered, Rules(8.0, max_contribution_norm=1.5))
    assert verdict.scale("a") == 1.0 and verdict.scale("b") == 1.5 / 4.0 and verdict.scale("c") == 0.75
    assert verdict.part_scale("b") == 1.5 / 4.0 and verdict.part_scale("c") == 1.0


def test_members_must_agree_on_the_rules():
    same = {"a": {"rules": [4.0, None, "median"]}, "b": {"rules": [4.0, None, "median"]}}
    assert agreed_rules(same, Rules()) == Rules(4.0, None, "median")
    assert agreed_rules({"a": {}, "b": {}}, Rules(3.0)) == Rules(3.0)  # nobody gathered any: ours
    for bad in ({"a": {"rules": [4.0, None, "mean"]}, "b": {"rules": [8.0, None, "mean"]}},
                {"a": {"rules": [4.0, None, "mean"]}, "b": {"rules": [4.0, None, "median"]}},
                {"a": {"rules": [4.0, None, "mean"]}, "b": {}},
                {"a": {"rules": [4.0, None]}}, {"a": {"rules": [4.0, None, "mode"]}},
                {"a": {"rules": [-1.0, None, "mean"]}}, {"a": {"rules": [4.0, 0.0, "mean"]}}, {"a": {"rules": "x"}}):
        with pytest.raises(RulesDisagree):
            agreed_rules(bad, Rules())


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


def test_a_reducer_refuses_an_excluded_sender_and_weighs_by_gathered_weights():
    """A pure reducer (auxiliary, whole vector) with senders a and b, and x excluded: every part claims
    weight 1e15; a counts with weight 1, b with 3 and clipped by half, x is refused unread."""
    me, a, b, x = (_peer(i) for i in range(4))
    codec = get_codec("none")
    inputs = {a: torch.full((6,), 1.0), b: torch.full((6,), 4.0), x: torch.full((6,), 1e9)}

    async def send(runner, peer):
        async def parts():
            part = codec.compress(inputs[peer], CompressionInfo.from_tensor(inputs[peer]))
            yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g",
                                              tensor_part=part, weight=1e15)
        return [m async for m in runner.rpc_aggregate_part(parts(), SimpleNamespace(remote_id=peer))]

    async def scenario():
        runner = ExactAllReduceRunner(
            p2p=SimpleNamespace(peer_id=me), servicer_type=AllReduceRunner, prefix=None, group_id=b"g",
            tensors=[torch.zeros(6)], ordered_peer_ids=[me, a, b, x], peer_fractions=(6, 0, 0, 0),
            modes=(AveragingMode.AUX, AveragingMode.CLIENT, AveragingMode.CLIENT, AveragingMode.AUX),
            sender_weights=[1.0, 3.0], sender_scales=[1.0, 0.5], compression=codec,
        )
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
