"""What the zero-code training scripts share: the tiny Llama, its batches, the planted learning rate, the loss line.

Each script of this folder is a training script as its framework's users write it, with no line of
fsdp_patch telemetry in it; ``tests/integration/test_zero_code.py`` runs each under torchrun with
and without ``FSDP_PATCH_TELEMETRY=1``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import torch

STEPS = 6
WORLD = 2
# A learning rate whose updates bf16 compute weights cannot resolve: the report must name the parameter.
PLANTED_LR = 1e-9
LR = 1e-2
VOCAB, SEQ, BATCH = 64, 8, 4


def tiny_llama() -> torch.nn.Module:
    """A 2-layer Llama of hidden size 32, the same weights on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def token_batches(rank: int, steps: int = STEPS) -> list[torch.Tensor]:
    """This rank's batches of token ids (each rank its own)."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(steps)]


def param_groups(named: Iterable[tuple[str, torch.nn.Parameter]], planted: str) -> list[dict]:
    """Every parameter at :data:`LR` except ``planted``, at :data:`PLANTED_LR`."""
    named = list(named)
    assert planted in dict(named), f"no parameter {planted!r} among {[n for n, _ in named]}"
    return [
        {"params": [p for n, p in named if n != planted]},
        {"params": [p for n, p in named if n == planted], "lr": PLANTED_LR},
    ]


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
) -> list[float]:
    """The loop a user writes: forward, ``backward`` (``accelerator.backward`` under Accelerate), step,
    zero_grad, over this rank's batches; returns the losses."""
    losses = []
    for tokens in token_batches(rank):
        loss = model(input_ids=tokens, labels=tokens).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def print_losses(rank: int, losses: list[float]) -> None:
    """This rank's losses, exactly (JSON keeps every bit of a float), printed and written to
    ``losses.rank<N>.json`` in the working directory, which the test reads (the ranks share one
    stdout, where another rank's output can split a line)."""
    print("LOSSES", rank, json.dumps(losses), flush=True)
    with open(f"losses.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(losses, f)
