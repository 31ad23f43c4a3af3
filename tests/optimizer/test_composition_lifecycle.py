"""The adapted optimizer as an object: copied, adapted twice, undone, freed.

- ``copy.deepcopy``, pickling (and ``torch.save``/``torch.load``) and ``copy.copy``: the copy
  is a plain, unadapted optimizer of the same class (``fsdp_patch/adapter/copying.py``);
  the original stays adapted;
- ``fully_shard_optimizer`` twice is harmless; the public undo restores the instance (with a
  learning-rate scheduler made before the adaptation, after it, or none);
- an adapted optimizer is freed like any other once unreferenced.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.optim import lr_scheduler as L

from fsdp_patch import parameter_group_of, parameter_groups, remove_fully_shard_optimizer
from fsdp_patch.adapter import adaptation_of
from fsdp_patch.optimizer import fully_shard_optimizer
from tests.optimizer.support import (
    BF16,
    OBSERVERS,
    OPTIMIZERS,
    HandCast,
    O,
    adapt,
    assert_compute_fresh,
    assert_grads_original,
    assert_same,
    backward,
    batches,
    build_model,
    compute_is_fresh,
    env,
    fsdp_params,
    grad_dtypes,
    grads_snapshot,
    main_weights,
    optimizer_state,
)


# ----------------------------------------------------------------------------- copies
def _assert_plain(copied: torch.optim.Optimizer, original: torch.optim.Optimizer, what: str) -> None:
    """``copied`` is an unadapted optimizer of ``original``'s class, with nothing of the adapter."""
    assert type(copied) is type(original), f"{what}: a {type(copied).__name__}, want {type(original).__name__}"
    assert adaptation_of(copied) is None, f"{what}: adapted ({adaptation_of(copied)})"
    ours = {"step", "zero_grad", "__deepcopy__", "__reduce_ex__"} & copied.__dict__.keys()
    assert not ours, f"{what}: instance attributes of the adapter {sorted(ours)}"
    hooks = (dict(copied._optimizer_step_pre_hooks), dict(copied._optimizer_step_post_hooks))
    assert hooks == ({}, {}), f"{what}: step (pre, post) hooks {hooks}"


def _assert_copy(tag: str, copied: torch.optim.Optimizer, opt: torch.optim.Optimizer, with_grads: bool) -> None:
    originals = [p for g in opt.param_groups for p in g["params"]]
    params = [p for g in copied.param_groups for p in g["params"]]
    _assert_plain(copied, opt, tag)
    assert len(params) == len(originals), f"{tag}: {len(params)} parameters, want {len(originals)}"
    for index, (p, q) in enumerate(zip(originals, params, strict=True)):
        assert q is not p and parameter_group_of(q) is None, f"{tag}: parameter {index} is not a new, unmanaged one"
        assert isinstance(q, DTensor) and q.placements == p.placements, (
            f"{tag}: parameter {index} is a {type(q).__name__} {getattr(q, 'placements', None)}, want {p.placements}"
        )
        assert_same(q.detach(), p.detach(), f"{tag}: parameter {index}'s values")
        assert copied.state[q]["exp_avg"] is not opt.state[p]["exp_avg"], f"{tag}: parameter {index}'s state is shared"
        if with_grads:
            assert q.grad is not None and q.grad is not p.grad, f"{tag}: parameter {index}'s grad not copied"
            assert q.grad_dtype == BF16, f"{tag}: parameter {index}'s grad_dtype {q.grad_dtype}, want {BF16}"
            assert_same(q.grad, p.grad, f"{tag}: parameter {index}'s grad")
        else:
            assert q.grad is None, f"{tag}: parameter {index} has a grad (torch never pickles them)"
    assert_same(optimizer_state(copied), optimizer_state(opt), f"{tag}: state vs the original's")
    unkeyed = [i for i, q in enumerate(params) if q not in copied.state]
    assert not unkeyed, f"{tag}: state not keyed by the copied parameters {unkeyed}"
    got = [{k: v for k, v in g.items() if k != "params"} for g in copied.param_groups]
    want = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert got == want, f"{tag}: hyperparameters {got}, want {want}"


