"""bf16 compute copy, fp32 main weights, bf16 main grads (``model.bfloat16()`` before
``fully_shard``, default policy), stepped by hand on the group buffers and through the
optimizer adapter; and bf16 compute with fp32 main grads, stepped by torch's SGD directly.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from tests.fsdp import rank_fns
from tests.models import lm_loss, make_batches, make_model

WORLD_SIZE = 2
STEPS = 5
BF16_LOSS_TOL = 0.03  # bf16 keeps 8 mantissa bits: ~0.4% of a loss of ~3.7, plus drift over steps


@pytest.fixture(scope="module")
def mixed(run_once) -> list[dict]:
    return run_once(WORLD_SIZE, rank_fns.mixed_precision_run, STEPS)


@pytest.fixture(scope="module")
def fp32_reference_losses() -> list[float]:
    """Single-process fp32 SGD on the full batches, the losses the bf16 runs should track."""
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for tokens in make_batches(STEPS, batch=rank_fns.MICROBATCH):
        loss = lm_loss(model, tokens)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _global(per_rank: list[dict], key: str) -> list[float]:
    return [sum(r[key][s] for r in per_rank) / len(per_rank) for s in range(STEPS)]


def test_grads_are_bf16_dtensors_on_fp32_main_weights(mixed) -> None:
    for facts in mixed:
        assert len(facts["bf16_grad_facts"]) == STEPS
        for step in facts["bf16_grad_facts"]:
            for name, (is_dtensor, placements, grad_dtype, param_dtype, advertised) in step.items():
                assert is_dtensor and placements == (Shard(0),), name
                assert grad_dtype == "torch.bfloat16", name
                assert param_dtype == "torch.float32", name
                assert advertised == "torch.bfloat16", f"{name}: grad_dtype"
        assert (
            facts["bf16_groups"] == [("torch.float32", "torch.bfloat16", "torch.bfloat16")] * 3
        )  # main, compute, grads


def test_compute_copy_equals_main_weights_cast_after_each_refresh(mixed) -> None:
    for facts in mixed:
        for step in facts["bf16_step_facts"]:
            for group in step:
                assert group["main_dtype"] == "torch.float32"
                assert group["compute_equals_cast"]
                assert group["written"] == group["expected_written"] > 0


def test_refresh_is_one_cast_per_group(mixed) -> None:
    for facts in mixed:
        assert facts["refresh_ops"] == [["aten.copy_.default"]] * 3


def test_main_weights_keep_fp32_precision(mixed) -> None:
    params, initial = mixed[0]["bf16_params"], mixed[0]["bf16_initial_params"]
    moved = [n for n in params if not torch.equal(params[n], initial[n])]
    assert len(moved) == len(params)
    # SGD updates accumulated in fp32: the main weights are no longer all bf16-representable.
    off_grid = [n for n, p in params.items() if not torch.equal(p, p.to(torch.bfloat16).float())]
    assert off_grid, "main weights look like bf16 values: updates were not kept in fp32"
    assert all(p.dtype == torch.float32 for p in params.values())


def test_forward_gathers_the_compute_copy_without_a_cast(mixed) -> None:
    for facts in mixed:
        seen = facts["forward_sees"]
        assert seen["dtype"] == "torch.bfloat16" and not seen["is_dtensor"]
        assert seen["equals_compute_copy"], "forward did not use the (modified) compute copy as is"
        # A change of the main weights outside the optimizer is refreshed before the next gather.
        assert facts["forward_after_main_edit"]["equals_compute_copy"]
        # So is an in-place update through a sharded DTensor parameter.
        assert facts["forward_after_param_update"]["equals_compute_copy"]


def test_bf16_loss_curve_tracks_fp32_reference(mixed, fp32_reference_losses) -> None:
    bf16 = _global(mixed, "bf16_losses")
    fp32_grads = _global(mixed, "fp32grads_losses")
    for step, (ref, a, b) in enumerate(zip(fp32_reference_losses, bf16, fp32_grads, strict=True)):
        assert abs(a - ref) <= BF16_LOSS_TOL, f"step {step}: bf16 {a} vs fp32 {ref}"
        assert abs(b - ref) <= BF16_LOSS_TOL, f"step {step}: bf16 compute/fp32 grads {b} vs fp32 {ref}"
    # ... and it is really a bf16 run, not an fp32 one.
    assert max(abs(a - r) for a, r in zip(bf16, fp32_reference_losses, strict=True)) > 1e-6


def test_fp32_main_grads_with_bf16_compute(mixed) -> None:
    for facts in mixed:
        assert facts["fp32_grads_dtypes"] == ["torch.float32"]
        assert facts["fp32grads_compute_equals_cast"]


def test_optimizer_adapter_steps_like_the_hand_written_step(mixed) -> None:
    """``fully_shard_optimizer`` around torch's SGD: casts bf16 main grads to fp32, steps the
    fp32 main weights and refreshes the compute copy, bitwise as the hand-written step."""
    adapter = mixed[0]["adapter"]
    assert isinstance(adapter, dict), adapter
    assert adapter["losses"] == mixed[0]["bf16_losses"]
    for name, value in adapter["params"].items():
        assert torch.equal(value, mixed[0]["bf16_params"][name]), name
    for facts in mixed:
        assert facts["adapter"]["compute_equals_cast"]
        assert facts["adapter"]["main_dtypes"] == ["torch.float32"]
        assert all(facts["adapter"]["grads_after_zero"])
