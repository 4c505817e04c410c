"""What startup.build adds for models. The lineage id covers a Hugging Face model's config.json and its initial
weights, and stays what it was for the built-in model: learners with different models or inits never meet, old and
new built-in learners still do. The tokenizer's vocabulary must fit the model's."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import ConfigError, load_learner_config
from p2p_diloco.learner.startup import build, lineage_id
from p2p_diloco.train.models.registry import build_model, vocab_size

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "peers" / "models" / "llama-tiny"


def _cfg(*overrides: str):
    return load_learner_config(ROOT / "peers" / "small-cpu.toml", ["inner.steps_per_outer=6", *overrides])


def _lineage(model_path: Path, *overrides: str) -> str:
    cfg = _cfg(f'model.path="{model_path}"', *overrides)
    trainer, _ = build(cfg)
    return lineage_id(cfg, trainer.model_files)


def test_builtin_lineage_is_unchanged():
    # The ids before Hugging Face models existed (commit 0da125a): built-in learners of old and new code meet,
    # under the quorum the old code applied (K alone). Under the default majority quorum (since 2026-12-03) the
    # lineage is another one: learners that apply different quorums never meet; likewise with short rounds scaled
    # and long rounds decayed (the defaults since 2026-12-05), and with identities established after 4 rounds
    # (the default since 2026-12-07).
    for name, expected in [("small-cpu", "2543e0b8"), ("default", "86b63fdb")]:
        cfg = load_learner_config(ROOT / "peers" / f"{name}.toml",
                                  ["averaging.quorum=fixed", "outer.short_rounds=full", "outer.long_rounds=full",
                                   "averaging.established_after=0"])
        trainer, _ = build(cfg)
        assert trainer.model_files is None
        assert lineage_id(cfg, trainer.model_files) == lineage_id(cfg) == expected


def test_hf_lineage_covers_config_and_initial_weights(tmp_path):
    base = _lineage(TINY)
    assert base == _lineage(TINY)  # deterministic
    assert base != lineage_id(_cfg(f'model.path="{TINY}"'))  # the model's files count

    same = tmp_path / "same-config-elsewhere"
    shutil.copytree(TINY, same)
    assert _lineage(same) == base  # where the files lie does not count

    changed = tmp_path / "other-config"
    changed.mkdir()
    raw = json.loads((TINY / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": 1e-6}))  # same shapes, other model
    assert _lineage(changed) != base

    weights = tmp_path / "with-weights"
    model = build_model(_cfg(f'model.path="{TINY}"').model, seed=0)
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)  # one init differs, the config is the same
    model.hf.save_pretrained(weights)
    (weights / "config.json").write_text((TINY / "config.json").read_text())
    assert _lineage(weights) != base
    assert _lineage(TINY, "run.seed=1") != base


def test_tokenizer_must_fit_the_model():
    bpe = ROOT / "peers" / "tokenizers" / "bpe-4k"
    with pytest.raises(ConfigError, match="4096 tokens, more than the model's vocabulary of 256") as info:
        build(_cfg(f'data.tokenizer="{bpe}"'))  # the byte GPT embeds 256 ids
    assert "\n" not in str(info.value)
    trainer, _ = build(_cfg(f'data.tokenizer="{bpe}"', f'model.path="{TINY}"'))
    assert vocab_size(trainer.model) == 4096
