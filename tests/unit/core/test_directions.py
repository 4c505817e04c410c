"""The direction sketch of an outer gradient and rule 3 of the exclusion (a learner that climbs the loss)."""

import math

import pytest
import torch

from p2p_diloco.core import directions
from p2p_diloco.core.bans import Bans
from p2p_diloco.core.exclusion import Rules, judge


def _honest(base: torch.Tensor, noise: float, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [base + noise * torch.randn(base.shape, generator=g)]


def _true_cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    x, y = torch.cat([t.flatten() for t in a]).double(), torch.cat([t.flatten() for t in b]).double()
    return float(x @ y / (x.norm() * y.norm()))


def test_the_sketch_estimates_the_cosine_of_the_whole_vectors():
    base = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    for noise in (0.5, 1.0, 2.0):
        a, b = _honest(base, noise, 1), _honest(base, noise, 2)
        est = directions.cosine(directions.sketch(a, "s"), directions.sketch(b, "s"))
        assert abs(est - _true_cosine(a, b)) < 0.3, (noise, est, _true_cosine(a, b))
    # The same vector under the same seed gives the same sketch at every member; another seed another one.
    assert directions.sketch([base], "s") == directions.sketch([base.clone()], "s")
    assert directions.sketch([base], "s") != directions.sketch([base], "t")


def test_the_sketch_is_linear_across_tensors_and_chunks(monkeypatch):
    monkeypatch.setattr(directions, "CHUNK", 7)
    x = [torch.randn(3, 5), torch.randn(11)]
    s1, s2 = directions.sketch(x, "k"), directions.sketch([2 * t for t in x], "k")
    assert all(math.isclose(2 * a, b, rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(s1, s2, strict=True))
    assert directions.cosine([0.0] * 4, [1.0] * 4) == 0.0


@pytest.mark.parametrize("bad", [None, "x", [1.0] * 127, [1.0] * 129, [float("nan")] + [1.0] * 127,
                                 [True] + [1.0] * 127, [[1.0]] * 128])
def test_malformed_sketches_are_not_valid(bad):
    assert directions.valid(bad) is None


def _meta(sketch, norm=1.0):
    return {"norm": norm, "finite": True, "weight": 1.0, "direction": sketch}


def _group(honest: int, climbers: int, noise: float = 1.0):
    base = torch.randn(20_000, generator=torch.Generator().manual_seed(7))
    deltas = {f"h{i}": _honest(base, noise, i) for i in range(honest)}
    deltas |= {f"x{i}": [-d for d in _honest(base, noise, 100 + i)] for i in range(climbers)}
    return {p: _meta(directions.sketch(d, "parent")) for p, d in deltas.items()}


@pytest.mark.parametrize("honest,climbers", [(2, 1), (3, 1), (5, 2), (7, 3)])
def test_climbers_are_excluded_and_honest_members_kept(honest, climbers):
    verdict = judge(_group(honest, climbers), Rules(8.0, direction_check=True))
    assert sorted(verdict.excluded) == [f"x{i}" for i in range(climbers)]
    assert "points away from the others'" in verdict.excluded["x0"].why
    # The excluded climbers are banned from the learner's next rounds, as outliers are.
    assert Bans().after_round(verdict, "h0") == [f"x{i}" for i in range(climbers)]


def test_the_rule_is_off_unless_the_rules_say_so_and_judges_no_pair():
    assert not judge(_group(3, 1), Rules(8.0)).excluded
    assert not judge(_group(1, 1), Rules(8.0, direction_check=True)).excluded


def test_a_member_without_a_valid_sketch_is_excluded_when_the_rule_is_on():
    group = _group(3, 0)
    group["h1"] = {**group["h1"], "direction": [1.0] * 3}
    del group["h2"]["direction"]
    verdict = judge(group, Rules(8.0, direction_check=True))
    assert sorted(verdict.excluded) == ["h1", "h2"]
    assert verdict.excluded["h1"].why == "its direction sketch is missing or malformed"


def test_a_free_rider_that_sends_nothing_is_not_mistaken_for_a_climber():
    group = _group(3, 0)
    group["z"] = _meta([0.0] * directions.DIM, norm=0.0)
    assert "z" not in judge(group, Rules(8.0, direction_check=True)).excluded