def _copies(observer: str) -> None:
    data = batches(3)
    model, ref = build_model(), build_model()
    opt, ropt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](ref.parameters())
    recording = adapt(opt, observer)
    hand = HandCast(fsdp_params(ref))
    for tokens in data[:2]:
        for m in (model, ref):
            backward(m, tokens)
        opt.step()
        hand.step(ropt)
        opt.zero_grad()
        ropt.zero_grad()
    for m in (model, ref):
        backward(m, data[2])  # grads present while copying
    grads = grads_snapshot(model)
    _assert_copy("deepcopy", copy.deepcopy(opt), opt, with_grads=True)
    _assert_copy("pickle", pickle.loads(pickle.dumps(opt)), opt, with_grads=False)
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    _assert_copy("torch.save/load", torch.load(buffer, weights_only=False), opt, with_grads=False)
    shallow = copy.copy(opt)
    _assert_plain(shallow, opt, "copy.copy")
    assert shallow.param_groups[0]["params"][0] is opt.param_groups[0]["params"][0], "copy.copy: other parameters"
    assert shallow.state is opt.state, "copy.copy: another state"
    assert adaptation_of(opt) is not None, "original: no longer adapted after the copies"
    assert_same(grads_snapshot(model), grads, "original: grads after the copies")
    opt.step()
    hand.step(ropt)
    assert_same(main_weights(model), main_weights(ref), "original: next step vs reference")
    assert_grads_original(opt, "original: after the next step")
    assert_compute_fresh(model, "original: after the next step")
    if recording is not None:
        assert len(recording.steps) == 3, f"original: observer saw {len(recording.steps)} steps, want 3"


@pytest.mark.parametrize("observer", OBSERVERS)
def test_deepcopy_and_pickle_give_plain_optimizers(pool1: Any, observer: str) -> None:
    pool1.run(_copies, observer)


# ----------------------------------------------------------------------------- twice / undo
def _twice(observer: str) -> None:
    once, twice = build_model(), build_model()
    opt_once, opt_twice = OPTIMIZERS["adamw"](once.parameters()), OPTIMIZERS["adamw"](twice.parameters())
    adapt(opt_once, observer)
    recording = adapt(opt_twice, observer)
    adaptation = adaptation_of(opt_twice)
    snapshot = dict(opt_twice.__dict__)
    adapt(opt_twice, observer)
    with env(FSDP_PATCH_TELEMETRY=None):
        fully_shard_optimizer(opt_twice)  # and a third time, plain public call
    assert adaptation_of(opt_twice) is adaptation, f"another adaptation: {adaptation_of(opt_twice)}, was {adaptation}"
    assert opt_twice.__dict__.keys() == snapshot.keys(), (
        f"__dict__ keys {sorted(opt_twice.__dict__)}, was {sorted(snapshot)}"
    )
    replaced = sorted(k for k, v in snapshot.items() if opt_twice.__dict__[k] is not v)
    assert not replaced, f"__dict__ values replaced by the second call: {replaced}"
    hooks = (len(opt_twice._optimizer_step_pre_hooks), len(opt_twice._optimizer_step_post_hooks))
    assert hooks == (0, 0), f"(pre, post) step hooks {hooks}, want (0, 0)"
    for tokens in batches(2):
        for m, o in ((once, opt_once), (twice, opt_twice)):
            backward(m, tokens)
            o.step()
            o.zero_grad()
    assert_same(main_weights(twice), main_weights(once), "main weights vs a once-adapted optimizer's")
    if recording is not None:
        got, want = len([c for c in recording.casts if c[0] == "grads_cast"]), 2 * len(parameter_groups(twice))
        assert got == want, f"{got} grad casts in 2 steps, want {want} (one per group per step)"


