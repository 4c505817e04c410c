"""Checking the reducers with random projections (p2p_diloco/core/shard_sketches.py), without networking.

Three senders, two reducers: each sender's part of each shard goes through the codec as it would on the
wire; a reducer's shard is the weighted fp32 mean of the decoded parts, rounded by the codec for the
reply; every member sketches what it sent and what it received, and checks the others' sketches.
"""

import math

import pytest
import torch

from p2p_diloco.core import shard_sketches
from p2p_diloco.core.aggregators import aggregate
from p2p_diloco.core.quantization import get_quantizer

PEERS = ["peer-aaaaaa", "peer-bbbbbb", "peer-cccccc"]
SHARDS = [("peer-aaaaaa", 0, 700), ("peer-bbbbbb", 700, 1000)]  # peer-cccccc reduces nothing (a client)
WEIGHTS = {"peer-aaaaaa": 1.0, "peer-bbbbbb": 2.5, "peer-cccccc": 4.0}


def _round(codec: str, lie=None, seed: int = 0, aggregator: str = "mean"):
    """Every member's sketch, as each would make it; ``lie(shard index, y) -> y'``: what a reducer returns."""
    q = get_quantizer(codec, 64)
    g = torch.Generator().manual_seed(seed)
    parts = {p: torch.randn(1000, generator=g) * (i + 1) for i, p in enumerate(PEERS)}
    sent = {p: torch.cat([q.decode(q.encode(x[a:b]), (b - a,)) for _, a, b in SHARDS]) for p, x in parts.items()}
    total = sum(WEIGHTS.values())
    result = []
    for r, (_, a, b) in enumerate(SHARDS):
        if aggregator == "mean":
            acc = torch.zeros(b - a)
            for p in PEERS:
                acc.add_(sent[p][a:b], alpha=WEIGHTS[p])
            y = acc / total
        else:  # what a RobustReducer computes: the weights do not count
            y = aggregate([sent[p][a:b] for p in PEERS], [WEIGHTS[p] for p in PEERS], aggregator)
        if lie is not None:
            y = lie(r, y)
        result.append(q.decode(q.encode(y), (b - a,)))
    y = torch.cat(result)
    seed_hex = shard_sketches.seed_of([y])
    sketches = {p: shard_sketches.sketch(seed_hex, SHARDS, [sent[p][a:b] for _, a, b in SHARDS], y, q.error_bound,
                                         aggregator) for p in PEERS}
    norms = {p: 1.1 * float(sent[p].norm()) for p in PEERS}
    return sketches, norms


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "int4"])
def test_honest_reducers_pass_with_every_codec(codec):
    for seed in range(5):
        sketches, norms = _round(codec, seed=seed)
        for p in PEERS:
            assert shard_sketches.check(sketches[p], sketches, WEIGHTS, norms) == "", (codec, seed, p)


@pytest.mark.parametrize("codec", ["none", "int8"])
@pytest.mark.parametrize("lie", ["flip", "scale", "replace", "nudge"])
def test_a_reducer_that_returns_another_shard_is_caught_by_every_member(codec, lie):
    def liar(r, y):
        if r != 1:
            return y
        if lie == "flip":
            return -y
        if lie == "scale":
            return y * -50
        if lie == "replace":
            return torch.randn(y.numel(), generator=torch.Generator().manual_seed(9))
        return y + 0.5 * y.norm() / math.sqrt(y.numel())  # a shift of half the shard's norm, every value alike

    sketches, norms = _round(codec, lie=liar)
    for p in PEERS:
        why = shard_sketches.check(sketches[p], sketches, WEIGHTS, norms)
        assert "the shard reduced by bbbbbb does not match what its senders sent" in why, (lie, why)


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean"])
@pytest.mark.parametrize("codec", ["none", "fp16", "int8", "int4"])
def test_honest_robust_reducers_pass(codec, aggregator):
    for seed in range(5):
        sketches, norms = _round(codec, seed=seed, aggregator=aggregator)
        for p in PEERS:
            assert shard_sketches.check(sketches[p], sketches, WEIGHTS, norms) == "", (codec, seed, p)


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean"])
@pytest.mark.parametrize("lie", ["flip", "replace", "tenth", "one_huge"])
def test_a_robust_reducer_that_changes_its_shard_is_caught(aggregator, lie):
    def liar(r, y):
        if r != 1:
            return y
        y = y.clone()
        if lie == "flip":
            return -y
        if lie == "replace":
            return torch.randn(y.numel(), generator=torch.Generator().manual_seed(9))
        if lie == "tenth":  # every tenth value moved far (the spots find one with probability 1 - 0.9^32)
            y[::10] += 100.0
            return y
        y[17] = 1e4  # one value the spots miss, but larger than every sender's part together
        return y

    for seed in range(3):
        sketches, norms = _round("int8", lie=liar, seed=seed, aggregator=aggregator)
        for p in PEERS:
            why = shard_sketches.check(sketches[p], sketches, WEIGHTS, norms)
            assert "the shard reduced by bbbbbb does not match what its senders sent" in why, (lie, seed, why)
            if lie == "one_huge":
                assert "norm" in why


def test_spots_are_drawn_from_the_seed_and_shard():
    assert torch.equal(shard_sketches.spots("s", 0, 1000), shard_sketches.spots("s", 0, 1000))
    assert not torch.equal(shard_sketches.spots("s", 0, 1000), shard_sketches.spots("t", 0, 1000))
    assert shard_sketches.spots("s", 0, 5).numel() == 5 and int(shard_sketches.spots("s", 0, 5).max()) < 5
    assert shard_sketches.spots("s", 0, 10**6).numel() == shard_sketches.SPOTS


