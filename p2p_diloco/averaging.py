"""Averaging of outer gradients across a group, behind a small interface.

:class:`Averaging` is what an :class:`~p2p_diloco.round.OuterRound` talks to. :class:`HivemindAveraging`
implements it with a hivemind :class:`DecentralizedAverager` whose all-reduce is the exact variant
in :mod:`p2p_diloco.allreduce`; unit tests implement it with an in-process fake.

Matchmaking is keyed by the global version: before each round the averager's group bits are set
to the binary version number, so only learners that hold the same version look for each other
(hivemind's group key is ``{prefix}.0b{bits}``). Learners at other versions never meet in a group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import Float16Compression, NoCompression
from hivemind.utils import get_logger

from p2p_diloco.allreduce import ExactAllReduceRunner
from p2p_diloco.config import AveragingConfig
from p2p_diloco.lifecycle import die_with_parent

logger = get_logger(__name__)


class RoundFailed(RuntimeError):
    """The round did not produce an average that may be committed; the caller keeps its Δ."""


class RoundSuperseded(RoundFailed):
    """The swarm reached a newer version while we were looking for a group at ours."""


@dataclass
class AverageResult:
    deltas: list[torch.Tensor]
    groupmates: dict[str, dict[str, Any]]  # peer id -> metadata it gathered (version, sha, tokens, ...)
    allreduce_seconds: float
    bytes_sent: int

    @property
    def group_size(self) -> int:
        return len(self.groupmates)


class Averaging(Protocol):
    def average(
        self, deltas: Sequence[torch.Tensor], weight: float, metadata: dict[str, Any], version: int
    ) -> AverageResult:
        """Average ``deltas`` with a group at ``version``; raise :class:`RoundFailed` if none forms.

        Raises :class:`RoundSuperseded` when the swarm moved past ``version`` during matchmaking.
        """


StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


class OuterGradientAverager(DecentralizedAverager):
    """DecentralizedAverager running :class:`ExactAllReduceRunner` and serving the global state.

    ``step()`` returns ``{"gathered": ..., "stats": ...}``: hivemind's gathered metadata plus the
    all-reduce's seconds and bytes, measured inside the averager process.
    """

    def __init__(self, averaged_tensors, dht: DHT, *, state_provider: StateProvider | None = None, **kwargs):
        self._state_provider = state_provider
        self._round_stats: dict[bytes, dict[str, float]] = {}
        super().__init__(averaged_tensors, dht, **kwargs)

    def run(self) -> None:
        die_with_parent(self._parent_pid)
        super().run()

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return {"gathered": gathered, "stats": self._round_stats.pop(group_info.group_id, {})}

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        started = time.perf_counter()
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        outputs = await runner.collect()
        for tensor, averaged in zip(tensors, outputs, strict=True):
            tensor.copy_(averaged)
        self._round_stats[group_id] = {
            "seconds": time.perf_counter() - started,
            "bytes_sent": runner.bytes_sent,
        }

    def get_current_state(self):
        if self._state_provider is None:
            return {}, [], None
        metadata, tensors = self._state_provider()
        return metadata, tensors, None


@dataclass
class HivemindAveraging:
    """:class:`Averaging` over a hivemind DHT. Also serves and downloads the global state."""

    dht: DHT
    template: Sequence[torch.Tensor]
    cfg: AveragingConfig
    prefix: str
    state_provider: StateProvider | None = None
    # Polled while looking for a group: returns the swarm's newest version, to stop waiting for a
    # group that has already moved on.
    newest_version: Callable[[], int] | None = None
    poll_seconds: float = 1.0
    _buffers: list[torch.Tensor] = field(init=False)
    _averager: OuterGradientAverager = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _superseded_by: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        # hivemind logs "could not find a group" as an error with a traceback; for a learner it is a
        # normal outcome that OuterRound reports in one line.
        logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)
        self._buffers = [torch.zeros_like(t, dtype=torch.float32) for t in self.template]
        compression = Float16Compression() if self.cfg.compression == "fp16" else NoCompression()
        self._averager = OuterGradientAverager(
            self._buffers,
            self.dht,
            state_provider=self.state_provider,
            start=True,
            prefix=self.prefix,
            min_group_size=self.cfg.min_group_size,
            target_group_size=self.cfg.target_group_size,
            min_matchmaking_time=self.cfg.matchmaking_time,
            request_timeout=self.cfg.request_timeout,
            allreduce_timeout=self.cfg.allreduce_timeout,
            next_chunk_timeout=self.cfg.next_chunk_timeout,
            compression=compression,
            state_compression=NoCompression(),
            allow_state_sharing=True,
            declare_state_period=10.0,
            shutdown_timeout=5.0,
        )

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    def set_state_priority(self, version: int) -> None:
        """Peers that download state try the highest priority first: the newest version."""
        self._averager.state_sharing_priority = float(version)

    def average(
        self, deltas: Sequence[torch.Tensor], weight: float, metadata: dict[str, Any], version: int
    ) -> AverageResult:
        with self._lock:
            with self._averager.get_tensors() as buffers:
                for buf, d in zip(buffers, deltas, strict=True):
                    buf.copy_(d)
            self._averager.set_group_bits(format(version, "b"))
            control = self._averager.step(
                weight=float(weight), gather=metadata, timeout=self.cfg.round_timeout, wait=False
            )
            self._watch_for_newer_version(control, version)
            try:
                result = control.result()
            except Exception as e:  # hivemind raises a zoo of types here; all mean "no average"
                if control.cancelled() and self._superseded_by is not None:
                    raise RoundSuperseded(f"the swarm moved on to version {self._superseded_by}") from None
                raise RoundFailed(f"{type(e).__name__}: {e}".strip()) from None
            if not result:
                raise RoundFailed("no group formed within the round window")
            with self._averager.get_tensors() as buffers:
                averaged = [b.clone() for b in buffers]
        groupmates = {str(peer): data for peer, data in result["gathered"].items()}
        stats = result.get("stats", {})
        return AverageResult(
            deltas=averaged,
            groupmates=groupmates,
            allreduce_seconds=float(stats.get("seconds", 0.0)),
            bytes_sent=int(stats.get("bytes_sent", 0)),
        )

    def _watch_for_newer_version(self, control, version: int) -> None:
        """Cancel matchmaking if the swarm is already past ``version``; never once all-reduce began."""
        self._superseded_by = None
        if self.newest_version is None:
            return
        while not control.done():
            try:
                control.result(timeout=self.poll_seconds)
            except TimeoutError:
                pass
            except Exception:  # noqa: BLE001 - the failure itself is reported by the caller
                return
            if control.done() or control.began_allreduce:
                return
            newest = self.newest_version()
            if newest > version and not control.began_allreduce and control.cancel():
                self._superseded_by = newest
                return

    def download_state(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Newest global state from the peers that serve it (highest version first), or None."""
        loaded = self._averager.load_state_from_peers(wait=True, timeout=timeout)
        if loaded is None:
            return None
        metadata, tensors = loaded
        return metadata, list(tensors)

    def shutdown(self) -> None:
        try:
            self._averager.shutdown()
        except Exception as e:  # noqa: BLE001 - shutdown must not mask the caller's own exit path
            logger.debug(f"averager shutdown: {e!r}")
