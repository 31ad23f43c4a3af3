"""The small transformer of the fsdp tests in its variants (tied, unused, frozen), and its batch size."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tests.models import make_model

MICROBATCH = 8  # sequences per microbatch, divisible by 1, 2 and 4 ranks


def _tied(model: nn.Module) -> None:
    model.head.weight = model.embed.weight


def _unused(model: nn.Module) -> None:
    model.unused = nn.Parameter(torch.randn(5, 3))  # in the root unit
    model.blocks[1].unused = nn.Parameter(torch.randn(3))  # in a block unit; 3 rows on 4 ranks


def _frozen(model: nn.Module) -> None:
    model.blocks[0].requires_grad_(False)
    model.norm.requires_grad_(False)  # a frozen group next to a trainable one in the root


# What each variant changes in the plain model.
VARIANTS: dict[str, Callable[[nn.Module], None] | None] = {
    "plain": None,
    "tied": _tied,
    "unused": _unused,
    "frozen": _frozen,
}


def build_model(kind: str = "plain") -> nn.Module:
    """The small transformer, optionally with tied weights, unused parameters or a frozen block.

    Deterministic: every rank and the single-process reference build the same weights.
    """
    if kind not in VARIANTS:
        raise ValueError(f"unknown variant {kind!r}; expected one of {sorted(VARIANTS)}")
    model = make_model(seed=0)
    change = VARIANTS[kind]
    if change is not None:
        change(model)
    return model
