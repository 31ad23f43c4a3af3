"""The adapter's fast path (cached plan, reused cast buffer and DTensor views) stays correct.

Each scenario trains an adapted model and a hand-cast reference (an unadapted optimizer whose
grads the test casts by hand) side by side on 2 ranks, doing the same thing to both between
steps, and checks after every step: main weights and optimizer state bitwise equal to the
reference, the compute copy fresh, the grads the original bf16 main-grad views again. A step
pre-hook registered after the adaptation records the cast grads the update sees, so the checks
also tell whether the cast views were reused (same objects, same memory) or rebuilt.

Scenarios here: steps with ``zero_grad(set_to_none=True)`` and ``False``; ``add_param_group``;
grads replaced by the user; the optimizer's ``load_state_dict``; a model state-dict load and a DCP
load between steps; main weights written outside the adapter reaching the next forward. The cast
buffers' ownership and release: ``test_fast_path_buffers.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from fsdp_patch import parameter_group_of, parameter_groups
from tests.optimizer.fast_path_pairs import Pair, forward_loss
from tests.optimizer.support import (
    OBSERVERS,
    HandCast,
    assert_compute_fresh,
    assert_same,
    batches,
    fsdp_params,
    local,
    main_weights,
)


def _training_changes(observer: str, path: str) -> None:
    data = batches(9)
    # The optimizer starts with the blocks' parameters only; the rest is added later.
    pair = Pair(observer, params_of=lambda params: params[: len(params) // 2])
    first = fsdp_params(pair.opt)
    pair.step("step 1", data[0], zero=True)
    pair.step("step 2", data[1], zero=False)
    pair.spy.assert_reused(first, "after zero_grad(set_to_none=True)")
    pair.step("step 3", data[2], zero=True)
    pair.spy.assert_reused(first, "after zero_grad(set_to_none=False)")

    pair.both(lambda model, opt: opt.add_param_group({"params": list(model.parameters())[len(first) :]}))
    pair.step("add_param_group", data[3])
    added_groups = {parameter_group_of(q) for q in fsdp_params(pair.opt)[len(first) :]}
    unchanged = [p for p in first if parameter_group_of(p) not in added_groups]
    pair.spy.assert_reused(unchanged, "add_param_group: unchanged groups")
    uncast = [i for i, p in enumerate(fsdp_params(pair.opt)) if id(p) not in pair.spy.seen[-1]]
    assert not uncast, f"add_param_group: parameters {uncast} were not cast"

    def replace_grads(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        # A user's grads in place of two main-grad views: a DTensor and a scaled copy.
        params = fsdp_params(opt)
        for param in (params[0], params[-1]):
            param.grad = DTensor.from_local(
                local(param.grad).detach().clone() * 3,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )

    pair.step("grads replaced by the user", data[4], before_step=replace_grads)
    pair.step("after replaced grads", data[5])
    pair.spy.assert_reused(fsdp_params(pair.opt), "after replaced grads")

    states = {
        id(pair.opt): copy.deepcopy(pair.opt.state_dict()),
        id(pair.ref_opt): copy.deepcopy(pair.ref_opt.state_dict()),
    }
    pair.both(lambda model, opt: opt.load_state_dict(states[id(opt)]))
    pair.step("optimizer load_state_dict", data[6])
    pair.spy.assert_reused(fsdp_params(pair.opt), "optimizer load_state_dict")

    # Model state loaded between steps: through set_model_state_dict (copies into the parameters),
    # then by dcp.load (writes into the local shards of the state dict's tensors). The reference
    # is a fully_shard model too, so the compute copy's freshness is checked on its own.
    saved = {
        id(model): {k: v.clone() for k, v in get_model_state_dict(model).items()} for model in (pair.model, pair.ref)
    }
    weights_at_save = main_weights(pair.model)
    pair.step("before set_model_state_dict", data[7])
    pair.both(lambda model, opt: set_model_state_dict(model, saved[id(model)]))
    assert_same(main_weights(pair.model), weights_at_save, "set_model_state_dict: weights loaded")
    forward_loss(pair.model, data[7])
    assert_compute_fresh(pair.model, "set_model_state_dict, then a forward")
    pair.step("after set_model_state_dict", data[7])
    weights_at_save = main_weights(pair.model)
    for index, model in enumerate((pair.model, pair.ref)):
        dcp.save(get_model_state_dict(model), checkpoint_id=f"{path}/model{index}")
    pair.step("before dcp.load", data[8])
    for index, model in enumerate((pair.model, pair.ref)):
        dcp.load(get_model_state_dict(model), checkpoint_id=f"{path}/model{index}")
    assert_same(main_weights(pair.model), weights_at_save, "dcp.load: weights loaded in place")
    forward_loss(pair.model, data[8])
    assert_compute_fresh(pair.model, "dcp.load, then a forward")
    pair.step("after dcp.load", data[8])
    pair.spy.assert_reused(fsdp_params(pair.opt), "after the loads")


@pytest.mark.parametrize("observer", OBSERVERS)
def test_cached_views_stay_valid_across_changes(pool2: Any, observer: str, tmp_path: Any) -> None:
    pool2.run(_training_changes, observer, str(tmp_path))


def _external_writes() -> None:
    """Main weights written outside the adapter between steps reach the next forward, which
    casts each compute copy once."""
    data = batches(2)
    pair = Pair("null")
    pair.step("step", data[0])
    groups = parameter_groups(pair.model)

    def loss(model: torch.nn.Module) -> torch.Tensor:
        return forward_loss(model, data[1])

    versions = [g.compute_weight._version for g in groups]
    assert_same(loss(pair.model), loss(pair.ref), "forward vs the reference's")
    # A write need not show in any version counter: each forward casts every compute copy once.
    got, want = [g.compute_weight._version for g in groups], [v + 1 for v in versions]
    assert got == want, f"compute copies' versions after one forward: {got}, want {want} (one cast each)"
    writes = {
        "DTensor parameter edited in place": lambda model: model.head.weight.mul_(0.5),
        "main-weight buffer written": lambda model: parameter_groups(model)[0].main_weight.add_(0.25),
        "local shard written (as dcp.load does)": lambda model: local(model.blocks[0].fc1.weight).sub_(0.125),
    }
    for name, write in writes.items():
        for model in (pair.model, pair.ref):
            with torch.no_grad():
                write(model)
        HandCast(fsdp_params(pair.ref_opt)).refresh()
        assert_same(loss(pair.model), loss(pair.ref), f"{name}: next forward vs the reference's")
        assert_compute_fresh(pair.model, f"{name}, then a forward")


def test_main_weights_written_outside_the_adapter_reach_the_next_forward(pool2: Any) -> None:
    pool2.run(_external_writes)
