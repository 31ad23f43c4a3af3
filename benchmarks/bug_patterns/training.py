"""The tiny model every pattern is planted in, and the training loop with its planting hooks.

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
from typing import Any, Literal
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FSDP2",
    "FULLY_SHARD",
    "KINDS",
    "Context",
    "Plant",
    "Settings",
    "TinyLM",
    "environment",
    "train_on_rank",
]

FULLY_SHARD = "fully_shard"
FSDP2 = "fsdp2"
KINDS = (FULLY_SHARD, FSDP2)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Small enough for 2 CPU ranks to run hundreds of steps in seconds; the rule the tokens follow
# (see batch) is learnable, so healthy runs lower their loss.
VOCAB, DIM, HIDDEN, BLOCKS = 32, 16, 64, 2
BATCH, SEQ = 4, 8  # sequences and tokens per rank and microbatch


@dataclass(frozen=True)
class Settings:
    """How a pattern trains (both shardings read the same settings).

    Attributes:
        compute: Compute dtype: ``fully_shard`` casts the module to it before sharding, FSDP2
            gets it as ``MixedPrecisionPolicy.param_dtype``.
        main: Main-weight dtype: ``fp32`` (the mixed-precision contract), or the compute dtype
            for training without fp32 main weights (``fully_shard``'s ``main_params_dtype``;
            FSDP2 without a policy, over a module cast to it).
        grads: Main-grad dtype (``fully_shard``'s ``main_grads_dtype``) and FSDP2's
            ``reduce_dtype``: the dtype the grads are reduced in.
        optimizer: ``adamw`` or ``adam`` (torch's, single-tensor: the CPU default).
        lr: Learning rate.
        eps: Adam's eps.
        weight_decay: AdamW's decoupled weight decay.
        scaler: Train through a ``ShardedGradScaler`` (fp16 compute), starting at ``init_scale``.
        init_scale: The scaler's initial scale.
        clip: ``clip_grad_norm_``'s max norm, or ``None`` for no clipping.
        steps: Optimizer steps (or iterations a scaler skipped).
        microbatches: Backward passes per step; gradient sync on the last only.
        norm: ``torch`` (``nn.RMSNorm``) or ``naive`` (an RMSNorm whose statistics run in the
            compute dtype, without an upcast) for every norm of the model.
        loss: ``ce`` (cross entropy on float32 logits), ``ce_low`` (on the compute-dtype logits),
            ``log_softmax_naive`` (``-log(softmax(logits)).gather``, in the compute dtype).
        aux_sqrt: Add ``1e-3 * sqrt(sum(h**2))``, per token of the embedding output, to the loss.
        seed: Seed of the weights and the data.
    """

    compute: Literal["bf16", "fp16", "fp32"] = "bf16"
    main: Literal["fp32", "bf16", "fp16"] = "fp32"
    grads: Literal["fp32", "bf16", "fp16"] = "fp32"
    optimizer: Literal["adamw", "adam"] = "adamw"
    lr: float = 1e-3
    eps: float = 1e-8
    weight_decay: float = 0.0
    scaler: bool = False
    init_scale: float = 2.0**16
    clip: float | None = None
    steps: int = 8
    microbatches: int = 1
    norm: Literal["torch", "naive"] = "torch"
    loss: Literal["ce", "ce_low", "log_softmax_naive"] = "ce"
    aux_sqrt: bool = False
    seed: int = 0

    def describe(self) -> str:
        """The settings as one line (optional ones only where set)."""
        parts = [f"{self.compute} compute", f"{self.main} main weights", f"{self.grads} grads/reduce"]
        parts.append(f"{self.optimizer} lr {self.lr:g}" + (f" wd {self.weight_decay:g}" if self.weight_decay else ""))
        if self.eps != 1e-8:
            parts.append(f"eps {self.eps:g}")
        parts.append(f"GradScaler(init {self.init_scale:g})" if self.scaler else "no GradScaler")
        if self.clip is not None:
            parts.append(f"clip_grad_norm_ {self.clip:g}")
        if self.microbatches > 1:
            parts.append(f"{self.microbatches} microbatches")
        if self.norm != "torch":
            parts.append(f"{self.norm} norm")
        if self.loss != "ce":
            parts.append(f"loss {self.loss}")
        if self.aux_sqrt:
            parts.append("sqrt aux loss")
        parts.append(f"{self.steps} steps")
        return ", ".join(parts)


# -- the model ---------------------------------------------------------------------------------


class NaiveRMSNorm(nn.Module):
    """RMSNorm computed in its input's dtype: the mean of squares of fp16 inputs above ~256
    overflows, which ``nn.RMSNorm`` avoids by computing in float32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(kind: str, dim: int) -> nn.Module:
    return NaiveRMSNorm(dim) if kind == "naive" else nn.RMSNorm(dim, eps=1e-6)


class _GradSpike(torch.autograd.Function):
    """Identity in forward; adds ``spike`` to element [0, 0] of the grad in backward."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, spike: float) -> torch.Tensor:
        ctx.spike = spike
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        grad[0, 0] += ctx.spike
        return grad, None


class Head(nn.Linear):
    """The output projection; ``grad_spike`` (0: none) is added to its weight's grad element
    [0, 0] on the unsharded weight, where a rank's local grad is made before any reduce."""

    grad_spike: float = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _GradSpike.apply(self.weight, self.grad_spike) if self.grad_spike else self.weight
        return F.linear(x, weight, self.bias)


class Block(nn.Module):
    """``norm(x + fc2(act(fc1(x))))`` (post-norm: a block's input scale reaches its fc1 and fc2)."""

    def __init__(self, dim: int, hidden: int, norm: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.norm = _norm(norm, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


class TinyLM(nn.Module):
    """Embedding, ``BLOCKS`` blocks, a final norm and a head.

    Plants act through plain attributes read in forward (set per rank and step):
    ``embed_gain`` and ``final_gain`` scale the embedding output and the final norm's input (an
    outlier batch, large residuals); ``zeroed`` is a (sequence, token) whose embedding row the
    aux loss sees as exactly zero (a padded or zeroed token); ``aux`` is the aux loss the last
    forward made (``None`` without ``aux_sqrt``). A buffer ``inv_freq`` (``DIM / 2`` inverse
    frequencies), where a plant registers one, adds sinusoidal positions to the embedding output.
    """

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HIDDEN, settings.norm) for _ in range(BLOCKS))
        self.final_norm = _norm(settings.norm, DIM)
        self.head = Head(DIM, VOCAB)
        self.aux_sqrt = settings.aux_sqrt
        self.embed_gain = 1.0
        self.final_gain = 1.0
        self.zeroed: tuple[int, int] | None = None
        self.aux: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        inv_freq = getattr(self, "inv_freq", None)
        if inv_freq is not None:
            # Positions as the buffer's dtype holds them, as a RoPE cache built from it is.
            angles = torch.outer(torch.arange(tokens.shape[1], device=h.device, dtype=inv_freq.dtype), inv_freq)
            h = h + torch.cat([angles.sin(), angles.cos()], dim=-1).to(h.dtype)
        if self.embed_gain != 1.0:
            h = h * self.embed_gain
        self.aux = None
        if self.aux_sqrt:
            seen = h
            if self.zeroed is not None:
                keep = torch.ones_like(h)
                keep[self.zeroed] = 0
                seen = h * keep
            # sqrt at 0 has an infinite derivative: 0 * inf is NaN in the backward only.
            self.aux = 1e-3 * seen.float().pow(2).sum(-1).sqrt().mean()
        for block in self.blocks:
            h = block(h)
        if self.final_gain != 1.0:
            h = h * self.final_gain
        return self.head(self.final_norm(h))


def batch(step: int, microbatch: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and targets: each sequence follows ``next = (5 * token + 3) % VOCAB``
    from a random start, so the head can learn it."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + microbatch * 31 + rank)
    start = torch.randint(1, VOCAB, (BATCH, 1), generator=gen)
    seq = [start]
    for _ in range(SEQ):
        seq.append((5 * seq[-1] + 3) % VOCAB)
    tokens = torch.cat(seq, dim=1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_of(kind: str, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss ``kind`` names (see :class:`Settings`) of ``logits`` against ``targets`` (-100: ignored)."""
    flat, labels = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if kind == "ce":
        return F.cross_entropy(flat.float(), labels)
    if kind == "ce_low":
        return F.cross_entropy(flat, labels)
    probs = torch.softmax(flat, dim=-1)
    return -torch.log(probs).gather(1, labels.clamp(min=0)[:, None]).mean()


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
    with environment(telemetry_environment(trace_dir, precision_every)):
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
