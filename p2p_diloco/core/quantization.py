"""Low-bit wire formats for outer gradients (pseudo-gradients): the arithmetic, without hivemind.

A :class:`Quantizer` turns a floating point tensor into payload bytes and back into fp32. It imports
only torch and numpy: :mod:`p2p_diloco.net.codecs` wraps it in hivemind's ``CompressionBase`` for the
all-reduce, and a simulation without networking calls :func:`round_trip` for the same bits::

    >>> x = torch.tensor([7.0, -7.0, 0.0, 1.0, -3.0])
    >>> get_quantizer("int4").round_trip(x).tolist()
    [7.0, -7.0, 0.0, 1.0, -3.0]
    >>> get_quantizer("int4").tag, len(get_quantizer("int4").encode(x))
    ('p2pd:int4:64', 7)

Tags
----
Each format is named on the wire by a tag (the protobuf message's ``dtype`` string, see
:mod:`p2p_diloco.net.codecs`): ``p2pd:<name>`` for none, fp16, bf16 and ``p2pd:<name>:<block_size>``
for int8 and int4, e.g. ``p2pd:int4:64``. A block size is between 1 and :data:`MAX_BLOCK_SIZE`.

Payloads and bytes per value (n values, B = block size, nb = ceil(n / B) blocks; multi-byte values
little-endian):

=====  =======================================================  =======================  ==============
codec  payload                                                  bytes                    per value, B=64
=====  =======================================================  =======================  ==============
none   fp32 values                                              4n                       4
fp16   IEEE fp16, clamped to the finite fp16 range              2n                       2
bf16   bfloat16 bit patterns (int16), clamped to finite range   2n                       2
int8   nb fp32 scales, then n int8 codes in [-127, 127]         4nb + n                  1 + 4/B = 1.0625
int4   nb fp32 scales, then ceil(n/2) bytes of 4-bit codes      4nb + ceil(n/2)          0.5 + 4/B = 0.5625
=====  =======================================================  =======================  ==============

int8 / int4 are blockwise absmax-symmetric: per block ``scale = absmax / L`` (L = 127 or 7, fp32
division), ``q = clamp(round(x / scale), -L, L)`` (round half to even), decoded as ``q * scale``; an
all-zero block has scale 0 and decodes to zeros. int4 stores ``q + 8`` in a nibble, element 2i in
the low nibble of byte i and element 2i+1 in the high one; an odd count is padded with one zero
code. Both directions use only correctly rounded fp32 operations, so encoding is deterministic and
the same bytes decode to the same fp32 values on every machine (assuming IEEE semantics, i.e.
denormals not flushed to zero, which is PyTorch's default). Requantizing a decoded tensor
reproduces the same bytes as long as the scales are normal fp32 numbers (see the tests).

Accumulation stays fp32: a reducer decodes every incoming part to fp32 and sums/averages in fp32;
only the wire is low-bit. The averaged part is then re-encoded for the reply, so a value crosses
the wire quantized twice (input and result), each time within :func:`error_bound`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

TAG_PREFIX = "p2pd:"
FP16_MAX = torch.finfo(torch.float16).max  # 65504
BF16_MAX = torch.finfo(torch.bfloat16).max  # ~3.39e38, below fp32 max: larger values would round to inf
DEFAULT_BLOCK_SIZE = 64
# The largest block a codec can be configured with, and so the largest a peer can name in a tag:
# decoding pads the codes to whole blocks, so the bound also bounds what a short message allocates.
MAX_BLOCK_SIZE = 4096


class Quantizer:
    """One wire format: a floating point tensor to payload bytes, and payload bytes to fp32."""

    name: ClassVar[str] = ""
    bytes_per_value: float = 4.0  # payload bytes per value (block formats: including their share of the scale)

    @property
    def tag(self) -> str:
        """The name of this format on the wire, e.g. ``p2pd:fp16``."""
        return TAG_PREFIX + self.name

    def payload_bytes(self, numel: int) -> int:
        """Exact length of the payload of ``numel`` values."""
        return int(self.bytes_per_value) * numel

    def encode(self, tensor: torch.Tensor) -> bytes:
        """The payload of a finite floating point tensor (any shape, dtype or device; read as fp32)."""
        if not torch.is_floating_point(tensor):
            raise ValueError(f"{self!r} only compresses floating point tensors, got {tensor.dtype}")
        flat = tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        # fast path: a finite sum implies finite elements (inf/NaN propagate); a non-finite sum may be overflow
        if not bool(torch.isfinite(flat.sum())) and not bool(torch.isfinite(flat).all()):
            bad = int((~torch.isfinite(flat)).sum())
            raise ValueError(f"{self!r}: refusing to compress a tensor with {bad} non-finite (NaN/inf) values")
        return self._encode(flat)

    def decode(self, payload: bytes, shape: Sequence[int]) -> torch.Tensor:
        """The fp32 tensor of ``shape`` in ``payload``; ValueError, before any allocation, if they disagree."""
        if any(d < 0 for d in shape):
            raise ValueError(f"{self!r}: negative dimension in shape {list(shape)}")
        numel = math.prod(shape)
        expected = self.payload_bytes(numel)
        if len(payload) != expected:
            raise ValueError(f"{self!r}: buffer of {len(payload)} bytes for {numel} values, expected {expected}")
        return self._decode(payload, numel).reshape(tuple(shape))

    def round_trip(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a receiver decodes from ``tensor`` sent in this format: the same bits as over the wire."""
        return self.decode(self.encode(tensor), tensor.shape)

    def error_bound(self, tensor: torch.Tensor, fp32_slack: bool = True) -> torch.Tensor:
        """Elementwise bound on ``|round_trip(tensor) - tensor|``, flat; see :func:`error_bound`."""
        return torch.zeros(tensor.numel(), dtype=torch.float32)

    def _encode(self, flat: torch.Tensor) -> bytes:  # flat: finite fp32, 1-D, cpu
        return flat.numpy().astype("<f4", copy=False).tobytes()

    def _decode(self, payload: bytes, numel: int) -> torch.Tensor:  # returns fp32, 1-D
        return torch.from_numpy(np.frombuffer(payload, dtype="<f4").astype(np.float32))

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class Fp32(Quantizer):
    """Raw fp32 (lossless for fp32 input); the ``none`` codec."""

    name = "none"


