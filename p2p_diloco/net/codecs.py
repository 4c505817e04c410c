"""The wire formats of :mod:`p2p_diloco.core.quantization` as hivemind compressions, for the butterfly all-reduce.

Wire format
-----------
Every codec produces an ordinary :class:`hivemind.proto.runtime_pb2.Tensor`. hivemind's ``compression`` field is a
fixed protobuf enum, so instead of a new enum value the codec is **tagged in the ``dtype`` string**::

    dtype = "p2pd:<name>"               # none, fp16, bf16
    dtype = "p2pd:<name>:<block_size>"  # int8, int4, e.g. "p2pd:int4:64"
    compression = NONE, size = original shape, buffer = the quantizer's payload

Such a message must be decoded with :func:`decode` (hivemind's own ``deserialize_torch_tensor`` fails loudly on it,
since ``np.dtype("p2pd:...")`` is not a dtype); :func:`decode` falls back to hivemind for untagged messages.
The payloads, their sizes and error bounds are described in :mod:`p2p_diloco.core.quantization`, which computes them
without hivemind (``quantization.round_trip`` gives the same bits as ``decode(codec.compress(...))``).
"""

from __future__ import annotations

import torch
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from p2p_diloco.core.quantization import (
    BF16_MAX,
    DEFAULT_BLOCK_SIZE,
    FP16_MAX,
    TAG_PREFIX,
    Bf16,
    Fp16,
    Fp32,
    Int4,
    Int8,
    Quantizer,
    error_bound,
    get_quantizer,
    parse_tag,
    quantizer_for_tag,
)

__all__ = [
    "BF16_MAX",
    "CODECS",
    "FP16_MAX",
    "TAG_PREFIX",
    "Bf16Codec",
    "Fp16Codec",
    "Int4Codec",
    "Int8Codec",
    "NoneCodec",
    "P2PCodec",
    "decode",
    "error_bound",
    "get_codec",
    "parse_tag",
]


class P2PCodec(CompressionBase):
    """A :class:`~p2p_diloco.core.quantization.Quantizer` as a hivemind compression: tagged messages, its payload."""

    compression_type = runtime_pb2.CompressionType.NONE

    def __init__(self, quantizer: Quantizer) -> None:
        self.quantizer = quantizer

    @property
    def name(self) -> str:
        """The codec's name, e.g. ``int4``."""
        return self.quantizer.name

    @property
    def tag(self) -> str:
        """The ``dtype`` string of this codec's messages, e.g. ``p2pd:int4:64``."""
        return self.quantizer.tag

    @property
    def bytes_per_value(self) -> float:
        """Payload bytes per value (block codecs: including their share of the scale)."""
        return self.quantizer.bytes_per_value

    def payload_bytes(self, numel: int) -> int:
        """Exact ``len(buffer)`` for a tensor of ``numel`` values."""
        return self.quantizer.payload_bytes(numel)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        """A tagged message holding ``tensor`` (finite, floating point); ``info`` is not needed."""
        return runtime_pb2.Tensor(
            compression=self.compression_type, buffer=self.quantizer.encode(tensor), size=tensor.shape, dtype=self.tag
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        """The fp32 tensor in a message of this codec; ValueError for another tag or a malformed message."""
        if serialized_tensor.dtype != self.tag:
            raise ValueError(f"{self!r} cannot decode a message tagged {serialized_tensor.dtype!r}")
        return self.quantizer.decode(serialized_tensor.buffer, serialized_tensor.size)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """Payload bytes per byte of the original tensor (hivemind sizes the all-reduce's parts with it)."""
        return self.bytes_per_value / torch.empty((), dtype=info.descriptor.dtype).element_size()

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.quantizer!r})"


class NoneCodec(P2PCodec):
    """Raw fp32 (lossless for fp32 input)."""

    def __init__(self) -> None:
        super().__init__(Fp32())


class Fp16Codec(P2PCodec):
    """IEEE fp16, clamped to the finite fp16 range."""

    def __init__(self) -> None:
        super().__init__(Fp16())


class Bf16Codec(P2PCodec):
    """bfloat16, clamped to the finite bf16 range."""

    def __init__(self) -> None:
        super().__init__(Bf16())


class Int8Codec(P2PCodec):
    """Blockwise absmax int8, one fp32 scale per ``block_size`` values."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__(Int8(block_size))


class Int4Codec(P2PCodec):
    """Blockwise absmax int4, two codes per byte, one fp32 scale per ``block_size`` values."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__(Int4(block_size))


CODECS: dict[str, type[P2PCodec]] = {
    "none": NoneCodec,
    "fp16": Fp16Codec,
    "bf16": Bf16Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
}


def get_codec(name: str, block_size: int = DEFAULT_BLOCK_SIZE) -> P2PCodec:
    """Codec instance by name; ``block_size`` applies to int8 / int4 only."""
    return P2PCodec(get_quantizer(name, block_size))


def decode(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """Decode a tagged message with our codec (fp32 result), anything else with hivemind's deserializer.

    The tag (codec, block size) and the buffer's length are checked against the shape before anything
    is allocated: a message comes from a peer.
    """
    if serialized.dtype.startswith(TAG_PREFIX):
        return quantizer_for_tag(serialized.dtype).decode(serialized.buffer, serialized.size)
    return deserialize_torch_tensor(serialized)
