"""A cap on one message of a p2pd stream, before it is read.

hivemind frames each protobuf message of a stream (all-reduce parts and replies, state downloads)
with an 8-byte length and reads that many bytes into memory (``P2P.receive_raw_data``). The length
comes from the peer: one message announced at 2⁶⁰ bytes, and fed slowly, would make the process buffer
whatever arrives. Honest messages are small: hivemind cuts tensors into 64 KiB chunks for downloads
and all-reduce parts are at most ``part_size_bytes`` (512 KiB by default). :func:`cap_stream_messages`
makes every stream of this process refuse a message longer than :data:`MAX_STREAM_MESSAGE_BYTES`
by its header, before reading it; the stream then fails like any broken stream (a download is
retried elsewhere, an all-reduce part is refused). Unary calls (the DHT's) go through p2pd's own
4 MiB limit.

hivemind calls the reader through its ``P2P`` class (``P2P.receive_raw_data(reader)``), not through
an instance, so the cap replaces that class attribute in the process that calls this (the DHT's
and the averager's processes, each in its own ``run``), not a subclass's.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P
from hivemind.utils import get_logger

logger = get_logger(__name__)

MAX_STREAM_MESSAGE_BYTES = 16 * 2**20


class MessageTooLarge(ValueError):
    """A stream message announced more bytes than the cap; it was not read."""


def cap_stream_messages(max_bytes: int = MAX_STREAM_MESSAGE_BYTES) -> None:
    """From now on, in this process, refuse any stream message longer than ``max_bytes`` before reading it."""

    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        header = await reader.readexactly(P2P.HEADER_LEN)
        length = int.from_bytes(header, P2P.BYTEORDER)
        if length > max_bytes:
            logger.warning(f"refused a stream message of {length} bytes (the cap is {max_bytes})")
            raise MessageTooLarge(f"a stream message of {length} bytes, above the cap of {max_bytes}")
        return await reader.readexactly(length)

    P2P.receive_raw_data = staticmethod(receive_raw_data)
