"""Low-bit codecs for outer gradients (pseudo-gradients) sent through hivemind's butterfly all-reduce.

Wire format
-----------
Every codec produces an ordinary :class:`hivemind.proto.runtime_pb2.Tensor`. hivemind's ``compression`` field is a
fixed protobuf enum, so instead of a new enum value the codec is **tagged in the ``dtype`` string**::

    dtype = "p2pd:<name>"               # none, fp16, bf16
    dtype = "p2pd:<name>:<block_size>"  # int8, int4, e.g. "p2pd:int4:64"
    compression = NONE, size = original shape, buffer = codec payload (all multi-byte values little-endian)

Such a message must be decoded with :func:`decode` (hivemind's own ``deserialize_torch_tensor`` fails loudly on it,
since ``np.dtype("p2pd:...")`` is not a dtype); :func:`decode` falls back to hivemind for untagged messages.

Payloads and bytes per value (n values, B = block size, nb = ceil(n / B) blocks):

=====  =======================================================  =======================  ==============
codec  buffer                                                   bytes                    per value, B=64
=====  =======================================================  =======================  ==============
none   fp32 values                                              4n                       4
fp16   IEEE fp16, clamped to the finite fp16 range              2n                       2
bf16   bfloat16 bit patterns (int16), clamped to finite range   2n                       2
int8   nb fp32 scales, then n int8 codes in [-127, 127]         4nb + n                  1 + 4/B = 1.0625
int4   nb fp32 scales, then ceil(n/2) bytes of 4-bit codes      4nb + ceil(n/2)          0.5 + 4/B = 0.5625
=====  =======================================================  =======================  ==============

int8 / int4 are blockwise absmax-symmetric: per block ``scale = absmax / L`` (L = 127 or 7, fp32 division),
``q = clamp(round(x / scale), -L, L)`` (round half to even), decoded as ``q * scale``; an all-zero block has
scale 0 and decodes to zeros. int4 stores ``q + 8`` in a nibble, element 2i in the low nibble of byte i and
element 2i+1 in the high one; an odd count is padded with one zero code. Both directions use only correctly rounded
fp32 operations, so encoding is deterministic and the same bytes decode to the same fp32 values on every machine
(assuming IEEE semantics, i.e. denormals not flushed to zero, which is PyTorch's default). Requantizing a decoded
tensor reproduces the same bytes as long as the scales are normal fp32 numbers (see the tests).

Accumulation stays fp32: a reducer decodes every incoming part to fp32 and sums/averages in fp32; only the wire is
low-bit. The averaged part is then re-encoded for the reply, so a value crosses the wire quantized twice (input and
result), each time within :func:`error_bound`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor
from hivemind.proto import runtime_pb2

TAG_PREFIX = "p2pd:"
FP16_MAX = torch.finfo(torch.float16).max  # 65504
BF16_MAX = torch.finfo(torch.bfloat16).max  # ~3.39e38, below fp32 max: larger values would round to inf


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class P2PCodec(CompressionBase):
    """Common part of the tagged codecs: fp32 conversion, finiteness check, tag, shape handling."""

    compression_type = runtime_pb2.CompressionType.NONE
    name: str = ""
    bytes_per_value: float = 4.0  # payload bytes per value (block codecs: including their share of the scale)

    @property
    def tag(self) -> str:
        return TAG_PREFIX + self.name

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if not torch.is_floating_point(tensor):
            raise ValueError(f"{self!r} only compresses floating point tensors, got {tensor.dtype}")
        flat = tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        # fast path: a finite sum implies finite elements (inf/NaN propagate); a non-finite sum may be overflow
        if not bool(torch.isfinite(flat.sum())) and not bool(torch.isfinite(flat).all()):
            bad = int((~torch.isfinite(flat)).sum())
            raise ValueError(f"{self!r}: refusing to compress a tensor with {bad} non-finite (NaN/inf) values")
        return runtime_pb2.Tensor(
            compression=self.compression_type, buffer=self._encode(flat), size=tensor.shape, dtype=self.tag
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        if serialized_tensor.dtype != self.tag:
            raise ValueError(f"{self!r} cannot decode a message tagged {serialized_tensor.dtype!r}")
        shape = torch.Size(serialized_tensor.size)
        buffer = bytes(serialized_tensor.buffer)
        expected = self.payload_bytes(shape.numel())
        if len(buffer) != expected:
            raise ValueError(f"{self!r}: buffer of {len(buffer)} bytes for {shape.numel()} values, expected {expected}")
        return self._decode(buffer, shape.numel()).reshape(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.bytes_per_value / _element_size(info.descriptor.dtype)

    def payload_bytes(self, numel: int) -> int:
        """Exact ``len(buffer)`` for a tensor of ``numel`` values."""
        return int(self.bytes_per_value * numel)

    def _encode(self, flat: torch.Tensor) -> bytes:  # flat: finite fp32, 1-D, cpu
        raise NotImplementedError

    def _decode(self, buffer: bytes, numel: int) -> torch.Tensor:  # returns fp32, 1-D
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class NoneCodec(P2PCodec):
    """Raw fp32 (lossless for fp32 input)."""

    name, bytes_per_value = "none", 4.0

    def _encode(self, flat: torch.Tensor) -> bytes:
        return flat.numpy().astype("<f4", copy=False).tobytes()

    def _decode(self, buffer: bytes, numel: int) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(buffer, dtype="<f4").astype(np.float32))


class Fp16Codec(P2PCodec):
    """IEEE fp16, round to nearest even, values clamped to [-65504, 65504] first (hivemind's Float16Compression
    does the same clamp, but keeps the sender's dtype name in ``dtype``, so we tag instead of wrapping it)."""

    name, bytes_per_value = "fp16", 2.0

    def _encode(self, flat: torch.Tensor) -> bytes:
        return flat.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).numpy().astype("<f2", copy=False).tobytes()

    def _decode(self, buffer: bytes, numel: int) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(buffer, dtype="<f2").astype(np.float32))


