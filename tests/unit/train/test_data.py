import hashlib
import os
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import DataConfig
from p2p_diloco.train.data.batches import (
    BatchSampler,
    DataError,
    default_corpus_root,
    fixed_eval_batches,
    load_split,
    load_splits,
)
from p2p_diloco.train.data.corpus import open_corpus


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
    # 60 docs of 3000 bytes, cut in pieces of 2250 bytes for this small corpus (so 120 pieces), joined
    # with one newline between pieces inside each split.
    assert open_corpus(cfg).piece_bytes == 2250
    assert total == 60 * 3000 + (120 - 4)
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
    with pytest.raises(DataError, match="holds only 2 bytes; 1 shard.* need at least 102400 bytes"):
        load_split(DataConfig(path=str(tmp_path), num_shards=1), 0)


TEXT_SUFFIXES_BEFORE = {".py", ".txt", ".md", ".rst", ".toml", ".json", ".csv", ".html", ".c", ".h", ".cfg", ""}


# Today's reading of a text corpus, before pieces were sized from the corpus: the byte splits of the
# default corpus must stay exactly these, or the default swarm's results would change.
def _bytes_before_sizing(cfg: DataConfig, split: int | None) -> bytes:
    root, limit, chunks, total = default_corpus_root(), int(cfg.max_corpus_mb * 1e6), [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in {"site-packages", "__pycache__"})
        for fn in sorted(filenames):
            p = Path(dirpath) / fn
            if p.suffix not in TEXT_SUFFIXES_BEFORE:
                continue
            if total >= limit:
                return b"\n".join(chunks)
            raw = p.read_bytes()
            if b"\0" in raw[:4096]:
                continue
            name = str(p.relative_to(root))
            pieces = [(name, raw)] if len(raw) <= 65536 else [
                (f"{name}#{i // 65536}", raw[i : i + 65536]) for i in range(0, len(raw), 65536)]
            for piece_name, piece in pieces:
                b = int.from_bytes(hashlib.sha256(piece_name.encode()).digest()[:8], "big") % 10_000
                if (None if b < cfg.eval_fraction * 10_000 else b % cfg.num_shards) == split:
                    chunks.append(piece)
                    total += len(piece)
    return b"\n".join(chunks)


@pytest.mark.parametrize("split", [3, None])
def test_default_corpus_gives_the_same_bytes_as_before(split):
    cfg = DataConfig(max_corpus_mb=0.5)  # 16 shards, eval fraction 0.02: the default swarm's split
    assert open_corpus(cfg).piece_bytes == 64 * 1024
    got = load_splits(cfg, [split])[split]
    assert got.dtype == torch.uint8
    assert bytes(got.numpy()) == _bytes_before_sizing(cfg, split)


def test_a_300_kb_directory_feeds_16_shards(tmp_path):
    # Five files of 60 KB: with the old 64 KiB pieces, 5 documents for 17 splits left most shards empty.
    g = torch.Generator().manual_seed(1)
    for i in range(5):
        (tmp_path / f"book{i}.txt").write_bytes(bytes(torch.randint(97, 123, (60_000,), generator=g).tolist()))
    cfg = DataConfig(path=str(tmp_path), num_shards=16)
    splits = load_splits(cfg, [*range(16), None], min_tokens=66)
    assert min(len(t) for t in splits.values()) >= 1024
    assert sum(len(t) for t in splits.values()) >= 300_000


def test_a_truly_tiny_corpus_says_how_much_text_it_needs(tmp_path):
    (tmp_path / "a.txt").write_text("word " * 10_000)  # 50 KB
    with pytest.raises(DataError, match=r"holds only 50000 bytes; 16 shard\(s\).* at least 102400 bytes") as e:
        load_splits(DataConfig(path=str(tmp_path), num_shards=16), [0, None])
    assert "\n" not in str(e.value) and "eval_fraction" in str(e.value)
    with pytest.raises(DataError, match="shard 0/4 .* holds only .* tokens, fewer than the 100000 needed; "
                                        "the corpus needs about .* MB"):
        load_splits(DataConfig(path=str(tmp_path), num_shards=4, eval_fraction=0.1), [0], min_tokens=100_000)
