"""The bugs the catalogue plants, one :class:`~.training.Plant` each.

Each acts at a given step (``at``: from that step on, ``until``: through that step) and on given
ranks, at one point of the iteration; the catalogue says which public issue each reproduces.
Writes into sharded tensors go through ``DTensor.to_local()``: this rank's shard of the main
weights or main grads, for ``fully_shard`` and FSDP2 alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .tiny_lm import DIM, TinyLM
from .training import Context, Plant

__all__ = [
    "BatchGain",
    "ClipInLowPrecision",
    "FinalGain",
    "GradSpike",
    "HeadBias",
    "IgnoreAllTargets",
    "LowPrecisionBuffer",
    "LowPrecisionOptimizerState",
    "LrSchedule",
    "MainWeightsFromCompute",
    "NanStateDictLoad",
    "NoPlant",
    "ScaleLogits",
    "ScaleLoss",
    "WeightWrite",
    "WriteGrad",
    "ZeroedToken",
]


def _local(tensor: Any) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass(frozen=True)
class When:
    """The steps (``at`` through ``until``, ``None``: to the end) and ranks (``None``: all) a plant acts on."""

    at: int
    until: int | None = None
    ranks: tuple[int, ...] | None = None

    def __call__(self, ctx: Context) -> bool:
        in_steps = ctx.step >= self.at and (self.until is None or ctx.step <= self.until)
        return in_steps and (self.ranks is None or ctx.rank in self.ranks)


class NoPlant(Plant):
    """The healthy controls: nothing planted."""


@dataclass
class BatchGain(Plant):
    """Scales the embedding output by ``gain`` (an outlier batch, activations far above the usual)."""

    when: When
    gain: float

    def before_forward(self, ctx: Context, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        assert ctx.model is not None
        ctx.model.embed_gain = self.gain if self.when(ctx) else 1.0


@dataclass
class FinalGain(Plant):
    """Scales the final norm's input by ``gain`` (a residual stream of large magnitude)."""

    when: When
    gain: float

    def before_forward(self, ctx: Context, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        assert ctx.model is not None
        ctx.model.final_gain = self.gain if self.when(ctx) else 1.0


@dataclass
class ZeroedToken(Plant):
    """Token (0, 0) of the batch reaches the sqrt aux loss as an exactly zero vector."""

    when: When

    def before_forward(self, ctx: Context, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        assert ctx.model is not None
        ctx.model.zeroed = (0, 0) if self.when(ctx) else None


@dataclass
class IgnoreAllTargets(Plant):
    """Every target of the batch is ``-100`` (ignored): a per-rank mean over zero tokens."""

    when: When

    def before_forward(self, ctx: Context, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        if self.when(ctx):
            targets.fill_(-100)


@dataclass
class ScaleLogits(Plant):
    """Multiplies the logits the loss reads by ``factor`` (saturated logits)."""

    when: When
    factor: float

    def on_logits(self, ctx: Context, logits: torch.Tensor) -> torch.Tensor:
        return logits * self.factor if self.when(ctx) else logits


@dataclass
class HeadBias(Plant):
    """Adds ``offset`` to the head's bias before sharding: every logit sits near ``offset``, where
    the compute dtype's spacing is coarse."""

    offset: float

    def before_shard(self, ctx: Context, model: TinyLM) -> None:
        with torch.no_grad():
            model.head.bias.add_(self.offset)


@dataclass
class LowPrecisionBuffer(Plant):
    """Before sharding, registers the root's ``inv_freq`` buffer (RoPE's inverse frequencies) in
    float32 and casts it to ``dtype``, as ``model.bfloat16()`` casts every floating buffer."""

    dtype: torch.dtype = torch.bfloat16

    def before_shard(self, ctx: Context, model: TinyLM) -> None:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
        model.register_buffer("inv_freq", inv_freq.to(self.dtype))


@dataclass
class ScaleLoss(Plant):
    """Multiplies the loss by ``factor`` (a loss far below or above its usual magnitude)."""

    when: When
    factor: float

    def on_loss(self, ctx: Context, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.factor if self.when(ctx) else loss


@dataclass
class GradSpike(Plant):
    """Adds ``spike`` to the local (pre-reduce) grad of ``head.weight[0, 0]`` on every rank."""

    when: When
    spike: float
    divide_factor: float | None = None

    def after_shard(self, ctx: Context) -> None:
        if self.divide_factor is not None and ctx.kind == "fsdp2":
            assert ctx.model is not None
            for module in ctx.model.modules():
                setter = getattr(module, "set_gradient_divide_factor", None)
                if setter is not None:
                    setter(self.divide_factor)

    def before_forward(self, ctx: Context, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        assert ctx.model is not None
        ctx.model.head.grad_spike = self.spike if self.when(ctx) else 0.0


@dataclass
class WriteGrad(Plant):
    """Writes ``value`` into element ``index`` of this rank's shard of ``param``'s grad after backward."""

    when: When
    param: str
    value: float
    index: int = 0

    def after_backward(self, ctx: Context) -> None:
        if self.when(ctx):
            with torch.no_grad():
                _local(ctx.named[self.param].grad).view(-1)[self.index] = self.value


@dataclass
class WeightWrite(Plant):
    """Between steps, writes into this rank's shard of ``param``'s main weight: ``value`` at
    ``index``, then, with ``round_trip``, the whole shard cast to ``round_trip`` and back in place
    (a validation pass casting live weights to fp16)."""

    when: When
    param: str
    value: float
    index: int = 0
    round_trip: torch.dtype | None = None

    def between_steps(self, ctx: Context) -> None:
        if not self.when(ctx):
            return
        with torch.no_grad():
            local = _local(ctx.named[self.param])
            local.view(-1)[self.index] = self.value
            if self.round_trip is not None:
                local.copy_(local.to(self.round_trip).to(local.dtype))
            ctx.notes["written"] = {"param": self.param, "finite": bool(torch.isfinite(local).all())}


@dataclass
class NanStateDictLoad(Plant):
    """Between steps, ``model.load_state_dict`` of the model's own state dict with ``param``
    replaced by a tensor made with ``torch.empty`` and filled with NaN (a weight the checkpoint
    lacked, left uninitialized)."""

    when: When
    param: str

    def between_steps(self, ctx: Context) -> None:
        if not self.when(ctx):
            return
        assert ctx.model is not None
        state = ctx.model.state_dict()
        held = state[self.param]
        with torch.no_grad():
            loaded = torch.empty_like(held)
            _local(loaded).fill_(math.nan)
        state[self.param] = loaded
        ctx.model.load_state_dict(state)


@dataclass
class LowPrecisionOptimizerState(Plant):
    """After step ``when.at - 1``, ``param``'s Adam ``exp_avg_sq`` is kept in ``dtype`` (an
    optimizer whose state is low precision), which the optimizer then updates in place."""

    when: When
    param: str
    dtype: torch.dtype = torch.float16

    def before_step(self, ctx: Context) -> None:
        if ctx.step != self.when.at:
            return
        assert ctx.optimizer is not None
        state = ctx.optimizer.state[ctx.named[self.param]]
        state["exp_avg_sq"] = state["exp_avg_sq"].to(self.dtype)


@dataclass
class LrSchedule(Plant):
    """Sets every param group's lr to ``lr`` from step ``when.at`` (through ``when.until``), then
    back to the settings' lr: a spike, or a drop of a schedule."""

    when: When
    lr: float

    def before_step(self, ctx: Context) -> None:
        assert ctx.optimizer is not None
        lr = self.lr if self.when(ctx) else ctx.settings.lr
        for group in ctx.optimizer.param_groups:
            group["lr"] = lr


@dataclass
class MainWeightsFromCompute(Plant):
    """Between steps, every main weight is replaced by its ``dtype`` rounding (a resume whose
    checkpoint held only the bf16 model state: the fp32 main weights rebuilt from it)."""

    when: When
    dtype: torch.dtype = torch.bfloat16

    def between_steps(self, ctx: Context) -> None:
        if ctx.step != self.when.at:
            return
        assert ctx.model is not None
        with torch.no_grad():
            changed = 0
            for param in ctx.model.parameters():
                local = _local(param)
                rounded = local.to(self.dtype).to(local.dtype)
                changed += int((rounded != local).sum())
                local.copy_(rounded)
        ctx.notes["elements_rounded"] = changed


@dataclass
class ClipInLowPrecision(Plant):
    """After backward, clips every grad by a total norm summed in fp16 from this rank's shards and
    all-reduced (as fairscale's OSS clip did), after ``spike`` is added to one grad element of
    ``param`` on rank ``when.ranks``: each element stays finite, their squares do not."""

    when: When
    param: str
    spike: float
    max_norm: float = 1.0

    def after_backward(self, ctx: Context) -> None:
        import torch.distributed as dist

        assert ctx.model is not None
        with torch.no_grad():
            if self.when(ctx):
                _local(ctx.named[self.param].grad).view(-1)[0] += self.spike
            grads = [_local(p.grad) for p in ctx.model.parameters() if p.grad is not None]
            squares = torch.stack([g.half().pow(2).sum() for g in grads]).sum()
            dist.all_reduce(squares)
            total = squares.float().sqrt()
            coef = (self.max_norm / (total + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
            if self.when(ctx):
                ctx.notes.setdefault("total_norms", []).append(float(total))
