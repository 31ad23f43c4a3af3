"""The small transformer of the fsdp tests in its variants (tied, unused, frozen), and its batch size."""

from __future__ import annotations

import torch
from torch import nn

from tests.models import make_model

MICROBATCH = 8  # sequences per microbatch, divisible by 1, 2 and 4 ranks


def build_model(kind: str = "plain") -> nn.Module:
    """The small transformer, optionally with tied weights, unused parameters or a frozen block.

    Deterministic: every rank and the single-process reference build the same weights.
    """
    model = make_model(seed=0)
    if kind == "tied":
        model.head.weight = model.embed.weight
    elif kind == "unused":
        model.unused = nn.Parameter(torch.randn(5, 3))  # in the root unit
        model.blocks[1].unused = nn.Parameter(torch.randn(3))  # in a block unit; 3 rows on 4 ranks
    elif kind == "frozen":
        model.blocks[0].requires_grad_(False)
        model.norm.requires_grad_(False)  # a frozen group next to a trainable one in the root
    elif kind != "plain":
        raise ValueError(kind)
    return model
