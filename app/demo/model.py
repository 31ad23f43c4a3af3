"""A small decoder-only transformer for the demo and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of :class:`GPT`: vocabulary, width, attention heads, blocks and sequence length."""

    vocab: int = 512
    dim: int = 128
    heads: int = 4
    layers: int = 4
    seq: int = 64

    @property
    def approx_params(self) -> int:
        return self.vocab * self.dim * 2 + self.seq * self.dim + self.layers * 12 * self.dim * self.dim


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.pos = nn.Parameter(torch.randn(config.seq, config.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(config.dim, config.heads) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def shard(model: GPT, **kwargs: Any) -> GPT:
    """``fully_shard`` bottom-up: each block, then the root."""
    from fsdp_patch import fully_shard

    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def to_float8(model: GPT, device: torch.device) -> GPT:
    """The blocks' linear layers swapped for torchao ``Float8Linear`` s (tensorwise scaling, gathered
    in float8 by ``fully_shard``): the embedding and the head stay in the compute dtype, as the
    float8 recipes keep a model's first and last layers. The fp8 matmuls are emulated where the
    device has none (the CPU; GPUs before compute capability 8.9).

    Raises:
        RuntimeError: torchao is not installed.
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise RuntimeError(
            f"the float8 scenarios need torchao's float8 training (pip install torchao): {exc}"
        ) from None
    native = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    config = Float8LinearConfig(emulate=not native, enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn.startswith("blocks."))
