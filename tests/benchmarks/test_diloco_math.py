"""The no-network benchmark's decoupled arithmetic (benchmarks/diloco_math.py) against its plain DiLoCo."""

import pytest

from tests.benchmarks import ROOT, load_benchmark


@pytest.fixture(scope="module")
def diloco_math():
    return load_benchmark("diloco_math")


def _curve(diloco_math, kind, policy=None, *overrides):
    config = str(ROOT / "peers" / "small-cpu.toml")
    tiny = ["model.n_layer=1", "model.n_embd=32", "data.eval_batches=2", *overrides]
    return diloco_math.run((kind, 5, 0.7, 0.6, policy), 2, 20, 10, config, tiny)["curve"]


def test_one_fragment_without_overlap_or_compression_is_plain_diloco(diloco_math):
    plain = _curve(diloco_math, "diloco")
    assert _curve(diloco_math, "decoupled", "overwrite") == plain
    assert _curve(diloco_math, "decoupled", "mix") == plain  # with τ = 0 nothing is left to mix


def test_overlap_policies_and_int4_change_the_result(diloco_math):
    decoupled = ["sync.fragments=2", "sync.overlap_steps=1", "averaging.compression=int4"]
    overwrite = _curve(diloco_math, "decoupled", "overwrite", *decoupled)
    mix = _curve(diloco_math, "decoupled", "mix", *decoupled)
    assert overwrite[0] == mix[0] and overwrite[-1] != mix[-1]
    assert all(0 < loss < 10 for _, loss in overwrite + mix)
