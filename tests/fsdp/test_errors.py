"""Every bad input gets its error (type and message), and a failed ``fully_shard`` leaves the
module as it was: same parameter objects, same class, no hooks, no FSDP state; fixing the input
and calling again then works (no registry state was left behind)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_patch import MixedPrecisionPolicy, fully_shard
from tests.fsdp.sharded_views import world

# case -> (exception type, words the message must contain)
EXPECTED = {
    "applied_twice": ("ValueError", ["already applied", "once"]),
    "mesh_3d": ("NotImplementedError", ["1-D", "2-D", "got a 3-D mesh"]),
    "tied_across_units_parent": ("ValueError", ["'b.weight'", "tied", "one unit", "'weight'"]),
    "tied_across_units_sibling": ("ValueError", ["tied", "one unit"]),
    "child_after_parent": ("ValueError", ["already sharded", "bottom-up"]),
    "zero_dim": ("ValueError", ["'scale'", "0-dimensional"]),
    "int_param": ("ValueError", ["'index'", "torch.int64", "floating-point"]),
    "not_a_module": ("TypeError", ["nn.Module"]),
    "bad_mesh": ("TypeError", ["DeviceMesh"]),
    "bad_policy": ("TypeError", ["MixedPrecisionPolicy"]),
    "bad_reshard": ("TypeError", ["reshard_after_forward", "a bool, an int or None"]),
}
RETRIED = ["mesh_3d", "tied_across_units_parent", "tied_across_units_sibling", "zero_dim", "int_param"]


class _ZeroDim(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ok = nn.Linear(2, 2)
        self.scale = nn.Parameter(torch.tensor(1.0))


class _IntParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ok = nn.Linear(2, 2)
        self.index = nn.Parameter(torch.arange(3), requires_grad=False)


def _tied_pair() -> nn.Module:
    model = nn.Module()
    model.a = nn.Linear(3, 3)
    model.b = nn.Linear(3, 3)
    model.b.weight = model.a.weight
    return model


def errors_run(world_size_for_2d: int) -> dict[str, Any]:
    """Every bad input: the exception (type, message) and whether the module was left alone.

    For each case, ``setup`` builds the module (and applies any valid earlier fully_shard
    calls), ``call`` is the failing call, ``fix`` (optional) repairs the input so a retry must
    succeed, proving the failure left no registry state behind.
    """
    from fsdp_patch import fully_shard

    rank, world_size = world()
    cases: dict[str, dict[str, Any]] = {}

    def case(
        name: str,
        setup: Callable[[], nn.Module],
        call: Callable[[nn.Module], Any],
        target: Callable[[nn.Module], nn.Module] = lambda m: m,
        fix: Callable[[nn.Module], None] | None = None,
        retry: Callable[[nn.Module], Any] | None = None,
    ) -> None:
        module = setup()
        before = module_snapshot(module)
        try:
            call(module)
        except Exception as exc:
            outcome: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
        else:
            outcome = {"type": None, "message": ""}
        after = module_snapshot(module)
        outcome["changed"] = [
            (was, now) for was, now in itertools.zip_longest(before, after) if was != now
        ]  # (before, after) of each submodule the call changed
        outcome["target_is_fsdp"] = type(target(module)).__name__.startswith("FSDP")
        if fix is not None:
            fix(module)
            try:
                (retry or (lambda m: fully_shard(target(m))))(module)
                outcome["retry"] = "ok"
                out = target(module)
                # The repaired module trains: forward and backward through it.
                outcome["retry_is_fsdp"] = type(out).__name__.startswith("FSDP")
            except Exception as exc:
                outcome["retry"] = f"{type(exc).__name__}: {exc}"
        cases[name] = outcome

    def twice(m: nn.Module) -> None:
        fully_shard(m)

    case("applied_twice", lambda: fully_shard(nn.Linear(4, 4)), twice)

    mesh_3d = init_device_mesh("cpu", (1, 1, world_size), mesh_dim_names=("outer", "replicate", "shard"))
    case(
        "mesh_3d",
        lambda: nn.Linear(4, 4),
        lambda m: fully_shard(m, mesh=mesh_3d),
        fix=lambda m: None,
        retry=lambda m: fully_shard(m, mesh=mesh_3d["replicate", "shard"]),
    )

    # Tied across units: the shared weight's other use sits in an already sharded unit.
    def tied_child_first() -> nn.Module:
        model = _tied_pair()
        fully_shard(model.a)
        return model

    def untie(m: nn.Module) -> None:
        m.b.weight = nn.Parameter(torch.randn(3, 3))

    case("tied_across_units_parent", tied_child_first, lambda m: fully_shard(m), fix=untie)

    def tied_siblings() -> nn.Module:
        model = _tied_pair()
        fully_shard(model.a)
        return model

    case("tied_across_units_sibling", tied_siblings, lambda m: fully_shard(m.b), target=lambda m: m.b, fix=untie)

    # Top-down order: the child's parameters already belong to the parent's unit.
    def parent_first() -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(model)
        return model

    case("child_after_parent", parent_first, lambda m: fully_shard(m[0]), target=lambda m: m[0])

    def zero_dim_fix(m: nn.Module) -> None:
        m.scale = nn.Parameter(torch.ones(1))

    case("zero_dim", _ZeroDim, lambda m: fully_shard(m), fix=zero_dim_fix)

    def int_fix(m: nn.Module) -> None:
        del m.index
        m.register_buffer("index", torch.arange(3))

    case("int_param", _IntParam, lambda m: fully_shard(m), fix=int_fix)

    case(
        "not_a_module",
        lambda: nn.Linear(2, 2),
        lambda m: fully_shard(m.weight),  # type: ignore[arg-type]
        target=lambda m: m,
    )
    case("bad_mesh", lambda: nn.Linear(2, 2), lambda m: fully_shard(m, mesh="cpu"))  # type: ignore[arg-type]
    case(
        "bad_policy", lambda: nn.Linear(2, 2), lambda m: fully_shard(m, mp_policy={"main_params_dtype": torch.float32})
    )  # type: ignore[arg-type]
    case("bad_reshard", lambda: nn.Linear(2, 2), lambda m: fully_shard(m, reshard_after_forward="yes"))  # type: ignore[arg-type]

    # Tied within one unit is supported: one sharded parameter in both places, not duplicated.
    model = _tied_pair()
    fully_shard(model)
    cases["tied_within_unit"] = {
        "same_object": model.a.weight is model.b.weight,
        "named_parameters": [n for n, _ in model.named_parameters()],
        "state_dict_keys": sorted(model.state_dict()),
        "group_params": sum(len(g.params) for g in model.fsdp_parameter_groups),
    }
    return cases


@pytest.fixture(scope="module")
def cases(run_once) -> list[dict]:
    return run_once(2, errors_run, 2)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_raises_and_leaves_module_unchanged(cases, case: str) -> None:
    exc_type, words = EXPECTED[case]
    for facts in cases:
        outcome = facts[case]
        assert outcome["type"] == exc_type, outcome
        for word in words:
            assert word in outcome["message"], f"{word!r} not in {outcome['message']!r}"
        assert outcome["changed"] == [], f"the failed call changed the module: {outcome['changed']}"
        if case != "applied_twice":
            assert outcome["target_is_fsdp"] is False, f"{case}: the target became an FSDP module"
        if case in RETRIED:
            assert outcome["retry"] == "ok" and outcome["retry_is_fsdp"], outcome


def test_tied_parameters_within_one_unit_are_not_duplicated(cases) -> None:
    for facts in cases:
        tied = facts["tied_within_unit"]
        assert tied["same_object"] is True, "the tied weight is two objects after fully_shard"
        assert tied["named_parameters"] == ["a.weight", "a.bias", "b.bias"]
        assert tied["state_dict_keys"] == ["a.bias", "a.weight", "b.bias", "b.weight"]
        assert tied["group_params"] == 3


def module_snapshot(module: nn.Module) -> list[tuple[Any, ...]]:
    """Everything a failed ``fully_shard`` must leave as it was, for every submodule."""
    return [
        (
            name,
            type(m),
            [(k, id(p)) for k, p in m._parameters.items()],
            [(k, id(b)) for k, b in m._buffers.items()],
            len(m._forward_pre_hooks),
            len(m._forward_hooks),
            len(m._backward_hooks),
            "_fsdp_state" in m.__dict__,
        )
        for name, m in module.named_modules(remove_duplicate=False)
    ]


def test_without_process_group_or_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    module = nn.Linear(3, 3)
    before = module_snapshot(module)
    with pytest.raises(RuntimeError, match="initialized torch.distributed process group"):
        fully_shard(module)
    assert module_snapshot(module) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"main_params_dtype": torch.int32},
        {"main_params_dtype": "float32"},
        {"main_grads_dtype": torch.int64},
        {"main_grads_dtype": torch.bool},
    ],
    ids=repr,
)
def test_mixed_precision_policy_rejects_non_float_dtypes(kwargs: dict) -> None:
    with pytest.raises(TypeError, match="floating-point torch.dtype"):
        MixedPrecisionPolicy(**kwargs)


def test_mixed_precision_policy_defaults() -> None:
    policy = MixedPrecisionPolicy()
    assert policy.main_params_dtype == torch.float32 and policy.main_grads_dtype is None
    assert policy.grads_dtype_for(torch.bfloat16) == torch.bfloat16
    assert MixedPrecisionPolicy(main_grads_dtype=torch.float32).grads_dtype_for(torch.bfloat16) == torch.float32
