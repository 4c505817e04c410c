"""Butterfly all-reduce whose result is bit-identical on every member of the group.

hivemind's :class:`AllReduceRunner` returns *differences*: each reducer sends back
``average − (what it received)`` and every member adds that to its own local tensor. In floating
point ``x + (a − x)`` is not always ``a``, and with compression each member adds a different
rounding error, so members end close to, but not exactly at, the same average. It also quietly
keeps a member's *local* values for the shard of a reducer that failed.

This subclass changes these things and keeps the rest of hivemind's protocol (matchmaking, wire
format, timeouts, banning of failed senders):

1. A reducer returns the averaged shard itself, and members **overwrite** their copy with it. Each
   shard is computed once, by one reducer, so every member receives the same bytes.
2. The shard a member reduces for itself goes through the same compress → decompress round trip as
   the copies it sends to others (both as input and as result).
3. Results land in a scratch copy; the caller's tensors are written only when every shard arrived.
   A failed reducer raises :class:`IncompleteAllReduce`, so no half-averaged tensor leaves the
   round, and a retry starts from the untouched inputs.

Everything a peer sends is checked (docs/security.md, "Hostile input on the wire"): a part or reply
is refused by its header (index, codec tag, size) before it is decoded, and by its values after
(non-finite, or a part larger than the norm its sender declared for its whole contribution). A
refused part fails the all-reduce; :meth:`ExactAllReduceRunner.refused` names whose, so that the
learner can ban them.

4. A reducer drops its whole shard when a sender fails part-way (:class:`AllOrNothingReducer`):
   hivemind would average the parts that sender delivered with it and the rest without it. Every
   committed round then holds each groupmate's outer gradient entirely, which is what lets a
   learner that did not see the commit tell from the round's contributors whether its progress is
   already in Θ (docs/resilience.md, "Exactly-once contributions").
5. A reducer takes each sender's weight (and its clipping factor) from the group's gathered
   metadata, never from the part: every reducer uses the same numbers, and a part claiming
   ``weight=1e15`` counts like any other. With a robust aggregator (``averaging.aggregator``,
   :class:`RobustReducer`) it combines the parts by a coordinate-wise median or trimmed mean
   instead. Members whose contributions the group excluded
   (:mod:`p2p_diloco.core.exclusion`) take part as hivemind's auxiliary peers with no shard: they send
   nothing and reduce nothing, and parts from them are refused unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import (
    AllreduceException,
    BannedException,
    TensorPartContainer,
    TensorPartReducer,
)
from hivemind.compression import CompressionInfo
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

from p2p_diloco.core import shard_sketches
from p2p_diloco.core.aggregators import aggregate
from p2p_diloco.hooks import NO_FAULTS, FaultHooks
from p2p_diloco.net.codecs import decode

logger = get_logger(__name__)


# How long a reducer keeps its reply stream to a sender open after its last reply, waiting for the sender
# to close it. When the reducer's side closes first, p2pd may reset the stream, and a reset that reaches
# the sender's side before the reply is read discards the reply: in one 16-learner run, 2 of 554 reply
# streams ended with no reply although the reducer had sent it ("peer ... sent 0 parts"), and each
# failed the round of all 16 (docs/scale.md). Our senders close as soon as they hold every
# reply they expect, which cancels the wait (hivemind cancels a handler whose stream its caller closed).
_REPLY_HOLD = 5.0


class IncompleteAllReduce(AllreduceException):
    """Some shard of the result never arrived; the round must not be committed."""


class MalformedPart(ValueError):
    """A part or reply from a peer that does not fit what the round expects (refused before decoding when
    its header shows it)."""


class NotInGroup(AllreduceException):
    """A groupmate answered that it is in no group with this id: it will send its parts to nobody."""


class AllOrNothingReducer(TensorPartReducer):
    """Averages each part over every sender, or fails: a sender that stops part-way fails the shard.

    hivemind excludes a failed sender from the parts it had not sent yet, and a sender that never
    started at one reducer may have delivered everything to another. Here a sender that fails
    before its last part fails the whole shard: its groupmates miss the shard and drop the round,
    so no committed round holds part of a member's outer gradient.
    """

    failure: str | None = None

    def on_sender_failed(self, sender_index: int) -> None:
        """A sender that failed before its last part fails the whole shard: every sender awaiting it gets the error.

        One that had delivered every part is handled as hivemind does.
        """
        if self.failure is not None or self.finished.is_set():
            return
        received = self.num_parts_received[sender_index]
        if received < self.num_parts:
            self.failure = f"sender {sender_index} failed after {received} of {self.num_parts} parts"
            if not self.current_part_future.done():
                self.current_part_future.set_exception(AllreduceException(self.failure))
                self.current_part_future.exception()  # retrieved here; awaiting senders get it too
            self.finished.set()
            return
        super().on_sender_failed(sender_index)

    async def accumulate_part(self, sender_index, part_index, tensor_part, weight=1.0):
        """hivemind's accumulation, refused with :class:`AllreduceException` once the shard has failed."""
        if self.failure is not None:
            raise AllreduceException(self.failure)
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight)


