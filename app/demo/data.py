"""Synthetic token batches with learnable structure, addressed by position.

Batch ``index`` depends only on the random seed and the index, never on what was drawn before,
so a run resumed at data position ``p`` reads exactly the batches an uninterrupted run reads there.
"""

from __future__ import annotations

import torch

from .model import GPTConfig

_PERIOD = 7  # tokens repeat a noisy ramp with this period, so the loss can fall
_NOISE = 0.05


def _stream_seed(seed: int, index: int) -> int:
    # The CPU generator (mt19937) keeps only the low 32 bits of a seed: mix seed and index into
    # them, so that neither is lost (a golden-ratio multiplier spreads nearby seeds apart).
    return (seed * 0x9E3779B1 + index) & 0xFFFFFFFF


def tokens_at(config: GPTConfig, rows: int, index: int, seed: int = 0) -> torch.Tensor:
    """Batch number ``index``: ``rows`` sequences of ``config.seq + 1`` tokens (inputs and targets).

    Args:
        config: Model sizes (vocabulary and sequence length).
        rows: Sequences in the batch.
        index: Position in the data stream, from 0.
        seed: Seed of the whole stream.
    """
    gen = torch.Generator().manual_seed(_stream_seed(seed, index))
    start = torch.randint(0, config.vocab, (rows, 1), generator=gen)
    ramp = torch.arange(config.seq + 1).unsqueeze(0) % _PERIOD
    tokens = (start + ramp * 3) % config.vocab
    noise = torch.rand(tokens.shape, generator=gen) < _NOISE
    tokens[noise] = torch.randint(0, config.vocab, (int(noise.sum()),), generator=gen)
    return tokens


def synthetic_batches(config: GPTConfig, rows: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Batches 0 to ``steps - 1`` of the stream (see :func:`tokens_at`)."""
    return [tokens_at(config, rows, index, seed) for index in range(steps)]
