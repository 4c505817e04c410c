"""Resuming a learner from its checkpoint: whether the checkpoint fits, and loading it into the parts
:func:`p2p_diloco.learner.startup.build` made, with the outer gradients it may have sent before it died.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from p2p_diloco.config import LearnerConfig, ModelConfig
from p2p_diloco.core.outer import GlobalState, StateFormatError
from p2p_diloco.errors import LearnerError
from p2p_diloco.learner.state import Counters, LearnerState, Unconfirmed
from p2p_diloco.train.checkpoint import CheckpointError
from p2p_diloco.train.trainer import Trainer

logger = logging.getLogger(__name__)

# Where a model's files lie and whether a learner saves memory are its own business: not the lineage's, and
# a checkpoint resumes after either changed (the lineage covers the model files' contents instead).
LOCAL_MODEL_FIELDS = {"path", "activation_checkpointing"}


def check_compatible(cfg: LearnerConfig, payload: dict[str, Any], where: Path) -> None:
    """Refuse (LearnerError) a checkpoint made with another model or number of fragments."""
    saved = payload["config"]
    try:  # fields added since the checkpoint was made take their defaults
        saved_model = ModelConfig.model_validate(saved["model"]).model_dump(exclude=LOCAL_MODEL_FIELDS)
    except (ValidationError, KeyError, TypeError):
        saved_model = None
    same_model = saved_model == cfg.model.model_dump(exclude=LOCAL_MODEL_FIELDS)
    if not same_model or saved.get("sync", {}).get("fragments", 1) != cfg.sync.fragments:
        raise LearnerError(f"checkpoint in {where} was made with a different model or fragments")


def restore(payload: dict[str, Any], trainer: Trainer, state: LearnerState, where: Path) -> int:
    """Load a checkpoint into the freshly built parts; returns the sampler cursor to apply.

    A checkpoint of the right format whose contents do not fit is one :class:`CheckpointError` line."""
    try:
        return _restore(payload, trainer, state, where)
    except StateFormatError as e:
        raise CheckpointError(f"checkpoint in {where}: bad global state ({e})") from None
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint in {where} does not fit this learner ({type(e).__name__}: {e}); "
                              "move it away to start fresh") from None


def _restore(payload: dict[str, Any], trainer: Trainer, state: LearnerState, where: Path) -> int:
    state.states = [state.pin(GlobalState.from_dict(g)) for g in payload["global"]]
    trainer.model.load_state_dict(payload["model"])
    trainer.inner_opt.load_state_dict(payload["inner_opt"])
    state.counters = Counters(**payload["counters"])
    state.counters.fill_lr_steps()
    state.changed.update(range(len(state.fragments)))  # θ and the inner optimizer: a unit sends both at start
    if "lr_position" in payload:  # checkpoints before it restart at version · H
        try:
            trainer.lr_position.load(payload["lr_position"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint in {where}: bad lr_position ({e})") from None
    # We may have died in a round after sending our outer gradient, and the others may have
    # committed it. A round in flight or unconfirmed at the checkpoint is saved with its
    # snapshot; any other fragment's progress in the checkpoint is all it could have sent.
    saved = {int(u["fragment"]): u for u in payload.get("unconfirmed", [])}
    c = state.counters
    for frag in state.fragments:
        f = frag.index
        if f in saved:
            u = saved[f]
            lr_steps = u.get("lr_steps")  # checkpoints before it: a share of the fragment's by count
            state.unconfirmed[f] = Unconfirmed(int(u["version"]), list(u["snapshot"]), int(u["tokens"]),
                                               int(u["steps"]), None if lr_steps is None else float(lr_steps))
        elif c.tokens_since_merge[f] > 0:
            snapshot = state.snapshot(frag)
            state.unconfirmed[f] = Unconfirmed(state.states[f].version, snapshot, c.tokens_since_merge[f],
                                               c.steps_since_merge[f], c.lr_steps_since_merge[f])
    logger.info(f"resumed from {where} at version {state.version}")
    return int(payload["sampler_cursor"])
