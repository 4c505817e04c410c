"""Regenerate the committed tokenizer ``peers/tokenizers/bpe-4k/tokenizer.json``.

How it was made (run from the repository root, offline, about a minute on 2 cores)::

    .venv/bin/python scripts/train_tokenizer.py

- **Corpus**: the default corpus (``data.path`` unset: the standard library of the Python running
  the script; 3.11.7 for the committed file), cut into documents exactly as the learners cut it,
  **without the eval split** (default ``data.eval_fraction`` 0.02), so eval losses measured with
  this tokenizer are on text it never saw. Documents in corpus order, at most ``--max-mb`` MB.
- **Model**: byte-level BPE (GPT-2's pre-tokenizer regex and byte alphabet), so any text encodes
  without unknown tokens; ``<|endoftext|>`` is id 0, then the 256 byte symbols, then merges up to
  exactly 4096 ids (the shipped tiny Llama config's ``vocab_size``).
- **End of text**: ``<|endoftext|>`` (id 0) is the tokenizer's only special token. The learners' data
  joins documents with it (``Tokenizer.separator``), the shipped Llama configs name it as
  ``bos_token_id`` and ``eos_token_id``, and ``p2p-diloco export`` writes it as the exported
  tokenizer's ``eos_token``, so ``generate`` stops at the end of a text.
- **Library**: ``tokenizers`` (0.23.3 for the committed file). Training is deterministic for a
  given library version and corpus: two runs give byte-identical files (the script prints the
  sha256, which is the tokenizer's fingerprint in cache keys). Another Python version has another
  standard library, hence another, equally valid, tokenizer.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p_diloco.config import DataConfig  # noqa: E402  (needs the path above when run as a script)
from p2p_diloco.train.data.corpus import open_corpus, split_of  # noqa: E402

VOCAB_SIZE = 4096
SPECIAL = "<|endoftext|>"


def training_texts(max_mb: float) -> Iterator[str]:
    """The default corpus's non-eval documents, in corpus order, up to ``max_mb`` MB."""
    cfg = DataConfig()
    budget = int(max_mb * 1e6)
    for group in open_corpus(cfg).documents():
        for name, payload in group:
            if split_of(name, cfg.num_shards, cfg.eval_fraction) is None:
                continue
            raw = payload if isinstance(payload, bytes) else payload.encode()
            budget -= len(raw)
            yield raw.decode(errors="replace")
        if budget <= 0:
            return


def train(max_mb: float) -> str:
    """A byte-level BPE tokenizer of VOCAB_SIZE ids trained on the default corpus, as JSON text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_texts(max_mb), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"training gave {tok.get_vocab_size()} ids, not {VOCAB_SIZE}: give it more text")
    return str(tok.to_str())


def main() -> None:
    """Train and write the tokenizer; print its size and sha256."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "peers" / "tokenizers" / "bpe-4k" / "tokenizer.json")
    p.add_argument("--max-mb", type=float, default=64.0, help="train on at most this much text (default: all)")
    args = p.parse_args()
    text = train(args.max_mb)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    raw = args.out.read_bytes()
    print(f"wrote {args.out} ({len(raw) / 1e3:.0f} KB, sha256 {hashlib.sha256(raw).hexdigest()})")


if __name__ == "__main__":
    main()