@pytest.mark.parametrize("observer", OBSERVERS)
def test_fully_shard_optimizer_twice_is_harmless(pool1: Any, observer: str) -> None:
    pool1.run(_twice, observer)


def _undo(observer: str, scheduler: str) -> None:
    model = build_model()
    opt = O.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = L.StepLR(opt, step_size=1, gamma=0.5) if scheduler == "before" else None
    before = dict(opt.__dict__)
    # 1. Adapt and undo at once: the instance is exactly as before.
    adapt(opt, observer)
    remove_fully_shard_optimizer(opt)
    assert opt.__dict__.keys() == before.keys(), (
        f"immediate undo: __dict__ keys {sorted(opt.__dict__)}, was {sorted(before)}"
    )
    replaced = sorted(k for k, v in before.items() if opt.__dict__[k] is not v)
    assert not replaced, f"immediate undo: __dict__ values replaced: {replaced}"
    hooks = (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_step_post_hooks))
    assert hooks == ({}, {}), f"immediate undo: step (pre, post) hooks {hooks}"
    # 2. Adapt, train, undo.
    adapt(opt, observer)
    if scheduler == "after":
        sched = L.StepLR(opt, step_size=1, gamma=0.5)
    data = batches(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backward(model, data[0])
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        remove_fully_shard_optimizer(opt)
        remove_fully_shard_optimizer(opt)  # a no-op now
        # Keys torch adds without any adapter: the scheduler's wrapper marks _opt_called, and a
        # scheduler created after the adaptation installs its own `step` (it wraps our wrapper,
        # which stays inside it and passes calls through).
        torch_keys = {"_opt_called"} if sched is not None else set()
        if scheduler == "after":
            torch_keys.add("step")
        ours = opt.__dict__.keys() - before.keys() - torch_keys
        assert not ours, f"undo: keys of ours left in __dict__: {sorted(ours)}"
        replaced = sorted(k for k, v in before.items() if opt.__dict__[k] is not v)
        assert not replaced, f"undo: __dict__ values replaced: {replaced}"
        hooks = (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_step_post_hooks))
        assert hooks == ({}, {}), f"undo: step (pre, post) hooks {hooks}"
        assert adaptation_of(opt) is None, f"undo: still adapted ({adaptation_of(opt)})"
        # The optimizer is plain again: it steps the bf16 grads as they are, refreshes nothing.
        seen: list[set[torch.dtype]] = []
        opt.register_step_pre_hook(lambda o, a, k: seen.append(grad_dtypes(o)))
        backward(model, data[1])
        opt.step()
        if sched is not None:
            sched.step()
        assert seen == [{BF16}], f"after undo: grad dtypes the update saw {seen}, want [{{{BF16}}}]"
        assert not compute_is_fresh(model), "after undo: the compute copy was refreshed, by nothing but the adapter"
    warned = [str(w.message) for w in caught if "optimizer.step()" in str(w.message)]
    assert not warned, f"scheduler warnings: {warned}"


@pytest.mark.parametrize("scheduler", ["none", "before", "after"])
@pytest.mark.parametrize("observer", OBSERVERS)
def test_remove_fully_shard_optimizer_restores_the_instance(pool1: Any, observer: str, scheduler: str) -> None:
    pool1.run(_undo, observer, scheduler)


# ----------------------------------------------------------------------------- lifetime
def _freed() -> None:
    for observer in OBSERVERS:
        model = build_model()
        opt = OPTIMIZERS["adamw"](model.parameters())
        adapt(opt, observer)
        backward(model, batches(1)[0])
        opt.step()
        ref = weakref.ref(opt)
        del opt
        gc.collect()
        assert ref() is None, f"{observer}: the adapted optimizer outlived its last reference"


def test_adapted_optimizer_is_freed(pool1: Any) -> None:
    pool1.run(_freed)