class _NarrowFloat(Quantizer):
    """A 16-bit float: values clamped to its finite range, then rounded to nearest even."""

    bytes_per_value = 2.0
    finite_max: ClassVar[float]
    half_ulp: ClassVar[float]  # relative rounding error of a normal number
    smallest_error: ClassVar[float]  # absolute rounding error among subnormals

    def error_bound(self, tensor: torch.Tensor, fp32_slack: bool = True) -> torch.Tensor:
        """Half an ulp of each value (at least ``smallest_error``), or ``|x| − finite_max`` where clamped.

        ``fp32_slack`` is not used here.
        """
        ax = tensor.detach().to(torch.float32).reshape(-1).abs()
        m = self.finite_max
        return torch.where(ax > m, ax - m, torch.clamp_min(ax * self.half_ulp, self.smallest_error))


class Fp16(_NarrowFloat):
    """IEEE fp16, values clamped to [-65504, 65504] first (as hivemind's Float16Compression does,
    but tagged: that one keeps the sender's dtype name in ``dtype``)."""

    name, finite_max, half_ulp, smallest_error = "fp16", FP16_MAX, 2.0**-11, 2.0**-25

    def _encode(self, flat: torch.Tensor) -> bytes:
        return flat.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).numpy().astype("<f2", copy=False).tobytes()

    def _decode(self, payload: bytes, numel: int) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(payload, dtype="<f2").astype(np.float32))


class Bf16(_NarrowFloat):
    """bfloat16, clamped to the finite bf16 range; sent as int16 bit patterns."""

    name, finite_max, half_ulp, smallest_error = "bf16", BF16_MAX, 2.0**-8, 2.0**-134

    def _encode(self, flat: torch.Tensor) -> bytes:
        bits = flat.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16).view(torch.int16)
        return bits.numpy().astype("<i2", copy=False).tobytes()

    def _decode(self, payload: bytes, numel: int) -> torch.Tensor:
        bits = torch.from_numpy(np.frombuffer(payload, dtype="<i2").astype(np.int16))
        return bits.view(torch.bfloat16).to(torch.float32)


class BlockQuantizer(Quantizer):
    """Blockwise absmax-symmetric quantization to integer levels in [-levels, levels], one fp32 scale per block."""

    levels: ClassVar[int] = 127
    bits: ClassVar[int] = 8

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        _check_block_size(block_size)
        self.block_size = block_size
        self.bytes_per_value = self.bits / 8 + 4 / block_size

    @property
    def tag(self) -> str:
        """``p2pd:<name>:<block_size>``, e.g. ``p2pd:int8:64``."""
        return f"{TAG_PREFIX}{self.name}:{self.block_size}"

    def payload_bytes(self, numel: int) -> int:
        """4 bytes of scale per block, then the packed codes: ``ceil(numel · bits / 8)`` bytes."""
        # integer ceilings: exact for any numel a peer may claim, unlike float division
        return 4 * -(-numel // self.block_size) + -(-numel * self.bits // 8)

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
        """(fp32 scale per block, int8 codes) -> fp32 1-D tensor."""
        n, bs = codes.numel(), self.block_size
        blocks = torch.nn.functional.pad(codes.to(torch.float32), (0, -n % bs)).view(-1, bs)
        return (blocks * scale[:, None]).view(-1)[:n]

    def error_bound(self, tensor: torch.Tensor, fp32_slack: bool = True) -> torch.Tensor:
        """Half the scale of each element's block, plus the fp32 allowance with ``fp32_slack`` (:func:`error_bound`)."""
        x = tensor.detach().to(torch.float32).reshape(-1)
        scale = self.quantize(x)[0]
        per_block = scale / 2 + (scale * 2.0**-15 + 2.0**-142 if fp32_slack else 0.0)
        return per_block.repeat_interleave(self.block_size)[: x.numel()]

    def _encode(self, flat: torch.Tensor) -> bytes:
        scale, codes = self.quantize(flat)
        return scale.numpy().astype("<f4", copy=False).tobytes() + self._pack(codes)

    def _decode(self, payload: bytes, numel: int) -> torch.Tensor:
        n_scales = -(-numel // self.block_size)
        scale = torch.from_numpy(np.frombuffer(payload, dtype="<f4", count=n_scales).astype(np.float32))
        packed = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8, offset=4 * n_scales).copy())
        return self.dequantize(scale, self._unpack(packed, numel))

    def _pack(self, codes: torch.Tensor) -> bytes:
        return codes.numpy().tobytes()

    def _unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        return packed.view(torch.int8)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(block_size={self.block_size})"


