"""bf16 compute copy, fp32 main weights, bf16 main grads (``model.bfloat16()`` before
``fully_shard``, default policy), stepped by hand on the group buffers and through the
optimizer adapter; and bf16 compute with fp32 main grads, stepped by torch's SGD directly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tests.fsdp.sharded_views import difference, full, full_params, rank0, stale_compute_copies, world
from tests.fsdp.transformer_variants import MICROBATCH
from tests.models import lm_loss, make_batches, make_model, rank_slice

WORLD_SIZE = 2
STEPS = 5
BF16_LOSS_TOL = 0.03  # bf16 keeps 8 mantissa bits: ~0.4% of a loss of ~3.7, plus drift over steps


def _hand_sgd(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """SGD on main weights from main grads cast to fp32, then one refresh per group."""
    from fsdp_patch import parameter_groups

    facts = []
    for group in parameter_groups(model):
        grad32 = group.main_grad.to(torch.float32)
        group.main_weight.add_(grad32, alpha=-lr)
        written = group.refresh_compute_weight()
        facts.append(
            {
                "written": written,
                "expected_written": group.compute_weight.numel() * group.compute_weight.element_size(),
                "compute_vs_cast": difference(group.compute_weight, group.main_weight.to(group.compute_dtype)),
                "main_dtype": str(group.main_weight.dtype),
            }
        )
    return facts


def mixed_precision_run(steps: int) -> dict[str, Any]:
    from torch.utils._python_dispatch import TorchDispatchMode

    from fsdp_patch import MixedPrecisionPolicy, parameter_groups
    from tests.models import shard_model

    rank, world_size = world()
    batches = make_batches(steps, batch=MICROBATCH)
    out: dict[str, Any] = {}

    # --- bf16 compute, fp32 main, bf16 main grads (default), stepped by hand.
    model = shard_model(make_model(seed=0).bfloat16())
    initial = full_params(model)
    losses, step_facts, grad_facts = [], [], []
    for step in range(steps):
        loss = lm_loss(model, rank_slice(batches[step], rank, world_size))
        loss.backward()
        losses.append(loss.item())
        grad_facts.append(
            {
                n: (
                    isinstance(p.grad, DTensor),
                    tuple(p.grad.placements),
                    str(p.grad.dtype),
                    str(p.dtype),
                    str(p.grad_dtype),
                )
                for n, p in model.named_parameters()
            }
        )
        step_facts.append(_hand_sgd(model, lr=0.1))
        model.zero_grad(set_to_none=True)
    out["bf16_losses"] = losses
    out["bf16_grad_facts"] = grad_facts
    out["bf16_step_facts"] = step_facts
    out["bf16_params"] = rank0(full_params(model))
    out["bf16_initial_params"] = rank0(initial)
    out["bf16_groups"] = [
        (str(g.main_weight.dtype), str(g.compute_weight.dtype), str(g.grads_dtype)) for g in parameter_groups(model)
    ]

    # Refresh is one cast per group: count aten ops it runs.
    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    refresh_ops = []
    for group in parameter_groups(model):
        with Ops() as mode:
            group.refresh_compute_weight()
        refresh_ops.append(mode.ops)
    out["refresh_ops"] = refresh_ops

    # Forward gathers the compute copy as is (no cast from main): make the compute copy differ
    # from the main weights and look at what forward sees.
    gathered: dict[str, Any] = {}
    block = model.blocks[0]
    group = block.fsdp_parameter_groups[0]
    with torch.no_grad():
        group.compute_weight.mul_(2)  # exact in bf16
    expected_weight = full(block.fc1.weight).to(torch.bfloat16) * 2

    def look(module: nn.Module, args: Any, output: Any) -> None:
        gathered["dtype"] = str(module.fc1.weight.dtype)
        gathered["is_dtensor"] = isinstance(module.fc1.weight, DTensor)
        gathered["vs_compute_copy"] = difference(module.fc1.weight.detach(), expected_weight)

    handle = block.register_forward_hook(look, prepend=True)
    with torch.no_grad():
        model(batches[0][:1, :-1])
    handle.remove()
    out["forward_sees"] = gathered
    # A change of the main weights outside any adapter (here: a manual edit) is picked up.
    with torch.no_grad():
        group.main_weight.mul_(1.0)
    handle = block.register_forward_hook(look, prepend=True)
    expected_weight = full(block.fc1.weight).to(torch.bfloat16)
    with torch.no_grad():
        model(batches[0][:1, :-1])
    handle.remove()
    out["forward_after_main_edit"] = dict(gathered)
    # ... and so is an in-place update through a DTensor parameter (as a torch optimizer does).
    with torch.no_grad():
        block.fc1.weight.add_(0.5)
    handle = block.register_forward_hook(look, prepend=True)
    expected_weight = full(block.fc1.weight).to(torch.bfloat16)
    with torch.no_grad():
        model(batches[0][:1, :-1])
    handle.remove()
    out["forward_after_param_update"] = dict(gathered)

    # --- bf16 compute with fp32 main grads: torch's SGD steps the main weights directly.
    model = shard_model(make_model(seed=0).bfloat16(), mp_policy=MixedPrecisionPolicy(main_grads_dtype=torch.float32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses32 = []
    for step in range(steps):
        loss = lm_loss(model, rank_slice(batches[step], rank, world_size))
        loss.backward()
        losses32.append(loss.item())
        out["fp32_grads_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
        opt.step()
        for g in parameter_groups(model):
            g.refresh_compute_weight()
        opt.zero_grad()
    out["fp32grads_losses"] = losses32
    out["fp32grads_stale_compute_copies"] = stale_compute_copies(parameter_groups(model), torch.bfloat16)

    # --- the optimizer adapter, when it is there: same SGD as the hand-written step.
    try:
        from fsdp_patch.optimizer import fully_shard_optimizer
    except ImportError as exc:
        out["adapter"] = f"missing: {exc}"
    else:
        model = shard_model(make_model(seed=0).bfloat16())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fully_shard_optimizer(opt)
        adapter_losses = []
        for step in range(steps):
            loss = lm_loss(model, rank_slice(batches[step], rank, world_size))
            loss.backward()
            adapter_losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        out["adapter"] = {
            "losses": adapter_losses,
            "params": rank0(full_params(model)),
            "stale_compute_copies": stale_compute_copies(parameter_groups(model), torch.bfloat16),
            "grads_after_zero": [n for n, p in model.named_parameters() if p.grad is not None],
            "main_dtypes": sorted({str(g.main_weight.dtype) for g in parameter_groups(model)}),
        }
    return out


@pytest.fixture(scope="module")
def mixed(run_once) -> list[dict]:
    return run_once(WORLD_SIZE, mixed_precision_run, STEPS)


@pytest.fixture(scope="module")
def fp32_reference_losses() -> list[float]:
    """Single-process fp32 SGD on the full batches, the losses the bf16 runs should track."""
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for tokens in make_batches(STEPS, batch=MICROBATCH):
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
                assert group["main_dtype"] == "torch.float32", f"main weights in {group['main_dtype']}"
                diff = group["compute_vs_cast"]
                assert diff is None, f"the compute copy is not the main weights cast: {diff}"
                got, want = group["written"], group["expected_written"]
                assert got == want > 0, f"refresh wrote {got} bytes, want {want}"


def test_refresh_is_one_cast_per_group(mixed) -> None:
    for facts in mixed:
        assert facts["refresh_ops"] == [["aten.copy_.default"]] * 3


def test_main_weights_keep_fp32_precision(mixed) -> None:
    params, initial = mixed[0]["bf16_params"], mixed[0]["bf16_initial_params"]
    moved = [n for n in params if not torch.equal(params[n], initial[n])]
    assert len(moved) == len(params), f"unchanged by training: {sorted(set(params) - set(moved))}"
    # SGD updates accumulated in fp32: the main weights are no longer all bf16-representable.
    off_grid = [n for n, p in params.items() if not torch.equal(p, p.to(torch.bfloat16).float())]
    assert off_grid, "main weights look like bf16 values: updates were not kept in fp32"
    dtypes = {n: p.dtype for n, p in params.items() if p.dtype != torch.float32}
    assert dtypes == {}, f"main weights not in fp32: {dtypes}"


def test_forward_gathers_the_compute_copy_without_a_cast(mixed) -> None:
    for facts in mixed:
        seen = facts["forward_sees"]
        assert seen["dtype"] == "torch.bfloat16" and not seen["is_dtensor"]
        diff = seen["vs_compute_copy"]
        assert diff is None, f"forward did not use the (modified) compute copy as is: {diff}"
        # A change of the main weights outside the optimizer is refreshed before the next gather.
        diff = facts["forward_after_main_edit"]["vs_compute_copy"]
        assert diff is None, f"forward after an edit of the main weights: {diff}"
        # So is an in-place update through a sharded DTensor parameter.
        diff = facts["forward_after_param_update"]["vs_compute_copy"]
        assert diff is None, f"forward after an update through the DTensor parameter: {diff}"


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
        stale = facts["fp32grads_stale_compute_copies"]
        assert stale == {}, f"compute copies not the main weights cast: {stale}"


def test_optimizer_adapter_steps_like_the_hand_written_step(mixed) -> None:
    """``fully_shard_optimizer`` around torch's SGD: casts bf16 main grads to fp32, steps the
    fp32 main weights and refreshes the compute copy, bitwise as the hand-written step."""
    adapter = mixed[0]["adapter"]
    assert isinstance(adapter, dict), adapter
    assert adapter["losses"] == mixed[0]["bf16_losses"]
    for name, value in adapter["params"].items():
        diff = difference(value, mixed[0]["bf16_params"][name])
        assert diff is None, f"{name}: adapter's step differs from the hand-written one: {diff}"
    for facts in mixed:
        stale = facts["adapter"]["stale_compute_copies"]
        assert stale == {}, f"compute copies not the main weights cast: {stale}"
        assert facts["adapter"]["main_dtypes"] == ["torch.float32"], facts["adapter"]["main_dtypes"]
        kept = facts["adapter"]["grads_after_zero"]
        assert kept == [], f"grads left after the adapter's zero_grad: {kept}"
