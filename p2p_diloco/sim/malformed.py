"""Malformed all-reduce messages, as a hostile peer would send them (fault injection: ``malform``).

A learner with ``malform at round R with KIND`` (p2p_diloco/sim/faults.py) sends each outer-gradient part,
and replies with each averaged shard, malformed as KIND says, from round R on. The kinds are the bad
inputs of the trust issue's list that a part or a reply can carry:

============  =====================================================================
nan           every value NaN (the payload's bytes: fp32 NaN over and over)
inf, ninf     every value +Inf / -Inf
huge          every value 3e38 (finite; sums of a few overflow fp32)
size-empty    ``size = []``
size-neg      ``size = [-1]`` (hivemind's size field is uint32: -1 arrives as ``[2^32-1]``)
size-2e62     ``size = [2^62]`` (as ``[2^31, 2^31]``: 2^62 does not fit one uint32)
shape         the right number of values in another shape (``[n, 1]``)
short, long   the buffer one byte short / long
float64       ``dtype = "float64"`` (hivemind's own format, not ours)
no-dtype      ``dtype = ""``
block-0       ``dtype = "p2pd:int8:0"``
block-neg     ``dtype = "p2pd:int8:-1"``
other-codec   another codec's tag over the same bytes
block-huge    ``dtype = "p2pd:int8:17179869184"``, ``size = [1]``, 5 bytes (asks for 64 GiB)
extra-part    one part more than the receiver expects
missing-part  one part fewer (the stream ends early)
============  =====================================================================

A receiver must refuse every one without a crash, and without allocating more than the message's
known size (p2p_diloco/net/allreduce.py; tests/integration/test_hostile_wire.py).
"""

from __future__ import annotations

import struct

from hivemind.proto import averaging_pb2, runtime_pb2

from p2p_diloco.sim.faults import MALFORM_KINDS as KINDS

_VALUES = {"nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "huge": 3e38}


def malform(kind: str, message: runtime_pb2.Tensor) -> list[runtime_pb2.Tensor]:
    """What a hostile peer sends instead of ``message`` (a part or a reply): none, one or two messages."""
    if kind == "missing-part":
        return []
    if kind == "extra-part":
        return [message, message]
    bad = runtime_pb2.Tensor()
    bad.CopyFrom(message)
    if kind in _VALUES:
        word = struct.pack("<f", _VALUES[kind])
        bad.buffer = (word * (len(bad.buffer) // 4 + 1))[:len(bad.buffer)]
    elif kind == "size-empty":
        del bad.size[:]
    elif kind in ("size-neg", "size-2e62"):  # size is uint32 on the wire: -1 arrives as 2^32-1
        del bad.size[:]
        bad.size.extend([2**32 - 1] if kind == "size-neg" else [2**31, 2**31])
    elif kind == "shape":
        n = 1
        for s in message.size:
            n *= s
        del bad.size[:]
        bad.size.extend([n, 1])
    elif kind == "short":
        bad.buffer = bad.buffer[:-1]
    elif kind == "long":
        bad.buffer = bad.buffer + b"\0"
    elif kind == "float64":
        bad.dtype = "float64"
    elif kind == "no-dtype":
        bad.dtype = ""
    elif kind == "block-0":
        bad.dtype = "p2pd:int8:0"
    elif kind == "block-neg":
        bad.dtype = "p2pd:int8:-1"
    elif kind == "other-codec":
        bad.dtype = "p2pd:fp16" if message.dtype != "p2pd:fp16" else "p2pd:int8:64"
    elif kind == "block-huge":
        bad.dtype, bad.buffer = "p2pd:int8:17179869184", b"\1\0\0\0\0"
        del bad.size[:]
        bad.size.append(1)
    else:
        raise ValueError(f"unknown malformation {kind!r}; one of {', '.join(KINDS)}")
    return [bad]


def malformed_messages(kind: str, message: averaging_pb2.AveragingData,
                       index: int) -> list[averaging_pb2.AveragingData]:
    """``message`` (the ``index``-th of its all-reduce stream) as a hostile peer sends it: its tensor part
    malformed; "missing-part" drops every part after the first, "extra-part" repeats the first."""
    if kind == "missing-part":
        return [message] if index == 0 else []
    if kind == "extra-part":
        return [message, averaging_pb2.AveragingData(code=message.code, tensor_part=message.tensor_part)] \
            if index == 0 else [message]
    out = averaging_pb2.AveragingData()
    out.CopyFrom(message)
    out.tensor_part.CopyFrom(malform(kind, message.tensor_part)[0])
    return [out]
