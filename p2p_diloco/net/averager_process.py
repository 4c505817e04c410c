"""hivemind's DecentralizedAverager, made to all-reduce one fragment per round exactly.

:class:`OuterGradientAverager` runs :class:`~p2p_diloco.net.allreduce.ExactAllReduceRunner` on the tensors
of the fragment named in the round's gathered metadata, leaves out the contributions the group's
metadata excludes (:mod:`p2p_diloco.core.exclusion`) and refuses parts for groups it is not forming; its
download path (serving and fetching the global state) is :mod:`p2p_diloco.net.downloads`. It runs in
hivemind's averager process; :class:`~p2p_diloco.net.averaging.HivemindAveraging` is the learner's
side of it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads typing.AsyncIterator

import hivemind.averaging.averager
import msgpack
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import CompressionBase
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time, get_logger
from hivemind.utils.asyncio import achain, as_aiter, enter_asynchronously
from hivemind.utils.mpfuture import MPFuture

from p2p_diloco.core import shard_sketches
from p2p_diloco.core import standing as standings
from p2p_diloco.core.averaging_api import StateProvider
from p2p_diloco.core.exclusion import Rules, Verdict, group_rules, judge
from p2p_diloco.hooks import NO_FAULTS, FaultHooks
from p2p_diloco.net.allreduce import ExactAllReduceRunner
from p2p_diloco.net.dht import die_with_parent, read_whole_messages, serialize_requests
from p2p_diloco.net.downloads import StateDownloads
from p2p_diloco.net.message_caps import cap_stream_messages
from p2p_diloco.net.patient_matchmaking import PatientMatchmaking
from p2p_diloco.net.strong_tasks import in_loops_made_by
from p2p_diloco.trust import signed_metadata
from p2p_diloco.trust.signed_matchmaking import SignedGroupKeyManager, download_key

logger = get_logger(__name__)


REFUSED_PARTS = "it sent malformed, non-finite or oversized parts or replies"  # why a refused sender is banned


class RefusedPeers(MatchmakingException):
    """The all-reduce failed, and this member refused parts or replies of ``peers`` (malformed, non-finite,
    larger than declared): the learner bans them from its next rounds."""

    def __init__(self, message: str, peers: Sequence[str], why: str = REFUSED_PARTS):
        super().__init__(message, tuple(peers), why)  # all in args: the exception crosses to the learner pickled
        self.message, self.peers, self.why = message, tuple(peers), why

    def __str__(self) -> str:
        return self.message


class ExcludedFromRound(MatchmakingException):
    """The group excluded this learner's own contribution: it takes no part in the all-reduce and does not commit."""


async def quiet_if_cancelled(step: Any, running: Awaitable[Any]) -> Any:
    """Await hivemind's ``_step`` for ``step``; if the learner cancelled the step (the swarm moved on) while
    its all-reduce finished, end quietly.

    hivemind then sets the result of a cancelled step; the error that raises is concurrent.futures'
    InvalidStateError, and its handler catches asyncio's, so it surfaced as an ERROR traceback ("Task
    exception was never retrieved") for an ordinary outcome. Nobody waits for a cancelled step's result;
    the same error for a step that was not cancelled is hivemind's to report."""
    try:
        return await running
    except concurrent.futures.InvalidStateError:
        if step.cancelled():
            return None
        raise


