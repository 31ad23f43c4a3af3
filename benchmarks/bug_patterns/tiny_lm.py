"""The tiny model every bug pattern is planted in, its batches and losses, and the settings a pattern
trains with.

:class:`TinyLM` is an embedding, :data:`BLOCKS` MLP blocks with a norm each, a final norm and a
head, small enough for 2 CPU ranks to run hundreds of steps in seconds; :func:`batch` gives tokens
that follow a learnable rule, so healthy runs lower their loss. :class:`Settings` names the dtypes,
optimizer, norm and loss a pattern trains with (the same under both shardings); the model's knobs
(a naive RMSNorm, a sqrt aux loss, gains a plant sets) are what the catalogue's bugs need.
:mod:`.training` shards and trains it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BATCH",
    "BLOCKS",
    "DIM",
    "DTYPES",
    "HIDDEN",
    "SEQ",
    "VOCAB",
    "Settings",
    "TinyLM",
    "batch",
    "loss_of",
    "to_float8",
]

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
        float8: Which linear layers torchao's ``convert_to_float8_training`` swaps for
            ``Float8Linear`` (fp8 matmuls emulated): ``off``, ``blocks`` (every block's fc1 and fc2:
            the recipes' choice, first and last layers kept in bf16) or ``all`` (the head too).
        float8_recipe: ``tensorwise`` (torchao's default: e4m3 forward, e5m2 grads), ``rowwise``
            (torchao's rowwise recipe) or ``all_e4m3`` (tensorwise, grads cast to e4m3 too).
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
    float8: Literal["off", "blocks", "all"] = "off"
    float8_recipe: Literal["tensorwise", "rowwise", "all_e4m3"] = "tensorwise"
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
        if self.float8 != "off":
            parts.append(f"float8 {self.float8_recipe} ({'blocks' if self.float8 == 'blocks' else 'blocks and head'})")
        parts.append(f"{self.steps} steps")
        return ", ".join(parts)


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
    outlier batch, large residuals); ``first_token_gain`` scales each sequence's first token's
    embedding output (a massive activation on one token); ``zeroed`` is a (sequence, token) whose embedding row the
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
        self.first_token_gain = 1.0
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
        if self.first_token_gain != 1.0:
            gain = torch.ones(h.shape[1], 1, dtype=h.dtype, device=h.device)
            gain[0] = self.first_token_gain
            h = h * gain
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


def to_float8(model: TinyLM, settings: Settings) -> None:
    """Swaps the linear layers ``settings.float8`` names for torchao ``Float8Linear`` s, as
    ``settings.float8_recipe`` configures them (emulated: the CPU has no float8 matmul)."""
    import dataclasses

    from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training

    if settings.float8_recipe == "rowwise":
        config = Float8LinearConfig.from_recipe_name("rowwise")
    else:
        config = Float8LinearConfig()
        if settings.float8_recipe == "all_e4m3":
            e4m3 = CastConfig(target_dtype=torch.float8_e4m3fn)
            config = dataclasses.replace(
                config, cast_config_grad_output=e4m3, cast_config_grad_output_for_grad_weight=e4m3
            )
    config = dataclasses.replace(config, emulate=True)
    keep = (lambda module, fqn: True) if settings.float8 == "all" else (lambda module, fqn: fqn != "head")
    convert_to_float8_training(model, config=config, module_filter_fn=keep)


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
