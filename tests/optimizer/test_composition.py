"""The adapted optimizer composes with the rest of torch.optim.

- torch's instance and global step hooks still run, once per step, and see what the
  attachment documents (``wrapt_attachment.py``: every hook is inside the wrapped step, so
  all of them see the cast grads, and the post-hooks a compute copy not yet refreshed);
- ``torch.amp.GradScaler("cpu")``: a step skipped for an injected inf neither casts nor
  refreshes; the other steps equal a hand-cast reference unscaled the same way;
- ``state_dict()``/``load_state_dict()`` round trip into a new adapted optimizer;
- the public path with ``FSDP_PATCH_TELEMETRY=1`` gives telemetry's observer to the same
  attachment and trains bitwise like telemetry off.

Copies, adapting twice, undo and the optimizer's lifetime: ``test_composition_lifecycle.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fsdp_patch import parameter_groups, remove_fully_shard_optimizer
from fsdp_patch.adapter import NullObserver, adaptation_of
from fsdp_patch.optimizer import fully_shard_optimizer
from tests.models import lm_loss
from tests.optimizer.support import (
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
