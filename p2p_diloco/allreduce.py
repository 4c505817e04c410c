"""Butterfly all-reduce whose result is bit-identical on every member of the group.

hivemind's :class:`AllReduceRunner` returns *differences*: each reducer sends back
``average − (what it received)`` and every member adds that to its own local tensor. In floating
point ``x + (a − x)`` is not always ``a``, and with compression each member adds a different
rounding error, so members end close to, but not exactly at, the same average. It also quietly
keeps a member's *local* values for the shard of a reducer that failed.

This subclass changes three things and keeps the rest of hivemind's protocol (matchmaking, wire
format, timeouts, banning of failed senders):

1. A reducer returns the averaged shard itself, and members **overwrite** their copy with it. Each
   shard is computed once, by one reducer, so every member receives the same bytes.
2. The shard a member reduces for itself goes through the same compress → decompress round trip as
   the copies it sends to others (both as input and as result).
3. Results land in a scratch copy; the caller's tensors are written only when every shard arrived.
   A failed reducer raises :class:`IncompleteAllReduce`, so no half-averaged tensor leaves the
   round, and a retry starts from the untouched inputs.

Incoming parts that are not finite are refused and their sender is banned from the round.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

logger = get_logger(__name__)


class IncompleteAllReduce(AllreduceException):
    """Some shard of the result never arrived; the round must not be committed."""


class ExactAllReduceRunner(AllReduceRunner):
    """:class:`AllReduceRunner` that returns averages (not deltas) identical across the group."""

    def __init__(self, *, tensors, peer_fractions, ordered_peer_ids, p2p, **kwargs):
        container_kwargs = {
            k: kwargs[k] for k in ("compression", "part_size_bytes", "tensor_infos") if k in kwargs
        }
        super().__init__(
            tensors=tensors, peer_fractions=peer_fractions, ordered_peer_ids=ordered_peer_ids, p2p=p2p, **kwargs
        )
        self.tensor_part_container = TensorPartContainer(
            tensors, peer_fractions, return_deltas=False, **container_kwargs
        )
        my_index = self.ordered_peer_ids.index(self.peer_id)
        self._my_parts_with_info = list(self.tensor_part_container._input_parts_by_peer[my_index])
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(my_index)
        self.bytes_sent = 0
        self.rejected_senders: list[str] = []
        self._open_replies = 0  # reply streams to groupmates that are still being written

    async def collect(self) -> list[torch.Tensor]:
        """Run the all-reduce; return the averaged tensors or raise :class:`IncompleteAllReduce`."""
        outputs = [tensor async for tensor in self.run()]
        await self._wait_for_replies(timeout=self.reducer_timeout or 30.0)
        failed = self.tensor_part_container.failed_size
        if failed:
            raise IncompleteAllReduce(
                f"{failed} of {self.tensor_part_container.total_size} values were not averaged "
                f"(a reducer failed); the round is dropped"
            )
        return outputs

    async def _wait_for_replies(self, timeout: float) -> None:
        # Our own result may be complete while groupmates still receive our shard; waiting lets the
        # byte count cover the whole round and keeps us from leaving while others depend on us.
        deadline = asyncio.get_event_loop().time() + timeout
        while self._open_replies and asyncio.get_event_loop().time() < deadline:
            await asyncio.sleep(0.005)

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, (part, info) in enumerate(self._my_parts_with_info):
            serialized = self.tensor_part_container.compression.compress(part, info)
            part_as_sent = deserialize_torch_tensor(serialized)
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, part_as_sent, weight=self.weight
            )
            result = deserialize_torch_tensor(serialize_torch_tensor(averaged, serialized.compression))
            self.tensor_part_container.register_processed_part(peer_index, part_index, result)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += message.ByteSize()
            yield message

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        # Mirrors AllReduceRunner._accumulate_parts_streaming, but replies with the average itself
        # and refuses non-finite inputs.
        part_index = 0
        loop = asyncio.get_event_loop()
        self._open_replies += 1
        try:
            async for msg in stream:
                tensor_part = await loop.run_in_executor(None, deserialize_torch_tensor, msg.tensor_part)
                if not torch.isfinite(tensor_part).all():
                    sender = self.sender_peer_ids[sender_index]
                    logger.warning(f"Rejected a non-finite outer gradient part from {sender}")
                    self.rejected_senders.append(str(sender))
                    break
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=msg.weight
                    )
                    part_index += 1
                except BannedException:
                    break
                compression = msg.tensor_part.compression
                serialized = await loop.run_in_executor(None, serialize_torch_tensor, averaged, compression)
                reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                self.bytes_sent += reply.ByteSize()
                yield reply
        finally:
            self._open_replies -= 1
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
