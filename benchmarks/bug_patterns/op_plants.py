"""Bugs that live in one line of a user's code: custom operations and activations, losses and their
regularizers, and what a script does between steps.

Each plant puts, in this file, the code a public report describes (the catalogue cites it), so that
the operation audit's findings can be checked for naming this file, the function and the operation.
Activations replace each block's ``act`` before sharding (a module of the model, sharded with it);
losses and between-step code run where a training script runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .plants import _local
from .tiny_lm import DIM, HIDDEN, TinyLM
from .training import Context, Plant

__all__ = [
    "Activation",
    "BF16Ema",
    "BF16LossTotal",
    "DistillationKL",
    "FocalLoss",
    "MaskedSlotsAct",
    "NaiveSoftmaxAct",
    "PackedPositions",
    "RandomFeatureAct",
    "SmallBetaSoftplusAct",
    "StateThroughCheckpoint",
    "TopKRouterAct",
    "WeightDecayBelowFloat32",
]


# -- custom activations (each block's act) ------------------------------------------------------------


class TopKRouterAct(nn.Module):
    """A mixture-of-experts gate over the hidden units: a router picks ``k`` of ``experts`` groups
    per token from softmax probabilities computed in the compute dtype (vllm-project/vllm#14027)."""

    def __init__(self, fixed: bool = False, experts: int = 8, k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        nn.init.normal_(self.router.weight, std=0.02)
        self.experts, self.k, self.fixed = experts, k, fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # the router in float32 (vllm's fix)
            probs = torch.softmax(F.linear(x.float(), self.router.weight.float()), dim=-1)
            top = probs.topk(self.k, dim=-1)
            gate = torch.zeros_like(probs).scatter(-1, top.indices, top.values).to(x.dtype)
            return F.gelu(x) * gate.repeat_interleave(HIDDEN // self.experts, dim=-1) * (self.experts / self.k)
        probs = torch.softmax(self.router(x), dim=-1)
        top = probs.topk(self.k, dim=-1)  # ties in bf16 probabilities pick by index
        gate = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
        return F.gelu(x) * gate.repeat_interleave(HIDDEN // self.experts, dim=-1) * (self.experts / self.k)


class MaskedSlotsAct(nn.Module):
    """Attention over the hidden units seen as 8 slots of 8, with a padding mask and a causal mask,
    each made of ``torch.finfo(dtype).min`` and added together (huggingface/transformers#17306)."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x.unflatten(-1, (8, 8)) * 20.0
        low = torch.finfo(x.dtype).min
        padding = torch.zeros(8, 8, dtype=x.dtype, device=x.device)
        padding[0] = low  # the first slot is left padding: its row is masked whole
        causal = torch.full((8, 8), low, dtype=x.dtype, device=x.device).triu(1)
        if self.fixed:  # one mask value, and the masked softmax in float32 (transformers#17437)
            mask = torch.maximum(padding, causal)
            probs = torch.softmax(scores.float() + mask.float(), dim=-1).to(x.dtype)
            return (probs * scores).flatten(-2)
        mask = padding + causal  # two finfo.min add up to -inf
        probs = torch.softmax((scores + mask).float(), dim=-1).to(x.dtype)
        return (probs * scores).flatten(-2)


class SmallBetaSoftplusAct(nn.Module):
    """``F.softplus(x, beta)`` with a small beta: about 0.69 / beta, past float16's largest value
    (pytorch/pytorch#187180)."""

    def __init__(self, fixed: bool = False, beta: float = 1e-5) -> None:
        super().__init__()
        self.beta, self.fixed = beta, fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # in float32, scaled back before the cast
            return (F.softplus(x.float(), beta=self.beta) * self.beta).to(x.dtype)
        return F.softplus(x, beta=self.beta) * self.beta


class RandomFeatureAct(nn.Module):
    """FAVOR+ random features ``exp(w.x - |x|^2 / 2)`` and their normalizer, in the compute dtype
    (facebookresearch/xformers#96): the features underflow and the normalizer is 0."""

    def __init__(self, fixed: bool = False, features: int = 32) -> None:
        super().__init__()
        # A plain attribute, not a buffer: the model's cast to float16 leaves it in float32.
        self.projection = torch.randn(features, 8, generator=torch.Generator().manual_seed(0))
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # the features and their normalizer in float32 (xformers#98)
            return self._attend(x.float(), self.projection.float()).to(x.dtype)
        return self._attend(x, self.projection.to(x.dtype))

    def _attend(self, x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
        slots = x.unflatten(-1, (8, 8)) * 3.0
        features = torch.exp(slots @ projection.T - slots.square().sum(-1, keepdim=True) / 2)
        normalizer = features @ features.sum(-2, keepdim=True).transpose(-1, -2)
        mixed = features @ (features.transpose(-1, -2) @ slots)
        return (mixed / normalizer).flatten(-2)


class NaiveSoftmaxAct(nn.Module):
    """A softmax written out as ``exp(s) / exp(s).sum()`` without subtracting the maximum
    (NVIDIA/FasterTransformer#43): ``exp`` of a score over 11.1 is Inf in float16."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x.unflatten(-1, (8, 8)) * 8.0
        if self.fixed:  # the row's maximum subtracted first
            scores = scores - scores.amax(-1, keepdim=True)
        weights = torch.exp(scores)
        probs = weights / weights.sum(-1, keepdim=True)
        return (probs * x.unflatten(-1, (8, 8))).flatten(-2)


@dataclass
class Activation(Plant):
    """Each block's ``act`` replaced, before sharding, by ``make(fixed)`` in the compute dtype."""

    make: Any
    fixed: bool = False

    def before_shard(self, ctx: Context, model: TinyLM) -> None:
        dtype = next(model.parameters()).dtype
        for block in model.blocks:
            block.act = self.make(self.fixed).to(dtype)


# -- positions --------------------------------------------------------------------------------------


class _PackedEmbedding(nn.Module):
    """Token and learned position embeddings; positions start at ``offset`` (a document packed
    into a long sequence) and are made in the embedding's dtype (pytorch/pytorch#137774)."""

    def __init__(self, tokens: nn.Embedding, offset: int, positions: int, fixed: bool) -> None:
        super().__init__()
        self.tokens = tokens
        self.positions = nn.Embedding(positions, DIM)
        self.offset, self.fixed = offset, fixed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids)
        if self.fixed:  # integer positions
            return h + self.positions(torch.arange(self.offset, self.offset + ids.shape[1], device=ids.device))
        pos = torch.arange(self.offset, self.offset + ids.shape[1], dtype=h.dtype, device=ids.device)
        return h + self.positions(pos.long())


@dataclass
class PackedPositions(Plant):
    """The embedding gains position embeddings from ``offset`` on, made as described above."""

    offset: int = 1000
    fixed: bool = False

    def before_shard(self, ctx: Context, model: TinyLM) -> None:
        dtype = model.embed.weight.dtype
        model.embed = _PackedEmbedding(model.embed, self.offset, self.offset + 64, self.fixed).to(dtype)


# -- losses ------------------------------------------------------------------------------------------


@dataclass
class _LossPlant(Plant):
    """Keeps the batch's targets and the logits, for a loss term added to the loss."""

    weight: float = 0.1
    fixed: bool = False
    targets: torch.Tensor | None = field(default=None, repr=False)
    logits: torch.Tensor | None = field(default=None, repr=False)

    def before_forward(self, ctx: Context, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        self.targets = targets

    def on_logits(self, ctx: Context, logits: torch.Tensor) -> torch.Tensor:
        self.logits = logits
        return logits

    def on_loss(self, ctx: Context, loss: torch.Tensor) -> torch.Tensor:
        assert self.logits is not None and self.targets is not None
        return loss + self.weight * self.term(self.logits, self.targets)

    def term(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class FocalLoss(_LossPlant):
    """A sigmoid focal loss on the logits (sharpened by a temperature of 0.15), in their dtype, with
    float32's smallest normal value as the guard of its logs (open-mmlab/mmcv#1488)."""

    def term(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = (logits.float() if self.fixed else logits) / 0.15  # fixed: in float32
        p = torch.sigmoid(x)
        tiny = torch.tensor(torch.finfo(torch.float32).tiny, dtype=x.dtype)  # 0 in float16
        onehot = F.one_hot(targets, x.shape[-1]).to(x.dtype)
        positive = -0.25 * (1 - p) ** 2 * torch.log(torch.maximum(p, tiny))
        negative = -0.75 * p**2 * torch.log(torch.maximum(1 - p, tiny))
        return (onehot * positive + (1 - onehot) * negative).sum(-1).mean().float()


@dataclass
class DistillationKL(_LossPlant):
    """A distillation KL term against a teacher whose logits are close to the model's, computed in
    the logits' dtype (vllm-project/speculators#788)."""

    def term(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(int(targets.sum()))
        teacher = (logits.detach().float() + 0.01 * torch.randn(logits.shape, generator=gen)).to(logits.dtype)
        if self.fixed:  # both distributions in float32 (speculators#788)
            logits, teacher = logits.float(), teacher.float()
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean")
        return kl.float()


# -- between steps -----------------------------------------------------------------------------------


@dataclass
class BF16LossTotal(Plant):
    """A running total of the loss for logging, kept in bfloat16 and never reset; the run resumed
    with ``start`` in it (huggingface/transformers#8561)."""

    start: float = 4600.0
    fixed: bool = False
    total: torch.Tensor | None = field(default=None, repr=False)
    last: torch.Tensor | None = field(default=None, repr=False)

    def on_loss(self, ctx: Context, loss: torch.Tensor) -> torch.Tensor:
        self.last = loss
        return loss

    def between_steps(self, ctx: Context) -> None:
        assert self.last is not None
        dtype = torch.float32 if self.fixed else torch.bfloat16  # fixed: a float32 total
        if self.total is None:
            self.total = torch.tensor(self.start, dtype=dtype)
        self.total += self.last.detach().to(dtype)
        ctx.notes["loss_total"] = float(self.total)


@dataclass
class BF16Ema(Plant):
    """An exponential moving average of the weights kept in bfloat16, updated after each step
    (d8ahazard/sd_dreambooth_extension#1417)."""

    decay: float = 0.999
    fixed: bool = False
    shadow: list[torch.Tensor] = field(default_factory=list, repr=False)

    def between_steps(self, ctx: Context) -> None:
        dtype = torch.float32 if self.fixed else torch.bfloat16  # fixed: a float32 average
        params = [_local(p.detach()) for p in ctx.named.values()]
        if not self.shadow:
            self.shadow = [p.to(dtype).clone() for p in params]
        with torch.no_grad():
            for average, param in zip(self.shadow, params, strict=True):
                average.mul_(self.decay).add_(param.to(dtype), alpha=1 - self.decay)


@dataclass
class StateThroughCheckpoint(Plant):
    """After step ``at``, the optimizer's state saved with its floating tensors cast to ``dtype`` (to
    halve the checkpoint) and loaded back into the float32 state: bfloat16 rounds every moment to a
    bfloat16 value (pytorch/pytorch#43706); float16 also flushes an ``exp_avg_sq`` below its
    smallest subnormal to 0, and where the next grad is 0 too (an embedding's row that batch does
    not reach) Adam divides ``exp_avg`` by eps alone (ultralytics/ultralytics#24085). ``fixed``: the
    state keys in ``fix_keeps`` (every key where it is empty) saved in float32, each thread's fix."""

    dtype: str = "bf16"
    fix_keeps: tuple[str, ...] = ()
    at: int = 3
    fixed: bool = False

    def between_steps(self, ctx: Context) -> None:
        if ctx.step != self.at:
            return
        assert ctx.optimizer is not None
        saved = ctx.optimizer.state_dict()
        cast = {"bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]
        for state in saved["state"].values():
            for key, value in state.items():
                if self.fixed and (not self.fix_keeps or key in self.fix_keeps):
                    continue
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                    state[key] = value.to(cast).to(value.dtype)
        ctx.optimizer.load_state_dict(saved)


@dataclass
class WeightDecayBelowFloat32(Plant):
    """AdamW at DETR's learning rate and weight decay, 1e-4 each (pytorch/pytorch#64475): torch's
    AdamW decays by ``param.mul_(1 - lr * weight_decay)``, and 1 - 1e-8 is 1 in float32, so the fp32
    main weights never decay. Fixed: a weight decay of 1e-2, whose factor float32 holds."""

    fixed: bool = False

    def param_groups(self, ctx: Context) -> list[dict[str, Any]] | None:
        assert ctx.model is not None
        return [{"params": list(ctx.model.parameters()), "weight_decay": 1e-2 if self.fixed else 1e-4}]
