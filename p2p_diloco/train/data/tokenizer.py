"""Tokenizers: bytes (the default), a Hugging Face ``tokenizer.json``, or a SentencePiece ``.model``.

All three share one small interface, :class:`Tokenizer`, so the data code and the model need not
know which one they hold. The ``tokenizers`` and ``sentencepiece`` libraries are imported only when
such a tokenizer is loaded: a default learner (bytes) starts without them.

Example::

    >>> tok = load_tokenizer("peers/tokenizers/bpe-4k")
    >>> tok.vocab_size, tok.decode(tok.encode("def f(x):")) == "def f(x):"
    (4096, True)
    >>> tok.eos_token, tok.separator                    # documents of a split are joined by it
    ('<|endoftext|>', [0])
    >>> load_tokenizer(None).encode("hé")
    [104, 195, 169]
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2p_diloco.train.data.corpus import DataError, one_line

BYTES = "bytes"
# The end-of-text token's name in the tokenizers people bring, most wanted first: GPT-2 / Qwen (and ours),
# Llama 3, Llama 2 / Mistral, Gemma. A tokenizer.json does not say which of its special tokens ends a text
# (tokenizer_config.json does, and not every tokenizer comes with one), so the name decides.
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class Tokenizer(ABC):
    """Text to token ids and back.

    ``vocab_size`` is one more than the largest id it can produce (a model's embedding table must
    hold that many rows); ``fingerprint`` identifies it (the sha256 of its file, or ``"bytes"``), so
    caches and lineages can tell tokenizers apart; ``path`` is the file it was read from;
    ``eos_id`` / ``eos_token`` its end-of-text token, None when it has none (bytes).
    """

    kind: str
    vocab_size: int
    fingerprint: str
    path: Path | None
    eos_id: int | None = None
    eos_token: str | None = None

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text, without special tokens (documents are joined by :attr:`separator`)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; invalid sequences decode to U+FFFD rather than raising."""

    def encode(self, text: str) -> list[int]:
        """The ids of one text."""
        return self.encode_batch([text])[0]

    @property
    def separator(self) -> list[int]:
        """The ids placed between two documents of a split: the end-of-text token when there is one (so
        the model learns where a text ends, and ``generate`` stops there), else those of a newline, as
        bytes always had."""
        return [self.eos_id] if self.eos_id is not None else self.encode("\n")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, path={self.path})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids: a vocabulary of 256, nothing to load, the default."""

    kind = BYTES
    vocab_size = 256
    fingerprint = BYTES
    path = None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The UTF-8 bytes of each text."""
        return [list(t.encode()) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of a byte sequence."""
        return bytes(ids).decode(errors="replace")


class HuggingFaceTokenizer(Tokenizer):
    """A ``tokenizer.json`` read with the ``tokenizers`` library (BPE, WordPiece, Unigram, ...)."""

    kind = "huggingface"

    def __init__(self, path: Path, raw: bytes) -> None:
        from tokenizers import Tokenizer as _Rust  # lazily: only when this kind is asked for

        # The learner forks its DHT process after tokenising; children never tokenise, so the
        # library's "parallelism has already been used" warning at each fork is only noise.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

        try:
            self._tok = _Rust.from_str(raw.decode())
        except Exception as e:  # the Rust side raises a bare Exception on any parse error
            raise DataError(f"tokenizer {path} is not a valid Hugging Face tokenizer.json: {one_line(e)}") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.eos_token = next((name for name in END_OF_TEXT if name in special), None)
        self.eos_id = special[self.eos_token] if self.eos_token is not None else None
        self.fingerprint = hashlib.sha256(raw).hexdigest()
        self.path = path

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text, encoded in parallel by the Rust library."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens dropped)."""
        return str(self._tok.decode(list(ids)))


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` (for example Llama's or Mistral's ``tokenizer.model``)."""

    kind = "sentencepiece"

    def __init__(self, path: Path, raw: bytes) -> None:
        import sentencepiece  # lazily: only when this kind is asked for

        self._sp: Any = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(raw)
        except Exception as e:  # RuntimeError or OSError depending on the version
            raise DataError(f"tokenizer {path} is not a valid SentencePiece model: {one_line(e)}") from None
        self.vocab_size = int(self._sp.get_piece_size())
        eos = int(self._sp.eos_id())  # -1 when the model was trained without one
        self.eos_id, self.eos_token = (eos, str(self._sp.id_to_piece(eos))) if eos >= 0 else (None, None)
        self.fingerprint = hashlib.sha256(raw).hexdigest()
        self.path = path

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text (no BOS/EOS)."""
        return [list(ids) for ids in self._sp.encode(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""
        return str(self._sp.decode(list(ids)))


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer at ``path``: None (or ``"bytes"``) for bytes, a ``tokenizer.json`` or a directory
    holding one, or a SentencePiece ``.model``. DataError naming the file if it cannot be used.
    """
    if path is None or str(path) == BYTES:
        return ByteTokenizer()
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "tokenizer.json").exists():
            raise DataError(f"tokenizer directory {p} holds no tokenizer.json")
        p = p / "tokenizer.json"
    elif not p.exists():
        raise DataError(f"tokenizer {p} does not exist")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(f"tokenizer {p} could not be read: {e.strerror or one_line(e)}") from None
    if p.suffix == ".model":
        return SentencePieceTokenizer(p, raw)
    if p.suffix == ".json":
        return HuggingFaceTokenizer(p, raw)
    raise DataError(f"tokenizer {p} is neither a tokenizer.json (or a directory with one) nor a SentencePiece .model")
