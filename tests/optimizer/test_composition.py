"""The adapted optimizer composes with the rest of torch.optim and with copies.

- torch's instance and global step hooks still run, once per step, and see what the
  attachment documents (``hook_attachment.py``; wrapt: every hook is inside the wrapped
  step, so all of them see the cast grads and none the refreshed compute copy);
- ``torch.amp.GradScaler("cpu")``: a step skipped for an injected inf neither casts nor
  refreshes; the other steps equal a hand-cast reference unscaled the same way;
- ``state_dict()``/``load_state_dict()`` round trip into a new adapted optimizer;
- ``copy.deepcopy``, pickling (and ``torch.save``/``torch.load``) and ``copy.copy``: the copy
  is a plain, unadapted optimizer of the same class (``fsdp_patch/adapter/copying.py``);
  the original stays adapted;
- ``fully_shard_optimizer`` twice is harmless; the public undo restores the instance;
- the public path with ``FSDP_PATCH_TELEMETRY=1`` uses telemetry's observer through the
  wrapt attachment and trains bitwise like the default path;
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
from fsdp_patch.adapter import adaptation_of
from fsdp_patch.optimizer import fully_shard_optimizer
from tests.models import lm_loss
from tests.optimizer.support import (
    ATTACHMENTS,
    BF16,
    FP32,
    OPTIMIZERS,
    HandCast,
    O,
    adapt,
    assert_all,
    backward,
    batches,
    build_model,
    compute_is_fresh,
    env,
    fsdp_params,
    grad_dtypes,
    grads_are_original,
    grads_snapshot,
    local,
    local_tokens,
    main_weights,
    optimizer_state,
    same,
)

# ----------------------------------------------------------------------------- step hooks
EXPECTED_HOOKS = {
    # name: (grad dtypes seen, compute copy fresh) per attachment
    "hooks": {
        "global_pre": ({BF16}, True),
        "pre_before": ({BF16}, True),
        "pre_after": ({FP32}, True),
        "post_before": ({FP32}, False),
        "post_after": ({BF16}, True),
        "global_post": ({BF16}, True),
    },
    "wrapt": {
        "global_pre": ({FP32}, True),
        "pre_before": ({FP32}, True),
        "pre_after": ({FP32}, True),
        "post_before": ({FP32}, False),
        "post_after": ({FP32}, False),
        "global_post": ({FP32}, False),
    },
}
HOOK_ORDER = ["global_pre", "pre_before", "pre_after", "post_before", "post_after", "global_post"]


def _step_hooks(attachment: str) -> dict[str, Any]:
    model = build_model()
    opt = OPTIMIZERS["adamw"](model.parameters())
    log: list[tuple[str, set[torch.dtype], bool]] = []

    def record(name: str) -> Any:
        return lambda o, args, kwargs: log.append((name, grad_dtypes(o), compute_is_fresh(model))) if o is opt else None

    opt.register_step_pre_hook(record("pre_before"))
    opt.register_step_post_hook(record("post_before"))
    adapt(opt, attachment)
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
    checks = {"each hook ran once per step, in torch's order": [name for name, *_ in log] == HOOK_ORDER * 2}
    for name, dtypes, fresh in log:
        expected = EXPECTED_HOOKS[attachment][name]
        checks[f"{name} saw {sorted(map(str, expected[0]))}, compute fresh={expected[1]}"] = (dtypes, fresh) == expected
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_instance_and_global_step_hooks_run(pool1: Any, attachment: str) -> None:
    assert_all(pool1.run(_step_hooks, attachment))


# ----------------------------------------------------------------------------- GradScaler
def _grad_scaler(attachment: str) -> dict[str, bool]:
    model, ref = build_model(), build_model()
    opt, ropt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](ref.parameters())
    observer = adapt(opt, attachment)
    hand = HandCast(fsdp_params(ref))
    calls: list[set[torch.dtype]] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(grad_dtypes(o)))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    rscaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    checks: dict[str, bool] = {}
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
        observed_before = len(observer.steps) if observer is not None else 0
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
            checks[f"{tag} skipped: optimizer.step not called"] = len(calls) == calls_before
            checks[f"{tag} skipped: scale backed off"] = scaler.get_scale() == scale_before / 2
            checks[f"{tag} skipped: no cast, grads original"] = grads_are_original(opt) is None
            checks[f"{tag} skipped: main weights unchanged"] = same(main_weights(model), main_before)
            checks[f"{tag} skipped: compute copy not refreshed"] = same(
                [g.compute_weight for g in parameter_groups(model)], compute_before
            )
            if observer is not None:
                checks[f"{tag} skipped: no step observed, no cast recorded"] = len(observer.steps) == observed_before
        else:
            checks[f"{tag}: update saw fp32 grads"] = len(calls) == calls_before + 1 and calls[-1] == {FP32}
            checks[f"{tag}: weights == reference"] = same(main_weights(model), main_weights(ref))
            checks[f"{tag}: state == reference"] = same(optimizer_state(opt), optimizer_state(ropt))
            checks[f"{tag}: compute copy fresh"] = compute_is_fresh(model)
        opt.zero_grad()
        ropt.zero_grad()
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_grad_scaler_skipped_steps_neither_cast_nor_refresh(pool1: Any, attachment: str) -> None:
    assert_all(pool1.run(_grad_scaler, attachment))


# ----------------------------------------------------------------------------- state_dict
def _state_dict_roundtrip(attachment: str) -> dict[str, bool]:
    data = batches(3)
    model, other = build_model(), build_model()
    opt, first = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](other.parameters())
    adapt(opt, attachment)
    adapt(first, attachment)
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
    adapt(loaded, attachment)
    # state_dict() returns references and load_state_dict() keeps tensors whose dtype and
    # device already match (torch's semantics): copy, as one does when both live on.
    loaded.load_state_dict(copy.deepcopy(saved))
    checks = {
        "state_dict has torch's format": saved.keys() == plain_format.keys()
        and all(isinstance(i, int) for g in saved["param_groups"] for i in g["params"]),
        "state_dict holds the live state": all(
            saved["state"][i]["exp_avg"] is opt.state[p]["exp_avg"] for i, p in enumerate(model.parameters())
        ),
        "loaded state == saved state": same(optimizer_state(loaded), optimizer_state(opt)),
    }
    for m in (model, other):
        backward(m, data[2])
    opt.step()
    loaded.step()
    checks["next step equal after the round trip"] = same(main_weights(model), main_weights(other))
    checks["next state equal after the round trip"] = same(optimizer_state(loaded), optimizer_state(opt))
    checks["compute copy fresh"] = compute_is_fresh(other)
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_state_dict_round_trip(pool1: Any, attachment: str) -> None:
    assert_all(pool1.run(_state_dict_roundtrip, attachment))


# ----------------------------------------------------------------------------- copies
def _is_plain(copied: torch.optim.Optimizer, original: torch.optim.Optimizer) -> bool:
    return (
        type(copied) is type(original)
        and adaptation_of(copied) is None
        and not ({"step", "zero_grad", "__deepcopy__", "__reduce_ex__"} & copied.__dict__.keys())
        and not copied._optimizer_step_pre_hooks
        and not copied._optimizer_step_post_hooks
    )


def _copy_checks(
    tag: str, copied: torch.optim.Optimizer, opt: torch.optim.Optimizer, with_grads: bool
) -> dict[str, bool]:
    originals = [p for g in opt.param_groups for p in g["params"]]
    params = [p for g in copied.param_groups for p in g["params"]]
    checks = {
        f"{tag}: a plain, unadapted {type(opt).__name__}": _is_plain(copied, opt),
        f"{tag}: new parameters, not FSDP-managed": all(
            q is not p and parameter_group_of(q) is None for p, q in zip(originals, params, strict=True)
        ),
        f"{tag}: parameters are DTensors with the same values": all(
            isinstance(q, DTensor) and q.placements == p.placements and same(q.detach(), p.detach())
            for p, q in zip(originals, params, strict=True)
        ),
        f"{tag}: state == original's, and separate": same(optimizer_state(copied), optimizer_state(opt))
        and all(
            copied.state[q]["exp_avg"] is not opt.state[p]["exp_avg"] for p, q in zip(originals, params, strict=True)
        ),
        f"{tag}: state keyed by the copied parameters": all(q in copied.state for q in params),
        f"{tag}: same hyperparameters": [{k: v for k, v in g.items() if k != "params"} for g in copied.param_groups]
        == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    }
    if with_grads:
        checks[f"{tag}: grads copied with their dtype and grad_dtype"] = all(
            q.grad is not None and q.grad is not p.grad and q.grad_dtype == BF16 and same(q.grad, p.grad)
            for p, q in zip(originals, params, strict=True)
        )
    else:
        checks[f"{tag}: no grads (torch never pickles them)"] = all(q.grad is None for q in params)
    return checks


def _copies(attachment: str) -> dict[str, bool]:
    data = batches(3)
    model, ref = build_model(), build_model()
    opt, ropt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](ref.parameters())
    observer = adapt(opt, attachment)
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
    checks: dict[str, bool] = {}
    checks.update(_copy_checks("deepcopy", copy.deepcopy(opt), opt, with_grads=True))
    checks.update(_copy_checks("pickle", pickle.loads(pickle.dumps(opt)), opt, with_grads=False))
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    checks.update(_copy_checks("torch.save/load", torch.load(buffer, weights_only=False), opt, with_grads=False))
    shallow = copy.copy(opt)
    checks["copy.copy: plain, unadapted"] = _is_plain(shallow, opt)
    checks["copy.copy: shares parameters and state"] = shallow.param_groups[0]["params"][0] is opt.param_groups[0][
        "params"
    ][0] and (shallow.state is opt.state)
    checks["original: still adapted, grads untouched"] = adaptation_of(opt) is not None and same(
        grads_snapshot(model), grads
    )
    opt.step()
    hand.step(ropt)
    checks["original: next step == reference"] = same(main_weights(model), main_weights(ref))
    checks["original: grads original, compute fresh"] = grads_are_original(opt) is None and compute_is_fresh(model)
    if observer is not None:
        checks["original: observer saw 3 steps"] = len(observer.steps) == 3
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_deepcopy_and_pickle_give_plain_optimizers(pool1: Any, attachment: str) -> None:
    assert_all(pool1.run(_copies, attachment))


# ----------------------------------------------------------------------------- twice / undo
def _twice(attachment: str) -> dict[str, bool]:
    once, twice = build_model(), build_model()
    opt_once, opt_twice = OPTIMIZERS["adamw"](once.parameters()), OPTIMIZERS["adamw"](twice.parameters())
    adapt(opt_once, attachment)
    observer = adapt(opt_twice, attachment)
    adaptation = adaptation_of(opt_twice)
    snapshot = dict(opt_twice.__dict__)
    adapt(opt_twice, attachment)
    if attachment == "hooks":
        fully_shard_optimizer(opt_twice)  # and a third time, plain public call
    checks = {
        "same adaptation": adaptation_of(opt_twice) is adaptation,
        "instance unchanged by the second call": opt_twice.__dict__.keys() == snapshot.keys()
        and all(opt_twice.__dict__[k] is v for k, v in snapshot.items()),
        "one pre and one post hook": len(opt_twice._optimizer_step_pre_hooks) == (1 if attachment == "hooks" else 0)
        and len(opt_twice._optimizer_step_post_hooks) == (1 if attachment == "hooks" else 0),
    }
    for tokens in batches(2):
        for m, o in ((once, opt_once), (twice, opt_twice)):
            backward(m, tokens)
            o.step()
            o.zero_grad()
    checks["trains like a once-adapted optimizer"] = same(main_weights(twice), main_weights(once))
    if observer is not None:
        grad_casts = [c for c in observer.casts if c[0] == "grads_cast"]
        checks["one grad cast per group per step"] = len(grad_casts) == 2 * len(parameter_groups(twice))
    return checks


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_fully_shard_optimizer_twice_is_harmless(pool1: Any, attachment: str) -> None:
    assert_all(pool1.run(_twice, attachment))


def _undo(attachment: str, scheduler: str) -> dict[str, bool]:
    model = build_model()
    opt = O.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checks: dict[str, bool] = {}
    sched = L.StepLR(opt, step_size=1, gamma=0.5) if scheduler == "before" else None
    before = dict(opt.__dict__)
    # 1. Adapt and undo at once: the instance is exactly as before.
    adapt(opt, attachment)
    remove_fully_shard_optimizer(opt)
    checks["immediate undo: same __dict__ keys and values"] = opt.__dict__.keys() == before.keys() and all(
        opt.__dict__[k] is v for k, v in before.items()
    )
    checks["immediate undo: hook dicts empty"] = (
        not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    )
    # 2. Adapt, train, undo.
    adapt(opt, attachment)
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
        # scheduler created after the adaptation installs its own `step` (under wrapt it wraps
        # our wrapper, which stays inside it and passes calls through).
        torch_keys = {"_opt_called"} if sched is not None else set()
        if scheduler == "after":
            torch_keys.add("step")
        checks["undo: no key of ours left"] = opt.__dict__.keys() - before.keys() <= torch_keys
        checks["undo: every other value as before"] = all(opt.__dict__[k] is v for k, v in before.items())
        checks["undo: hook dicts empty"] = not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
        checks["undo: not adapted"] = adaptation_of(opt) is None
        # The optimizer is plain again: it steps the bf16 grads as they are, refreshes nothing.
        seen: list[set[torch.dtype]] = []
        opt.register_step_pre_hook(lambda o, a, k: seen.append(grad_dtypes(o)))
        backward(model, data[1])
        opt.step()
        if sched is not None:
            sched.step()
        checks["after undo: the update sees bf16 grads"] = seen == [{BF16}]
        checks["after undo: no refresh by the adapter"] = not compute_is_fresh(model)
    checks["no scheduler warning"] = not [w for w in caught if "optimizer.step()" in str(w.message)]
    return checks


@pytest.mark.parametrize("scheduler", ["none", "before", "after"])
@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_remove_fully_shard_optimizer_restores_the_instance(pool1: Any, attachment: str, scheduler: str) -> None:
    assert_all(pool1.run(_undo, attachment, scheduler))


# ----------------------------------------------------------------------------- telemetry on
def _telemetry_public_path() -> dict[str, bool]:
    import fsdp_patch.telemetry as telemetry

    checks: dict[str, bool] = {}
    default_model = build_model()
    default_opt = OPTIMIZERS["adamw"](default_model.parameters())
    adapt(default_opt, "hooks")
    with env(FSDP_PATCH_TELEMETRY="1", OTEL_SDK_DISABLED="true"):
        model = build_model()
        opt = OPTIMIZERS["adamw"](model.parameters())
        fully_shard_optimizer(opt)
        fully_shard_optimizer(opt)
        adaptation = adaptation_of(opt)
        checks["telemetry on: wrapt attachment"] = adaptation is not None and adaptation.kind == "wrapt"
        checks["telemetry on: telemetry's observer"] = isinstance(
            adaptation.attachment._observer, telemetry.OptimizerObserver
        )
        checks["telemetry on: no step hooks of ours"] = not opt._optimizer_step_pre_hooks
        for tokens in batches(3):
            for m, o in ((model, opt), (default_model, default_opt)):
                backward(m, tokens)
                o.step()
            checks["telemetry on: grads restored"] = grads_are_original(opt) is None
            for o in (opt, default_opt):
                o.zero_grad()
        checks["telemetry on: bitwise the default path"] = same(main_weights(model), main_weights(default_model))
        checks["telemetry on: compute copy fresh"] = compute_is_fresh(model)
    with env(FSDP_PATCH_TELEMETRY="0"):
        try:
            fully_shard_optimizer(opt)
            checks["switching attachments is refused"] = False
        except ValueError:
            checks["switching attachments is refused"] = True
    return checks


def test_public_path_with_telemetry_on(pool2: Any) -> None:
    assert_all(pool2.run(_telemetry_public_path))


def test_public_path_with_telemetry_env_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # Plain parameters need no process group; the entry point picks the attachment from the env.
    import fsdp_patch.telemetry as telemetry

    monkeypatch.setenv("FSDP_PATCH_TELEMETRY", "true")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    model = nn.Linear(3, 2)
    opt = O.SGD(model.parameters(), lr=0.1)
    fully_shard_optimizer(opt)
    adaptation = adaptation_of(opt)
    assert adaptation is not None and adaptation.kind == "wrapt"
    assert isinstance(adaptation.attachment._observer, telemetry.OptimizerObserver)
    before = model.weight.detach().clone()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    assert not torch.equal(model.weight.detach(), before)
    remove_fully_shard_optimizer(opt)
    assert adaptation_of(opt) is None and "step" not in opt.__dict__
    monkeypatch.setenv("FSDP_PATCH_TELEMETRY", "0")
    fully_shard_optimizer(opt)
    assert adaptation_of(opt).kind == "hooks"


# ----------------------------------------------------------------------------- lifetime
def _freed() -> dict[str, bool]:
    checks: dict[str, bool] = {}
    for attachment in ATTACHMENTS:
        model = build_model()
        opt = OPTIMIZERS["adamw"](model.parameters())
        adapt(opt, attachment)
        backward(model, batches(1)[0])
        opt.step()
        ref = weakref.ref(opt)
        del opt
        gc.collect()
        checks[f"{attachment}: adapted optimizer freed"] = ref() is None
    return checks


def test_adapted_optimizer_is_freed(pool1: Any) -> None:
    assert_all(pool1.run(_freed))