class OuterGradientAverager(StateDownloads, DecentralizedAverager):
    """DecentralizedAverager running :class:`ExactAllReduceRunner` on one fragment per round.

    ``averaged_tensors`` holds buffers for every parameter; a round all-reduces only the tensors of
    the fragment named in the step's gathered metadata (``{"fragment": f, ...}``), compressed with
    that fragment's codec. ``step()`` returns ``{"gathered": ..., "stats": ..., "verdict": ...}``: hivemind's
    gathered metadata, the all-reduce's seconds, its bytes sent and received and the wall time the group
    formed (``group_formed``), measured inside the averager process, and
    the :class:`~p2p_diloco.core.exclusion.Verdict` the all-reduce ran with (``rules``: the thresholds used
    when no groupmate gathered any). A learner whose own contribution is excluded raises
    :class:`ExcludedFromRound` before the all-reduce; the others run it without it.

    Besides hivemind's whole-state download it serves single fragments (``rpc_download_fragments``):
    a learner behind on one fragment fetches that fragment only, 1/P of the bytes.
    """

    # hivemind caches the RPC handlers per class on first use; a subclass that adds an RPC must not
    # inherit the base class's cache.
    _rpc_handlers = None
    _stub_type = None

    def __init__(
        self,
        averaged_tensors,
        dht: DHT,
        *,
        fragments: Sequence[Sequence[int]],
        codecs: Sequence[CompressionBase],
        state_provider: StateProvider | None = None,
        faults: FaultHooks | None = None,
        rules: Rules | None = None,
        **kwargs,
    ):
        self._state_provider = state_provider
        self._rules = rules or Rules()
        self._faults = NO_FAULTS if faults is None else faults
        self._fault_round = 0
        self._fragments = [tuple(f) for f in fragments]
        # Bytes of each fragment's served tensors (parameters and momentum, fp32): a download's cap.
        self._served_bytes = [8 * sum(averaged_tensors[i].numel() for i in f) for f in self._fragments]
        self._codecs = list(codecs)
        self._base_quorum = int(kwargs.get("min_group_size", 2))  # K; a majority quorum only raises it
        self._standing: dict[str, int] = {}  # the round's fragment state's (set_standing); empty: everyone counts
        self._established_after = 0
        self._base_target = int(kwargs.get("target_group_size") or self._base_quorum)  # and this, to at least itself
        self._round_stats: dict[bytes, dict[str, Any]] = {}
        self._owner: bytes = getattr(dht, "owner", b"")  # our signed subkey (p2p_diloco.trust.signed_matchmaking)
        super().__init__(averaged_tensors, dht, **kwargs)
        serialize_requests(self)  # the round thread, the training loop and downloads all send requests

    def run(self) -> None:
        die_with_parent(self._parent_pid)
        cap_stream_messages()  # parts, replies and downloads come through this process's streams
        read_whole_messages(self)
        in_loops_made_by(hivemind.averaging.averager)  # a cancelled round's matchmaking must end, not be collected
        super().run()

    async def _step(self, **kwargs):
        mm = PatientMatchmaking.adopt(self._matchmaking)  # hivemind builds it in the averager process; every
        if not isinstance(mm.group_key_manager, SignedGroupKeyManager):  # round passes here first
            mm.group_key_manager = SignedGroupKeyManager(mm.group_key_manager, self._owner,
                                                         poll_interval=mm.min_matchmaking_time / POLLS_PER_WINDOW)
        return await quiet_if_cancelled(kwargs["step"], super()._step(**kwargs))

    async def _declare_for_download_periodically(self):
        # hivemind's loop, declaring under our signed subkey (its own writes our raw peer ID, unsigned)
        key = download_key(self._matchmaking.group_key_manager.prefix)
        subkey = self._owner or self.peer_id.to_bytes()
        sharing_was_allowed = self.allow_state_sharing
        while True:
            expiration_time = get_dht_time() + self.declare_state_period
            if self.allow_state_sharing or sharing_was_allowed:
                priority = self.state_sharing_priority if self.allow_state_sharing else None
                asyncio.create_task(asyncio.wait_for(self.dht.store(
                    key, subkey=subkey, value=priority, expiration_time=expiration_time, return_future=True),
                    timeout=expiration_time - get_dht_time()))
                sharing_was_allowed = self.allow_state_sharing
            self._state_updated.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._state_updated.wait(), timeout=max(0.0, expiration_time - get_dht_time()))

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        # Mirrors DecentralizedAverager._aggregate_with_group, restricted to one fragment's tensors.
        formed = time.time()  # the group has formed: the learner's matchmaking time ends here (wall clock)
        try:
            _bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered), strict=True)
            gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_bytes), strict=True))
            fragment = _agreed_fragment(gathered, len(self._fragments))
            mine = gathered.get(self.peer_id)
            self._fault_round = int(mine.get("version", -1)) + 1 if isinstance(mine, dict) else 0
            named = {str(p): m for p, m in gathered.items()}
            # With signed records every member signs what it gathers: a leader cannot change it in relaying.
            forged = {p: why for p, m in named.items() if self._owner and (why := signed_metadata.forged(p, m))}
            rules, dissent = group_rules({p: m for p, m in named.items() if p not in forged}, self._rules)
            ramp = standings.ramps(self._standing, named, self._established_after, self._base_quorum)
            verdict = judge(named, rules, forged, dissent, ramp=ramp)
            self._leave_if_excluded(verdict, group_info, mine, fragment)
            self._check_quorum(verdict, group_info, gathered)
            excluded = [str(p) in verdict.excluded for p in group_info.peer_ids]
            modes = tuple(map(AveragingMode, mode_ids))
            download_bandwidths = reducer_shares(group_info.peer_ids, modes, excluded, named)
            indices = self._fragments[fragment]
            size = sum(self._averaged_tensors[i].numel() for i in indices)
            peer_fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, size, download_bandwidths, min_vector_size
            )
            kwargs.update(_runner_roles(group_info.peer_ids, peer_fractions, excluded, verdict, named))
            kwargs["compression"], kwargs["tensor_infos"] = self._codecs[fragment], None
            async with enter_asynchronously(self.get_tensors()) as all_tensors:
                tensors = [all_tensors[i] for i in indices]
                await self._run_allreduce_inplace_(tensors, group_info, peer_fractions=peer_fractions, **kwargs)
            stats = {**self._round_stats.pop(group_info.group_id, {}), "group_formed": formed}
            return {"gathered": gathered, "stats": stats, "verdict": verdict}
        except ExcludedFromRound:
            raise
        except RefusedPeers as e:
            raise RefusedPeers(f"Unable to run All-Reduce: {e}", e.peers, e.why) from e
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug(f"all-reduce failed: {e!r}")
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from e

    def _in_averager_process(self, method: str, wait: bool, **kwargs: Any):
        """Run ``method`` (a coroutine method taking ``future``) in the averager process, through hivemind's pipe."""
        future = MPFuture()
        self._outer_pipe.send((method, [], dict(**kwargs, future=future)))
        return future.result() if wait else future

    def set_min_group_size(self, size: int, everyone: Iterable[str] = (), wait: bool = True):
        """Matchmake with quorum ``size`` from the next round on (a majority quorum follows the swarm's size);
        a group then closes before its window ends only once it has at least that many members, and either
        holds the target size or every peer of ``everyone`` (peer IDs; :mod:`p2p_diloco.net.early_close`)."""
        return self._in_averager_process("_set_min_group_size", wait, size=int(size),
                                         everyone=sorted(str(p) for p in everyone))

    async def _set_min_group_size(self, size: int, everyone: list[str], future: MPFuture) -> None:
        def apply() -> None:
            quorum = max(self._base_quorum, size)
            self._matchmaking.min_group_size = quorum
            PatientMatchmaking.adopt(self._matchmaking).expected = frozenset(everyone)
            target = max(self._base_target, quorum)
            # hivemind's key manager draws each member's next group bits from `target` buckets: it must
            # hold the largest group (our group bits are set again before every round anyway).
            self._matchmaking.target_group_size = self._matchmaking.group_key_manager.target_group_size = target

        _settle(future, apply)

    def set_standing(self, standing: dict[str, int], after: int, wait: bool = True):
        """Judge the next rounds with this standing (:mod:`p2p_diloco.core.standing`): who counts toward the group's
        quorum (:meth:`_check_quorum`) and the ramp of each contribution's weight (``averaging.established_after``)."""
        return self._in_averager_process("_set_standing", wait, standing=dict(standing), after=int(after))

    async def _set_standing(self, standing: dict[str, int], after: int, future: MPFuture) -> None:
        def apply() -> None:
            self._standing, self._established_after = standing, after

        _settle(future, apply)

    def set_go_timeout(self, seconds: float, wait: bool = True):
        """From the next search on, wait up to ``seconds`` past the group's deadline for a leader's go
        (:mod:`p2p_diloco.net.patient_matchmaking`; never less than ``request_timeout``)."""
        return self._in_averager_process("_set_go_timeout", wait, seconds=float(seconds))

    async def _set_go_timeout(self, seconds: float, future: MPFuture) -> None:
        def apply() -> None:
            PatientMatchmaking.adopt(self._matchmaking).go_timeout = seconds

        _settle(future, apply)

    def _check_quorum(self, verdict: Verdict, group_info, gathered: dict) -> None:
        """Fail the round for every member if the contributions left are fewer than the group's quorum: a
        group that shrank below it by exclusion would commit what a group that small may not.

        The group's quorum is K, or, when members gathered a majority quorum of the swarm they see, the
        median of those claims (every member computes the same from the same gathered data; a minority of
        members claiming a huge or a tiny swarm moves it no further than the honest claims around it)."""
        # Established members only, unless the group's upper median says fewer than K established learners train
        # (then everyone counts, as each member's quorum claim did).
        live = group_quorum(gathered.values(), 0, claim="established")
        established = (standings.established(self._standing, self._established_after, self._base_quorum)
                       if live >= self._base_quorum else None)
        left = standings.counted((str(p) for p in group_info.peer_ids if str(p) not in verdict.excluded), established)
        quorum = group_quorum(gathered.values(), self._base_quorum)
        if left < quorum:
            self._cancel_registration(group_info)
            names = ", ".join(f"{p[-6:]} ({e.why})" for p, e in sorted(verdict.excluded.items()))
            why = f" left after leaving out {names}" if names else " in the group"
            counts = "" if established is None else " established"
            message = (f"{left}{counts} contribution(s){why}: below the quorum "
                       f"{'K' if quorum == self._base_quorum else 'of a majority'} = {quorum}")
            inflated = inflated_claims(gathered, str(self.peer_id))
            if inflated:
                raise RefusedPeers(f"{message}, claimed by {', '.join(p[-6:] for p in inflated)}", inflated,
                                   "it claimed a majority quorum more than twice ours")
            raise AllreduceException(message)

    def _cancel_registration(self, group_info) -> None:
        running = self._running_groups.get(group_info.group_id)
        if running is not None and not running.done():
            running.cancel()  # registered for this group, never to run: not "an all-reduce that did not finish"

    def _leave_if_excluded(self, verdict: Verdict, group_info, mine: Any, fragment: int) -> None:
        """Raise :class:`ExcludedFromRound` if the group excluded our own contribution (nobody sends us parts)."""
        exclusion = verdict.excluded.get(str(self.peer_id))
        if exclusion is None:
            return
        self._cancel_registration(group_info)
        version = mine.get("version") if isinstance(mine, dict) else None
        raise ExcludedFromRound(f"excluded {str(self.peer_id)[-6:]} from fragment {fragment} version {version}: "
                                f"{exclusion.why}")

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate's parts for an all-reduce; refused at once if we are in no such group.

        hivemind waits, for a group id it does not know, until this averager registers its next
        group: a follower may receive parts before its leader's "begin all-reduce" arrives. A peer
        that was counted into a group it never joined (its join request timed out after the leader
        had accepted it, see docs/design.md "Ghost groupmates") is not about to register that
        group, and the sender waited ``2 · next_chunk_timeout`` for it while the learner sat at τ.
        Here the part waits only while a group may still be forming for this averager; otherwise
        it gets ``BAD_GROUP_ID`` and the sender drops the round within one poll.
        """
        request = await anext(stream)
        if request.group_id not in self._running_groups and not await self._may_join(request.group_id):
            logger.debug(f"refused parts from {context.remote_id}: not in that group")
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _may_join(self, group_id: bytes, poll: float = 0.05) -> bool:
        """Wait until ``group_id`` is registered (True) or no group is forming here (False).

        "Forming": a join request or accept is under way, a leader accepted us and its answer is
        due, or a group was assembled and is about to be registered. Two polls in a row without
        any of these are needed, because between the matchmaker's return and the registration
        there is one event-loop turn in which none shows.
        """
        mm, idle_polls = self._matchmaking, 0
        while group_id not in self._running_groups:
            forming = (mm.current_leader is not None or mm.lock_request_join_group.locked()
                       or (mm.is_looking_for_group and mm.assembled_group.done()))
            idle_polls = 0 if forming else idle_polls + 1
            if idle_polls >= 2:
                return False
            await asyncio.sleep(poll)
        return True

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
        runner.faults, runner.round = self._faults, self._fault_round
        self._running_groups[group_id].set_result(runner)
        try:
            outputs = await runner.collect()
        except Exception as e:
            if runner.refused():
                raise RefusedPeers(f"{e} (refused what {', '.join(p[-6:] for p in runner.refused())} sent)",
                                   runner.refused()) from e
            raise
        seconds = time.perf_counter() - started
        # Before the inputs are overwritten: our parts are views of them.
        sketch = await asyncio.get_event_loop().run_in_executor(None, runner.sketch, outputs)
        sketch_key = await self._publish_sketch(sketch) if sketch is not None else ""
        for tensor, averaged in zip(tensors, outputs, strict=True):
            tensor.copy_(averaged)
        self._round_stats[group_id] = {
            "seconds": seconds,
            "bytes_sent": runner.bytes_sent,
            "bytes_received": runner.bytes_received,
            "sketch": sketch,
            "sketch_key": sketch_key,
            "refused": runner.refused(),
        }

    async def _publish_sketch(self, sketch: dict[str, Any]) -> str:
        """Store our sketch of the all-reduce, signed, at once (before the learner goes on to commit): our
        groupmates check their shards against it even if we die right after (p2p_diloco/core/shard_sketches.py).
        The key it is under, or "" when this DHT signs no records (nobody could trust it)."""
        owner = getattr(self.dht, "owner", b"")
        if not owner:
            return ""
        key = shard_sketches.sketch_key(self.prefix, sketch["seed"])
        if self._faults.withholds_sketch(self._fault_round):
            return key  # the groupmates wait for it in vain
        try:
            stored = self.dht.store(key, msgpack.packb(sketch, use_bin_type=True), get_dht_time() + 300.0,
                                    subkey=owner, return_future=True)
            await asyncio.wait_for(stored, timeout=10.0)
        except Exception as e:  # noqa: BLE001 - the groupmates will say whose sketch they miss
            logger.debug(f"could not store our sketch under {key}: {e!r}")
        return key


def reducer_shares(peer_ids: Sequence[Any], modes: Sequence[AveragingMode], excluded: Sequence[bool],
                   named: dict[str, Any]) -> list[float | None]:
    """What each member counts as in hivemind's load balancing: None (an equal share of the fragment) for a
    member that reduces, 0.0 for one that does not (a client, or excluded).

    The bandwidths and modes in hivemind's gathered tuples are outside the members' signatures: a leader
    could set the others' to 0 (or to CLIENT) and reduce the whole fragment itself. So bandwidths are
    ignored (learners declare none), and whether a member reduces is what its own signed metadata says
    (``reduces``), the gathered mode only for metadata without it.

    >>> reducer_shares(["a", "b"], [AveragingMode.CLIENT, AveragingMode.CLIENT], [False, False],
    ...                {"a": {"reduces": True}, "b": {"reduces": False}})
    [None, 0.0]
    """
    out: list[float | None] = []
    for peer, mode, left_out in zip(peer_ids, modes, excluded, strict=True):
        meta = named.get(str(peer))
        said = meta.get("reduces") if isinstance(meta, dict) else None
        reduces = said if isinstance(said, bool) else mode != AveragingMode.CLIENT
        out.append(None if reduces and not left_out else 0.0)
    return out


def _runner_roles(peer_ids, peer_fractions, excluded: Sequence[bool], verdict: Verdict,
                  named: dict[str, Any] | None = None) -> dict[str, Any]:
    """The runner's modes, and each sender's weight and clipping factor, all from the verdict, and the norm
    of its whole contribution as reducers see it (its declared norm, clipped; 1 for unit vectors).

    Without exclusions the modes are the ones hivemind's runner derives itself (a peer with no
    shard only sends); an excluded member is an auxiliary peer with no shard: it neither sends nor reduces.
    """
    modes = tuple(
        AveragingMode.AUX if out else AveragingMode.CLIENT if fraction == 0 else AveragingMode.NODE
        for fraction, out in zip(peer_fractions, excluded, strict=True)
    )
    senders = [str(p) for p, mode in zip(peer_ids, modes, strict=True) if mode != AveragingMode.AUX]
    named = named or {}  # the group's gathered metadata by peer id
    return {"modes": modes, "sender_weights": [verdict.weights[p] for p in senders],
            "sender_scales": [verdict.part_scale(p) for p in senders], "aggregator": verdict.aggregator,
            "sender_norms": [_declared_norm(named.get(p), p in verdict.unit, verdict.scale(p)) for p in senders]}


def _declared_norm(metadata: Any, unit: bool, scale: float) -> float:
    """A sender's whole contribution's norm as the reducers see it: 1 for unit vectors, else its gathered
    norm times its clipping factor; unbounded when it gathered no usable norm (the verdict decided on it)."""
    if unit:
        return 1.0
    norm = metadata.get("norm") if isinstance(metadata, dict) else None
    if isinstance(norm, int | float) and not isinstance(norm, bool) and math.isfinite(norm) and norm >= 0:
        return float(norm) * scale
    return math.inf


def _agreed_fragment(gathered: dict, num_fragments: int) -> int:
    fragments = {m.get("fragment") if isinstance(m, dict) else None for m in gathered.values()}
    if len(fragments) != 1:
        raise AllreduceException(f"groupmates disagree on the fragment: {fragments}")
    (fragment,) = fragments
    if not isinstance(fragment, int) or not 0 <= fragment < num_fragments:
        raise AllreduceException(f"invalid fragment index {fragment!r}")
    return fragment




POLLS_PER_WINDOW = 8  # reads of the group key per matchmaking time, at most (trust/signed_matchmaking.py)
MAX_QUORUM = 1_000_000  # a claimed quorum above this is malformed


def group_quorum(gathered: Iterable[Any], base: int, claim: str = "quorum") -> int:
    """The quorum a group applies: the upper median of what its members gathered as theirs (under ``claim``; also
    the count of established learners training, "established"), at least ``base`` (K).

    A member that gathered no valid ``quorum`` (an int in [1, MAX_QUORUM]) counts as claiming K: under a fixed
    quorum nobody claims one, and one member's claim cannot fail the rounds it joins; under a majority quorum a
    minority of members lying high or low moves the median no further than the honest claims around it.
    The upper median, not the lower: a count too low forks (a group smaller than half the swarm commits), a count
    too high only fails a round. In a pair it is the larger claim, so one member that missed learners in its reads
    no longer lets the pair commit (WAN benchmark, links 10 → 2 Mbit/s: a pair committed while 4
    learners trained).
    """
    claims = [base if (value := _claimed(meta, claim)) is None else value for meta in gathered]
    if not claims:
        return base
    claims.sort()
    return max(base, claims[len(claims) // 2])


def _claimed(meta: Any, claim: str) -> int | None:
    """A member's gathered ``claim`` if well-formed (an int in [1, MAX_QUORUM]), else None."""
    value = meta.get(claim) if isinstance(meta, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_QUORUM else None


def inflated_claims(gathered: Mapping[Any, Any], me: str) -> list[str]:
    """The members whose gathered majority quorum is more than twice ours plus 2: a swarm more than twice as large
    as the one this member's records show, which only a liar or a member reading another swarm claims. A round
    that fails on such a claim (in a pair the upper median is the larger) is their doing. [] when we gathered no
    valid claim; a malformed claim counts as K (:func:`group_quorum`) and fails nothing."""
    claims = {str(p): _claimed(m, "quorum") for p, m in gathered.items()}
    mine = claims.pop(me, None)
    if mine is None:
        return []
    return sorted(p for p, c in claims.items() if c is not None and c > 2 * mine + 2)


def _settle(future: MPFuture, action: Callable[[], None]) -> None:
    """Run ``action`` in the averager process and settle the caller's ``future`` with its outcome."""
    try:
        action()
        future.set_result(None)
    except Exception as e:
        if not future.done():
            future.set_exception(e)
