"""Small models the multi-process tests train."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fsdp_patch.app.demo.model import Block
from torch import nn


class TinyTransformer(nn.Module):
    """A decoder-only transformer; odd sizes so shards are uneven on 2 and 4 ranks."""

    def __init__(self, vocab: int = 37, dim: int = 24, heads: int = 2, layers: int = 2, seq: int = 7) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(seed: int = 0, **kwargs: int) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(**kwargs)


def make_batches(steps: int, batch: int = 8, seq: int = 7, vocab: int = 37, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(steps)]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def shard_model(model: nn.Module, **kwargs) -> nn.Module:
    """Applies fully_shard bottom-up: each block, then the root."""
    from fsdp_patch import fully_shard

    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def sharded_model(seed: int = 0, dtype: torch.dtype = torch.bfloat16, **kwargs: int) -> nn.Module:
    """The TinyTransformer in ``dtype``, the compute dtype (bf16: fp32 main weights, bf16 compute
    weights and grads), sharded by ``fully_shard`` bottom-up over all ranks."""
    return shard_model(make_model(seed, **kwargs).to(dtype))


def fsdp2_shard_model(model: nn.Module, **kwargs) -> nn.Module:
    """Applies torch FSDP2's fully_shard the same way: each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def rank_slice(tokens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = tokens.shape[0] // world_size
    return tokens[rank * per : (rank + 1) * per]
