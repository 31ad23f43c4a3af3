"""The training loop every pattern runs, with its planting hooks (the model: :mod:`.tiny_lm`).

``train_on_rank`` runs on the current rank of an initialized gloo process group: it builds the
model, shards it (``fully_shard`` of fsdp_patch, or torch FSDP2's ``fully_shard`` with a
``MixedPrecisionPolicy``: each block as a unit, then the root), adapts the optimizer with
``fully_shard_optimizer`` under ``FSDP_PATCH_TELEMETRY=1`` and trains, with the embedded default
writing the trace files into the directory it is given. A :class:`Plant` gets a call at each
point of an iteration where a bug of the catalogue lives: before sharding, after it, when the
optimizer is made, before the forward, on the logits and the loss, after the backward, before the step and
between steps.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from .tiny_lm import DTYPES, Settings, TinyLM, batch, loss_of, to_float8

__all__ = [
    "FSDP2",
    "FULLY_SHARD",
    "KINDS",
    "Context",
    "Plant",
    "environment",
    "train_on_rank",
]

FULLY_SHARD = "fully_shard"
FSDP2 = "fsdp2"
KINDS = (FULLY_SHARD, FSDP2)


# -- planting --------------------------------------------------------------------------------------


@dataclass
class Context:
    """What a plant sees: the run and where in it the loop is.

    Attributes:
        kind: ``fully_shard`` or ``fsdp2``.
        rank: This rank.
        world_size: The process group's size.
        settings: The pattern's settings.
        step: The iteration (from 1), as the optimizer and the report count them.
        microbatch: The backward pass within the step (from 0).
        model: The (sharded, once sharding ran) model.
        optimizer: The optimizer, once made.
        scaler: The GradScaler, if any.
        notes: What the plant wants the run's result to carry (facts it measured).
    """

    kind: str
    rank: int
    world_size: int
    settings: Settings
    step: int = 0
    microbatch: int = 0
    model: TinyLM | None = None
    optimizer: torch.optim.Optimizer | None = None
    scaler: Any = None
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def named(self) -> dict[str, nn.Parameter]:
        assert self.model is not None
        return dict(self.model.named_parameters())


class Plant:
    """The bug of a pattern; each hook does nothing unless a plant overrides it."""

    def before_shard(self, ctx: Context, model: TinyLM) -> None:
        """After the model is built and cast, before any sharding."""

    def after_shard(self, ctx: Context) -> None:
        """After sharding, before the optimizer exists."""

    def param_groups(self, ctx: Context) -> list[dict[str, Any]] | None:
        """The optimizer's param groups (``None``: every parameter in one group)."""
        return None

    def before_forward(self, ctx: Context, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        """Before each microbatch's forward (the model's attributes, the batch in place)."""

    def on_logits(self, ctx: Context, logits: torch.Tensor) -> torch.Tensor:
        """The logits the loss reads."""
        return logits

    def on_loss(self, ctx: Context, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward runs on (after the aux loss is added)."""
        return loss

    def after_backward(self, ctx: Context) -> None:
        """After the step's last backward (grads reduced and installed), before clipping."""

    def before_step(self, ctx: Context) -> None:
        """After clipping, right before ``optimizer.step()`` (or the scaler's step)."""

    def between_steps(self, ctx: Context) -> None:
        """After ``optimizer.step()`` and ``zero_grad()``, before the next step's forward."""

    def undo(self) -> None:
        """After the run, also one that raised: what the plant changed outside the model, restored."""


# -- the run ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def environment(values: dict[str, str | None]) -> Iterator[None]:
    """The variables of ``values`` set (``None``: unset) for a block; every variable as it was after."""
    with mock.patch.dict(os.environ, {k: v for k, v in values.items() if v is not None}):
        for key in [k for k, v in values.items() if v is None]:
            os.environ.pop(key, None)
        yield


def _shard(model: TinyLM, kind: str, settings: Settings) -> None:
    compute, main, grads = DTYPES[settings.compute], DTYPES[settings.main], DTYPES[settings.grads]
    if settings.float8 != "off":
        to_float8(model, settings)
    units: list[nn.Module] = [*model.blocks, model]
    if kind == FULLY_SHARD:
        from fsdp_patch import MixedPrecisionPolicy, fully_shard

        model.to(compute)
        policy = MixedPrecisionPolicy(main_params_dtype=main, main_grads_dtype=grads)
        for unit in units:
            fully_shard(unit, mp_policy=policy)
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if main != torch.float32:
        # No fp32 main weights: the sharded parameters are the low-precision ones the optimizer steps.
        model.to(main)
        torch_policy = TorchPolicy()
    else:
        torch_policy = TorchPolicy(param_dtype=compute, reduce_dtype=grads)
    for unit in units:
        torch_fully_shard(unit, mp_policy=torch_policy)


def _optimizer(ctx: Context, plant: Plant) -> torch.optim.Optimizer:
    settings = ctx.settings
    assert ctx.model is not None
    groups = plant.param_groups(ctx) or [{"params": list(ctx.model.parameters())}]
    if settings.optimizer == "adam":
        return torch.optim.Adam(groups, lr=settings.lr, eps=settings.eps, weight_decay=settings.weight_decay)
    return torch.optim.AdamW(groups, lr=settings.lr, eps=settings.eps, weight_decay=settings.weight_decay)


def _scaler(settings: Settings) -> Any:
    if not settings.scaler:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    # Sharded: every rank skips when any rank's grads hold NaN/Inf (found_inf is all-reduced).
    return ShardedGradScaler("cpu", init_scale=settings.init_scale)


def telemetry_environment(trace_dir: str, precision_every: int | None) -> dict[str, str | None]:
    """Telemetry on, trace files of the embedded default into ``trace_dir``, the diagnostics every
    ``precision_every`` steps (``None``: the default schedule), nothing else exported."""
    return {
        "FSDP_PATCH_TELEMETRY": "1",
        "FSDP_PATCH_TRACE_DIR": trace_dir,
        "FSDP_PATCH_SUMMARY": "none",
        "FSDP_PATCH_PRECISION_EVERY": None if precision_every is None else str(precision_every),
        "OTEL_TRACES_EXPORTER": None,
        "OTEL_METRICS_EXPORTER": None,
        "OTEL_SDK_DISABLED": None,
    }


@contextlib.contextmanager
def _undone(plant: Plant) -> Iterator[None]:
    try:
        yield
    finally:
        plant.undo()


def train_on_rank(
    kind: str, settings: Settings, plant: Plant, trace_dir: str, precision_every: int | None
) -> dict[str, Any]:
    """Trains ``settings.steps`` iterations of the pattern on this rank (inside an initialized
    process group), telemetry on, trace files written into ``trace_dir`` and closed.

    Returns:
        This rank's losses per step, the scaler's scale per step (if any), whether the loss ever
        went non-finite, and the plant's notes.
    """
    import fsdp_patch.telemetry as telemetry

    from fsdp_patch.optimizer import fully_shard_optimizer

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = Context(kind, rank, world, settings)
    losses: list[float] = []
    scales: list[float] = []
    with environment(telemetry_environment(trace_dir, precision_every)), _undone(plant):
        torch.manual_seed(settings.seed)
        model = TinyLM(settings)
        plant.before_shard(ctx, model)
        _shard(model, kind, settings)
        ctx.model = model
        plant.after_shard(ctx)
        optimizer = ctx.optimizer = _optimizer(ctx, plant)
        fully_shard_optimizer(optimizer)
        scaler = ctx.scaler = _scaler(settings)
        for step in range(1, settings.steps + 1):
            ctx.step = step
            loss_sum = 0.0
            for micro in range(settings.microbatches):
                ctx.microbatch = micro
                last = micro == settings.microbatches - 1
                if settings.microbatches > 1:
                    model.set_requires_gradient_sync(last)  # type: ignore[operator]
                tokens, targets = batch(step, micro, rank, settings.seed)
                plant.before_forward(ctx, tokens, targets)
                logits = plant.on_logits(ctx, model(tokens))
                loss = loss_of(settings.loss, logits, targets)
                if model.aux is not None:
                    loss = loss + model.aux
                loss = plant.on_loss(ctx, loss) / settings.microbatches
                (scaler.scale(loss) if scaler is not None else loss).backward()
                loss_sum += float(loss.detach().float())
            plant.after_backward(ctx)
            if settings.clip is not None:
                if scaler is not None:
                    scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip)
            plant.before_step(ctx)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
                scales.append(float(scaler.get_scale()))
            else:
                optimizer.step()
            optimizer.zero_grad()
            plant.between_steps(ctx)
            losses.append(loss_sum)
        telemetry.shutdown()
    return {
        "losses": losses,
        "scales": scales,
        "nonfinite_loss": any(not math.isfinite(x) for x in losses),
        "notes": ctx.notes,
    }