class _Collected:
    """Stands in for hivemind's running weighted sum of one part: keeps every sender's part, and on
    ``div_`` (hivemind's last step of a part) returns their robust aggregate."""

    def __init__(self, kind: str):
        self.kind = kind
        self.parts: list[torch.Tensor] = []
        self.weights: list[float] = []

    def add_(self, tensor_part: torch.Tensor, alpha: float = 1.0):
        self.parts.append(tensor_part.float().clone())
        self.weights.append(float(alpha))
        return self

    def div_(self, _denominator: float) -> torch.Tensor:
        return aggregate(self.parts, self.weights, self.kind)


class RobustReducer(AllOrNothingReducer):
    """:class:`AllOrNothingReducer` that combines each part by a robust aggregator (p2p_diloco/core/aggregators.py).

    Every sender's part is kept until the last one arrives (the reducer's memory grows from one part to
    one part per sender); the result is the same at whichever reducer computes it.
    """

    def __init__(self, part_shapes, num_senders: int, aggregator: str):
        self.aggregator = aggregator
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _Collected(self.aggregator)


class ExactAllReduceRunner(AllReduceRunner):
    """:class:`AllReduceRunner` that returns averages (not deltas) identical across the group.

    ``sender_weights`` and ``sender_scales`` (default 1.0): each sender's weight and clipping factor, in the
    order of ``sender_peer_ids`` (the members that are not auxiliary), from the gathered metadata;
    ``sender_norms`` (default unbounded): the norm each sender declared for its whole contribution as the
    reducers see it (clipped): a part larger than that is refused.
    """

    def __init__(self, *, tensors, peer_fractions, ordered_peer_ids, p2p, sender_weights, sender_scales=None,
                 sender_norms=None, aggregator="mean", **kwargs):
        # (unannotated like hivemind's: annotating would make mypy check a body built on untyped attributes)
        container_kwargs = {
            k: kwargs[k] for k in ("compression", "part_size_bytes", "tensor_infos") if k in kwargs
        }
        super().__init__(
            tensors=tensors, peer_fractions=peer_fractions, ordered_peer_ids=ordered_peer_ids, p2p=p2p, **kwargs
        )
        self.tensor_part_container = TensorPartContainer(
            tensors, peer_fractions, return_deltas=False, **container_kwargs
        )
        self.tensor_part_reducer.finished.set()  # hivemind's own, unused: its finalize would warn "received 0%"
        shapes = tuple(part.shape for part in self.parts_for_local_averaging)
        self.tensor_part_reducer = (AllOrNothingReducer(shapes, len(self.sender_peer_ids)) if aggregator == "mean"
                                    else RobustReducer(shapes, len(self.sender_peer_ids), aggregator))
        my_index = self.ordered_peer_ids.index(self.peer_id)
        # Every reducer's (part, info) as we send them, kept for the sketch: hivemind clears its lists at the end.
        self._parts_by_peer = [list(parts) for parts in self.tensor_part_container._input_parts_by_peer]
        self._my_parts_with_info = self._parts_by_peer[my_index]
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(my_index)
        self._codec = self.tensor_part_container.compression
        # Aligned with sender_peer_ids: from the gathered metadata, the same at every reducer.
        self.sender_weights = [float(w) for w in sender_weights]
        self.sender_scales = [float(c) for c in sender_scales] if sender_scales else [1.0] * len(sender_weights)
        self.sender_norms = [float(n) for n in sender_norms] if sender_norms else [math.inf] * len(sender_weights)
        if len(self.sender_weights) != len(self.sender_peer_ids) \
                or not len(self.sender_scales) == len(self.sender_norms) == len(self.sender_weights):
            raise ValueError(f"{len(self.sender_weights)} weights for {len(self.sender_peer_ids)} senders")
        self.aggregator = aggregator
        self.faults: FaultHooks = NO_FAULTS  # fault injection (tests): set by the averager
        self.round = 0  # the version this round produces, for fault matching
        self.bytes_sent = 0
        self.bytes_received = 0  # parts from senders and averaged shards from reducers, as bytes_sent counts them
        self.rejected_senders: list[str] = []  # whose parts we refused (malformed, non-finite, too large)
        self.rejected_reducers: list[str] = []  # whose replies we refused
        self._open_replies = 0  # reply streams to groupmates that are still being written
        self.not_in_group: str | None = None  # a groupmate that answered it is in no such group

    async def collect(self) -> list[torch.Tensor]:
        """Run the all-reduce; return the averaged tensors or raise :class:`IncompleteAllReduce`."""
        outputs = [tensor async for tensor in self.run()]
        await self._wait_for_replies(timeout=self.reducer_timeout or 30.0)
        failed = self.tensor_part_container.failed_size
        if failed:
            why = f": {self.not_in_group}" if self.not_in_group else ""
            raise IncompleteAllReduce(
                f"{failed} of {self.tensor_part_container.total_size} values were not averaged "
                f"(a reducer failed{why}); the round is dropped"
            )
        return outputs

    async def _wait_for_replies(self, timeout: float) -> None:
        # Our own result may be complete while groupmates still receive our shard; waiting lets the
        # byte count cover the whole round and keeps us from leaving while others depend on us.
        deadline = asyncio.get_event_loop().time() + timeout
        while self._open_replies and asyncio.get_event_loop().time() < deadline:
            await asyncio.sleep(0.005)

    async def _communicate_with_peer(self, peer_id):
        if peer_id == self.peer_id:
            return await self._reduce_own_shard()
        # Mirrors AllReduceRunner._communicate_with_peer (remote branch), decoding with our codecs.
        peer_index = self.ordered_peer_ids.index(peer_id)
        stream = None
        try:
            done_sending = asyncio.Event()
            inputs_aiter = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs_aiter)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            part_index = 0
            shapes = [part.shape for part, _ in self._parts_by_peer[peer_index]]  # a reply has its part's shape

            async def checked(messages):
                index = 0
                async for msg in messages:
                    if msg.code == averaging_pb2.BAD_GROUP_ID:
                        raise NotInGroup(f"{peer_id} is not in this group (it never received the leader's go)")
                    if msg.code != averaging_pb2.AVERAGED_PART:
                        raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                    self._check_header(msg.tensor_part, index, shapes)
                    index += 1
                    yield msg
                    if index == len(shapes):
                        return  # every reply is here: we close the stream, not the reducer (_REPLY_HOLD)

            def _try_decode(msg):
                try:
                    return self._checked_values(decode(msg.tensor_part))
                except ValueError as e:  # the codec's checks of a peer's buffer: a malformed reply
                    raise MalformedPart(str(e)) from None

            async for averaged in amap_in_executor(
                _try_decode, checked(self._counted(aiter_with_timeout(stream, self.reducer_timeout))),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
                self.faults.fire("receive", self.round)
            if part_index != self.tensor_part_container.num_parts_by_peer[peer_index]:
                raise AllreduceException(  # not refused: an honest reducer ends so when another sender failed it
                    f"peer {peer_id} sent {part_index} parts, expected "
                    f"{self.tensor_part_container.num_parts_by_peer[peer_index]}"
                )
        except BaseException as e:
            if isinstance(e, MalformedPart):
                logger.warning(f"Rejected a malformed averaged part from {peer_id}: {e}")
                self.rejected_reducers.append(str(peer_id))
            elif isinstance(e, Exception):
                logger.debug(f"Caught {e!r} when communicating to {peer_id}", exc_info=True)
            self.tensor_part_container.register_failed_reducer(peer_index)
            if isinstance(e, NotInGroup):
                self.not_in_group = str(e)
                if peer_id in self.sender_peer_ids:
                    # It will send its parts to nobody: our own shard fails now, and hivemind's wait for
                    # missing senders (sender_timeout) ends once every other sender has started.
                    await self._ban_sender(peer_id)
                    if set(self.sender_peer_ids) <= self.active_senders | self.banned_senders:
                        self.all_senders_started.set()
            raise
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):  # e.g. a timed-out read still holds it: it ends with the task
                    await stream.aclose()

    async def _counted(self, stream):
        # On the event loop, not in the decoding executor: every += to the byte count happens on one thread.
        async for msg in stream:
            self.bytes_received += msg.ByteSize()
            yield msg

    async def _reduce_own_shard(self) -> None:
        peer_index = self.ordered_peer_ids.index(self.peer_id)
        sender_index = self.sender_peer_ids.index(self.peer_id)
        try:
            for part_index, (part, info) in enumerate(self._my_parts_with_info):
                part_as_sent = self._clipped(decode(self._codec.compress(part, info)), sender_index)
                averaged = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, part_as_sent, weight=self.sender_weights[sender_index]
                )
                result = decode(self._compress_result(averaged))
                self.tensor_part_container.register_processed_part(peer_index, part_index, result)
        except BaseException:
            # Our own shard failed (a sender stopped part-way): mark it, or the output iterator would
            # wait for it until the all-reduce timeout.
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    def _clipped(self, part: torch.Tensor, sender_index: int) -> torch.Tensor:
        scale = self.sender_scales[sender_index]
        return part if scale == 1.0 else part * scale

    async def rpc_aggregate_part(self, stream, context):
        """Parts from a groupmate; refused unread from one that is no sender (an excluded contributor)."""
        if context.remote_id not in self.sender_peer_ids:
            logger.debug(f"refused parts from {context.remote_id}: its contribution is excluded from this round")
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        else:
            async for message in super().rpc_aggregate_part(stream, context):
                yield message
        # Returning would close our end at once, and p2pd may then reset the stream before the sender
        # has read our last reply: wait for the sender to close it.
        await asyncio.sleep(_REPLY_HOLD)

    def _check_header(self, part: runtime_pb2.Tensor, index: int, shapes: Sequence[torch.Size]) -> None:
        """Refuse a part (or reply) from a peer by its header alone: its index, codec tag and size; the
        codec then checks the buffer's length against the size before it allocates anything."""
        if index >= len(shapes):
            raise MalformedPart(f"part {index + 1} of {len(shapes)} expected")
        tag = getattr(self._codec, "tag", None)
        if tag is not None and part.dtype != tag:
            raise MalformedPart(f"tagged {part.dtype[:40]!r}, not {tag!r}")
        if tuple(part.size) != tuple(shapes[index]):
            raise MalformedPart(f"size {list(part.size)[:4]}, expected {list(shapes[index])}")

    @staticmethod
    def _checked_values(tensor: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(tensor).all():
            raise MalformedPart("non-finite values")
        return tensor

    @staticmethod
    def _within_norm(part: torch.Tensor, declared: float, codec) -> torch.Tensor:
        """``part`` (decoded and clipped) if its norm fits the sender's declared norm of its whole contribution,
        with 5 % and the codec's rounding to spare; a part cannot be larger than the whole it was cut from."""
        quantizer = getattr(codec, "quantizer", None)
        rounding = float(quantizer.error_bound(part).double().norm()) if quantizer is not None else 0.0
        norm = float(part.double().norm())
        if not norm <= 1.05 * declared + rounding + 1e-6:
            raise MalformedPart(f"a part of norm {norm:.4g}, its sender declared {declared:.4g} for all of it")
        return part

    def refused(self) -> list[str]:
        """The groupmates whose parts or replies this member refused in this all-reduce."""
        return sorted(set(self.rejected_senders) | set(self.rejected_reducers))

    def _compress_result(self, averaged: torch.Tensor):
        averaged = self.faults.reduced_shard(averaged, self.round)  # a malicious reducer (tests): one lie to all
        return self._codec.compress(averaged, CompressionInfo.from_tensor(averaged))

    def sketch(self, outputs: list[torch.Tensor]) -> dict | None:
        """Our sketch of this all-reduce (:mod:`p2p_diloco.core.shard_sketches`): projections of the parts we sent
        and of the shards we received, values at spots and norms; None if we sent nothing.

        Call it after :meth:`collect` and before the input tensors are overwritten (our parts are views of them).
        """
        if self.peer_id not in self.sender_peer_ids:
            return None
        scale = self.sender_scales[self.sender_peer_ids.index(self.peer_id)]
        seed = shard_sketches.seed_of(outputs)
        result = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in outputs])
        shards, sent, start = [], [], 0
        for r, parts in enumerate(self._parts_by_peer):
            n = sum(part.numel() for part, _ in parts)
            if n:
                shards.append((str(self.ordered_peer_ids[r]), start, start + n))
                decoded = torch.cat([decode(self._codec.compress(part, info)).reshape(-1) for part, info in parts])
                sent.append(decoded if scale == 1.0 else decoded * scale)  # as the reducer clips it (_clipped)
            start += n
        quantizer = getattr(self._codec, "quantizer", None)
        bound = quantizer.error_bound if quantizer is not None else (lambda y: torch.zeros_like(y))
        return shard_sketches.sketch(seed, shards, sent, result, bound, self.aggregator)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        index = 0
        async for message in super()._generate_input_for_peer(peer_index):
            for out in self.faults.wire_messages(message, index, self.round):  # a hostile peer (tests)
                self.bytes_sent += out.ByteSize()
                yield out
            index += 1
            self.faults.fire("send", self.round)

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        # Mirrors AllReduceRunner._accumulate_parts_streaming, but replies with the average itself,
        # refuses non-finite inputs, and weighs each sender by its gathered weight, not the part's.
        part_index = 0
        loop = asyncio.get_event_loop()
        self._open_replies += 1
        try:
            async for msg in stream:
                self.bytes_received += msg.ByteSize()
                try:  # the header (index, tag, size) before anything is decoded, the values after
                    self._check_header(msg.tensor_part, part_index, self.tensor_part_reducer.part_shapes)
                    tensor_part = await loop.run_in_executor(None, decode, msg.tensor_part)
                    tensor_part = self._within_norm(self._clipped(self._checked_values(tensor_part), sender_index),
                                                    self.sender_norms[sender_index], self._codec)
                except Exception as e:  # noqa: BLE001 - a malformed part from a peer
                    sender = self.sender_peer_ids[sender_index]
                    logger.warning(f"Rejected an invalid outer gradient part from {sender}: {e}")
                    self.rejected_senders.append(str(sender))
                    break
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=self.sender_weights[sender_index],
                    )
                    part_index += 1
                except BannedException:
                    break
                serialized = await loop.run_in_executor(None, self._compress_result, averaged)
                reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                for out in self.faults.wire_messages(reply, part_index - 1, self.round):  # a hostile reducer (tests)
                    self.bytes_sent += out.ByteSize()
                    yield out
                self.faults.fire("reduce", self.round)
            else:  # the stream ended of itself: a sender that sends fewer parts than it owes is refused
                if part_index < self.tensor_part_reducer.num_parts:
                    sender = self.sender_peer_ids[sender_index]
                    logger.warning(f"Rejected the outer gradient of {sender}: its parts ended after {part_index} "
                                   f"of {self.tensor_part_reducer.num_parts}")
                    self.rejected_senders.append(str(sender))
        finally:
            self._open_replies -= 1
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
