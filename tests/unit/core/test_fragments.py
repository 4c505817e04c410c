import pytest
import torch

from p2p_diloco.config import ModelConfig
from p2p_diloco.core.fragments import build_fragments, due_fragments, partition
from p2p_diloco.train.models.registry import build_model


def _named():
    cfg = ModelConfig(n_layer=4, n_embd=64, n_head=4)
    return [(n, p.shape) for n, p in build_model(cfg, 0).named_parameters()]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_every_parameter_in_exactly_one_fragment(p):
    named = _named()
    bins = partition([s for _, s in named], p)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(named)))
    assert all(b for b in bins)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_fragments_are_balanced(p):
    named = _named()
    sizes = [sum(torch.Size(named[i][1]).numel() for i in b) for b in partition([s for _, s in named], p)]
    largest_tensor = max(torch.Size(s).numel() for _, s in named)
    # Greedy (largest first, into the lightest bin) is within one largest tensor of perfect balance.
    assert max(sizes) - min(sizes) <= largest_tensor
    assert max(sizes) <= sum(sizes) / p + largest_tensor


def test_same_fragments_on_every_learner_and_embedding_flag():
    a, b = build_fragments(_named(), 4, 24), build_fragments(_named(), 4, 24)
    assert a == b
    assert any(f.has_embedding for f in a)
    assert [f.offset for f in a] == [0, 6, 12, 18]


def test_staggered_schedule_syncs_each_fragment_once_per_outer_step():
    frags = build_fragments(_named(), 4, 24)
    due = [f.index for s in range(1, 49) for f in due_fragments(frags, s, 24)]
    assert sorted(due) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert due_fragments(frags, 0, 24) == []
    # at most one fragment starts on any step
    assert all(len(due_fragments(frags, s, 24)) <= 1 for s in range(1, 200))


def test_single_fragment_is_plain_diloco():
    frags = build_fragments(_named(), 1, 10)
    assert [s for s in range(1, 31) if due_fragments(frags, s, 10)] == [10, 20, 30]


def test_too_many_fragments_is_an_error():
    with pytest.raises(ValueError):
        partition([torch.Size([2])], 2)


def test_clock_schedule_staggers_fragments_and_skips_the_current_slot():
    from p2p_diloco.core.fragments import ClockSchedule

    frags = build_fragments(_named(), 4, 24)
    sched = ClockSchedule(frags, period=40.0, now=1000.0)
    assert sched.due(1000.5) == []
    fired = []
    t = 1000.0
    while t < 1080.0:
        t += 0.5
        fired += [(round(t, 1), f.index) for f in sched.due(t)]
    # one fragment every period / P = 10 s, each fragment once per 40 s period
    assert [f for _, f in fired] == [1, 2, 3, 0, 1, 2, 3, 0]
    gaps = {round(b[0] - a[0], 1) for a, b in zip(fired, fired[1:], strict=False)}
    assert gaps == {10.0}


def test_clock_schedule_next_slot_is_when_that_fragment_is_next_due():
    from p2p_diloco.core.fragments import ClockSchedule

    frags = build_fragments(_named(), 4, 24)
    for now in (1000.0, 1003.7, 1019.99, 1020.0):
        for f in frags:
            sched = ClockSchedule(frags, period=40.0, now=now)
            at = sched.next_slot(f, now)
            assert now < at <= now + 40.0
            assert f not in sched.due(at - 1e-6)
            assert f in sched.due(at)
