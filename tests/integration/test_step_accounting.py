"""Iterations a GradScaler skipped are counted exactly, with where their overflow began; a float16
reduce that overflows is named as the reduce; escalated iterations name the module.

The tiny transformer computes in float16 (``fully_shard``: float32 main weights and main grads;
torch FSDP2: float32 parameters cast to float16), trained with ``torch.amp.GradScaler`` where a
scaler is asked for. An overflow is planted by a forward hook on ``blocks.1.fc1`` that scales its
output past float16's range, on the steps listed.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import models
from tests.integration.otel_training import environment, reset_otel
from tests.integration.test_origin import _local, _report, _shard

STEPS = 8
KINDS = ("fully_shard", "fsdp2")


class _GradTo(torch.autograd.Function):
    """Identity forward; backward sends a grad whose sum over the rows is 5e4 in each column, so
    that the bias behind it gets a grad of 5e4 on every rank: finite in float16, and beyond
    float16's 65504 once the ranks' grads are summed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        rows = grad.numel() // grad.shape[-1]
        return torch.full_like(grad, 5e4 / rows)


def scaled_training(kind: str, overflow_steps: list[int], trace_dir: str, reduce_fp16: bool = False) -> list[Any]:
    """Train STEPS steps with a GradScaler (none when ``reduce_fp16``: then the grad of
    blocks.0.fc2.bias is made large enough that its float16 reduce overflows at step 3); returns the
    final local shards of the main weights."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    settings = {
        "FSDP_PATCH_TELEMETRY": "1" if trace_dir else None,
        "FSDP_PATCH_TRACE_DIR": trace_dir,
        "FSDP_PATCH_SUMMARY": "none",
        "OTEL_TRACES_EXPORTER": None,
        "OTEL_METRICS_EXPORTER": None,
    }
    with environment(**settings):
        reset_otel()
        if reduce_fp16:
            # float32 compute, float16 reduce: each rank's grads are finite, their sum is not.
            policy: dict[str, Any] = (
                {"main_grads_dtype": torch.float16} if kind == "fully_shard" else {"reduce_dtype": torch.float16}
            )
            model = _shard(models.make_model(0), kind, **policy)
        elif kind == "fully_shard":
            model = _shard(models.make_model(0).half(), kind, main_grads_dtype=torch.float32)
        else:
            model = _shard(models.make_model(0), kind, param_dtype=torch.float16, reduce_dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fully_shard_optimizer(optimizer)
        scaler = None if reduce_fp16 else torch.amp.GradScaler("cpu", init_scale=1024.0)
        now = {"step": 0}
        # Part of the model from the start (before any hook telemetry adds): fc1's output leaves
        # float16's range on the steps listed, as an overflowing activation would.
        model.blocks[1].fc1.register_forward_hook(lambda m, a, out: out * 1e5 if now["step"] in overflow_steps else out)
        if reduce_fp16:
            model.blocks[0].fc2.register_forward_hook(lambda m, a, out: _GradTo.apply(out) if now["step"] == 3 else out)
        for step, tokens in enumerate(models.make_batches(STEPS), start=1):
            now["step"] = step
            loss = models.lm_loss(model, models.rank_slice(tokens, rank, world))
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
        weights = [_local(p).detach().clone() for p in model.parameters()]
        from fsdp_patch import telemetry

        telemetry.shutdown()
        del optimizer, model
        gc.collect()
        reset_otel()
    return weights


def _run(
    dist_pool: Any, kind: str, overflow: list[int], tmp_path: Path, name: str, world: int = 2, **kwargs: Any
) -> dict[str, Any]:
    trace_dir = tmp_path / f"{kind}-{name}"
    os.makedirs(trace_dir, exist_ok=True)
    dist_pool(world).run(scaled_training, kind, overflow, str(trace_dir), **kwargs)
    return _report(trace_dir)


@pytest.mark.parametrize("kind", KINDS)
def test_a_scaler_that_skips_every_iteration_is_counted_and_its_overflow_named(dist_pool, tmp_path, kind) -> None:
    """deepspeedai/DeepSpeed#697, facebookresearch/fairseq#512: every iteration overflows anew, the
    scaler skips them all and its scale collapses; telemetry used to record nothing at all."""
    report = _run(dist_pool, kind, list(range(1, STEPS + 1)), tmp_path, "all")
    got = report["iterations"]
    want = {
        "optimizer_steps": 0,
        "skipped": STEPS,
        "scale_first": 1024.0,
        "scale_last": 1024.0 / 2 ** (STEPS - 1),
        "backward_without_steps": 0,
    }
    assert got == want, f"{kind}: want {want}, got {got}"
    origin = report["origin"]
    assert origin is not None and (origin["step"], origin["stage"], origin["where"]) == (1, "forward", "blocks.1"), (
        f"{kind}: want the overflow's origin at step 1, forward of blocks.1, got {origin}"
    )
    refined = [(o["stage"], o["where"]) for o in origin["refined"]]
    assert ("forward", "blocks.1.fc1") in refined, f"{kind}: escalation did not name the module: {refined}"
    checks = [f["check"] for f in report["findings"]]
    assert checks[:2] == ["origin", "scaler_skipped"] and report["verdict"] == "problem", (
        f"{kind}: want the origin, then the skipped iterations, as problems; got {checks} ({report['verdict']})"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_scaler_that_skips_a_few_iterations_is_counted_and_trains_as_with_telemetry_off(
    dist_pool, tmp_path, kind
) -> None:
    report = _run(dist_pool, kind, [3, 6], tmp_path, "some")
    got = (report["iterations"]["optimizer_steps"], report["iterations"]["skipped"])
    assert got == (STEPS - 2, 2), f"{kind}: want (steps, skipped) {(STEPS - 2, 2)}, got {got}"
    assert "scaler_skipped" not in [f["check"] for f in report["findings"]], (
        f"{kind}: two skips in {STEPS} iterations are a scaler doing its work, not a finding: {report['findings']}"
    )
    on = dist_pool(2).run(scaled_training, kind, [3, 6], str(tmp_path / "on"))
    off = dist_pool(2).run(scaled_training, kind, [3, 6], "")
    for rank, (a, b) in enumerate(zip(on, off, strict=True)):
        same = [torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True)]
        assert all(same), f"{kind}, rank {rank}: an escalated run's weights differ with telemetry on and off: {same}"


@pytest.mark.parametrize("kind", KINDS)
def test_a_float16_reduce_that_overflows_is_named_as_the_reduce(dist_pool, tmp_path, kind) -> None:
    """pytorch/pytorch#123362: grads finite on every rank, their float16 sum over ranks is not. On
    4 ranks: torch FSDP2 divides each rank's grads by 2 before summing there (by the world size on
    2 ranks, where no sum of finite halves overflows)."""
    report = _run(dist_pool, kind, [], tmp_path, "reduce", world=4, reduce_fp16=True)
    origin = report["origin"]
    got = None if origin is None else (origin["step"], origin["stage"], origin["where"], origin["dtype"])
    assert got == (3, "reduce", "blocks.0", "float16"), f"{kind}: want (3, reduce, blocks.0, float16), got {got}"
    assert "reduce_dtype=torch.float32" in report["findings"][0]["advice"], report["findings"][0]


def backward_only(kind: str, trace_dir: str) -> None:
    """Three backward passes through an adapted optimizer's model, and no optimizer step."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    settings = {
        "FSDP_PATCH_TELEMETRY": "1",
        "FSDP_PATCH_TRACE_DIR": trace_dir,
        "FSDP_PATCH_SUMMARY": "none",
        "OTEL_TRACES_EXPORTER": None,
        "OTEL_METRICS_EXPORTER": None,
    }
    with environment(**settings):
        reset_otel()
        model = _shard(models.make_model(0), kind)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fully_shard_optimizer(optimizer)
        for tokens in models.make_batches(3):
            models.lm_loss(model, models.rank_slice(tokens, rank, world)).backward()
        from fsdp_patch import telemetry

        telemetry.shutdown()
        del optimizer, model
        gc.collect()
        reset_otel()


@pytest.mark.parametrize("kind", KINDS)
def test_backward_passes_without_any_optimizer_step_are_named(dist_pool, tmp_path, kind) -> None:
    trace_dir = tmp_path / kind
    os.makedirs(trace_dir, exist_ok=True)
    dist_pool(2).run(backward_only, kind, str(trace_dir))
    report = _report(trace_dir)
    got = ([f["check"] for f in report["findings"]], report["iterations"]["backward_without_steps"])
    assert got == (["no_optimizer_steps"], 3), f"{kind}: want 3 backward passes named without a step, got {got}"
