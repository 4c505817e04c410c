"""Tokenizers: bytes, the committed BPE, a SentencePiece model, and one-line errors for bad files."""

import hashlib
import io
import json
import random
from pathlib import Path

import pytest

from p2p_diloco.train.data.batches import DataError
from p2p_diloco.train.data.tokenizer import ByteTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
BPE = ROOT / "peers" / "tokenizers" / "bpe-4k"
TEXT = "def f(x):\n    return x + 1  # héllo, 世界 🙂\n"


def tiny_sentencepiece(path: Path) -> Path:
    """A SentencePiece BPE model of 100 pieces trained in memory on made-up sentences."""
    import sentencepiece as spm

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "data", "model", "token", "learner", "swarm", "round"]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(500)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=100,
                                   model_type="bpe", minloglevel=2)
    path.write_bytes(model.getvalue())
    return path


def test_bytes_are_the_default():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.fingerprint == "bytes"
    assert tok.encode(TEXT) == list(TEXT.encode()) and tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.separator == [10] and load_tokenizer("bytes").fingerprint == "bytes"
    assert tok.eos_id is None and tok.eos_token is None  # bytes have no end-of-text token: data stays as it was


@pytest.mark.parametrize("where", [BPE, BPE / "tokenizer.json"])
def test_the_committed_bpe_holds_4096_tokens_and_round_trips(where):
    tok = load_tokenizer(str(where))
    assert tok.vocab_size == 4096 and tok.path == BPE / "tokenizer.json"
    assert tok.fingerprint == hashlib.sha256((BPE / "tokenizer.json").read_bytes()).hexdigest()
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) / 1.5 and max(ids) < 4096  # it compresses, even code with unicode
    assert tok.decode(ids) == TEXT
    assert tok.encode_batch([TEXT, "x"]) == [ids, tok.encode("x")]
    assert (BPE / "tokenizer.json").stat().st_size < 300_000


def test_the_committed_bpe_ends_texts_with_its_special_token_which_the_shipped_llamas_know():
    tok = load_tokenizer(str(BPE))
    assert (tok.eos_token, tok.eos_id) == ("<|endoftext|>", 0)
    assert tok.separator == [0]  # documents of a split are joined by it, so a model learns where texts end
    assert 0 not in tok.encode(TEXT) and tok.decode([*tok.encode("a"), 0, *tok.encode("b")]) == "ab"
    for name in ("llama-tiny", "llama-20m"):
        config = json.loads((ROOT / "peers" / "models" / name / "config.json").read_text())
        assert config["vocab_size"] == tok.vocab_size and config["eos_token_id"] == config["bos_token_id"] == 0


def test_a_tokenizer_json_without_an_end_of_text_token_keeps_the_newline(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["a b\n"] * 5, trainers.BpeTrainer(vocab_size=260, special_tokens=["<pad>"],
                                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_id is None and tok.eos_token is None and tok.separator == tok.encode("\n")


def test_a_sentencepiece_model(tmp_path):
    tok = load_tokenizer(str(tiny_sentencepiece(tmp_path / "sp.model")))
    assert tok.vocab_size == 100 and tok.kind == "sentencepiece"
    assert tok.decode(tok.encode("alpha beta swarm")) == "alpha beta swarm"
    assert tok.fingerprint == hashlib.sha256((tmp_path / "sp.model").read_bytes()).hexdigest()
    assert (tok.eos_token, tok.eos_id) == ("</s>", 2) and tok.separator == [2]  # SentencePiece's own eos


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.json", None, "tokenizer .*missing.json does not exist"),
        ("empty_dir", "dir", "tokenizer directory .*empty_dir holds no tokenizer.json"),
        ("broken.json", b'{"model": ', "tokenizer .*broken.json is not a valid Hugging Face tokenizer.json"),
        ("broken.model", b"garbage", "tokenizer .*broken.model is not a valid SentencePiece model"),
        ("vocab.txt", b"a\nb\n", "tokenizer .*vocab.txt is neither a tokenizer.json .* nor a SentencePiece .model"),
    ],
)
def test_bad_tokenizers_give_one_line_errors(tmp_path, name, content, message):
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message) as e:
        load_tokenizer(str(path))
    assert "\n" not in str(e.value)


def test_an_unreadable_tokenizer_names_the_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.mkdir()
    with pytest.raises(DataError, match="holds no tokenizer.json"):
        load_tokenizer(str(path))
    (path / "tokenizer.json").mkdir()  # fails to read like a file without permission (root reads those)
    with pytest.raises(DataError, match="tokenizer .*tokenizer.json/tokenizer.json could not be read"):
        load_tokenizer(str(path))
