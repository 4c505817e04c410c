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

A Hugging Face model is rebuilt from the copy of its ``config.json`` that the learner keeps in the
checkpoint directory (``DIR/model/``, next to ``DIR/tokenizer/``; see
:func:`p2p_diloco.train.checkpoint.save_model_files`), so the export runs from anywhere. Checkpoints written
before learners kept those copies fall back to ``model.path`` and ``data.tokenizer`` as their config
names them, relative to the working directory: run those exports where the learner ran.

A tokenizer with an end-of-text token (``<|endoftext|>`` in the committed BPE) is exported with it as
``eos_token``, and the model's generation config gets its id where the model's config names none, so
``generate`` stops at the end of a text, as the learners saw it between documents.
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

from p2p_diloco.config import LearnerConfig, ModelConfig, config_error
from p2p_diloco.core.fragments import build_fragments
from p2p_diloco.core.outer import GlobalState, StateFormatError, load_into_module
from p2p_diloco.errors import UserError
from p2p_diloco.learner.state import LearnerState
from p2p_diloco.train.checkpoint import (
    MODEL_DIR,
    MODEL_FILES,
    TOKENIZER_DIR,
    CheckpointError,
    load_checkpoint,
    tokenizer_copy_name,
)
from p2p_diloco.train.data.tokenizer import load_tokenizer
from p2p_diloco.train.models.registry import build_model, embedding_names, named_shapes

logger = logging.getLogger("p2p_diloco.ops.export")

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
    model = build_model(_model_source(where, cfg.model), cfg.run.seed)
    try:
        _load_theta(model, payload, cfg)
    except StateFormatError as e:
        raise CheckpointError(f"checkpoint in {where}: bad global state ({e})") from None
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint in {where} does not fit its model ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]})") from None
    return cfg, model


def _model_source(where: Path, model: ModelConfig) -> ModelConfig:
    """``model`` with ``path`` at the checkpoint's copy of the config files, else at ``model.path`` as saved
    (a checkpoint from before the copies); neither is one CheckpointError line."""
    if model.path is None:
        return model
    copy = where / MODEL_DIR
    if (copy / MODEL_FILES[0]).is_file():
        return model.model_copy(update={"path": str(copy)})
    if (Path(model.path) / MODEL_FILES[0]).is_file():
        logger.info(f"{where} holds no copy of the model's {MODEL_FILES[0]}: using model.path {model.path}")
        return model
    raise CheckpointError(f"checkpoint in {where} holds no {MODEL_DIR}/{MODEL_FILES[0]}, nor is there one in its "
                          f"model.path {model.path} (relative to where the learner ran): run the export there, "
                          f"or copy the model's {MODEL_FILES[0]} into {copy}")


def _tokenizer_source(where: Path, tokenizer: str) -> Path:
    """The checkpoint's copy of the tokenizer file, else ``data.tokenizer`` as saved; neither: one ExportError line."""
    copy = where / TOKENIZER_DIR / tokenizer_copy_name(tokenizer)
    if copy.is_file():
        return copy
    source = Path(tokenizer).expanduser()
    if source.is_dir():
        source = source / TOKENIZER_JSON
    if source.is_file():
        logger.info(f"{where} holds no copy of the tokenizer: using data.tokenizer {tokenizer}")
        return source
    raise ExportError(f"checkpoint in {where} holds no {TOKENIZER_DIR}/{copy.name}, nor is there a tokenizer at its "
                      f"data.tokenizer {tokenizer} (relative to where the learner ran): run the export there, "
                      f"or copy the tokenizer file to {copy}")


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
            eos = _export_tokenizer(Path(checkpoint_dir), cfg.data.tokenizer, out)
            if eos is not None and hf.generation_config.eos_token_id is None:
                hf.generation_config.eos_token_id = eos  # the learners saw it between documents
            hf.save_pretrained(out)
        else:
            torch.save(model.state_dict(), out / "model.pt")
            (out / "config.json").write_text(json.dumps(cfg.model.model_dump(), indent=2) + "\n")
    except OSError as e:
        raise ExportError(f"cannot write the export to {out}: {e.strerror or e}") from None
    logger.info(f"exported the global model of {checkpoint_dir} to {out}")
    return out


def _export_tokenizer(where: Path, tokenizer: str | None, out: Path) -> int | None:
    """Write the tokenizer next to the model; returns the id of its end-of-text token, if it has one."""
    if tokenizer is None:
        logger.info("no tokenizer to export: the model was trained on bytes (token id = byte value)")
        return None
    source = _tokenizer_source(where, tokenizer)
    try:
        tok = load_tokenizer(source)
    except UserError as e:
        raise ExportError(f"cannot export the tokenizer: {e}") from None
    if source.suffix == ".model":  # SentencePiece: transformers has no generic class that loads it as is
        shutil.copyfile(source, out / "tokenizer.model")
        return tok.eos_id
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_file=str(source), eos_token=tok.eos_token)
    fast.save_pretrained(out)
    return tok.eos_id
