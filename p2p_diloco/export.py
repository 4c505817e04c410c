"""Export the global model Θ of a learner's checkpoint (``p2p-diloco export --checkpoint-dir DIR --out OUT``).

Θ is what the swarm agreed on, not the learner's local weights: the fp32 global parameters of every
fragment, put back in module order. A Hugging Face model is written with ``save_pretrained``
(safetensors) next to its tokenizer, so that::

    model = AutoModelForCausalLM.from_pretrained(OUT)
    tokenizer = AutoTokenizer.from_pretrained(OUT)       # for a tokenizer.json tokenizer
    print(tokenizer.decode(model.generate(tokenizer("def ", return_tensors="pt").input_ids)[0]))

A SentencePiece ``.model`` tokenizer is copied to ``OUT/tokenizer.model``;
``sentencepiece.SentencePieceProcessor(model_file="OUT/tokenizer.model")`` loads it. The built-in byte
GPT is written as ``OUT/model.pt`` (a torch state dict) and ``OUT/config.json`` (its ModelConfig)::

    model = ByteGPT(ModelConfig.model_validate_json(Path("OUT/config.json").read_text()))
    model.load_state_dict(torch.load("OUT/model.pt"))

A Hugging Face model is rebuilt from ``model.path`` as the checkpoint's config names it (relative to
the working directory, like the learner's), so run the export where the learner ran.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from pydantic import ValidationError

from p2p_diloco.checkpoint import CheckpointError, load_checkpoint
from p2p_diloco.config import LearnerConfig, config_error
from p2p_diloco.errors import UserError
from p2p_diloco.fragments import build_fragments
from p2p_diloco.learner_state import LearnerState
from p2p_diloco.models import build_model, embedding_names, named_shapes
from p2p_diloco.outer import GlobalState, StateFormatError, load_into_module

logger = logging.getLogger("p2p_diloco.export")

TOKENIZER_JSON = "tokenizer.json"


class ExportError(UserError, RuntimeError):
    """The export cannot be written (output not writable, tokenizer missing); the message is one line."""


def global_model(checkpoint_dir: str | Path) -> tuple[LearnerConfig, nn.Module]:
    """The checkpoint's config and its model holding Θ (CPU, fp32); bad input is one CheckpointError line."""
    where = Path(checkpoint_dir)
    payload = load_checkpoint(where)
    if payload is None:
        raise CheckpointError(f"no checkpoint in {where} (no {where / 'latest.pt'})")
    try:
        cfg = LearnerConfig.model_validate(payload["config"])
    except ValidationError as e:
        raise CheckpointError(f"checkpoint in {where}: its config does not validate ({config_error(e)})") from None
    except KeyError:
        raise CheckpointError(f"checkpoint in {where} holds no config") from None
    model = build_model(cfg.model, cfg.run.seed)
    try:
        _load_theta(model, payload, cfg)
    except StateFormatError as e:
        raise CheckpointError(f"checkpoint in {where}: bad global state ({e})") from None
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint in {where} does not fit its model ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]})") from None
    return cfg, model


def _load_theta(model: nn.Module, payload: dict[str, Any], cfg: LearnerConfig) -> None:
    # The local weights first, for the buffers a state dict may hold; then Θ over every parameter.
    model.load_state_dict(payload["model"])
    fragments = build_fragments(named_shapes(model), cfg.sync.fragments, cfg.inner.steps_per_outer,
                                    embedding_names(model))
    states = [GlobalState.from_dict(g) for g in payload["global"]]
    if len(states) != len(fragments):
        raise ValueError(f"{len(states)} global states for {len(fragments)} fragments")
    theta = LearnerState(fragments, states, list(model.parameters())).global_params()
    load_into_module(model, theta)


def export(checkpoint_dir: str | Path, out: str | Path) -> Path:
    """Write the checkpoint's Θ to directory ``out`` (created if needed); returns ``out``.

    Hugging Face models: ``save_pretrained`` plus the tokenizer; the built-in model: ``model.pt`` and
    ``config.json``. Any problem (no or corrupt checkpoint, model directory gone, ``out`` not writable)
    is one :class:`~p2p_diloco.errors.UserError` line.
    """
    cfg, model = global_model(checkpoint_dir)
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        hf = getattr(model, "hf", None)
        if hf is not None:
            hf.save_pretrained(out)
            _export_tokenizer(cfg.data.tokenizer, out)
        else:
            torch.save(model.state_dict(), out / "model.pt")
            (out / "config.json").write_text(json.dumps(cfg.model.model_dump(), indent=2) + "\n")
    except OSError as e:
        raise ExportError(f"cannot write the export to {out}: {e.strerror or e}") from None
    logger.info(f"exported the global model of {checkpoint_dir} to {out}")
    return out


def _export_tokenizer(tokenizer: str | None, out: Path) -> None:
    if tokenizer is None:
        logger.info("no tokenizer to export: the model was trained on bytes (token id = byte value)")
        return
    source = Path(tokenizer)
    if source.is_dir():
        source = source / TOKENIZER_JSON
    if not source.is_file():
        raise ExportError(f"data.tokenizer {tokenizer}: no tokenizer file there to export with the model")
    if source.suffix == ".model":  # SentencePiece: transformers has no generic class that loads it as is
        shutil.copyfile(source, out / "tokenizer.model")
        return
    from transformers import PreTrainedTokenizerFast

    try:
        fast = PreTrainedTokenizerFast(tokenizer_file=str(source))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception types
        raise ExportError(f"data.tokenizer {source} is not a Hugging Face tokenizer.json "
                          f"({type(e).__name__})") from None
    fast.save_pretrained(out)