class Bf16Codec(P2PCodec):
    """bfloat16, round to nearest even, clamped to the finite bf16 range; sent as int16 bit patterns."""

    name, bytes_per_value = "bf16", 2.0

    def _encode(self, flat: torch.Tensor) -> bytes:
        bits = flat.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16).view(torch.int16)
        return bits.numpy().astype("<i2", copy=False).tobytes()

    def _decode(self, buffer: bytes, numel: int) -> torch.Tensor:
        bits = torch.from_numpy(np.frombuffer(buffer, dtype="<i2").astype(np.int16))
        return bits.view(torch.bfloat16).to(torch.float32)


class BlockQuantCodec(P2PCodec):
    """Blockwise absmax-symmetric quantization to integer levels in [-levels, levels], one fp32 scale per block."""

    levels: int = 127
    bits: int = 8

    def __init__(self, block_size: int = 64):
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.bytes_per_value = self.bits / 8 + 4 / block_size

    @property
    def tag(self) -> str:
        return f"{TAG_PREFIX}{self.name}:{self.block_size}"

    def payload_bytes(self, numel: int) -> int:
        return 4 * math.ceil(numel / self.block_size) + math.ceil(numel * self.bits / 8)

    def quantize(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 1-D tensor -> (fp32 scale per block, int8 codes of length numel)."""
        n, bs = flat.numel(), self.block_size
        blocks = (torch.nn.functional.pad(flat, (0, -n % bs)) if n % bs else flat).view(-1, bs)
        lo, hi = torch.aminmax(blocks, dim=1) if n else (flat, flat)
        scale = torch.maximum(lo.abs(), hi.abs()) / self.levels
        # near fp32 max, scale may round up so that levels * scale overflows: step it down one ulp
        scale = torch.where(torch.isinf(scale * self.levels), torch.nextafter(scale, torch.zeros_like(scale)), scale)
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero block: codes 0, scale 0
        codes = (blocks / divisor[:, None]).round_().clamp_(-self.levels, self.levels).to(torch.int8)
        return scale, codes.view(-1)[:n]

    def dequantize(self, scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        n, bs = codes.numel(), self.block_size
        blocks = torch.nn.functional.pad(codes.to(torch.float32), (0, -n % bs)).view(-1, bs)
        return (blocks * scale[:, None]).view(-1)[:n]

    def _encode(self, flat: torch.Tensor) -> bytes:
        scale, codes = self.quantize(flat)
        return scale.numpy().astype("<f4", copy=False).tobytes() + self._pack(codes)

    def _decode(self, buffer: bytes, numel: int) -> torch.Tensor:
        n_scales = math.ceil(numel / self.block_size)
        scale = torch.from_numpy(np.frombuffer(buffer, dtype="<f4", count=n_scales).astype(np.float32))
        packed = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8, offset=4 * n_scales).copy())
        return self.dequantize(scale, self._unpack(packed, numel))

    def _pack(self, codes: torch.Tensor) -> bytes:
        return codes.numpy().tobytes()

    def _unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        return packed.view(torch.int8)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(block_size={self.block_size})"


class Int8Codec(BlockQuantCodec):
    name, levels, bits = "int8", 127, 8


class Int4Codec(BlockQuantCodec):
    name, levels, bits = "int4", 7, 4

    def _pack(self, codes: torch.Tensor) -> bytes:
        nibbles = (codes + 8).view(torch.uint8)  # codes in [-7, 7] -> nibbles in [1, 15]
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])  # pad with a zero code
        pairs = nibbles.view(-1, 2)
        return (pairs[:, 0] | (pairs[:, 1] << 4)).numpy().tobytes()

    def _unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)[:numel]
        return (nibbles.to(torch.int16) - 8).to(torch.int8)


CODECS: dict[str, type[P2PCodec]] = {
    "none": NoneCodec,
    "fp16": Fp16Codec,
    "bf16": Bf16Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
}


def get_codec(name: str, block_size: int = 64) -> P2PCodec:
    """Codec instance by name; ``block_size`` applies to int8 / int4 only."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; expected one of {sorted(CODECS)}")
    cls = CODECS[name]
    return cls(block_size) if issubclass(cls, BlockQuantCodec) else cls()


