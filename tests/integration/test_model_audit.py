"""Low precision beyond the parameters, named once each with its fix, for ``fully_shard`` and torch
FSDP2 models on 2 ranks: a RoPE ``inv_freq`` buffer rounded by ``model.bfloat16()``
(huggingface/transformers#29285), a cross entropy on bf16 logits (Modalities/modalities#464), an
RMSNorm computing its statistics in bf16 (meta-llama/llama#1048), and microbatches summed into bf16
grads (deepspeedai/DeepSpeed#1800, pytorch/pytorch#106395). A model that keeps all of these in
float32 names none of them.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.integration.otel_training import environment, reset_otel
from tests.integration.test_origin import _report

STEPS = 3
MICROBATCHES = 2
KINDS = ("fully_shard", "fsdp2")


class RMSNorm(nn.Module):
    """A hand-written RMSNorm: its statistics are in its input's dtype unless ``upcast``."""

    def __init__(self, dim: int, upcast: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.upcast = upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if self.upcast else x
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, dim: int, upcast: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, upcast)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Rotary(nn.Module):
    """Positions as sines of ``inv_freq``, the buffer ``model.bfloat16()`` rounds."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device, dtype=self.inv_freq.dtype)
        angles = torch.outer(positions, self.inv_freq)
        return x + torch.cat([angles.sin(), angles.cos()], dim=-1).to(x.dtype)


class Model(nn.Module):
    def __init__(self, upcast: bool, dim: int = 16, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rotary = Rotary(dim)
        self.blocks = nn.ModuleList(Block(dim, upcast) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.rotary(self.embed(tokens))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def audited_training(kind: str, careful: bool, trace_dir: str) -> None:
    """bf16 compute, 2 microbatches a step; ``careful``: the buffer back in float32, statistics
    upcast, the loss on float32 logits, grads accumulated in float32."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank = dist.get_rank()
    settings = {
        "FSDP_PATCH_TELEMETRY": "1",
        "FSDP_PATCH_TRACE_DIR": trace_dir,
        "FSDP_PATCH_SUMMARY": "none",
        "OTEL_TRACES_EXPORTER": None,
        "OTEL_METRICS_EXPORTER": None,
    }
    with environment(**settings):
        reset_otel()
        torch.manual_seed(0)
        model = Model(upcast=careful)
        if kind == "fully_shard":
            from fsdp_patch import MixedPrecisionPolicy, fully_shard

            model = model.bfloat16()  # bf16 compute for fully_shard: the parameters' own dtype
            if careful:
                model.rotary.inv_freq.data = model.rotary.inv_freq.data.float()
            policy = MixedPrecisionPolicy(main_grads_dtype=torch.float32 if careful else None)
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            if not careful:
                model.rotary.inv_freq.data = model.rotary.inv_freq.data.bfloat16()
            fsdp2_policy = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if careful else torch.bfloat16
            )
            for block in model.blocks:
                fully_shard(block, mp_policy=fsdp2_policy)
            fully_shard(model, mp_policy=fsdp2_policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fully_shard_optimizer(optimizer)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            for micro in range(MICROBATCHES):
                model.set_requires_gradient_sync(micro == MICROBATCHES - 1)
                tokens = torch.randint(0, 11, (4, 6), generator=gen)
                logits = model(tokens[:, :-1])
                logits = logits.float() if careful else logits
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).float()
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        from fsdp_patch import telemetry

        telemetry.shutdown()
        del optimizer, model
        gc.collect()
        reset_otel()


def _violations(dist_pool: Any, tmp_path: Path, kind: str, careful: bool) -> dict[tuple[str, str], dict[str, Any]]:
    trace_dir = tmp_path / f"{kind}-{careful}"
    os.makedirs(trace_dir, exist_ok=True)
    dist_pool(2).run(audited_training, kind, careful, str(trace_dir))
    report = _report(trace_dir)
    return {(v["tensor"], v["param"]): v for f in report["findings"] for v in f.get("violations", ())}


@pytest.mark.parametrize("kind", KINDS)
def test_the_model_audit_names_each_low_precision_role_once_with_its_fix(dist_pool, tmp_path, kind) -> None:
    found = _violations(dist_pool, tmp_path, kind, careful=False)
    want = {
        ("buffer", "rotary.inv_freq"): "buffer.data = buffer.data.float()",
        ("loss", "NllLoss"): "cross_entropy(logits.float(), labels)",
        ("norm_statistics", "blocks.0.norm"): "compute them in float32",
        ("norm_statistics", "blocks.1.norm"): "compute them in float32",
        ("grad_accumulation", "blocks.0"): f"{MICROBATCHES} microbatches summed into bfloat16 grads",
    }
    missing = {key: fix for key, fix in want.items() if key not in found or fix not in found[key]["detail"]}
    assert not missing, f"{kind}: want each named with its fix, missing {missing}; found {sorted(found)}"
    for key in want:
        got = (found[key]["actual"], found[key]["expected"], found[key]["step"], found[key]["ranks"])
        assert got == ("bfloat16", "float32", 1, [0, 1]), f"{kind}, {key}: (actual, expected, step, ranks) {got}"


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_that_keeps_them_in_float32_names_none(dist_pool, tmp_path, kind) -> None:
    found = _violations(dist_pool, tmp_path, kind, careful=True)
    roles = {"buffer", "loss", "norm_statistics", "grad_accumulation"}
    named = sorted(key for key in found if key[0] in roles)
    assert named == [], f"{kind}: a float32 buffer, statistics, loss and accumulation were named: {named}"


def failing_forward(kind: str, trace_dir: str) -> list[str]:
    """The audit's first training forward raises (a batch of the wrong type): the error is the user's, and
    the next forward trains. Returns what each attempt raised."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    settings = {
        "FSDP_PATCH_TELEMETRY": "1",
        "FSDP_PATCH_TRACE_DIR": trace_dir,
        "FSDP_PATCH_SUMMARY": "none",
        "OTEL_TRACES_EXPORTER": None,
        "OTEL_METRICS_EXPORTER": None,
    }
    raised = []
    with environment(**settings):
        reset_otel()
        torch.manual_seed(0)
        model = Model(upcast=False)
        if kind == "fully_shard":
            from fsdp_patch import fully_shard

            model = model.bfloat16()
        else:
            from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fully_shard_optimizer(optimizer)
        tokens = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(dist.get_rank()))
        for batch in (tokens.tolist(), tokens):  # a list first: the embedding refuses it
            try:
                model(batch).float().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                raised.append("")
            except Exception as exc:
                raised.append(f"{type(exc).__name__}: {exc}")
        from fsdp_patch import telemetry

        telemetry.shutdown()
        del optimizer, model
        gc.collect()
        reset_otel()
    return raised


@pytest.mark.parametrize("kind", KINDS)
def test_an_error_in_the_audited_forward_stays_the_users(dist_pool, tmp_path, kind) -> None:
    for rank, raised in enumerate(dist_pool(2).run(failing_forward, kind, str(tmp_path / "traces"))):
        assert len(raised) == 2 and raised[0].startswith("TypeError: embedding()") and raised[1] == "", (
            f"rank {rank}: want the embedding's TypeError, then a step that trains; got {raised}"
        )
