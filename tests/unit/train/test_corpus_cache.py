"""The tokenised-shard cache: reused on restart, rebuilt when the tokenizer or the corpus changes,
never left half-written."""

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import DataConfig
from p2p_diloco.train.data import batches as data
from p2p_diloco.train.data.batches import load_splits
from p2p_diloco.train.data.tokenizer import Tokenizer, load_tokenizer

BPE = Path(__file__).resolve().parents[3] / "peers" / "tokenizers" / "bpe-4k" / "tokenizer.json"


class Counting(Tokenizer):
    """Another tokenizer that counts the texts it encodes, and fails after ``fail_after`` batches."""

    def __init__(self, inner: Tokenizer, fail_after: int | None = None) -> None:
        self.inner, self.fail_after, self.texts, self.batches = inner, fail_after, 0, 0
        self.kind, self.vocab_size, self.fingerprint, self.path = inner.kind, inner.vocab_size, inner.fingerprint, None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        self.batches += 1
        if self.fail_after is not None and self.batches > self.fail_after:
            raise KeyboardInterrupt  # like a learner stopped mid-way
        self.texts += len(texts)
        return self.inner.encode_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        return self.inner.decode(ids)


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(40):
        words = [["def", "return", "class", "self", "import", "x", "(", ")", ":", "\n"][int(j)]
                 for j in torch.randint(0, 10, (1500,), generator=g)]
        (d / f"doc{i:02d}.py").write_text(" ".join(words))
    return d


def cfg_for(corpus: Path, tmp_path: Path) -> DataConfig:
    return DataConfig(path=str(corpus), num_shards=4, eval_fraction=0.1, cache_dir=str(tmp_path / "cache"))


def test_a_restart_reuses_the_cache_and_a_new_tokenizer_rebuilds_it(corpus, tmp_path, caplog):
    cfg, first = cfg_for(corpus, tmp_path), Counting(load_tokenizer(str(BPE)))
    with caplog.at_level(logging.INFO, logger="p2p_diloco.train.data.batches"):
        a = load_splits(cfg, [2, None], first)
        assert first.texts > 0 and "tokenising shard2of4 and eval" in caplog.text
        caplog.clear()
        again = Counting(load_tokenizer(str(BPE)))
        b = load_splits(cfg, [2, None], again)
        assert again.texts == 0  # no re-tokenisation on restart
        assert "tokenised shard2of4 from cache" in caplog.text and "tokenised eval from cache" in caplog.text
    assert all(torch.equal(a[s], b[s]) and b[s].dtype == torch.uint16 for s in (2, None))
    bytes_text = load_splits(cfg, [2])[2]
    assert first.decode(a[2].tolist()) == bytes(bytes_text.numpy()).decode()  # same documents, same order

    changed = tmp_path / "tokenizer.json"  # the same merges, another file: another fingerprint
    changed.write_text(json.dumps(json.loads(BPE.read_text()), indent=1))
    other = Counting(load_tokenizer(str(changed)))
    assert other.fingerprint != first.fingerprint
    load_splits(cfg, [2], other)
    assert other.texts > 0
    assert len(list((tmp_path / "cache").glob("shard2of4-*.uint16"))) == 2


def test_an_edited_corpus_or_other_settings_rebuild(corpus, tmp_path):
    cfg, tok = cfg_for(corpus, tmp_path), load_tokenizer(str(BPE))
    load_splits(cfg, [1], tok)
    (corpus / "doc00.py").write_text("x = 2\n" * 300)  # size and mtime change
    edited = Counting(tok)
    load_splits(cfg, [1], edited)
    assert edited.texts > 0
    for change in ({"max_corpus_mb": 0.01}, {"num_shards": 5}, {"eval_fraction": 0.2}):
        other = Counting(tok)
        load_splits(cfg.model_copy(update=change), [1], other)
        assert other.texts > 0, change
    unchanged = Counting(tok)
    load_splits(cfg, [1], unchanged)
    assert unchanged.texts == 0


def test_a_stopped_tokenisation_leaves_no_cache_file(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(data._TokenSink, "_BATCH_CHARS", 2_000)  # many batches, so it stops mid-way
    cfg = cfg_for(corpus, tmp_path)
    with pytest.raises(KeyboardInterrupt):
        load_splits(cfg, [0, None], Counting(load_tokenizer(str(BPE)), fail_after=3))
    assert not list((tmp_path / "cache").iterdir())  # neither a final file nor a temporary one
    done = Counting(load_tokenizer(str(BPE)))
    load_splits(cfg, [0, None], done)
    assert done.texts > 0 and len(list((tmp_path / "cache").iterdir())) == 2


def test_the_default_cache_dir_is_under_the_working_directory(corpus, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(data, "_PROGRESS_EVERY_S", 0.0)  # a progress line after every file
    cfg = DataConfig(path=str(corpus), num_shards=4, eval_fraction=0.1)
    with caplog.at_level(logging.INFO, logger="p2p_diloco.train.data.batches"):
        load_splits(cfg, [3], load_tokenizer(str(BPE)))
    assert len(list((tmp_path / ".cache" / "p2p-diloco").glob("shard3of4-*.uint16"))) == 1
    assert "MB read in" in caplog.text and "shard3of4" in caplog.text
    shutil.rmtree(tmp_path / ".cache")


def test_a_killed_writers_temporary_file_is_cleaned_up(corpus, tmp_path):
    cfg, tok = cfg_for(corpus, tmp_path), load_tokenizer(str(BPE))
    load_splits(cfg, [0], tok)
    (final,) = (tmp_path / "cache").iterdir()
    final.unlink()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = final.with_name(f"{final.name}.{int(gone.stdout)}.tmp")  # what a SIGKILL mid-write leaves
    left.write_bytes(b"\0" * 10)
    load_splits(cfg, [0], tok)
    assert sorted((tmp_path / "cache").iterdir()) == [final]