class Int8(BlockQuantizer):
    """int8 codes in [-127, 127], one fp32 scale per block."""

    name, levels, bits = "int8", 127, 8


class Int4(BlockQuantizer):
    """4-bit codes in [-7, 7], two per byte, one fp32 scale per block."""

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


QUANTIZERS: dict[str, type[Quantizer]] = {"none": Fp32, "fp16": Fp16, "bf16": Bf16, "int8": Int8, "int4": Int4}


def _check_block_size(block_size: object) -> None:
    if not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be an int between 1 and {MAX_BLOCK_SIZE}, got {block_size!r}")


def get_quantizer(name: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Quantizer:
    """The format called ``name`` (a key of :data:`QUANTIZERS`); ``block_size`` applies to int8 / int4 only."""
    if name not in QUANTIZERS:
        raise ValueError(f"unknown codec {name!r}; expected one of {sorted(QUANTIZERS)}")
    cls = QUANTIZERS[name]
    return cls(block_size) if issubclass(cls, BlockQuantizer) else cls()


def parse_tag(tag: str) -> tuple[str, int]:
    """``"p2pd:int4:64"`` -> ``("int4", 64)``; ``"p2pd:fp16"`` -> ``("fp16", 64)`` (block size unused).

    Refuses a block size outside 1..MAX_BLOCK_SIZE: it comes from a peer and sizes what decoding allocates.
    """
    if not tag.startswith(TAG_PREFIX):
        raise ValueError(f"{tag!r} is not a p2pd codec tag")
    name, _, block = tag[len(TAG_PREFIX) :].partition(":")
    try:
        block_size = int(block) if block else DEFAULT_BLOCK_SIZE
    except ValueError:
        raise ValueError(f"malformed codec tag {tag!r}") from None
    _check_block_size(block_size)
    return name, block_size


def quantizer_for_tag(tag: str) -> Quantizer:
    """The format a message tagged ``tag`` is in; ValueError for an unknown or malformed tag."""
    quantizer = get_quantizer(*parse_tag(tag))
    if quantizer.tag != tag:  # e.g. "p2pd:fp16:8" or "p2pd:int8:064": not something we would send
        raise ValueError(f"{quantizer!r} cannot decode a message tagged {tag!r}")
    return quantizer


def round_trip(codec_name: str, tensor: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """``tensor`` after one crossing of the wire in codec ``codec_name``: encoded, then decoded (fp32).

    Bit for bit what the all-reduce's receiver gets (``codecs.decode(codec.compress(tensor, info))``),
    for simulations that run without hivemind.
    """
    return get_quantizer(codec_name, block_size).round_trip(tensor)


def error_bound(
    codec_name: str, tensor: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, fp32_slack: bool = True
) -> torch.Tensor:
    """Elementwise bound on ``|round_trip(codec_name, tensor) - tensor|`` (w.r.t. the fp32 value of ``tensor``).

    * none: 0.
    * fp16: ``max(2^-11 |x|, 2^-25)`` (half an ulp; 2^-25 covers fp16 subnormals), or ``|x| - 65504`` where clamped.
    * bf16: ``max(2^-8 |x|, 2^-134)``, or ``|x| - bf16_max`` where clamped.
    * int8 / int4: ``scale / 2`` of the element's block, ``scale = absmax / 127`` (int8) or ``absmax / 7`` (int4).
      With ``fp32_slack`` (default) a rigorous allowance for the fp32 rounding of the scale, of ``x / scale`` and of
      ``q * scale`` is added: ``scale * 2^-15 + 2^-142`` (the second term only matters for subnormal scales).
    """
    return get_quantizer(codec_name, block_size).error_bound(tensor, fp32_slack).reshape(tensor.shape)
