"""``init_optimizer_state`` materializes state neutrally; torch's own path uses it where it would fail.

Neutral means, for every optimizer of the list but LBFGS (plus Rprop, a tensor learning rate
and stateless SGD): the parameters and grads are bitwise unchanged by the call, and the next
real steps are bitwise those of an optimizer that was never initialized. Two ways to get
there are checked separately:

- the state values themselves are those of a fresh optimizer after its first step would
  see them (step counters 0, NAdam's ``mu_product`` 1, Adamax's ``exp_inf`` 0, moments 0):
  a ``state_dict``/``load_state_dict`` round trip of the initialized state (which keeps it) is
  still neutral;
- state that no value can make neutral (SGD momentum with dampening: the first step copies
  the grad into the buffer, a later one damps it) is dropped at the first step when no load
  filled it, so that step starts from empty state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_patch.optimizer import init_optimizer_state
from tests.optimizer.support import (
    OPTIMIZERS,
    O,
    adapt,
    assert_all,
    backward,
    batches,
    build_model,
    grads_snapshot,
    main_weights,
    optimizer_state,
    same,
)

NEUTRAL = {name: make for name, make in OPTIMIZERS.items() if name != "lbfgs"}
NEUTRAL.update(
    {
        "sgd_stateless": lambda p: O.SGD(p, lr=0.05),
        "adam_tensor_lr": lambda p: O.Adam(p, lr=torch.tensor(1e-2)),
        "nadam_decoupled": lambda p: O.NAdam(p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    }
)
# State that is not neutral by value: only the drop at the first step makes it neutral.
NOT_NEUTRAL_BY_VALUE = {"sgd_momentum"}  # dampening=0.1


def _neutrality(name: str, attachment: str) -> dict[str, bool]:
    make = NEUTRAL[name]
    data = batches(3)
    # "fresh": never initialized; "init": initialized, state kept as init left it until the
    # first step; "roundtrip": initialized, then its own state_dict loaded back (no drop).
    models = {k: build_model() for k in ("fresh", "init", "roundtrip")}
    opts = {k: make(m.parameters()) for k, m in models.items()}
    for opt in opts.values():
        adapt(opt, attachment)
    checks: dict[str, bool] = {}
    # Grads present when init runs must survive it.
    for k in models:
        backward(models[k], data[0])
    for k in ("init", "roundtrip"):
        weights, grads = main_weights(models[k]), grads_snapshot(models[k])
        init_optimizer_state(opts[k])
        checks[f"{k}: params bitwise unchanged by init"] = same(main_weights(models[k]), weights)
        checks[f"{k}: grads unchanged by init"] = same(grads_snapshot(models[k]), grads)
    stateful = bool(opts["init"].state)
    checks["stateless SGD stays stateless, others get state for every param"] = (
        not stateful
        if name == "sgd_stateless"
        else len(opts["init"].state) == sum(1 for _ in models["init"].parameters())
    )
    opts["roundtrip"].load_state_dict(opts["roundtrip"].state_dict())
    for step, tokens in enumerate(data):
        if step:
            for k in models:
                backward(models[k], tokens)
        for opt in opts.values():
            opt.step()
        fresh = main_weights(models["fresh"])
        checks[f"init: step {step} == never initialized"] = same(main_weights(models["init"]), fresh)
        checks[f"init: step {step} state == never initialized"] = same(
            optimizer_state(opts["init"]), optimizer_state(opts["fresh"])
        )
        roundtrip_equal = same(main_weights(models["roundtrip"]), fresh)
        if name in NOT_NEUTRAL_BY_VALUE:
            # Proves the need for the drop: the kept zero buffer changes the first update.
            checks[f"roundtrip: step {step} differs (dampening)"] = not roundtrip_equal
        else:
            checks[f"roundtrip: step {step} == never initialized"] = roundtrip_equal
        for opt in opts.values():
            opt.zero_grad()
    return checks


@pytest.mark.parametrize("name", list(NEUTRAL))
def test_init_optimizer_state_is_neutral(pool1: Any, name: str) -> None:
    assert_all(pool1.run(_neutrality, name, "hooks"))


def test_init_optimizer_state_is_neutral_under_wrapt(pool1: Any) -> None:
    assert_all(pool1.run(_neutrality, "adamw", "wrapt"))


def _plain_rprop() -> dict[str, bool]:
    # Rprop cannot step DTensor parameters on CPU (its update index_put_s a Shard(0) tensor,
    # which DTensor refuses), so its state is checked on plain parameters. A synthetic step
    # with lr forced to 0 (torch's _init_optim_state) would leave step sizes of 0.
    checks: dict[str, bool] = {}
    for lr in (1e-2, 100.0):  # 100 > step_size_max: the first step clamps
        torch.manual_seed(0)
        fresh, init = nn.Linear(5, 3), nn.Linear(5, 3)
        init.load_state_dict(fresh.state_dict())
        opts = {"fresh": O.Rprop(fresh.parameters(), lr=lr), "init": O.Rprop(init.parameters(), lr=lr)}
        for opt in opts.values():
            adapt(opt, "hooks")
        before = [p.detach().clone() for p in init.parameters()]
        init_optimizer_state(opts["init"])
        checks[f"lr={lr}: params unchanged"] = same([p.detach() for p in init.parameters()], before)
        checks[f"lr={lr}: step sizes start at lr"] = all(
            torch.equal(s["step_size"], torch.full_like(s["step_size"], lr)) for s in opts["init"].state.values()
        )
        opts["init"].load_state_dict(opts["init"].state_dict())  # keep the values: no drop
        gen = torch.Generator().manual_seed(3)
        for step in range(3):
            x = torch.randn(4, 5, generator=gen)
            for model, opt in ((fresh, opts["fresh"]), (init, opts["init"])):
                opt.zero_grad()
                model(x).square().sum().backward()
                opt.step()
            checks[f"lr={lr}: step {step} == never initialized"] = same(
                [p.detach() for p in init.parameters()], [p.detach() for p in fresh.parameters()]
            )
    return checks


def test_rprop_step_sizes_neutral(pool1: Any) -> None:
    assert_all(pool1.run(_plain_rprop))


def _noop_and_lbfgs() -> dict[str, Any]:
    checks: dict[str, Any] = {}
    model = build_model()
    opt = O.AdamW(model.parameters(), lr=1e-2)
    adapt(opt, "hooks")
    backward(model, batches(1)[0])
    opt.step()
    state_objects = {id(p): {k: v for k, v in s.items()} for p, s in opt.state.items()}
    state_values = optimizer_state(opt)
    weights, grads = main_weights(model), grads_snapshot(model)
    hooks_before = len(opt._optimizer_step_pre_hooks)
    init_optimizer_state(opt)
    checks["no-op once state exists: same state objects"] = all(
        all(opt.state[p][k] is v for k, v in state_objects[id(p)].items()) for p in opt.state
    )
    checks["no-op once state exists: same state values"] = same(optimizer_state(opt), state_values)
    checks["no-op once state exists: params and grads unchanged"] = same(main_weights(model), weights) and same(
        grads_snapshot(model), grads
    )
    checks["no-op once state exists: no hook registered"] = len(opt._optimizer_step_pre_hooks) == hooks_before
    lbfgs = O.LBFGS(build_model().parameters())
    adapt(lbfgs, "hooks")
    try:
        init_optimizer_state(lbfgs)
        checks["LBFGS raises NotImplementedError naming LBFGS"] = False
    except NotImplementedError as exc:
        checks["LBFGS raises NotImplementedError naming LBFGS"] = "LBFGS" in str(exc) and "load_state_dict" in str(exc)
    checks["LBFGS state untouched"] = not lbfgs.state
    try:
        init_optimizer_state(object())  # type: ignore[arg-type]
        checks["non-optimizer is a TypeError"] = False
    except TypeError:
        checks["non-optimizer is a TypeError"] = True
    return checks


def test_init_is_noop_once_state_exists_and_rejects_lbfgs(pool1: Any) -> None:
    assert_all(pool1.run(_noop_and_lbfgs))


def _torch_path(name: str) -> dict[str, Any]:
    """What torch's get_optimizer_state_dict does on a fresh adapted optimizer."""
    from torch.distributed.checkpoint import state_dict as torch_state_dict
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = build_model()
    opt = NEUTRAL[name](model.parameters())
    adapt(opt, "hooks")
    out: dict[str, Any] = {}
    # torch's own initialization, unwrapped: it assigns zeros_like(param) (fp32) as the grad of
    # a parameter that advertises bf16 grads.
    original = getattr(torch_state_dict._init_optim_state, "__wrapped__", None)
    try:
        original(opt)  # type: ignore[misc]
        out["error"] = None
    except (RuntimeError, TypeError) as exc:
        out["error"] = str(exc)
    # get_optimizer_state_dict itself, on a fresh optimizer and after init_optimizer_state:
    # the same state, the parameters untouched.
    for how in ("fresh", "after_init"):
        model = build_model()
        opt = NEUTRAL[name](model.parameters())
        adapt(opt, "hooks")
        weights = main_weights(model)
        if how == "after_init":
            init_optimizer_state(opt)
        osd = get_optimizer_state_dict(model, opt)
        out[f"{how}_state_entries"] = len(osd["state"])
        out[f"{how}_weights_unchanged"] = same(main_weights(model), weights)
    out["params"] = sum(1 for _ in model.parameters())
    out["rank"] = dist.get_rank()
    return out


@pytest.mark.parametrize("name", ["adamw", "sgd_stateless"])
def test_torch_get_optimizer_state_dict_works_without_init(pool1: Any, name: str) -> None:
    (out,) = pool1.run(_torch_path, name)
    error = out["error"] or ""
    assert "grad_dtype" in error, f"torch's unwrapped _init_optim_state: want its grad_dtype refusal, got {error!r}"
    expected = 0 if name == "sgd_stateless" else out["params"]
    for how in ("fresh", "after_init"):
        got = out[f"{how}_state_entries"]
        assert got == expected, f"{how}: get_optimizer_state_dict made {got} state entries, want {expected}"
        assert out[f"{how}_weights_unchanged"], f"{how}: get_optimizer_state_dict changed the main weights"
