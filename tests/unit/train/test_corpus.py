"""Table corpora (.jsonl, .json, .parquet, .csv), read with `datasets` and split by row, and their errors."""

import json
import os
import random

# Before anything imports `datasets` or `huggingface_hub`: these tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

from p2p_diloco.config import DataConfig  # noqa: E402
from p2p_diloco.train.data.batches import DataError, load_splits  # noqa: E402
from p2p_diloco.train.data.corpus import open_corpus, split_of  # noqa: E402
from p2p_diloco.train.data.tokenizer import load_tokenizer  # noqa: E402

WORDS = ["round", "learner", "fragment", "momentum", "shard", "swarm", "token", "peer", "outer", "inner"]
ROWS = [f"row {i}: " + " ".join(random.Random(i).choices(WORDS, k=8)) for i in range(600)]


def write_table(path, fmt, rows, field="text"):
    """``rows`` as one table file of format ``fmt`` at ``path``, with an extra numeric column."""
    records = [{field: r, "n": i} for i, r in enumerate(rows)]
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif fmt == "json":
        path.write_text(json.dumps(records))
    elif fmt == "csv":
        path.write_text(f"{field},n\n" + "".join(f'"{r[field]}",{r["n"]}\n' for r in records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({field: [r[field] for r in records], "n": [r["n"] for r in records]}), path)
    return path


def rows_by_split(cfg, splits):
    """The rows each split holds, read back from its bytes."""
    got = load_splits(cfg, splits)
    return {s: bytes(t.numpy()).decode().split("\n") for s, t in got.items()}


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_each_table_format_splits_its_rows_by_hash(tmp_path, fmt):
    path = write_table(tmp_path / f"rows.{fmt}", fmt, ROWS)
    cfg = DataConfig(path=str(path), num_shards=2, eval_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    assert open_corpus(cfg).kind == "table"
    got = rows_by_split(cfg, [0, 1, None])
    assert sorted(sum(got.values(), [])) == sorted(ROWS)
    for s, rows in got.items():
        assert all(split_of(f"rows.{fmt}#{int(r.split(':')[0][4:])}", 2, 0.1) == s for r in rows)


def test_a_directory_of_tables_with_the_bpe_tokenizer(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_table(data / "a.jsonl", "jsonl", ROWS[:300])
    write_table(data / "b.parquet", "parquet", ROWS[300:])
    (data / "README.md").write_text("not a table: ignored, since the directory holds .jsonl/.parquet files")
    cfg = DataConfig(path=str(data), num_shards=2, eval_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    tok = load_tokenizer("peers/tokenizers/bpe-4k")
    ids = load_splits(cfg, [0, None], tok)
    text = rows_by_split(cfg, [0, None])
    for s in (0, None):
        assert ids[s].dtype.itemsize == 2  # uint16: 4096 ids fit
        sep = tok.separator  # <|endoftext|> between rows, so a model learns where a text ends
        assert ids[s].tolist() == [i for r in text[s] for i in (*sep, *tok.encode(r))][len(sep):]
        assert all(r in ROWS for r in text[s])


def test_json_and_csv_files_in_a_text_directory_stay_text(tmp_path):
    (tmp_path / "code.py").write_text("x = 1\n" * 20_000)
    (tmp_path / "settings.json").write_text('{"a": 1}')
    assert open_corpus(DataConfig(path=str(tmp_path))).kind == "text"
    assert open_corpus(DataConfig(path=str(tmp_path / "settings.json"))).kind == "table"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_a_table_without_the_text_field_names_the_file_and_its_columns(tmp_path, fmt):
    path = write_table(tmp_path / f"rows.{fmt}", fmt, ROWS[:50], field="content")
    with pytest.raises(DataError, match=rf"rows.{fmt} has no column 'text' \(data.text_field\); "
                                        r"its columns: \['content', 'n'\]") as e:
        load_splits(DataConfig(path=str(path), cache_dir=str(tmp_path / "cache")), [0])
    assert "\n" not in str(e.value)
    cfg = DataConfig(path=str(path), text_field="content", num_shards=1, eval_fraction=0.1,
                     cache_dir=str(tmp_path / "cache"))
    assert len(load_splits(cfg, [0])[0]) > 1024  # naming the column reads it


def test_bad_tables_give_one_line_errors(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(DataError, match="could not read .*broken.jsonl: ") as e:
        load_splits(DataConfig(path=str(tmp_path / "broken.jsonl"), cache_dir=str(tmp_path / "c")), [0])
    assert "\n" not in str(e.value)
    write_table(tmp_path / "numbers.jsonl", "jsonl", ROWS[:5], field="n2")
    with pytest.raises(DataError, match="numbers.jsonl row 0: column 'n' holds int, not text"):
        load_splits(DataConfig(path=str(tmp_path / "numbers.jsonl"), text_field="n", cache_dir=str(tmp_path / "c")),
                    [0])


def test_too_little_text_in_a_table_says_which_split(tmp_path):
    path = write_table(tmp_path / "few.jsonl", "jsonl", ROWS[:40])
    with pytest.raises(DataError, match=r"shard \d+/16 of .*few.jsonl holds only \d+ bytes of text "
                                        r"\(at least 1024 needed\): give more text or lower data.num_shards"):
        load_splits(DataConfig(path=str(path), cache_dir=str(tmp_path / "cache")), list(range(16)))
    assert not list((tmp_path / "cache").glob("*"))  # nothing half-made is left behind


def test_a_hub_name_goes_through_the_same_streaming_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so that "someone/corpus" is not a local path
    corpus = open_corpus(DataConfig(path="someone/corpus"))
    assert corpus.kind == "hub" and corpus.source == "someone/corpus"
    with pytest.raises(DataError, match="could not read someone/corpus .*hub dataset.*: ") as e:
        load_splits(DataConfig(path="someone/corpus"), [0])  # offline here, so `datasets` cannot reach the hub
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="data path .*not/a/hub/name does not exist"):
        open_corpus(DataConfig(path="not/a/hub/name"))
