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
from torch import nn

from fsdp_patch.optimizer import init_optimizer_state
from tests.optimizer.support import (
    OPTIMIZERS,
    O,
    adapt,
    assert_changed,
    assert_same,
    backward,
    batches,
    build_model,
    grads_snapshot,
    main_weights,
    optimizer_state,
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


def _neutrality(name: str, observer: str) -> None:
    make = NEUTRAL[name]
    data = batches(3)
    # "fresh": never initialized; "init": initialized, state kept as init left it until the
    # first step; "roundtrip": initialized, then its own state_dict loaded back (no drop).
    models = {k: build_model() for k in ("fresh", "init", "roundtrip")}
    opts = {k: make(m.parameters()) for k, m in models.items()}
    for opt in opts.values():
        adapt(opt, observer)
    # Grads present when init runs must survive it.
    for k in models:
        backward(models[k], data[0])
    for k in ("init", "roundtrip"):
        weights, grads = main_weights(models[k]), grads_snapshot(models[k])
        init_optimizer_state(opts[k])
        assert_same(main_weights(models[k]), weights, f"{k}: main weights after init")
        assert_same(grads_snapshot(models[k]), grads, f"{k}: grads after init")
    entries = len(opts["init"].state)
    want = 0 if name == "sgd_stateless" else sum(1 for _ in models["init"].parameters())
    assert entries == want, f"init made state for {entries} parameters, want {want}"
    opts["roundtrip"].load_state_dict(opts["roundtrip"].state_dict())
    for step, tokens in enumerate(data):
        if step:
            for k in models:
                backward(models[k], tokens)
        for opt in opts.values():
            opt.step()
        fresh = main_weights(models["fresh"])
        assert_same(main_weights(models["init"]), fresh, f"init: step {step}: main weights vs never initialized")
        assert_same(
            optimizer_state(opts["init"]),
            optimizer_state(opts["fresh"]),
            f"init: step {step}: state vs never initialized",
        )
        if name in NOT_NEUTRAL_BY_VALUE:
            # Proves the need for the drop: the kept zero buffer changes the first update.
            assert_changed(main_weights(models["roundtrip"]), fresh, f"roundtrip: step {step} (dampening)")
        else:
            assert_same(main_weights(models["roundtrip"]), fresh, f"roundtrip: step {step}: vs never initialized")
        for opt in opts.values():
            opt.zero_grad()


@pytest.mark.parametrize("name", list(NEUTRAL))
def test_init_optimizer_state_is_neutral(pool1: Any, name: str) -> None:
    pool1.run(_neutrality, name, "null")


def test_init_optimizer_state_is_neutral_with_an_observer(pool1: Any) -> None:
    pool1.run(_neutrality, "adamw", "recording")


def _plain_rprop() -> None:
    # Rprop cannot step DTensor parameters on CPU (its update index_put_s a Shard(0) tensor,
    # which DTensor refuses), so its state is checked on plain parameters. A synthetic step
    # with lr forced to 0 (torch's _init_optim_state) would leave step sizes of 0.
    for lr in (1e-2, 100.0):  # 100 > step_size_max: the first step clamps
        torch.manual_seed(0)
        fresh, init = nn.Linear(5, 3), nn.Linear(5, 3)
        init.load_state_dict(fresh.state_dict())
        opts = {"fresh": O.Rprop(fresh.parameters(), lr=lr), "init": O.Rprop(init.parameters(), lr=lr)}
        for opt in opts.values():
            adapt(opt, "null")
        before = [p.detach().clone() for p in init.parameters()]
        init_optimizer_state(opts["init"])
        assert_same([p.detach() for p in init.parameters()], before, f"lr={lr}: parameters after init")
        for index, state in enumerate(opts["init"].state.values()):
            sizes = state["step_size"]
            assert torch.equal(sizes, torch.full_like(sizes, lr)), f"lr={lr}: state {index}'s step sizes {sizes}"
        opts["init"].load_state_dict(opts["init"].state_dict())  # keep the values: no drop
        gen = torch.Generator().manual_seed(3)
        for step in range(3):
            x = torch.randn(4, 5, generator=gen)
            for model, opt in ((fresh, opts["fresh"]), (init, opts["init"])):
                opt.zero_grad()
                model(x).square().sum().backward()
                opt.step()
            got, want = [p.detach() for p in init.parameters()], [p.detach() for p in fresh.parameters()]
            assert_same(got, want, f"lr={lr}: step {step}: parameters vs never initialized")


def test_rprop_step_sizes_neutral(pool1: Any) -> None:
    pool1.run(_plain_rprop)


def _noop_and_lbfgs() -> None:
    model = build_model()
    opt = O.AdamW(model.parameters(), lr=1e-2)
    adapt(opt, "null")
    backward(model, batches(1)[0])
    opt.step()
    state_objects = {id(p): {k: v for k, v in s.items()} for p, s in opt.state.items()}
    state_values = optimizer_state(opt)
    weights, grads = main_weights(model), grads_snapshot(model)
    hooks_before = len(opt._optimizer_step_pre_hooks)
    init_optimizer_state(opt)
    replaced = [
        (index, k)
        for index, p in enumerate(opt.state)
        for k, v in state_objects[id(p)].items()
        if opt.state[p][k] is not v
    ]
    assert not replaced, f"no-op once state exists: (parameter, state key) replaced {replaced}"
    assert_same(optimizer_state(opt), state_values, "no-op once state exists: state values")
    assert_same(main_weights(model), weights, "no-op once state exists: main weights")
    assert_same(grads_snapshot(model), grads, "no-op once state exists: grads")
    hooks = len(opt._optimizer_step_pre_hooks)
    assert hooks == hooks_before, f"no-op once state exists: {hooks} step pre hooks, was {hooks_before}"
    lbfgs = O.LBFGS(build_model().parameters())
    adapt(lbfgs, "null")
    with pytest.raises(NotImplementedError, match=r"(?s)(?=.*LBFGS)(?=.*load_state_dict)"):
        init_optimizer_state(lbfgs)
    assert not lbfgs.state, f"LBFGS state after the refusal: {dict(lbfgs.state)}"
    with pytest.raises(TypeError, match="object"):
        init_optimizer_state(object())  # type: ignore[arg-type]


def test_init_is_noop_once_state_exists_and_rejects_lbfgs(pool1: Any) -> None:
    pool1.run(_noop_and_lbfgs)


def _torch_path(name: str) -> None:
    """What torch's get_optimizer_state_dict does on a fresh adapted optimizer."""
    from torch.distributed.checkpoint import state_dict as torch_state_dict
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = build_model()
    opt = NEUTRAL[name](model.parameters())
    adapt(opt, "null")
    # torch's own initialization, unwrapped: it assigns zeros_like(param) (fp32) as the grad of
    # a parameter that advertises bf16 grads, which torch refuses naming grad_dtype.
    original = getattr(torch_state_dict._init_optim_state, "__wrapped__", None)
    with pytest.raises((RuntimeError, TypeError), match="grad_dtype"):
        original(opt)  # type: ignore[misc]
    # get_optimizer_state_dict itself, on a fresh optimizer and after init_optimizer_state:
    # the same state, the parameters untouched.
    want = 0 if name == "sgd_stateless" else sum(1 for _ in model.parameters())
    for how in ("fresh", "after_init"):
        model = build_model()
        opt = NEUTRAL[name](model.parameters())
        adapt(opt, "null")
        weights = main_weights(model)
        if how == "after_init":
            init_optimizer_state(opt)
        osd = get_optimizer_state_dict(model, opt)
        got = len(osd["state"])
        assert got == want, f"{how}: get_optimizer_state_dict made {got} state entries, want {want}"
        assert_same(main_weights(model), weights, f"{how}: main weights after get_optimizer_state_dict")


@pytest.mark.parametrize("name", ["adamw", "sgd_stateless"])
def test_torch_get_optimizer_state_dict_works_without_init(pool1: Any, name: str) -> None:
    pool1.run(_torch_path, name)
