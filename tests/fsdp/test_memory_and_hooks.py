"""Unsharded storage over a step, collectives per phase, gradient sync and unused parameters.

With ``reshard_after_forward=True`` a rank holds only its shards between and around forward and
backward: forward gathers each group once and frees it, backward gathers it again, reduce-
scatters once per group and frees it. With ``reshard_after_forward=False`` the gathered storage
survives forward and backward needs no gather. No-grad (eval) forwards always reshard; a frozen
unit that backward passes through is freed again; ``set_requires_gradient_sync(False)`` skips the
reduce-scatter.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.fsdp.sharded_views import count_collectives, difference, shard_storage_facts, unsharded_bytes, world
from tests.fsdp.transformer_variants import MICROBATCH, build_model
from tests.models import lm_loss, make_batches, rank_slice

WORLD_SIZE = 2  # collectives are skipped at world size 1


def memory_run() -> dict[str, Any]:
    """Unsharded storage across forward/backward/step, collectives per phase, eval resharding."""
    from fsdp_patch import FSDPModule, parameter_groups

    rank, world_size = world()
    facts: dict[str, Any] = {}
    tokens = rank_slice(make_batches(1, batch=MICROBATCH)[0], rank, world_size)

    for reshard in (True, False):
        model = build_model("plain")
        for block in model.blocks:
            from fsdp_patch import fully_shard

            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen_in_forward: dict[str, int] = {}
        seen_in_backward: dict[str, int] = {}

        def stored(module: nn.Module) -> int:
            return sum(g.unsharded_storage_bytes() for g in module.fsdp_parameter_groups)

        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                # Prepended, this forward hook runs before fully_shard's post-forward.
                module.register_forward_hook(
                    lambda m, a, o, name=name: seen_in_forward.__setitem__(name, stored(m)), prepend=True
                )
                # A hook on an unsharded parameter runs when backward computes its grad.
                module.fsdp_parameter_groups[0].unsharded_params[0].register_hook(
                    lambda g, name=name, m=module: seen_in_backward.__setitem__(name, stored(m))
                )
        phase: dict[str, Any] = {"init": unsharded_bytes(model)}
        with count_collectives() as fwd:
            loss = lm_loss(model, tokens)
        phase["after_forward"] = unsharded_bytes(model)
        with count_collectives() as bwd:
            loss.backward()
        phase["after_backward"] = unsharded_bytes(model)
        opt.step()
        phase["after_step"] = unsharded_bytes(model)
        phase["storage_after_step"] = shard_storage_facts(model)
        phase["expected_unsharded"] = {
            f"{name or '<root>'}[{i}]": g.layout.unsharded_numel * g.compute_weight.element_size()
            for name, module in model.named_modules()
            if isinstance(module, FSDPModule)
            for i, g in enumerate(module.fsdp_parameter_groups)
        }
        phase["seen_in_forward"] = dict(seen_in_forward)
        phase["seen_in_backward"] = dict(seen_in_backward)
        phase["forward_collectives"] = dict(fwd)
        phase["backward_collectives"] = dict(bwd)
        phase["groups"] = len(parameter_groups(model))
        # Inference: no_grad (and eval) forward reshards even without reshard_after_forward.
        model.eval()
        with torch.no_grad():
            eval_logits = model(tokens[:, :-1])
        phase["after_no_grad_forward"] = unsharded_bytes(model)
        model.train()
        with torch.no_grad():
            phase["no_grad_vs_grad_mode_diff"] = difference(eval_logits, model(tokens[:, :-1]))
        # The next training step still works and is reduce-scattered normally.
        opt.zero_grad()
        lm_loss(model, tokens).backward()
        phase["after_second_backward"] = unsharded_bytes(model)
        phase["grads_missing"] = [n for n, p in model.named_parameters() if p.grad is None]
        facts[f"reshard_{reshard}"] = phase

    # Frozen block: backward re-gathers it for its input grads and must free it again.
    model = build_model("frozen")
    from tests.models import shard_model

    shard_model(model)
    lm_loss(model, tokens).backward()
    facts["frozen_after_backward"] = unsharded_bytes(model)
    facts["frozen_groups"] = [
        (g.requires_grad, g.main_grad is None, g.grads_dtype, all(p.grad is None for p in g.params))
        for g in parameter_groups(model)
    ]

    # Gradient sync off: no reduce-scatter, no grads installed, until the synced microbatch.
    model = shard_model(build_model("plain"))
    model.set_requires_gradient_sync(False)
    with count_collectives() as nosync:
        lm_loss(model, tokens).backward()
    facts["nosync_collectives"] = dict(nosync)
    facts["nosync_grads_installed"] = [n for n, p in model.named_parameters() if p.grad is not None]
    facts["nosync_after_backward"] = unsharded_bytes(model)
    model.set_requires_gradient_sync(True)
    with count_collectives() as sync:
        lm_loss(model, tokens).backward()
    facts["sync_collectives"] = dict(sync)
    facts["sync_groups"] = sum(g.requires_grad for g in parameter_groups(model))
    facts["sync_grads_missing"] = [n for n, p in model.named_parameters() if p.grad is None]
    try:
        model.set_requires_gradient_sync("no")  # type: ignore[arg-type]
        facts["sync_bad_arg"] = None
    except TypeError as exc:
        facts["sync_bad_arg"] = str(exc)
    return facts


@pytest.fixture(scope="module")
def memory(run_once) -> list[dict]:
    return run_once(WORLD_SIZE, memory_run)


def _all_zero(sizes: dict[str, int]) -> bool:
    return bool(sizes) and all(v == 0 for v in sizes.values())


def test_reshard_after_forward_keeps_only_shards_between_uses(memory) -> None:
    for facts in memory:
        phase = facts["reshard_True"]
        expected = phase["expected_unsharded"]
        assert all(v > 0 for v in expected.values())
        for when in ("init", "after_forward", "after_backward", "after_step", "after_second_backward"):
            assert _all_zero(phase[when]), f"unsharded storage left {when}: {phase[when]}"
        # Each unit was gathered inside its forward and again inside its backward.
        by_unit = {k.split("[")[0]: v for k, v in expected.items()}
        assert phase["seen_in_forward"] == {("" if k == "<root>" else k): v for k, v in by_unit.items()}
        assert phase["seen_in_backward"] == phase["seen_in_forward"]
        storage = phase["storage_after_step"]
        outside = storage["params_outside_main_buffers"]
        assert outside == [], f"parameters whose local data are outside their group's buffer: {outside}"
        assert storage["param_storage_bytes"] == storage["shard_bytes_expected"]
        assert storage["unsharded_param_storage_bytes"] == 0


def test_reshard_after_forward_false_keeps_gathered_weights_until_backward(memory) -> None:
    for facts in memory:
        phase = facts["reshard_False"]
        assert phase["after_forward"] == phase["expected_unsharded"]
        for when in ("init", "after_backward", "after_step", "after_second_backward"):
            assert _all_zero(phase[when]), f"unsharded storage left {when}: {phase[when]}"


def test_collectives_per_phase(memory) -> None:
    for facts in memory:
        on, off = facts["reshard_True"], facts["reshard_False"]
        groups = on["groups"]
        assert on["forward_collectives"] == {"all_gather": groups, "reduce_scatter": 0}
        assert on["backward_collectives"] == {"all_gather": groups, "reduce_scatter": groups}
        assert off["forward_collectives"] == {"all_gather": groups, "reduce_scatter": 0}
        assert off["backward_collectives"] == {"all_gather": 0, "reduce_scatter": groups}


def test_no_grad_forward_reshards(memory) -> None:
    for facts in memory:
        for reshard in (True, False):
            phase = facts[f"reshard_{reshard}"]
            assert _all_zero(phase["after_no_grad_forward"]), phase["after_no_grad_forward"]
            diff = phase["no_grad_vs_grad_mode_diff"]
            assert diff is None, f"reshard={reshard}: eval no_grad logits differ from train-mode no_grad ones: {diff}"
            missing = phase["grads_missing"]
            assert missing == [], f"reshard={reshard}: training after an eval forward lost grads of {missing}"


def test_frozen_unit_is_freed_after_backward(memory) -> None:
    for facts in memory:
        assert _all_zero(facts["frozen_after_backward"]), facts["frozen_after_backward"]
        # (requires_grad, no main-grad buffer, grads_dtype, every .grad None): a frozen group
        # allocates no main-grad buffer, though its grads dtype is resolved for a later unfreeze.
        trainable, frozen = (True, False, torch.float32, False), (False, True, torch.float32, True)
        assert sorted(facts["frozen_groups"], key=repr) == sorted([trainable, trainable, frozen, frozen], key=repr)


def test_set_requires_gradient_sync_false_skips_reduce_scatter(memory) -> None:
    for facts in memory:
        assert facts["nosync_collectives"]["reduce_scatter"] == 0
        installed = facts["nosync_grads_installed"]
        assert installed == [], f"grads of {installed} installed although the reduce-scatter was skipped"
        assert _all_zero(facts["nosync_after_backward"])
        assert facts["sync_collectives"]["reduce_scatter"] == facts["sync_groups"]
        assert facts["sync_grads_missing"] == [], f"no grads after the synced backward: {facts['sync_grads_missing']}"
        assert "must be a bool" in facts["sync_bad_arg"]


def unused_run() -> dict[str, Any]:
    """Parameters no rank uses, and a parameter only some ranks use (rank-dependent control flow)."""
    from fsdp_patch import fully_shard

    rank, world_size = world()

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(11)
            self.shared = nn.Linear(4, 4)
            self.odd_only = nn.Linear(4, 4)  # used by odd ranks only
            self.never = nn.Linear(4, 3)  # used by nobody

        def forward(self, x: torch.Tensor, use_odd: bool) -> torch.Tensor:
            h = self.shared(x)
            if use_odd:
                h = h + self.odd_only(h)
            return h

    model = Branchy()
    refs = []
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + r)) for r in range(world_size)]
    for r in range(world_size):
        ref = Branchy()
        ref(xs[r], r % 2 == 1).square().sum().backward()
        refs.append(ref)
    fully_shard(model)
    model(xs[rank], rank % 2 == 1).square().sum().backward()
    facts = {}
    for name, p in model.named_parameters():
        expected = torch.zeros_like(p.full_tensor())
        for ref in refs:
            g = ref.get_parameter(name).grad
            if g is not None:
                expected += g
        expected /= world_size
        if p.grad is None:
            facts[name] = {
                "grad_is_none": True,
                "reference_grads": [ref.get_parameter(name).grad is not None for ref in refs],
            }
            continue
        facts[name] = {
            "grad_is_none": False,
            "grad_is_dtensor": isinstance(p.grad, DTensor),
            "max_abs_err": (p.grad.full_tensor() - expected).abs().max().item(),
            "all_zero": bool((p.grad.full_tensor() == 0).all()),
        }
    return facts


@pytest.mark.parametrize("world_size", (2, 4))
def test_unused_and_rank_dependent_parameters(run_once, world_size: int) -> None:
    """A parameter some ranks skip still takes part in the collectives (no hang) and gets the
    average of the ranks' grads on every rank; one no rank uses keeps ``None``, as in the
    unsharded model."""
    per_rank = run_once(world_size, unused_run)
    for rank, facts in enumerate(per_rank):
        for name in ("never.weight", "never.bias"):
            got = facts[name]
            assert got["grad_is_none"], f"rank {rank}: {name} got a grad, though no rank used it: {got}"
            assert got["reference_grads"] == [False] * world_size, (
                f"rank {rank}: {name}'s reference grads {got['reference_grads']}"
            )
        for name, grad in facts.items():
            if name.startswith("never."):
                continue
            assert not grad["grad_is_none"] and grad["grad_is_dtensor"], f"rank {rank}: {name}: {grad}"
            assert grad["max_abs_err"] <= 1e-6, (
                f"rank {rank}: {name}: differs from the ranks' average by {grad['max_abs_err']}"
            )
        assert not facts["odd_only.weight"]["all_zero"], f"rank {rank}: odd_only.weight's grad is all zero"
