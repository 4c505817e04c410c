"""Typed configuration of a learner, loaded from a TOML file in ``peers/`` and overridden from the CLI.

One place resolves the configuration: :func:`load_learner_config` reads the file, applies dotted
overrides (``inner.lr=3e-4``) and validates the result. Any problem becomes a :class:`ConfigError`
whose message is one line naming the field, which the CLI prints before exiting non-zero.

Example::

    >>> cfg = load_learner_config(None, ["inner.steps_per_outer=10", "averaging.min_group_size=3"])
    >>> cfg.inner.steps_per_outer, cfg.averaging.min_group_size
    (10, 3)
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from p2p_diloco.errors import UserError

Codec = Literal["none", "fp16", "bf16", "int8", "int4"]


class ConfigError(UserError, ValueError):
    """A user-caused configuration problem; the message is a single line meant for the terminal."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """The model: the built-in byte-level GPT (:mod:`p2p_diloco.train.models.gpt`; ``n_layer``, ``n_head``,
    ``n_embd``), or a Hugging Face causal LM from ``path``. ``seq_len`` is the training context of both."""

    n_layer: int = Field(2, ge=1, le=64)
    n_head: int = Field(4, ge=1, le=64)
    n_embd: int = Field(64, ge=8, le=8192)
    seq_len: int = Field(64, ge=8, le=8192)
    path: str | None = Field(
        None, description="a directory with a Hugging Face config.json (any causal-LM architecture transformers "
                          "knows), with or without weights; None = the built-in byte-level GPT")
    activation_checkpointing: bool = Field(False, description="Hugging Face models: recompute activations in "
                                                              "the backward pass to save memory")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self


class DataConfig(_Section):
    """Where text comes from and which shard of it this learner owns.

    ``path`` = None uses the embedded default corpus: the source files of the running Python's
    standard library, present on every machine without a download.
    """

    path: str | None = None
    num_shards: int = Field(16, ge=1, le=100_000)
    # None: derived from the learner's peer ID, so learners started without thought get distinct shards.
    shard_index: int | None = Field(None, ge=0)
    eval_fraction: float = Field(0.02, gt=0.0, lt=0.5)
    eval_batches: int = Field(8, ge=1, le=10_000)
    max_corpus_mb: float = Field(64.0, gt=0.0)
    tokenizer: str | None = Field(
        None, description="a Hugging Face tokenizer.json (or a directory with one) or a SentencePiece .model; "
                          "None = bytes (a vocabulary of 256)")
    text_field: str = Field("text", min_length=1, description="the text column of .jsonl/.json/.parquet/.csv data")
    cache_dir: str | None = Field(
        None, description="where tokenised shards are cached (default: .cache/p2p-diloco under the working "
                          "directory)")

    @model_validator(mode="after")
    def _shard_in_range(self) -> DataConfig:
        if self.shard_index is not None and self.shard_index >= self.num_shards:
            raise ValueError(f"shard_index ({self.shard_index}) must be below num_shards ({self.num_shards})")
        return self


class InnerConfig(_Section):
    """Local AdamW steps taken between two outer steps."""

    lr: float = Field(1e-3, gt=0.0, le=10.0)
    weight_decay: float = Field(0.1, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    batch_size: int = Field(16, ge=1)
    micro_batch_size: int | None = Field(
        None, ge=1, description="gradient accumulation: forward/backward this many sequences at a time "
                                "(must divide batch_size; None = the whole batch at once)")
    steps_per_outer: int = Field(50, ge=1, description="H: inner steps per outer step")
    grad_clip: float = Field(1.0, ge=0.0, description="0 disables clipping")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="after warm-up: keep lr, or decay it along a cosine to min_lr_ratio·lr at "
                                "decay_steps (see lr_schedule.py for where a learner stands in it)")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from lr/warmup_steps to lr")
    rejoin_warmup_steps: int = Field(
        20, ge=0, le=100_000,
        description="a learner whose AdamW starts fresh past the schedule's start (it joined a run in progress, "
                    "or restarted without a checkpoint) ramps its lr up over this many steps: Adam's first steps "
                    "are sign-like and would make an outlier of its first outer gradient (0 = off)")
    decay_steps: int | None = Field(
        None, ge=1, description="cosine: schedule position where the decay ends (default: run.max_outer_steps · H)")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine: the final lr as a fraction of lr")
    # Artificial slow-down per inner step, for tests and mixed-speed benchmarks.
    extra_step_seconds: float = Field(0.0, ge=0.0)


class OuterConfig(_Section):
    """Outer optimizer: SGD with Nesterov momentum on the fp32 global parameters."""

    lr: float = Field(0.7, gt=0.0, le=10.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    nesterov: bool = True
    short_rounds: Literal["scaled", "full"] = Field(
        "scaled", description="scaled (default): a round whose contributions carry fewer than inner.steps_per_outer "
                              "inner steps (a mean weighted as the round averaged) moves the momentum and its "
                              "look-ahead by that share of a full outer step, so a parting or first round of a few "
                              "steps is not a full momentum step; full: every round is one full outer step. "
                              "docs/design.md, 'Short rounds'")
    long_rounds: Literal["decayed", "full"] = Field(
        "decayed", description="decayed (default): a round whose contributions carry s > inner.steps_per_outer inner "
                               "steps (lower median) spans s/H outer steps' time, and the momentum that goes on past "
                               "it is momentum**(s/H) (linear between whole powers; s/H at most 64; also in the "
                               "look-ahead), so a slow link's long rounds do not carry stale momentum; full: momentum "
                               "as in a round of H steps. docs/design.md, 'Long rounds'")


class ContributionLimits(NamedTuple):
    """What bounds one contribution's weight (p2p_diloco/core/exclusion.py): the most tokens an inner step of any
    learner holds (None: the group's lower median of what its members' steps hold), H, and the weighting rule."""

    tokens_per_step: int | None
    steps_per_outer: int
    weighting: str
    warmup_steps: int = 0  # the inner lr's warm-up: bounds what a member's steps count as at the peak lr


class AveragingConfig(_Section):
    """Groups formed through the DHT for butterfly all-reduce of outer gradients."""

    min_group_size: int = Field(2, ge=1)
    target_group_size: int = Field(16, ge=1)
    quorum: Literal["fixed", "majority"] = Field(
        "majority", description="majority (default): a round commits with at least min_group_size contributors "
                                "(K) and more than half of the learners the swarm's records show training, so "
                                "that two disjoint groups never both commit the same version (docs/scale.md); the "
                                "minority side of a partition then waits. fixed: K alone (groups smaller than "
                                "half the swarm may then commit one version twice, healed later by a merge)")
    matchmaking_time: float = Field(4.0, gt=0.0, description="min seconds a leader waits for groupmates")
    early_close: bool = Field(
        True, description="a leader starts the all-reduce as soon as its group holds every learner the swarm's "
                          "records show training and every peer searching under the round's key, instead of waiting "
                          "out matchmaking_time (p2p_diloco/net/early_close.py); false: hivemind's rule alone (a "
                          "full target_group_size or the window's end)")
    request_timeout: float = Field(2.0, gt=0.0)
    round_timeout: float = Field(15.0, gt=0.0, description="give up finding a group after this long")
    allreduce_timeout: float = Field(
        120.0, gt=0.0, description="give up an all-reduce this long after the group formed; a groupmate that died "
                                   "before sending anything holds the round (and, at τ, the learner) this long")
    next_chunk_timeout: float = Field(15.0, gt=0.0)
    compression: Codec = "none"
    max_delta_norm: float = Field(1e4, gt=0.0, description="reject averaged outer gradients above this norm")
    norm_outlier_factor: float = Field(
        8.0, ge=0.0, description="leave out of a round a contribution whose norm is above this many times the median "
                                 "of the other contributions' norms (p2p_diloco/core/exclusion.py); 0 disables")
    max_contribution_norm: float | None = Field(
        None, gt=0.0, description="clip each contribution to this norm before it is averaged; None = no clipping")
    direction_check: bool = Field(
        True, description="leave out of a round, from 3 contributors on, an outer gradient that points away from most "
                          "of the others' (a learner that climbs the loss): each member gathers a 128-value sketch of "
                          "its outer gradient (p2p_diloco/core/directions.py)")
    established_after: int = Field(
        4, ge=0, le=10_000, description="an identity counts toward the majority quorum and a round certificate's "
                                        "signers, and its contributions count with full weight, once it "
                                        "contributed to this many committed versions of a fragment (the standing "
                                        "the fragment's state carries; p2p_diloco/core/standing.py): fresh keys "
                                        "cost nothing, rounds certified by groupmates do. While fewer than "
                                        "min_group_size established learners train, everyone counts; 0 switches "
                                        "the rule off")
    ban_rounds: int = Field(3, ge=0, le=1000, description="how many of this learner's next rounds it bans a peer "
                                                           "it saw excluded for a bad contribution (a ban counts "
                                                           "when a majority of the group holds it)")
    aggregator: Literal["mean", "median", "trimmed_mean"] = Field(
        "mean", description="how reducers combine the contributions to their shard: the token-weighted mean, or a "
                            "robust coordinate-wise median / trimmed mean that ignores self-reported weights "
                            "(p2p_diloco/core/aggregators.py)")
    verify_reducers: bool = Field(
        True, description="before signing a round, check every shard against what its senders sent (random "
                          "projections under the mean; spot values and a norm bound under every aggregator; "
                          "p2p_diloco/core/shard_sketches.py): a reducer that returns a chosen shard fails the round "
                          "instead of being committed; needs every contributor's sketch")
    certify_timeout: float = Field(
        10.0, gt=0.0, description="after the all-reduce, how long a round waits for the signatures of at least K "
                                  "contributors (its commit certificate) before it fails without committing; at "
                                  "least as long as the round's all-reduce took")
    max_tokens_per_step: int | None = Field(
        None, ge=1, lt=2**40, description="the most tokens one inner step of any learner of the swarm holds: a "
                                          "contribution's weight counts at most its inner steps times this many "
                                          "tokens (core/exclusion.py). None: in each round, the lower median "
                                          "of what one step of each member holds (batch_size · seq_len · workers); "
                                          "a swarm whose learner units or batches differ sets its largest, the "
                                          "same on every learner")

    @model_validator(mode="after")
    def _consistent(self) -> AveragingConfig:
        if self.target_group_size < self.min_group_size:
            raise ValueError("target_group_size must be >= min_group_size")
        if self.request_timeout >= self.matchmaking_time:
            # hivemind's matchmaking can deadlock otherwise (its own documented requirement).
            raise ValueError("request_timeout must be smaller than matchmaking_time")
        if self.round_timeout <= self.matchmaking_time:
            raise ValueError("round_timeout must be larger than matchmaking_time")
        if 0 < self.norm_outlier_factor < 1:
            raise ValueError("norm_outlier_factor must be 0 (off) or at least 1: below 1 it would leave out "
                             "contributions smaller than the others' median")
        return self


class SyncConfig(_Section):
    """Decoupled DiLoCo: fragments on staggered schedules, overlapped rounds, merging rules.

    The minimum quorum K is ``averaging.min_group_size``: a fragment's round commits only in a group
    of at least K learners.
    """

    fragments: int = Field(1, ge=1, le=1024, description="P; 1 = plain DiLoCo")
    overlap_steps: int = Field(0, ge=0, description="τ: inner steps between starting a round and applying it")
    apply_policy: Literal["overwrite", "mix"] = "overwrite"
    weighting: Literal["tokens", "tokens2_per_step"] = "tokens2_per_step"
    rda: bool = Field(False, description="radial-directional averaging for fragments without embeddings")
    fragment_compression: list[Codec] = Field(default_factory=list, description="per fragment; [] = averaging's")
    schedule: Literal["steps", "clock"] = Field(
        "steps", description="steps: fragment f every H steps at offset f·H/P; clock: at wall-clock slots"
    )
    period_seconds: float = Field(60.0, gt=0.0, description="clock schedule: seconds between a fragment's rounds "
                                                           "(with pace = auto: until the swarm has measured one)")
    pace: Literal["fixed", "auto"] = Field(
        "fixed", description="fixed: period_seconds and overlap_steps as set. auto (clock schedule): the learners "
                             "agree on the period through their records from their measured step and round times, "
                             "and each sets τ to cover its expected round, at most overlap_steps when that is "
                             "above 0 (p2p_diloco/core/pace.py, docs/design.md \"Pace from measurements\")")
    max_wait_seconds: float | None = Field(
        30.0, gt=0.0, description="with overlap (τ > 0): how long a learner waits at τ for a round that has not ended "
                                  "before it trains on; the round's result is applied when it ends. None = wait for it"
    )
    grace_gamma: float = Field(0.5, gt=0.0, lt=1.0, description="grace ≤ γ·slack")
    max_grace: float = Field(10.0, gt=0.0)


class NetworkConfig(_Section):
    """How a learner reaches the swarm: its run id (learners only average within one), peers, addresses, timeouts."""
    run_id: str = Field("p2p-diloco", pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    initial_peers: list[str] = Field(default_factory=list)
    host_maddrs: list[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = Field(default_factory=list)
    startup_timeout: float = Field(60.0, gt=0.0, description="seconds p2pd may take to start")
    record_ttl: float = Field(30.0, gt=1.0, le=600.0,
                              description="lifetime of this learner's progress record in the DHT")
    replica_reads: bool = Field(
        True, description="answer reads of the swarm's records, declarations, sketches and signatures from this "
                          "learner's own DHT replica of the key when it holds one and has been up record_ttl "
                          "seconds, instead of asking every node near the key (p2p_diloco/net/replica_reads.py)")
    client_mode: Literal["auto"] | bool = Field(
        "auto", description="auto: probe whether peers can dial this learner and run as a client if they cannot; "
                            "true: always a client (sends its part, never reduces or serves state); false: never")

    @field_validator("client_mode", mode="before")
    @classmethod
    def _auto_or_bool(cls, v: Any) -> Any:
        if v in ("auto", True, False, "true", "false"):
            return v if v == "auto" or isinstance(v, bool) else v == "true"
        raise ValueError(f"must be auto, true or false, not {v!r}")

    use_relay: bool = Field(True, description="libp2p circuit relay: dial and be dialled through relays")
    use_auto_relay: bool = Field(False, description="look for relays to become reachable behind NAT (p2pd's autorelay)")
    allowed_peers: str | None = Field(
        None, description="a private swarm: file of the peer IDs (one a line, the bootstrap node's too) that may "
                          "call this learner; everyone else is refused (p2p-diloco peer-id prints a peer's ID)")


class RunConfig(_Section):
    """Run control: seed, when to stop, checkpoints and resume, the summary file, and how to leave."""
    seed: int = 0
    max_outer_steps: int | None = Field(None, ge=1, description="stop once the global version reaches this")
    stop_at_eval_loss: float | None = Field(
        None, gt=0.0, description="stop once the global model's eval loss, measured after each outer step, is at or "
                                  "below this")
    checkpoint_dir: str | None = None
    checkpoint_on_commit: bool = Field(
        True, description="also checkpoint right after each committed round and each state taken from peers, not "
                          "only after each outer step: a kill then loses only the steps since the last merge")
    checkpoint_every_seconds: float | None = Field(
        60.0, gt=0.0, description="also checkpoint when this long has passed since the last checkpoint (written by a "
                                  "background thread; a kill loses at most this much training); None: only at "
                                  "merges and outer steps")
    eval_every: int = Field(1, ge=1, description="outer steps between evals (the progress line's eval_loss and the "
                                                 "stop_at_eval_loss check)")
    loss_rise_alert: float | None = Field(
        0.5, gt=0.0, description="warn, and write a loss_rose audit event, when an eval loss is more than this "
                                 "fraction above the previous one (a committed round that made the model worse: a "
                                 "poisoned round is visible beyond the loss curve); None: off")
    resume: bool = False
    summary: str | None = None
    threads: int = Field(1, ge=1, le=256, description="torch intra-op threads")
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:[0-9]+)?)$",
                        description="where inner steps run: auto (cuda if available, else cpu), cpu, cuda, cuda:N, mps")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="inner steps' autocast: auto = bf16 on CUDA, fp32 elsewhere; the global state is fp32")
    linger_seconds: float = Field(60.0, ge=0.0, description="after finishing, keep serving state this long")
    drain_seconds: float = Field(
        20.0, ge=0.0, description="on Ctrl+C or SIGTERM, spend up to this long handing the unmerged inner steps to "
                                  "the swarm in one last round per fragment (0: leave at once; a second signal also "
                                  "leaves at once)")
    log_every: int = Field(10, ge=1, description="inner steps between progress lines")
    audit_sign_every: int = Field(
        20, ge=1, le=10_000, description="audit.jsonl (learner/audit.py): sign the chain head with the identity "
                                         "key after this many lines (and at exit)")
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="serve Prometheus metrics on this port (all interfaces: 0.0.0.0); None: off")
    sharding: Literal["ddp", "fsdp"] = Field(
        "ddp", description="in a torchrun unit of several workers: ddp (every worker holds the whole model) or fsdp "
                           "(each holds 1/N of θ, its gradients and inner-optimizer state; rank 0 keeps a full copy "
                           "of θ in host memory); ignored by a learner of one worker")


class LearnerConfig(_Section):
    """A learner's whole configuration, one section per concern; saved in every checkpoint.

    Validated across sections too: fragments against H, overlap τ, per-fragment codecs, the lr schedule.
    """
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    inner: InnerConfig = Field(default_factory=InnerConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    averaging: AveragingConfig = Field(default_factory=AveragingConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @property
    def contribution_limits(self) -> ContributionLimits:
        """What bounds a contribution's weight (averaging, inner and sync settings together)."""
        return ContributionLimits(self.averaging.max_tokens_per_step, self.inner.steps_per_outer, self.sync.weighting,
                                  self.inner.warmup_steps)

    @model_validator(mode="after")
    def _schedule_fits(self) -> LearnerConfig:
        h, p, tau = self.inner.steps_per_outer, self.sync.fragments, self.sync.overlap_steps
        if p > h:
            raise ValueError(f"sync.fragments ({p}) cannot exceed inner.steps_per_outer ({h})")
        if self.sync.schedule == "clock" and self.sync.period_seconds / p <= self.averaging.matchmaking_time:
            raise ValueError(f"sync.period_seconds / sync.fragments must exceed averaging.matchmaking_time "
                             f"({self.averaging.matchmaking_time}s) so that one round ends before the next")
        if self.sync.pace == "auto" and self.sync.schedule != "clock":
            raise ValueError("sync.pace = auto needs sync.schedule = clock (it sets the clock's period)")
        if p > 1 and tau >= h // p:
            # At most one round in flight: a fragment's result is applied before the next one starts.
            raise ValueError(f"sync.overlap_steps ({tau}) must be below inner.steps_per_outer / sync.fragments "
                             f"({h // p})")
        if p == 1 and tau >= h:
            raise ValueError(f"sync.overlap_steps ({tau}) must be below inner.steps_per_outer ({h})")
        if self.inner.micro_batch_size is not None and self.inner.batch_size % self.inner.micro_batch_size:
            raise ValueError(f"inner.micro_batch_size ({self.inner.micro_batch_size}) must divide inner.batch_size "
                             f"({self.inner.batch_size})")
        if self.sync.fragment_compression and len(self.sync.fragment_compression) != p:
            raise ValueError(f"sync.fragment_compression lists {len(self.sync.fragment_compression)} codecs "
                             f"for {p} fragments")
        if self.inner.lr_schedule == "constant" and self.inner.decay_steps is not None:
            raise ValueError("inner.decay_steps applies only with inner.lr_schedule = cosine")
        if self.inner.lr_schedule == "cosine" and self.decay_steps is None:
            raise ValueError("inner.lr_schedule = cosine needs inner.decay_steps or run.max_outer_steps")
        if self.decay_steps is not None and self.decay_steps <= self.inner.warmup_steps:
            raise ValueError(f"the cosine decay must end after the warm-up: decay at {self.decay_steps} steps, "
                             f"inner.warmup_steps {self.inner.warmup_steps}")
        return self

    @property
    def decay_steps(self) -> int | None:
        """Where the inner lr's cosine decay ends: inner.decay_steps, else run.max_outer_steps · H."""
        if self.inner.lr_schedule != "cosine":
            return None
        if self.inner.decay_steps is not None:
            return self.inner.decay_steps
        target = self.run.max_outer_steps
        return None if target is None else target * self.inner.steps_per_outer

    def codec_for(self, fragment: int) -> str:
        """The codec name of ``fragment``: ``sync.fragment_compression[fragment]``, else ``averaging.compression``."""
        return self.sync.fragment_compression[fragment] if self.sync.fragment_compression else \
            self.averaging.compression


