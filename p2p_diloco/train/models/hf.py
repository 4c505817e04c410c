"""A Hugging Face causal LM behind the project's model interface: ``forward(idx, targets) -> (logits, loss)``.

``model.path`` is a directory with a ``config.json`` of any causal-LM architecture that ``transformers``
knows (Llama, GPT-2, Qwen2, Mistral, ...). Without weights the model is initialised from the config under
the run seed, so every learner of a run starts from bit-identical Θ; with weights (``model.safetensors``,
sharded or not) it starts from them. Nothing is fetched from the Hugging Face hub.

This module imports ``transformers`` (seconds): :mod:`p2p_diloco.train.models.registry` imports it only when
``model.path`` is set.

Example::

    model = build_hf_model(ModelConfig(path="peers/models/llama-tiny", seq_len=64), seed=0)
    logits, loss = model(x, y)            # y = x shifted by one token, as the data pipeline gives it
    model.hf.save_pretrained("out/")      # the transformers model itself
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from p2p_diloco.config import ConfigError, ModelConfig

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # single file, or sharded


class HFCausalLM(nn.Module):
    """A transformers causal LM (:attr:`hf`) with the project's ``forward``; ``config_json`` is the
    ``config.json`` it was built from, as read (it names the model in the lineage id)."""

    def __init__(self, hf: PreTrainedModel, config_json: dict[str, Any]):
        super().__init__()
        self.hf = hf
        self.config_json = config_json

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: every token id fed to the model must be below it."""
        rows = getattr(self.hf.get_input_embeddings(), "num_embeddings", None)
        return int(rows) if rows is not None else int(self.hf.config.vocab_size)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, V)`` and, given ``targets`` (already shifted by one), the mean cross-entropy.

        The loss is computed here, not by passing ``labels``: transformers would shift the labels a
        second time. No KV cache: training and eval see whole windows, a cache would only cost memory.
        """
        logits = self.hf(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` in directory ``path`` as a dict; anything missing or malformed is one ConfigError line."""
    file = Path(path) / CONFIG_FILE
    if not Path(path).is_dir():
        raise ConfigError(f"model.path {path} is not a directory (expected one holding a Hugging Face {CONFIG_FILE})")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"model.path {path} holds no {CONFIG_FILE}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {file}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file} is not a JSON object")
    return data


def _hf_config(path: Path, raw: dict[str, Any], seq_len: int) -> PretrainedConfig:
    """The transformers config for ``raw``, refused unless it is a causal LM that fits ``seq_len``."""
    file = path / CONFIG_FILE
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{file} has no model_type (e.g. \"llama\"): not a Hugging Face model config")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{file}: model_type {model_type!r} is an architecture transformers "
                          f"{transformers.__version__} does not know")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"{file}: model_type {model_type!r} is not a causal language model (no "
                          "AutoModelForCausalLM class for it)")
    try:  # trust_remote_code=False: only the library's own classes, never code shipped next to a config
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError, OSError, TypeError, KeyError, ...
        raise ConfigError(f"{file} is not a valid {model_type} config: {_one_line(e)}") from None
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ConfigError(f"model.seq_len ({seq_len}) exceeds max_position_embeddings ({limit}) in {file}")
    return config


def _one_line(e: BaseException) -> str:
    """``e`` as one line of at most ~300 characters: transformers' messages run over many lines."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text if len(text) <= 300 else text[:297] + '...'}"


def _fp32() -> dict[str, Any]:
    # fp32 whatever config.json says (transformers 5 loads in the saved dtype by default): Θ and the inner
    # AdamW are fp32, bf16 enters only through autocast. transformers 4.56 renamed torch_dtype to dtype.
    name = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {name: torch.float32}


def has_weights(path: str | Path) -> bool:
    """Whether ``path`` holds safetensors weights (one file, or an index of shards)."""
    return any((Path(path) / f).is_file() for f in WEIGHT_FILES)


def build_hf_model(cfg: ModelConfig, seed: int) -> HFCausalLM:
    """The causal LM of ``cfg.path``: its weights if the directory has them, else initialised under ``seed``.

    The same seed gives bit-identical weights on every learner with the same transformers version (the
    lineage id covers a hash of them). Any problem with the directory is one :class:`ConfigError` line.
    """
    assert cfg.path is not None
    path = Path(cfg.path)
    raw = read_config_json(path)
    config = _hf_config(path, raw, cfg.seq_len)
    # Weights the files lack (and every weight, without files) are drawn from the seeded generator.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if has_weights(path):
            try:
                hf = AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True,
                                                          trust_remote_code=False, **_fp32())
            except Exception as e:  # noqa: BLE001 - corrupt or mismatched files surface as many types
                raise ConfigError(f"cannot load the weights in {path}: {_one_line(e)}") from None
        else:
            hf = AutoModelForCausalLM.from_config(config, trust_remote_code=False, **_fp32())
    if cfg.activation_checkpointing:
        _checkpoint_activations(hf)
    return HFCausalLM(hf, raw)


def _checkpoint_activations(hf: PreTrainedModel) -> None:
    # activation_checkpointing_enable is the transformers 5 name; gradient_checkpointing_enable still
    # works there but warns. Non-reentrant: the reentrant variant needs inputs that require grad.
    kwargs = {"use_reentrant": False}
    try:
        if hasattr(hf, "activation_checkpointing_enable"):
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    except ValueError as e:
        raise ConfigError(f"model.activation_checkpointing: {_one_line(e)}") from None
