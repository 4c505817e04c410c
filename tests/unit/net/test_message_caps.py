"""The cap on one p2pd stream message (p2p_diloco/net/message_caps.py): refused by its header, before any read."""

import asyncio

import pytest
from hivemind.p2p import P2P

from p2p_diloco.net.message_caps import MessageTooLarge, cap_stream_messages


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_a_message_above_the_cap_is_refused_by_its_header_and_others_pass(monkeypatch):
    monkeypatch.setattr(P2P, "receive_raw_data", P2P.receive_raw_data)  # restored after the test
    cap_stream_messages(1024)

    async def go():
        ok = await P2P.receive_raw_data(_reader((5).to_bytes(8, "big") + b"hello"))
        assert ok == b"hello"
        huge = _reader((2**60).to_bytes(8, "big") + b"x" * 10)  # announces an exabyte, sends ten bytes
        with pytest.raises(MessageTooLarge, match="above the cap of 1024"):
            await P2P.receive_raw_data(huge)
        assert await huge.read() == b"x" * 10  # nothing of the body was read
        with pytest.raises(MessageTooLarge):
            await P2P.receive_raw_data(_reader((1025).to_bytes(8, "big") + b"y" * 1025))

    asyncio.run(go())