def parse_tag(dtype: str) -> tuple[str, int]:
    """``"p2pd:int4:64"`` -> ``("int4", 64)``; ``"p2pd:fp16"`` -> ``("fp16", 64)`` (block size unused)."""
    if not dtype.startswith(TAG_PREFIX):
        raise ValueError(f"{dtype!r} is not a p2pd codec tag")
    name, _, block = dtype[len(TAG_PREFIX) :].partition(":")
    try:
        return name, int(block) if block else 64
    except ValueError:
        raise ValueError(f"malformed codec tag {dtype!r}") from None


def decode(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """Decode a tagged message with our codec (fp32 result), anything else with hivemind's deserializer."""
    if serialized.dtype.startswith(TAG_PREFIX):
        return get_codec(*parse_tag(serialized.dtype)).extract(serialized)
    return deserialize_torch_tensor(serialized)


def error_bound(codec_name: str, tensor: torch.Tensor, block_size: int = 64, fp32_slack: bool = True) -> torch.Tensor:
    """Elementwise bound on ``|decode(compress(tensor)) - tensor|`` (w.r.t. the fp32 value of ``tensor``).

    * none: 0.
    * fp16: ``max(2^-11 |x|, 2^-25)`` (half an ulp; 2^-25 covers fp16 subnormals), or ``|x| - 65504`` where clamped.
    * bf16: ``max(2^-8 |x|, 2^-134)``, or ``|x| - bf16_max`` where clamped.
    * int8 / int4: ``scale / 2`` of the element's block, ``scale = absmax / 127`` (int8) or ``absmax / 7`` (int4).
      With ``fp32_slack`` (default) a rigorous allowance for the fp32 rounding of the scale, of ``x / scale`` and of
      ``q * scale`` is added: ``scale * 2^-15 + 2^-142`` (the second term only matters for subnormal scales).
    """
    x = tensor.detach().to(torch.float32).reshape(-1)
    ax = x.abs()
    if codec_name == "none":
        bound = torch.zeros_like(x)
    elif codec_name == "fp16":
        bound = torch.where(ax > FP16_MAX, ax - FP16_MAX, torch.clamp_min(ax * 2.0**-11, 2.0**-25))
    elif codec_name == "bf16":
        bound = torch.where(ax > BF16_MAX, ax - BF16_MAX, torch.clamp_min(ax * 2.0**-8, 2.0**-134))
    elif codec_name in ("int8", "int4"):
        codec = get_codec(codec_name, block_size)
        assert isinstance(codec, BlockQuantCodec)
        scale = codec.quantize(x)[0]
        per_block = scale / 2 + (scale * 2.0**-15 + 2.0**-142 if fp32_slack else 0.0)
        bound = per_block.repeat_interleave(block_size)[: x.numel()]
    else:
        get_codec(codec_name)  # raises the unknown-codec error
        raise AssertionError(codec_name)
    return bound.reshape(tensor.shape)
