"""Our inner AdamW against torch.optim.AdamW: same bits, interchangeable state dicts, clear errors."""


import pytest
import torch

from p2p_diloco.config import load_learner_config
from p2p_diloco.core.inner_optim import AdamW
from p2p_diloco.train.models.registry import build_model

SETTINGS = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _model():
    return build_model(load_learner_config("peers/small-cpu.toml", []).model, 0)


def _train(model, opt, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 64), generator=g)
        _, loss = model(x, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def test_bit_identical_to_torch_adamw():
    ours_model, torch_model = _model(), _model()
    ours, theirs = AdamW(ours_model.parameters(), **SETTINGS), torch.optim.AdamW(torch_model.parameters(), **SETTINGS)
    _train(ours_model, ours, 6)
    _train(torch_model, theirs, 6)
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("direction", ["torch to ours", "ours to torch"])
def test_state_dicts_load_across_and_training_continues_identically(direction):
    first_model = _model()
    first = (torch.optim.AdamW if direction == "torch to ours" else AdamW)(first_model.parameters(), **SETTINGS)
    _train(first_model, first, 3)
    saved = first.state_dict()
    second_model = _model()
    second_model.load_state_dict(first_model.state_dict())
    second = (AdamW if direction == "torch to ours" else torch.optim.AdamW)(second_model.parameters(), **SETTINGS)
    second.load_state_dict(saved)
    _train(first_model, first, 3, seed=1)
    _train(second_model, second, 3, seed=1)
    for a, b in zip(first_model.parameters(), second_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_mismatched_state_is_refused():
    model = _model()
    opt = AdamW(model.parameters(), **SETTINGS)
    _train(model, opt, 1)
    other = AdamW([torch.nn.Parameter(torch.zeros(3))], **SETTINGS)
    with pytest.raises(ValueError, match="for .* parameters"):
        other.load_state_dict(opt.state_dict())
    bad = opt.state_dict()
    bad["state"][0]["exp_avg"] = torch.zeros(1)
    with pytest.raises(ValueError, match="does not match its shape"):
        AdamW(model.parameters(), **SETTINGS).load_state_dict(bad)
    with pytest.raises(ValueError, match="invalid AdamW settings"):
        AdamW(model.parameters(), lr=-1.0)


