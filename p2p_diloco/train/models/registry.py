"""Which model a learner trains: the built-in byte-level GPT, or a Hugging Face causal LM from ``model.path``.

Every model has the same face to the rest of the project: ``forward(idx, targets) -> (logits, loss)``
with ``targets`` already shifted by one, parameters in a fixed module order (fragments are built from
``named_parameters()``), and a vocabulary size. The DiLoCo side never asks which model it is.

``transformers`` (seconds to import) is loaded only when ``model.path`` is set.

Example::

    >>> from p2p_diloco.config import ModelConfig
    >>> model = build_model(ModelConfig(), seed=0)      # path None: the built-in byte GPT
    >>> vocab_size(model), model_config_json(model)
    (256, None)
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn as nn

from p2p_diloco.config import ModelConfig
from p2p_diloco.train.models import gpt as byte_gpt


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The model of ``cfg`` with weights fixed by ``seed`` (or, for a Hugging Face directory with weights, by them).

    ``cfg.path`` None builds the built-in byte GPT exactly as :func:`p2p_diloco.train.models.gpt.build_model` does;
    a path builds :class:`p2p_diloco.train.models.hf.HFCausalLM`. A bad directory is one ConfigError line.
    """
    if cfg.path is None:
        return byte_gpt.build_model(cfg, seed)
    from p2p_diloco.train.models.hf import build_hf_model

    return build_hf_model(cfg, seed)


def vocab_size(model: nn.Module) -> int:
    """How many token ids ``model`` can embed: a tokenizer's vocabulary must fit in it."""
    size = getattr(model, "vocab_size", None)
    if not isinstance(size, int):
        raise TypeError(f"{type(model).__name__} does not say its vocab_size")
    return size


def model_config_json(model: nn.Module) -> str | None:
    """A Hugging Face model's ``config.json`` as canonical JSON (sorted keys, no spaces); None for the built-in
    model, which :class:`ModelConfig` describes whole. Part of the lineage id: the config, not its path."""
    raw: Any = getattr(model, "config_json", None)
    if raw is None:
        return None
    return json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def embedding_names(model: nn.Module) -> set[str]:
    """The names (as :func:`named_shapes` gives them) of the parameters that are embedding tables, found by
    module type rather than by name: GPT-2's ``wte``/``wpe`` and Llama's ``embed_tokens`` alike."""
    owned = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {n for n, p in model.named_parameters() if id(p) in owned}


def named_shapes(model: nn.Module) -> list[tuple[str, torch.Size]]:
    """(name, shape) of each parameter in module order, as fragments are built from them.

    ``named_parameters()`` yields a parameter shared by two modules (tied input and output embeddings)
    once, under its first name: it is one tensor of Θ, averaged once.
    """
    return [(n, p.shape) for n, p in model.named_parameters()]