def test_a_shift_within_the_codecs_rounding_is_not_a_lie():
    # int8 rounds each value by up to half its block's scale: a shift far below that is honest noise.
    sketches, norms = _round("int8", lie=lambda r, y: y + 1e-4 * y.abs().max())
    assert all(shard_sketches.check(sketches[p], sketches, WEIGHTS, norms) == "" for p in PEERS)


def test_missing_or_malformed_sketches_are_named():
    sketches, norms = _round("none")
    mine = sketches[PEERS[0]]
    others = {p: s for p, s in sketches.items() if p != "peer-cccccc"}
    assert shard_sketches.check(mine, others, WEIGHTS, norms) == "no sketch from cccccc"
    for bad, why in (
        ({**sketches[PEERS[2]], "sent": [[float("nan")] * 4, [0.0] * 4]}, "malformed projections"),
        ({**sketches[PEERS[2]], "sent": [[0.0] * 3, [0.0] * 4]}, "malformed projections"),
        ({**sketches[PEERS[2]], "sent": [[True] * 4, [0.0] * 4]}, "malformed projections"),
        ({**sketches[PEERS[2]], "sent": "x"}, "malformed projections"),
        ({**sketches[PEERS[2]], "seed": "0" * 64}, "computed from another result"),
        ({k: v for k, v in sketches[PEERS[2]].items() if k != "vectors"}, "another version of the reducer check"),
        ({**sketches[PEERS[2]], "shards": [["peer-aaaaaa", 0, 1000]]}, "another layout"),
        ({**sketches[PEERS[2]], "aggregator": "median"}, "another aggregator"),
        ({**sketches[PEERS[2]], "sent_spots": [[0.0] * 3, [0.0] * 32]}, "malformed spot values"),
        ({**sketches[PEERS[2]], "sent_spots": None}, "malformed spot values"),
        ({**sketches[PEERS[2]], "sent_norm": [-1.0, 1.0]}, "malformed norms"),
        ({**sketches[PEERS[2]], "sent_norm": [float("inf"), 1.0]}, "malformed norms"),
        ([1, 2], "not a sketch"),
    ):
        got = shard_sketches.check(mine, {**sketches, "peer-cccccc": bad}, WEIGHTS, norms)
        assert got == f"the sketch of cccccc is {why}" or why in got, (bad, got)


def test_a_sender_whose_sketch_lies_fails_the_check_too():
    # Nobody can tell it from a lying reducer: the round fails, and the message says so.
    sketches, norms = _round("none")
    liar = dict(sketches["peer-cccccc"])
    liar["sent"] = [[x * 3 for x in s] for s in liar["sent"]]
    why = shard_sketches.check(sketches[PEERS[0]], {**sketches, "peer-cccccc": liar}, WEIGHTS, norms)
    assert "does not match" in why and "or a sender's sketch, lied" in why


def test_projections_depend_on_the_seed_and_values_only():
    v = torch.arange(10, dtype=torch.float32)
    one = shard_sketches.projections("s", [[v]])
    assert one == shard_sketches.projections("s", [[v]])
    assert one != shard_sketches.projections("t", [[v]])
    assert len(one[0][0]) == shard_sketches.PROJECTIONS
    # Every shard meets the same vectors (drawn up to the longest shard's length), whatever its index.
    assert shard_sketches.projections("s", [[v], [v, 2 * v]]) == [one[0], [one[0][0], [2 * x for x in one[0][0]]]]


def test_projections_across_chunks_are_exact_and_linear(monkeypatch):
    monkeypatch.setattr(shard_sketches, "CHUNK", 7)  # vectors drawn 7 coordinates at a time
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(20, generator=g), torch.randn(13, generator=g)
    (px,), (py,) = shard_sketches.projections("s", [[x], [y]])
    vectors = torch.cat([shard_sketches._vectors("s", c, n) for c, n in enumerate([7, 7, 6])], dim=1)
    assert px == pytest.approx((vectors @ x.double()).tolist(), rel=1e-12)
    assert py == pytest.approx((vectors[:, :13] @ y.double()).tolist(), rel=1e-12)
    (pxy,) = shard_sketches.projections("s", [[x + 2 * torch.cat([y, torch.zeros(7)])]])
    assert pxy[0] == pytest.approx([a + 2 * b for a, b in zip(px, py, strict=True)], rel=1e-5)  # fp32 sum


@pytest.mark.parametrize("aggregator", ["mean", "median"])
def test_a_reducer_that_adds_an_oversized_own_part_is_named(aggregator):
    """Nobody but the reducer checks the part it adds to its own shard. One that adds a part 100× what its
    declared norm allows and sketches it truthfully matches the projections, so the check bounds each
    sketched part by the sender's declared norm and names the sender."""
    sketches, norms = _round("none", aggregator=aggregator)
    # peer-bbbbbb reduces shard 1; its own part there was 100× larger than its declared norm allows.
    big = {**sketches["peer-bbbbbb"]}
    big["sent_norm"] = [big["sent_norm"][0], 100 * norms["peer-bbbbbb"]]
    big["sent"] = [big["sent"][0], [x * 100 for x in big["sent"][1]]]
    for p in PEERS:
        why, blamed = shard_sketches.first_mismatch(sketches[p], {**sketches, "peer-bbbbbb": big}, WEIGHTS, norms)
        assert blamed == "peer-bbbbbb" and "above the" in why, why
    # A sketch that hides the norm behind its projections is inconsistent, and named too.
    hidden = {**big, "sent_norm": sketches["peer-bbbbbb"]["sent_norm"]}
    why, blamed = shard_sketches.first_mismatch(sketches[PEERS[0]], {**sketches, "peer-bbbbbb": hidden}, WEIGHTS,
                                                norms)
    assert blamed == "peer-bbbbbb" and "inconsistent" in why, why
