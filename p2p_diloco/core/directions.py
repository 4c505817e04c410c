"""Which way an outer gradient points: a small sketch of it that every groupmate gathers, and who disagrees.

A learner that climbs the loss through all its inner steps sends an outer gradient of ordinary norm
that points uphill: the norm rules (:mod:`p2p_diloco.core.exclusion`) cannot see it, and under the
token-weighted mean it is committed round after round. Its direction gives it away: the outer
gradients of honest learners that start from the same global state and descend the same loss point
roughly the same way (pairwise cosines well above 0), a climber's the other way.

Each member gathers, at matchmaking, a **count sketch** of its outer gradient Δ: every coordinate i
of the fragment's flattened Δ is added, with a sign s(i) = ±1, into one of :data:`DIM` buckets h(i).
h and s are drawn from a seed every groupmate knows (the hash of the global state the round starts
from), so the same coordinates land in the same buckets at every member, and

    E[⟨sketch(x), sketch(y)⟩] = ⟨x, y⟩,

with a standard deviation of about ‖x‖‖y‖·√(2/DIM) for uncorrelated x, y: the cosine of two sketches
estimates the cosine of the outer gradients to about ±0.13 at DIM = 128. Drawing h and s costs two
random integers per parameter (a few ms for the built-in model, ~0.2 s for 20M parameters), the
sketch itself DIM floats (about 1.2 kB gathered per member).

The rule (:func:`disagreeing`), from three members with a sketch on: member i **disagrees** with
member j when cos(sketch_i, sketch_j) < :data:`MIN_COSINE`; i is excluded when it disagrees with a
strict majority of the others. A climber among honest members disagrees with all of them; an honest
member disagrees only with the climbers, who are a minority of its others while the group has an
honest majority. In a pair nobody is judged: either could be the one that is wrong.

What it does not see: a member whose sketch lies about its Δ (it gathers an honest-looking sketch and
sends parts that climb). The sketch is signed with the rest of its metadata, but nothing here checks
it against the parts the reducers receive (docs/security.md, "Direction").
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

DIM = 128  # buckets of the count sketch
MIN_COSINE = 0.0  # i disagrees with j below this cosine
CHUNK = 1 << 20  # coordinates hashed at a time (bounds the memory of h and s)


def seed_of(text: str) -> int:
    """A 63-bit seed from ``text`` (the round's parent state hash), the same at every member."""
    return int.from_bytes(hashlib.sha256(f"direction:{text}".encode()).digest()[:8], "big") >> 1


def sketch(deltas: Sequence[torch.Tensor], seed: str, dim: int = DIM) -> list[float]:
    """The count sketch of the concatenation of ``deltas`` (flattened, in order) under ``seed``, as floats.

    >>> x = [torch.arange(6.0).reshape(2, 3), torch.ones(4)]
    >>> a, b = sketch(x, "s"), sketch([t * -2 for t in x], "s")
    >>> round(cosine(a, b), 6), len(a)
    (-1.0, 128)
    """
    generator = torch.Generator().manual_seed(seed_of(seed))
    out = torch.zeros(dim, dtype=torch.float64)
    for tensor in deltas:
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), CHUNK):
            values = flat[start:start + CHUNK].to(device="cpu", dtype=torch.float64)
            buckets = torch.randint(0, dim, (values.numel(),), generator=generator)
            signs = torch.randint(0, 2, (values.numel(),), generator=generator, dtype=torch.int8)
            out.index_add_(0, buckets, torch.where(signs.bool(), values, -values))
    return [float(v) for v in out.float()]


def valid(value: Any, dim: int = DIM) -> list[float] | None:
    """``value`` as a gathered sketch: a list of ``dim`` finite numbers (not bools), else None."""
    if not isinstance(value, list | tuple) or len(value) != dim:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        return None
    return [float(v) for v in value]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of two sketches; 0 when either is all zeros (a member that sent nothing points nowhere)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else 0.0


def disagreeing(sketches: Mapping[str, Sequence[float]], min_cosine: float = MIN_COSINE) -> dict[str, str]:
    """The members whose sketch disagrees with a strict majority of the others', with why (from 3 members on).

    >>> up, down = [1.0, 0.2] + [0.0] * 126, [-1.0, -0.1] + [0.0] * 126
    >>> sorted(disagreeing({"a": up, "b": up, "c": [0.9, 0.3] + [0.0] * 126, "d": down}))
    ['d']
    >>> disagreeing({"a": up, "d": down})
    {}
    """
    if len(sketches) < 3:
        return {}
    peers = sorted(sketches)
    cos = {(p, q): cosine(sketches[p], sketches[q]) for i, p in enumerate(peers) for q in peers[i + 1:]}
    out = {}
    for p in peers:
        mine = sorted(cos[(p, q) if p < q else (q, p)] for q in peers if q != p)
        against = sum(c < min_cosine for c in mine)
        if 2 * against > len(mine):
            listed = ", ".join(f"{c:+.2f}" for c in mine)
            out[p] = (f"its outer gradient points away from the others' (cosines {listed}; it disagrees, below "
                      f"{min_cosine:+g}, with {against} of {len(mine)})")
    return out


def cosines(sketches: Mapping[str, Sequence[float]]) -> dict[str, list[float]]:
    """Each member's cosines to the others, sorted (for logs and the audit)."""
    return {p: sorted(cosine(s, t) for q, t in sketches.items() if q != p) for p, s in sketches.items()}
