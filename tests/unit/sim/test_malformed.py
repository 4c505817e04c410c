"""Every malformation a hostile peer can put in a part or a reply (p2p_diloco/sim/malformed.py) is refused
by the receiver's checks (p2p_diloco/net/allreduce.py) before it is decoded, or by the codec or the values
check after, never by an allocation the size of what the message claims."""

import tracemalloc
from types import SimpleNamespace

import pytest
import torch
from hivemind.compression import CompressionInfo

from p2p_diloco.net.allreduce import ExactAllReduceRunner, MalformedPart
from p2p_diloco.net.codecs import decode, get_codec
from p2p_diloco.sim.malformed import KINDS, malform


def _receive(codec, message, shapes, index=0, declared=100.0):
    """What a reducer does with a part: header, decode, values, norm (a sender reading a reply: all but the
    norm; the sketches bound a reply's norm)."""
    ExactAllReduceRunner._check_header(SimpleNamespace(_codec=codec), message, index, shapes)
    part = ExactAllReduceRunner._checked_values(decode(message))
    return ExactAllReduceRunner._within_norm(part, declared, codec)


@pytest.mark.parametrize("codec_name", ["none", "int8", "fp16"])
@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("extra-part", "missing-part")])
def test_each_malformed_message_is_refused_without_a_large_allocation(codec_name, kind):
    codec = get_codec(codec_name)
    part = torch.randn(1000)
    good = codec.compress(part, CompressionInfo.from_tensor(part))
    assert torch.allclose(_receive(codec, good, [part.shape], declared=float(part.norm())), part, atol=0.05)
    (bad,) = malform(kind, good)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError):  # MalformedPart, or the codec's ValueError
            _receive(codec, bad, [part.shape], declared=float(part.norm()))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * 1024 * 1024, (kind, peak)


@pytest.mark.parametrize("codec_name", ["none", "int8", "int4", "fp16"])
def test_a_part_larger_than_its_senders_declared_norm_is_refused(codec_name):
    codec = get_codec(codec_name)
    whole = torch.randn(4000, generator=torch.Generator().manual_seed(3))
    for piece in whole.split(1000):  # every honest part passes against the whole's norm
        received = decode(codec.compress(piece, CompressionInfo.from_tensor(piece)))
        _receive(codec, codec.compress(piece, CompressionInfo.from_tensor(piece)), [piece.shape],
                 declared=float(whole.norm()))
        assert float(received.norm()) <= float(whole.norm())
    big = whole[:1000] * 10  # a part ten times larger than its sender said the whole was
    with pytest.raises(MalformedPart, match="declared"):
        _receive(codec, codec.compress(big, CompressionInfo.from_tensor(big)), [big.shape],
                 declared=float(whole.norm()))


def test_a_part_beyond_the_expected_count_is_refused_by_its_index():
    codec = get_codec("none")
    part = torch.randn(10)
    good = codec.compress(part, CompressionInfo.from_tensor(part))
    with pytest.raises(MalformedPart, match="part 2 of 1"):
        _receive(codec, good, [part.shape], index=1)
    assert malform("missing-part", good) == [] and malform("extra-part", good) == [good, good]
