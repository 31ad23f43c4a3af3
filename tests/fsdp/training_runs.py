"""Comparing training runs on the ranks: losses and final parameters, with the values in the message.

A run is ``(losses, params)``: the per-step losses this rank saw and the full (gathered) final
parameters by name. Sharded runs see their rank's rows of each batch; their global loss is the
mean over ranks, which :func:`global_losses` computes (a collective: call it on every rank).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from tests.comparison import max_abs_difference

__all__ = ["Run", "assert_same_training", "global_losses"]


class Run(NamedTuple):
    losses: list[float]
    params: dict[str, torch.Tensor]


def global_losses(losses: list[float]) -> list[float]:
    """The mean of every rank's per-step losses (each rank's loss is over its own rows)."""
    values = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(values)
    return (values / dist.get_world_size()).tolist()


def assert_same_training(got: Run, want: Run, tol: float, label: str, *, sharded_want: bool = True) -> None:
    """Asserts ``got`` trained like ``want`` to ``tol`` (``0.0``: bitwise); ``got`` is a sharded
    run, ``want`` too unless ``sharded_want`` is False (the unsharded reference, which saw all rows)."""
    got_losses = global_losses(got.losses)
    want_losses = global_losses(want.losses) if sharded_want else want.losses
    assert len(got_losses) == len(want_losses), f"{label}: {len(got_losses)} steps, want {len(want_losses)}"
    loss_err = max(abs(a - b) for a, b in zip(got_losses, want_losses, strict=True))
    assert loss_err <= tol, f"{label}: losses {got_losses}, want {want_losses} (off by {loss_err:.3g}, tolerance {tol})"
    err, where = max_abs_difference(got.params, want.params)
    assert err <= tol, f"{label}: final parameters off by {err:.3g} (in {where}), tolerance {tol}"
