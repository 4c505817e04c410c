import pytest
import torch

from p2p_diloco.core.grace import GraceWindow
from p2p_diloco.core.merging import rda_combine, rda_reference, to_unit, token_weight
from p2p_diloco.core.outer import weighted_mean


def test_token_weight_formula_and_staleness():
    assert token_weight(1000, 10) == 1000 * 100
    assert token_weight(1000, 10, rule="tokens") == 1000
    assert token_weight(1000, 10, missed_versions=3) == pytest.approx(1000 * 100 / 4)
    assert token_weight(0, 10) == 0.0 and token_weight(10, 0) == 0.0
    # equal tokens: fewer (larger) steps weigh more
    assert token_weight(512, 2) > token_weight(512, 8)


def _deltas(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(50, generator=g), torch.randn(7, 3, generator=g)] for _ in range(m)]


def test_rda_through_weighted_mean_matches_reference():
    deltas, weights = _deltas(4), [1.0, 3.0, 2.0, 5.0]
    units, norms = zip(*(to_unit(d) for d in deltas), strict=False)
    # what the all-reduce does: a weighted mean of unit vectors; norms travel in gathered metadata
    avg_unit = weighted_mean(list(units), weights)
    got = rda_combine(avg_unit, norms, weights)
    ref = rda_reference(deltas, weights)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rda_keeps_mean_norm_where_plain_mean_shrinks():
    deltas, weights = _deltas(8, seed=1), [1.0] * 8
    mean_norm = sum(float(torch.cat([t.flatten() for t in d]).norm()) for d in deltas) / 8
    rda = torch.cat([t.flatten() for t in rda_reference(deltas, weights)]).norm()
    plain = torch.cat([t.flatten() for t in weighted_mean(deltas, weights)]).norm()
    assert float(rda) == pytest.approx(mean_norm, rel=1e-5)
    assert float(plain) < 0.6 * mean_norm  # nearly orthogonal vectors: ~1/sqrt(8)


def test_rda_of_identical_vectors_is_that_vector():
    d = _deltas(1)[0]
    out = rda_reference([d, d, d], [1.0, 2.0, 3.0])
    for a, b in zip(out, d, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grace_window_follows_slack():
    g = GraceWindow(overlap_steps=100, gamma=0.5, floor=1.0, ceiling=8.0)
    assert g.choose() == 1.0  # nothing measured yet
    for _ in range(50):
        g.observe_step(0.1)  # τ·t_step = 10 s
    g.observe_round(round_seconds=3.0, allreduce_seconds=1.0, window=1.0)  # t_quorum 1, t_sync 1
    assert g.slack == pytest.approx(8.0)
    assert g.choose() == pytest.approx(4.0)
    g0 = GraceWindow(overlap_steps=0, gamma=0.5, floor=2.5, ceiling=8.0)
    g0.observe_step(1.0)
    assert g0.choose() == 2.5
