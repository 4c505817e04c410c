"""A learner's data, which never leaves its machine.

- :mod:`.corpus`: which documents a corpus holds and which split each belongs to.
- :mod:`.tokenizer`: bytes (the default), a Hugging Face ``tokenizer.json`` or a SentencePiece model.
- :mod:`.token_cache`: tokenised splits cached on disk, memory-mapped when read back.
- :mod:`.batches`: per-learner shards and the held-out eval split as tensors, and the batch sampler.
"""
