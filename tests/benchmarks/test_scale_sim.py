"""The swarm-size model (benchmarks/scale_sim.py): its formulas, fits, failure exposure and command line."""

import json
import math

import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def sim():
    return load_benchmark("scale_sim")


@pytest.fixture(scope="module")
def model(sim):
    built, _ = sim.build_model(sim.MEASURED_DEFAULT, sim.ALLREDUCE_DEFAULT)
    return built


def _bytes_sent_by_counting(g: int, groups: int, gradient: float) -> float:
    """One learner's sends in the two-level scheme, part by part."""
    shard = gradient / g
    sent = (g - 1) * shard  # reduce-scatter: its g − 1 other shards, one to each groupmate
    part = shard / groups
    sent += (groups - 1) * part  # cross-group reduce-scatter of its shard: G − 1 parts to its counterparts
    sent += (groups - 1) * part  # cross-group all-gather: its reduced part back to each of them
    sent += (g - 1) * shard  # all-gather inside the group: its finished shard to each groupmate
    return sent


@pytest.mark.parametrize(("g", "groups"), [(2, 1), (16, 1), (16, 7), (16, 625), (100, 100), (3, 2)])
def test_two_level_bytes_match_the_formula_and_a_part_by_part_count(sim, g, groups):
    factor = sim.two_level_factor(g, groups)
    assert factor == pytest.approx(2 * (g - 1) / g + 2 * (groups - 1) / (groups * g))
    assert factor == pytest.approx(_bytes_sent_by_counting(g, groups, 1.0))
    if groups == 1:
        assert factor == pytest.approx(sim.butterfly_factor(g)) == pytest.approx(2 * (g - 1) / g)


def test_two_level_with_one_group_is_the_butterfly(sim, model):
    for m in (4, 8, 16):
        one = model.two_level(m, 16, 0.1)
        base = model.baseline(m, 0.1)
        assert one["groups"] == 1
        for key in ("mb_sent", "gradient_factor", "round_seconds", "allreduce_seconds", "peers", "p_fail"):
            assert one[key] == pytest.approx(base[key])


def test_fits_recover_exact_curves(sim):
    xs = [4, 8, 16, 32]
    for form, (a, b) in {"linear": (1.0, 0.5), "nlogn": (-0.3, 0.12), "quadratic": (0.2, 0.03), "log": (-290, 251),
                         "power": (0.05, 1.9)}.items():
        ys = [sim.evaluate(form, a, b, x) for x in xs]
        fit = sim.make_fit("q", xs, ys, form)
        assert (fit.a, fit.b) == pytest.approx((a, b), rel=1e-6, abs=1e-9)
        assert fit.max_rel_residual < 1e-9 and abs(fit.holdout_error) < 1e-9


def test_fits_reproduce_the_measurements_within_their_stated_residuals(sim, model):
    rows = sim.measured_rows(sim.MEASURED_DEFAULT)
    fitted = ((model.matchmaking, "matchmaking_seconds_mean"), (model.matchmaking_p90, "matchmaking_seconds_p90"),
              (model.certificate, "certify_seconds_mean"), (model.dht_calls, "dht_calls_per_learner_per_version"))
    for fit, key in fitted:
        for r in rows:
            assert abs(fit(r["learners"]) - r[key]) <= fit.max_abs_residual + 1e-12
            assert abs(fit(r["learners"]) / r[key] - 1) <= fit.max_rel_residual + 1e-12
    # the all-reduce fit is an independent check: within 40% of each allreduce_bench run
    assert max(abs(r) for r in model.allreduce.relative_residuals) < 0.4
    assert 20e6 < model.allreduce.rate_bytes_per_second < 80e6


def test_failure_exposure_grows_with_the_dependency_set(sim):
    p = [sim.failure_probability(0.1, [(n, 60.0)]) for n in (1, 10, 100, 1000)]
    assert p == sorted(p) and p[0] == pytest.approx(1 - math.exp(-0.1 / 60))
    assert sim.failure_probability(0.1, [(10, 60.0), (90, 5.0)]) < sim.failure_probability(0.1, [(100, 60.0)])
    assert sim.failure_probability(0.1, [(10, 60.0), (90, 5.0)]) > sim.failure_probability(0.1, [(10, 60.0)])


@pytest.mark.parametrize("exposures", [[(100, 120.0)], [(16, 60.0), (984, 4.0)], [(3, 600.0)]])
def test_monte_carlo_agrees_with_the_analytic_probability(sim, exposures):
    p = sim.failure_probability(0.5, exposures)
    estimate, _ = sim.monte_carlo_failure(0.5, exposures, trials=4000, seed=1)
    assert abs(estimate - p) < 4 * math.sqrt(p * (1 - p) / 4000) + 1e-3
    assert sim.monte_carlo_failure(0.5, exposures, 500, seed=7) == sim.monte_carlo_failure(0.5, exposures, 500, seed=7)


def test_two_level_depends_on_fewer_learners_than_one_group(model):
    for m in (100, 1000):
        base, two = model.baseline(m, 0.1), model.two_level(m, 16, 0.1)
        assert two["p_fail_group_dropped"] <= two["p_fail"] < base["p_fail"]
        assert two["peers"] < base["peers"] and two["round_seconds"] < base["round_seconds"]
        assert two["dht_kb"] < base["dht_kb"]


def test_command_line_end_to_end(sim, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert sim.main(["--learners", "4", "8", "16", "100", "--mc-trials", "200", "--sweep-group-sizes", "8", "16",
                     "--measured", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for heading in ("### Fits", "### Check", "### Predictions", "### Failure exposure", "### Group size at M = 100"):
        assert heading in printed
    result = json.loads(out.read_text())
    assert [(p["design"], p["learners"]) for p in result["predictions"]][-2:] == [("baseline", 100), ("two-level", 100)]
    assert {r["learners"] for r in result["check"]} == {4, 8, 16}
    assert len(result["monte_carlo"]) == 8 and len(result["group_size_sweep"]) == 2
    assert result["measured_source"]["commit"] == "3f29ff4"