def config_error(exc: ValidationError, root: str = "config", source: str | Path | None = None) -> ConfigError:
    """The one-line :class:`ConfigError` for a pydantic validation error: its first problem, by field.

    ``root`` names the whole document when the problem is not tied to one field; ``source`` (a file)
    goes in front when given. Use it as
    ``raise config_error(e) from None`` so that the terminal shows no pydantic traceback.
    """
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or root
    msg = err["msg"].removeprefix("Value error, ")
    extra = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return ConfigError(f"{f'{source}: ' if source is not None else ''}{where}: {msg}{extra}")


def _parse_scalar(text: str) -> Any:
    """Parse an override value the way TOML would, falling back to a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one ``section.field=value`` override to a nested dict (in place)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected section.field=value")
    key, _, value = override.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r}: empty field name")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
        node = child
    node[parts[-1]] = _parse_scalar(value.strip())


def read_toml(path: str | Path) -> dict[str, Any]:
    """The parsed TOML file; a missing, unreadable or malformed file is a one-line :class:`ConfigError`."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None


def validate_learner_config(data: dict[str, Any]) -> LearnerConfig:
    """A :class:`LearnerConfig` from nested dicts; the first problem becomes a one-line :class:`ConfigError`."""
    try:
        return LearnerConfig.model_validate(data)
    except ValidationError as e:
        raise config_error(e) from None


def load_learner_config(path: str | Path | None, overrides: Sequence[str] = ()) -> LearnerConfig:
    """Read ``path`` (TOML; None means all defaults), apply ``overrides`` in order, validate."""
    data = read_toml(path) if path is not None else {}
    for override in overrides:
        apply_override(data, override)
    return validate_learner_config(data)
