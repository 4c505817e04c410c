import pytest
import torch

from p2p_diloco.config import DataConfig
from p2p_diloco.data import BatchSampler, DataError, fixed_eval_batches, load_split, load_splits


@pytest.fixture
def corpus(tmp_path):
    g = torch.Generator().manual_seed(0)
    for i in range(60):
        words = torch.randint(97, 123, (3000,), generator=g).tolist()
        (tmp_path / f"doc{i:02d}.txt").write_bytes(bytes(words))
    return tmp_path


def test_shards_partition_the_corpus_and_exclude_eval(corpus):
    cfg = DataConfig(path=str(corpus), num_shards=3, eval_fraction=0.1)
    parts = [load_split(cfg, i) for i in range(3)]
    evaluation = load_split(cfg, None)
    total = sum(len(p) for p in parts) + len(evaluation)
    # 60 docs of 3000 bytes, joined with one newline between docs inside each split.
    assert total == 60 * 3000 + (60 - 4)
    assert torch.equal(load_split(cfg, 1), parts[1])  # deterministic


def test_default_corpus_is_the_stdlib():
    cfg = DataConfig(num_shards=64, max_corpus_mb=0.5)
    assert len(load_split(cfg, 5)) > 100_000


def test_one_pass_gives_each_split_what_loading_it_alone_gives():
    cfg = DataConfig(num_shards=8, max_corpus_mb=0.3)
    both = load_splits(cfg, [3, None])
    assert torch.equal(both[3], load_split(cfg, 3))
    assert torch.equal(both[None], load_split(cfg, None))


def test_one_pass_over_a_directory_matches_separate_loads(corpus):
    cfg = DataConfig(path=str(corpus), num_shards=3, eval_fraction=0.1, max_corpus_mb=0.02)
    both = load_splits(cfg, [1, None])
    assert torch.equal(both[1], load_split(cfg, 1)) and torch.equal(both[None], load_split(cfg, None))
    assert len(both[1]) < 60 * 3000 / 3  # the limit cut this split short


def test_sampler_is_reproducible_and_resumable(corpus):
    data = load_split(DataConfig(path=str(corpus), num_shards=1), 0)
    a = BatchSampler(data, 16, 4, seed=1)
    batches = [a.next_batch() for _ in range(3)]
    b = BatchSampler(data, 16, 4, seed=1, cursor=2)
    x, y = b.next_batch()
    assert torch.equal(x, batches[2][0]) and torch.equal(y, batches[2][1])
    assert torch.equal(batches[0][0][:, 1:], batches[0][1][:, :-1])
    assert fixed_eval_batches(data, 16, 4, 2)[1][0].shape == (4, 16)


def test_bad_paths_give_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_split(DataConfig(path=str(tmp_path / "nope")), 0)
    (tmp_path / "tiny.txt").write_text("hi")
    with pytest.raises(DataError, match="holds only"):
        load_split(DataConfig(path=str(tmp_path), num_shards=1), 0)
