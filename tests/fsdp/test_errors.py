"""Every bad input gets its error (type and message), and a failed ``fully_shard`` leaves the
module as it was: same parameter objects, same class, no hooks, no FSDP state; fixing the input
and calling again then works (no registry state was left behind)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_patch import MixedPrecisionPolicy, fully_shard
from tests.fsdp import rank_fns

# case -> (exception type, words the message must contain)
EXPECTED = {
    "applied_twice": ("ValueError", ["already applied", "once"]),
    "mesh_2d": ("NotImplementedError", ["1-D", "2-D"]),
    "tied_across_units_parent": ("ValueError", ["'b.weight'", "tied", "one unit", "'weight'"]),
    "tied_across_units_sibling": ("ValueError", ["tied", "one unit"]),
    "child_after_parent": ("ValueError", ["already sharded", "bottom-up"]),
    "zero_dim": ("ValueError", ["'scale'", "0-dimensional"]),
    "int_param": ("ValueError", ["'index'", "torch.int64", "floating-point"]),
    "not_a_module": ("TypeError", ["nn.Module"]),
    "bad_mesh": ("TypeError", ["DeviceMesh"]),
    "bad_policy": ("TypeError", ["MixedPrecisionPolicy"]),
    "bad_reshard": ("TypeError", ["reshard_after_forward", "bool"]),
}
RETRIED = ["mesh_2d", "tied_across_units_parent", "tied_across_units_sibling", "zero_dim", "int_param"]


@pytest.fixture(scope="module")
def cases(run_once) -> list[dict]:
    return run_once(2, rank_fns.errors_run, 2)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_raises_and_leaves_module_unchanged(cases, case: str) -> None:
    exc_type, words = EXPECTED[case]
    for facts in cases:
        outcome = facts[case]
        assert outcome["type"] == exc_type, outcome
        for word in words:
            assert word in outcome["message"], f"{word!r} not in {outcome['message']!r}"
        assert outcome["unchanged"], "the failed call changed the module"
        if case != "applied_twice":
            assert not outcome["target_is_fsdp"]
        if case in RETRIED:
            assert outcome["retry"] == "ok" and outcome["retry_is_fsdp"], outcome


def test_tied_parameters_within_one_unit_are_not_duplicated(cases) -> None:
    for facts in cases:
        tied = facts["tied_within_unit"]
        assert tied["same_object"]
        assert tied["named_parameters"] == ["a.weight", "a.bias", "b.bias"]
        assert tied["state_dict_keys"] == ["a.bias", "a.weight", "b.bias", "b.weight"]
        assert tied["group_params"] == 3


def test_without_process_group_or_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    module = nn.Linear(3, 3)
    before = rank_fns.module_snapshot(module)
    with pytest.raises(RuntimeError, match="initialized torch.distributed process group"):
        fully_shard(module)
    assert rank_fns.module_snapshot(module) == before


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
