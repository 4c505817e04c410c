"""The inner AdamW's multi-tensor path (what a CUDA learner uses) against torch.optim.AdamW(foreach=True)."""

import torch

from p2p_diloco.config import load_learner_config
from p2p_diloco.core.inner_optim import AdamW
from p2p_diloco.train.models.gpt import build_model

SETTINGS = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _model() -> torch.nn.Module:
    return build_model(load_learner_config("peers/small-cpu.toml", []).model, 0)


def _train(model: torch.nn.Module, opt, steps: int, skip: str | None = None) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 64), generator=g)
        _, loss = model(x, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for name, p in model.named_parameters():
            if name == skip:
                p.grad = None  # a parameter without a gradient is left alone, as by torch
        opt.step()


def test_foreach_is_bit_identical_to_torch_foreach_adamw():
    ours_model, torch_model = _model(), _model()
    ours = AdamW(ours_model.parameters(), foreach=True, **SETTINGS)
    theirs = torch.optim.AdamW(torch_model.parameters(), foreach=True, **SETTINGS)
    _train(ours_model, ours, 5, skip="pos_emb.weight")
    _train(torch_model, theirs, 5, skip="pos_emb.weight")
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        assert torch.equal(a, b)
    mine, torch_state = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert mine.keys() == torch_state.keys()
    for i in mine:
        assert all(torch.equal(mine[i][k], torch_state[i][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_foreach_and_per_parameter_paths_agree_and_share_state_dicts():
    a_model, b_model = _model(), _model()
    a, b = AdamW(a_model.parameters(), foreach=True, **SETTINGS), AdamW(b_model.parameters(), **SETTINGS)
    _train(a_model, a, 3)
    _train(b_model, b, 3)
    for p, q in zip(a_model.parameters(), b_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    b.load_state_dict(a.state_dict())  # a GPU learner's checkpoint resumes on a CPU learner and back
    assert all(torch.equal(b.state[i]["exp_avg"], a.state[i]["exp_avg"]) for i in a.state)
