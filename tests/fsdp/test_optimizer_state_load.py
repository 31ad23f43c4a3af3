"""Resuming from a DCP checkpoint the way FSDP2 scripts do it, without ``init_optimizer_state``.

Train, ``dcp.save`` the model and optimizer state dicts, keep training (the uninterrupted run).
Then build a differently initialized model and a fresh AdamW, take the state-dict templates with
torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` (nothing called before), ``dcp.load``,
``set_model_state_dict`` / ``set_optimizer_state_dict``, and train the remaining steps. With bf16
compute (main grads bf16, main weights fp32) torch's own initialization cannot assign its fp32 zero
grads to the sharded parameters; the resumed run must still equal the uninterrupted one and
FSDP2's resumed run bitwise, with either compute-copy lifetime. fp32 on 4 ranks (uneven shards): like the unsharded model to 1e-5.
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tests.fsdp import pattern_models
from tests.fsdp.sharded_views import full_params, world
from tests.fsdp.training_runs import Run, assert_same_training

SAVE_AT, TOTAL = 2, 4
TOL = 1e-5
BF16 = torch.bfloat16


def _make(
    impl: str, seed: int, dtype: torch.dtype | None, compute_copy: str = "persistent"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = pattern_models.shard(
        pattern_models.Net(),
        impl,
        reshard_after_forward=None,
        dtype=dtype,  # type: ignore[arg-type]
        compute_copy=compute_copy,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if impl == "ours":
        from fsdp_patch.optimizer import fully_shard_optimizer

        fully_shard_optimizer(optimizer)
    return model, optimizer


def _train(
    impl: str, model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, dtype: torch.dtype | None
) -> list[float]:
    rank, world_size = (0, 1) if impl == "reference" else world()
    data = pattern_models.data(TOTAL)
    losses = []
    for step in steps:
        x, y = (pattern_models.rows(t, rank, world_size) for t in data[step])
        if impl == "ours" and dtype is not None:
            x = x.to(dtype)  # FSDP2 casts its forward inputs itself
        loss = pattern_models.mse(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def save_and_resume(
    impl: str, path: str, dtype: torch.dtype | None, compute_copy: str = "persistent"
) -> tuple[Run, Run]:
    """(uninterrupted, resumed): the last TOTAL - SAVE_AT steps of each."""
    model, optimizer = _make(impl, 0, dtype, compute_copy)
    _train(impl, model, optimizer, range(SAVE_AT), dtype)
    if impl != "reference":
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
            checkpoint_id=path,
        )
    uninterrupted = Run(_train(impl, model, optimizer, range(SAVE_AT, TOTAL), dtype), full_params(model))
    if impl == "reference":
        return uninterrupted, uninterrupted
    model, optimizer = _make(impl, 123, dtype, compute_copy)  # other weights, no optimizer state
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    resumed = Run(_train(impl, model, optimizer, range(SAVE_AT, TOTAL), dtype), full_params(model))
    return uninterrupted, resumed


def bf16_on_ranks(path: str) -> None:
    fsdp2_uninterrupted, fsdp2_resumed = save_and_resume("fsdp2", f"{path}/fsdp2", BF16)
    assert_same_training(fsdp2_resumed, fsdp2_uninterrupted, 0.0, "FSDP2 resumed against uninterrupted")
    for compute_copy in ("persistent", "per_gather"):
        uninterrupted, resumed = save_and_resume("ours", f"{path}/ours_{compute_copy}", BF16, compute_copy)
        assert_same_training(
            uninterrupted, fsdp2_uninterrupted, 0.0, f"fully_shard ({compute_copy}) uninterrupted against FSDP2"
        )
        assert_same_training(resumed, uninterrupted, 0.0, f"fully_shard ({compute_copy}) resumed against uninterrupted")
        # The loaded weights reach the compute copy of either lifetime: resumed equals FSDP2's resumed run.
        assert_same_training(resumed, fsdp2_resumed, 0.0, f"fully_shard ({compute_copy}) resumed against FSDP2 resumed")


def fp32_on_ranks(path: str) -> None:
    _, reference = save_and_resume("reference", f"{path}/reference", None)
    for impl in ("fsdp2", "ours"):
        _, resumed = save_and_resume(impl, f"{path}/{impl}", None)
        assert_same_training(resumed, reference, TOL, f"{impl} resumed against the unsharded model", sharded_want=False)


def test_bf16_resume_without_init_optimizer_state_equals_fsdp2(dist_pool, tmp_path) -> None:
    dist_pool(2).run(bf16_on_ranks, str(tmp_path))


def test_fp32_resume_on_uneven_shards_trains_like_the_reference(dist_pool, tmp_path) -> None:
    dist_pool(4).run(fp32_on_ranks, str(tmp_path))


def torch_path_scope_on_ranks() -> None:
    """torch's ``_init_optim_state`` is wrapped while a group whose grad dtype differs from its
    main-weight dtype lives; optimizers over other parameters get torch's own. (Whether it is
    restored exactly after the last such group is ``ScopedPatch``'s, tested on its own: other
    tests' groups may still be alive in this process.)"""
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    from fsdp_patch import parameter_groups
    from fsdp_patch.module import dcp_optimizer_state

    gc.collect()
    patch = dcp_optimizer_state._PATCH
    held_before = patch.live
    fp32_model, _ = _make("ours", 0, None)
    assert patch.live == held_before, (
        f"fp32 groups (grads torch's path accepts) hold the wrapper: {patch.live} live, {held_before} before"
    )
    model, optimizer = _make("ours", 0, BF16)
    groups = len(parameter_groups(model))
    assert patch.live >= groups, f"{patch.live} groups hold the wrapper, want at least the model's {groups}"
    wrapped = torch_state_dict._init_optim_state
    assert hasattr(wrapped, "__wrapped__"), (
        f"torch's _init_optim_state not wrapped while a bf16 group lives: {wrapped!r}"
    )
    # An optimizer over plain parameters takes torch's path: its lr=0 step leaves step 1.
    plain = nn.Linear(3, 2)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    steps = [float(s["step"]) for s in get_optimizer_state_dict(plain, plain_optimizer)["state"].values()]
    assert steps == [1.0, 1.0], f"plain optimizer's state after torch's initialization: steps {steps}"
    # The sharded one gets the neutral initialization: step 0, the main weights untouched.
    before = full_params(model)
    steps = sorted({float(s["step"]) for s in get_optimizer_state_dict(model, optimizer)["state"].values()})
    assert steps == [0.0], f"sharded optimizer's state after initialization: steps {steps}"
    after = full_params(model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert not changed, f"initializing the optimizer state changed {changed}"
    refs = [weakref.ref(group) for group in parameter_groups(model)]
    del model, optimizer, fp32_model
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    assert alive == 0, f"{alive} of the model's groups outlived it"
    if patch.live == 0:
        restored = torch_state_dict._init_optim_state
        assert not hasattr(restored, "__wrapped__"), (
            f"after the last bf16 group was freed: {restored!r}, want torch's own"
        )


def test_torch_initialization_is_wrapped_only_while_needed(dist_pool) -> None:
    dist_pool(2).run(torch_path_scope_on_ranks)


def test_init_optimizer_state_first_still_resumes_bitwise(dist_pool, tmp_path) -> None:
    """The API page's order (``init_optimizer_state`` before taking the templates) gives the same."""
    dist_pool(2).run(init_first_on_ranks, str(tmp_path))


def init_first_on_ranks(path: str) -> None:
    from fsdp_patch.optimizer import init_optimizer_state

    uninterrupted, _ = save_and_resume("ours", f"{path}/ours", BF16)
    model, optimizer = _make("ours", 123, BF16)
    init_optimizer_state(optimizer)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=f"{path}/ours")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    resumed = Run(_train("ours", model, optimizer, range(SAVE_AT, TOTAL), BF16), full_params(model))
    assert_same_training(resumed, uninterrupted, 0.0, "resumed after init_optimizer_state against uninterrupted")
