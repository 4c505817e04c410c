"""Which model a learner trains.

- :mod:`.registry`: the choice (``model.path`` or the built-in model) and the shared interface.
- :mod:`.gpt`: the built-in byte-level GPT (only torch).
- :mod:`.hf`: a Hugging Face causal LM behind the same ``forward(idx, targets)`` interface.
"""
