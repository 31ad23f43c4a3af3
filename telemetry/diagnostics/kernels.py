"""The element passes the precision diagnostics are made of, each one whole-tensor operation.

No OpenTelemetry and nothing of the other diagnostics modules here. Every function reads a
segment (a parameter's elements, or a chunk of them) in one or two torch operations and returns
a 0-d device tensor, so that a caller adds many of them up on the device and copies the results
to the host once.

Work buffers are reused from call to call and sized to a chunk (:data:`CHUNK_ELEMENTS`): fresh
temporaries of a whole shard cost more than the arithmetic on a CPU (every new page is faulted in
and zeroed), while chunk-sized ones keep the passes memory-bound, the extra memory bounded, and a
chunk's later passes reading it from cache.

Measured on a CPU core (ns per element, one thread), which decided the forms used here:
``bitwise_xor`` of the bit patterns and ``count_nonzero`` of the result 0.71 against ``ne`` and
``count_nonzero`` 1.00; a bool mask counted by :func:`count_true` 0.09 against ``count_nonzero``
0.26; a squared norm by ``dot`` per chunk 0.34, with a relative error of 1e-6 on 4M normal
values where ``_foreach_norm``'s was 1.6e-4.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 19
"""Elements per pass. The reused work buffers (an fp32 difference, the compute weight widened, two
compute-dtype casts, an int32 word buffer, two bool masks: about 18 bytes per element) stay at
about 9 MiB however large a shard is. Smaller chunks pay more for each pass's fixed cost (on two
CPU threads, 4x smaller chunks made the whole-model rows 1.7x slower); 2x and 4x larger ones
were as fast, within noise, for twice and four times the memory."""

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Masks shorter than this are counted with count_nonzero (one call, no padding to handle).
_WORD_COUNT_MIN = 1 << 14
_WORD_BLOCK = 8 * 128  # bytes per summed block of 128 int64 words


def bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bit patterns of ``t`` as integers, so that comparisons need no float rounding
    and a NaN equals itself."""
    return t.view(_INT_VIEW[t.element_size()])


class Scratch:
    """Typed work buffers of at least a chunk, one per (role, device, dtype), kept across steps."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, role: str, like: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
        key = (role, like.device, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(max(numel, CHUNK_ELEMENTS), dtype=dtype, device=like.device)
        return buffer[:numel]


class Masks:
    """Bool work buffers padded to whole blocks of words, with a zero tail for :func:`count_true`."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, role: str, like: torch.Tensor, numel: int) -> torch.Tensor:
        padded = -(-numel // _WORD_BLOCK) * _WORD_BLOCK
        key = (role, like.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < padded:
            size = max(padded, -(-CHUNK_ELEMENTS // _WORD_BLOCK) * _WORD_BLOCK)
            buffer = self._buffers[key] = torch.zeros(size, dtype=torch.bool, device=like.device)
        if padded > numel:
            buffer[numel:padded].zero_()
        return buffer[:numel]


scratch = Scratch()
masks = Masks()


def count_true(mask: torch.Tensor) -> torch.Tensor:
    """True elements of a mask from :class:`Masks` (whose storage is False up to the next block).

    Counting a bool mask with ``count_nonzero`` runs at about 1 ns per element on a CPU, slower
    than the comparison that made it; this sums the mask as 64-bit words instead (eight lanes of
    bytes, 128 words at a time so no lane carries), which is memory-bound.
    """
    n = mask.numel()
    if n < _WORD_COUNT_MIN:
        return torch.count_nonzero(mask)
    padded = -(-n // _WORD_BLOCK) * _WORD_BLOCK
    words = mask.as_strided((padded,), (1,)).view(torch.int64).view(-1, 128)
    # Each byte lane of a block's sum adds at most 128 ones: no carry into the next lane.
    return words.sum(dim=1).view(torch.uint8).sum(dtype=torch.int64)


def count_nonzero(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Non-zero elements of ``t`` (NaN counts, -0.0 does not), as ``count_nonzero`` counts them,
    through ``mask`` (from :class:`Masks`, ``t``'s numel): a conversion to bool and a word count
    run several times faster."""
    return count_true(mask.copy_(t))


def count_changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elements whose stored bits differ between ``a`` and ``b`` (same dtype and numel): a NaN
    that stays NaN is unchanged, ``-0.0 -> 0.0`` is a change."""
    a_bits, b_bits = bits(a), bits(b)
    differing = scratch.get("differing", a, a_bits.dtype, a.numel())
    return torch.count_nonzero(torch.bitwise_xor(a_bits, b_bits, out=differing))


def changed_mask(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mask`` (from :class:`Masks`, ``a``'s numel) set where the stored bits of ``a`` and ``b``
    differ, as :func:`count_changed` counts them; returns ``mask``."""
    a_bits = bits(a)
    differing = scratch.get("differing", a, a_bits.dtype, a.numel())
    return mask.copy_(torch.bitwise_xor(a_bits, bits(b), out=differing))


def sq_norm(t: torch.Tensor) -> torch.Tensor:
    """``sum(t**2)``: a dot product (BLAS, vectorized partial sums, on the chunk the previous pass
    left in cache) for float32/float64 chunks; narrower ones (bfloat16 main weights) accumulate
    in float32 and square in float64. The caller converts every sum to float64 at once."""
    if t.dtype in (torch.float32, torch.float64):
        return torch.dot(t, t)
    return torch.linalg.vector_norm(t, dtype=torch.float32).double().square()


def count_nonfinite(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN and Inf elements of ``t``."""
    return torch.count_nonzero(torch.isnan(t)), torch.count_nonzero(torch.isinf(t))
