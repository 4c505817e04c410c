"""Training on one learner's own machine: the model, its data and its inner steps.

- :mod:`.trainer`: inner steps on a device (the local model θ, its AdamW, the lr schedule's position).
- :mod:`.sharding`: a learner unit's model sharded with FSDP2 (``run.sharding = "fsdp"``).
- :mod:`.checkpoint`: atomic checkpoints (global state, local model, inner optimizer, counters, config).
- :mod:`.models`: which model a learner trains (the built-in byte-level GPT or a Hugging Face LM).
- :mod:`.data`: corpora, tokenizers, the token cache and the per-learner shards.
"""
