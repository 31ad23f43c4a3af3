"""The adapted optimizer composes with the rest of torch.optim and with copies.

- torch's instance and global step hooks still run, once per step, and see what the
  attachment documents (``wrapt_attachment.py``: every hook is inside the wrapped step, so
  all of them see the cast grads, and the post-hooks a compute copy not yet refreshed);
- ``torch.amp.GradScaler("cpu")``: a step skipped for an injected inf neither casts nor
  refreshes; the other steps equal a hand-cast reference unscaled the same way;
- ``state_dict()``/``load_state_dict()`` round trip into a new adapted optimizer;
- ``copy.deepcopy``, pickling (and ``torch.save``/``torch.load``) and ``copy.copy``: the copy
  is a plain, unadapted optimizer of the same class (``fsdp_patch/adapter/copying.py``);
  the original stays adapted;
- ``fully_shard_optimizer`` twice is harmless; the public undo restores the instance;
- the public path with ``FSDP_PATCH_TELEMETRY=1`` gives telemetry's observer to the same
  attachment and trains bitwise like telemetry off;
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
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import lr_scheduler as L
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fsdp_patch import parameter_group_of, parameter_groups, remove_fully_shard_optimizer
from fsdp_patch.adapter import NullObserver, adaptation_of
from fsdp_patch.optimizer import fully_shard_optimizer
from tests.models import lm_loss
from tests.optimizer.support import (
    BF16,
    FP32,
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
    local,
    local_tokens,
    main_weights,
    optimizer_state,
)

# ----------------------------------------------------------------------------- step hooks
# name: (grad dtypes seen, compute copy fresh); the same for every observer
EXPECTED_HOOKS = {
    "global_pre": ({FP32}, True),
    "pre_before": ({FP32}, True),
    "pre_after": ({FP32}, True),
    "post_before": ({FP32}, False),
    "post_after": ({FP32}, False),
    "global_post": ({FP32}, False),
}
HOOK_ORDER = ["global_pre", "pre_before", "pre_after", "post_before", "post_after", "global_post"]


def _step_hooks(observer: str) -> None:
    model = build_model()
    opt = OPTIMIZERS["adamw"](model.parameters())
    log: list[tuple[str, set[torch.dtype], bool]] = []

    def record(name: str) -> Any:
        return lambda o, args, kwargs: log.append((name, grad_dtypes(o), compute_is_fresh(model))) if o is opt else None

    opt.register_step_pre_hook(record("pre_before"))
    opt.register_step_post_hook(record("post_before"))
    adapt(opt, observer)
    opt.register_step_pre_hook(record("pre_after"))
    opt.register_step_post_hook(record("post_after"))
    handles = [
        register_optimizer_step_pre_hook(record("global_pre")),
        register_optimizer_step_post_hook(record("global_post")),
    ]
    try:
        for tokens in batches(2):
            backward(model, tokens)
            opt.step()
            opt.zero_grad()
    finally:
        for handle in handles:
            handle.remove()
    order = [name for name, *_ in log]
    assert order == HOOK_ORDER * 2, f"hooks ran in the order {order}, want {HOOK_ORDER * 2} (once per step)"
    for name, dtypes, fresh in log:
        expected = EXPECTED_HOOKS[name]
        assert (dtypes, fresh) == expected, (
            f"{name} saw (grad dtypes, compute fresh) {(dtypes, fresh)}, want {expected}"
        )


@pytest.mark.parametrize("observer", OBSERVERS)
def test_instance_and_global_step_hooks_run(pool1: Any, observer: str) -> None:
    pool1.run(_step_hooks, observer)


# ----------------------------------------------------------------------------- GradScaler
def _grad_scaler(observer: str) -> None:
    model, ref = build_model(), build_model()
    opt, ropt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](ref.parameters())
    recording = adapt(opt, observer)
    hand = HandCast(fsdp_params(ref))
    calls: list[set[torch.dtype]] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(grad_dtypes(o)))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    rscaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    for step, tokens in enumerate(batches(4)):
        for m, s in ((model, scaler), (ref, rscaler)):
            s.scale(lm_loss(m, local_tokens(tokens))).backward()
        skipped = step == 1
        if skipped:
            for m in (model, ref):
                local(next(m.parameters()).grad).view(-1)[0] = float("inf")
        main_before = main_weights(model)
        compute_before = [g.compute_weight.clone() for g in parameter_groups(model)]
        calls_before = len(calls)
        observed_before = len(recording.steps) if recording is not None else 0
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        # Reference: unscale the bf16 grads as scaler.step does, then cast by hand.
        rscaler.unscale_(ropt)
        hand.cast()
        rscaler.step(ropt)
        hand.restore()
        hand.refresh()
        rscaler.update()
        tag = f"step {step}"
        if skipped:
            assert len(calls) == calls_before, f"{tag} skipped: optimizer.step called {len(calls) - calls_before} times"
            scale, want = scaler.get_scale(), scale_before / 2
            assert scale == want, f"{tag} skipped: scale {scale}, want {want} (backed off)"
            assert_grads_original(opt, f"{tag} skipped: no cast")
            assert_same(main_weights(model), main_before, f"{tag} skipped: main weights")
            compute = [g.compute_weight for g in parameter_groups(model)]
            assert_same(compute, compute_before, f"{tag} skipped: compute copy (not refreshed)")
            if recording is not None:
                got = len(recording.steps)
                assert got == observed_before, f"{tag} skipped: observer saw {got} steps, want {observed_before}"
        else:
            assert calls[calls_before:] == [{FP32}], f"{tag}: grad dtypes the update saw: {calls[calls_before:]}"
            assert_same(main_weights(model), main_weights(ref), f"{tag}: weights vs reference")
            assert_same(optimizer_state(opt), optimizer_state(ropt), f"{tag}: state vs reference")
            assert_compute_fresh(model, tag)
        opt.zero_grad()
        ropt.zero_grad()


@pytest.mark.parametrize("observer", OBSERVERS)
def test_grad_scaler_skipped_steps_neither_cast_nor_refresh(pool1: Any, observer: str) -> None:
    pool1.run(_grad_scaler, observer)


# ----------------------------------------------------------------------------- state_dict
def _state_dict_roundtrip(observer: str) -> None:
    data = batches(3)
    model, other = build_model(), build_model()
    opt, first = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](other.parameters())
    adapt(opt, observer)
    adapt(first, observer)
    for tokens in data[:2]:
        for m, o in ((model, opt), (other, first)):
            backward(m, tokens)
            o.step()
            o.zero_grad()
    saved = opt.state_dict()
    plain_format = O.AdamW(nn.Linear(2, 2).parameters()).state_dict()
    # A second adapted optimizer over `other` takes over from `first` through the state dict.
    remove_fully_shard_optimizer(first)
    loaded = OPTIMIZERS["adamw"](other.parameters())
    adapt(loaded, observer)
    # state_dict() returns references and load_state_dict() keeps tensors whose dtype and
    # device already match (torch's semantics): copy, as one does when both live on.
    loaded.load_state_dict(copy.deepcopy(saved))
    assert saved.keys() == plain_format.keys(), f"state_dict keys {list(saved)}, torch's {list(plain_format)}"
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    assert all(isinstance(i, int) for i in ids), f"state_dict's param_groups name parameters by {ids}, want ints"
    stale = [i for i, p in enumerate(model.parameters()) if saved["state"][i]["exp_avg"] is not opt.state[p]["exp_avg"]]
    assert not stale, f"state_dict's exp_avg of parameters {stale} is not the live state"
    assert_same(optimizer_state(loaded), optimizer_state(opt), "loaded state vs saved state")
    for m in (model, other):
        backward(m, data[2])
    opt.step()
    loaded.step()
    assert_same(main_weights(other), main_weights(model), "next step after the round trip: main weights")
    assert_same(optimizer_state(loaded), optimizer_state(opt), "next step after the round trip: state")
    assert_compute_fresh(other, "after the round trip")


@pytest.mark.parametrize("observer", OBSERVERS)
def test_state_dict_round_trip(pool1: Any, observer: str) -> None:
    pool1.run(_state_dict_roundtrip, observer)


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


# ----------------------------------------------------------------------------- telemetry on
def _telemetry_public_path() -> None:
    import fsdp_patch.telemetry as telemetry

    default_model = build_model()
    default_opt = OPTIMIZERS["adamw"](default_model.parameters())
    adapt(default_opt, "null")
    default_observer = adaptation_of(default_opt).observer
    assert type(default_observer) is NullObserver, f"telemetry off: observer {default_observer!r}, want a NullObserver"
    with env(FSDP_PATCH_TELEMETRY="1", OTEL_SDK_DISABLED="true"):
        model = build_model()
        opt = OPTIMIZERS["adamw"](model.parameters())
        fully_shard_optimizer(opt)
        fully_shard_optimizer(opt)
        adaptation = adaptation_of(opt)
        observer = None if adaptation is None else adaptation.observer
        assert isinstance(observer, telemetry.OptimizerObserver), f"telemetry on: observer {observer!r}"
        for o, what in ((opt, "telemetry on"), (default_opt, "telemetry off")):
            step_type = type(o.step).__name__
            assert step_type == "_BoundMethodWrapper", (
                f"{what}: step is a {step_type}, want the attachment's _BoundMethodWrapper"
            )
            hooks = (dict(o._optimizer_step_pre_hooks), dict(o._optimizer_step_post_hooks))
            assert hooks == ({}, {}), f"{what}: step (pre, post) hooks {hooks}, want none"
        for tokens in batches(3):
            for m, o in ((model, opt), (default_model, default_opt)):
                backward(m, tokens)
                o.step()
            assert_grads_original(opt, "telemetry on: grads restored")
            for o in (opt, default_opt):
                o.zero_grad()
        assert_same(main_weights(model), main_weights(default_model), "telemetry on vs telemetry off")
        assert_compute_fresh(model, "telemetry on")
    # A second call with telemetry off keeps the adaptation and its observer.
    with env(FSDP_PATCH_TELEMETRY="0"):
        fully_shard_optimizer(opt)
    got = (adaptation_of(opt) is adaptation, adaptation.observer is observer)
    assert got == (True, True), f"(same adaptation, same observer) after a call with telemetry off: {got}"
    with pytest.raises(ValueError, match="remove_fully_shard_optimizer"):
        fully_shard_optimizer(opt, precision_aware=True)


def test_public_path_with_telemetry_on(pool2: Any) -> None:
    pool2.run(_telemetry_public_path)


def test_public_path_with_telemetry_env_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # Plain parameters need no process group; the entry point picks the observer from the env.
    import fsdp_patch.telemetry as telemetry

    monkeypatch.setenv("FSDP_PATCH_TELEMETRY", "true")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    model = nn.Linear(3, 2)
    opt = O.SGD(model.parameters(), lr=0.1)
    fully_shard_optimizer(opt)
    adaptation = adaptation_of(opt)
    observer = None if adaptation is None else adaptation.observer
    assert isinstance(observer, telemetry.OptimizerObserver), f"telemetry on: observer {observer!r}"
    before = model.weight.detach().clone()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    assert not torch.equal(model.weight.detach(), before)
    remove_fully_shard_optimizer(opt)
    assert adaptation_of(opt) is None and "step" not in opt.__dict__
    monkeypatch.setenv("FSDP_PATCH_TELEMETRY", "0")
    fully_shard_optimizer(opt)
    observer = adaptation_of(opt).observer
    assert type(observer) is NullObserver, f"telemetry off: observer {observer!r}, want a NullObserver"


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
