"""FSDP2's mixed precision under ``fully_shard``: ``MixedPrecisionPolicy`` (ours or torch's object)
trains like FSDP2, ``output_dtype`` and ``cast_forward_inputs`` cast as FSDP2 casts, and the policy
itself (keywords only, ``reduce_dtype`` as the main-grad dtype, types refused, immutable, torch's
policy mapped field for field).
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from tests.fsdp import pattern_models
from tests.fsdp.fsdp2_api import BF16, Api, both, compare, net, train

# -- scripts (run on the ranks) -------------------------------------------------------------------


def mixed_precision_script(impl: str, reduce_dtype: str | None, policy_class: str) -> dict[str, Any]:
    """An fp32 model, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=...)``, the policy
    built from ``policy_class`` ("own": the import the script uses; "torch": FSDP2's class, kept
    while only ``fully_shard`` changed its import)."""
    api = Api.of(impl)
    policy_type = Api.of("fsdp2").policy if policy_class == "torch" else api.policy
    reduce = None if reduce_dtype is None else getattr(torch, reduce_dtype)
    # FSDP2 reduces in param_dtype when reduce_dtype is None: said explicitly, as its default
    # follows the fp32 parameters from torch 2.15 on.
    if impl == "fsdp2" and reduce is None:
        reduce = BF16
    model = api.shard(net(), mp_policy=policy_type(param_dtype=BF16, reduce_dtype=reduce))
    seen: dict[str, Any] = {}
    model.blocks[0].register_forward_pre_hook(
        lambda m, args: seen.setdefault("block_input", str(args[0].dtype)) and None
    )
    result = train(api, model)
    result["facts"] = {
        **seen,
        "output": str(model(torch.randn(2, pattern_models.IN)).dtype),
        "sharded_dtype": str(next(model.blocks[0].parameters()).dtype),
    }
    return result


def forward_casts_script(impl: str, output_dtype: str | None, cast_forward_inputs: bool) -> dict[str, Any]:
    """``output_dtype`` on the root and ``cast_forward_inputs`` everywhere: the dtype the root's
    first layer receives (it casts to its weights' dtype itself, for ``cast_forward_inputs=False``)
    and the dtype of the model's output."""
    api = Api.of(impl)
    model = net()
    seen: list[str] = []

    def to_weight_dtype(module: nn.Module, args: tuple) -> tuple:
        seen.append(str(args[0].dtype))
        return (args[0].to(module.weight.dtype),)

    model.inp.register_forward_pre_hook(to_weight_dtype)
    common = dict(param_dtype=BF16, reduce_dtype=torch.float32, cast_forward_inputs=cast_forward_inputs)
    for block in model.blocks:
        api.fully_shard(block, mp_policy=api.policy(**common))
    output = None if output_dtype is None else getattr(torch, output_dtype)
    api.fully_shard(model, mp_policy=api.policy(output_dtype=output, **common))
    result = train(api, model)
    result["facts"] = {"root_input": sorted(set(seen)), "output": str(model(torch.randn(2, pattern_models.IN)).dtype)}
    return result


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_class", ["own", "torch"])
@pytest.mark.parametrize("reduce_dtype", ["float32", None])
def test_fsdp2_mixed_precision_policy_trains_like_fsdp2(run_once, reduce_dtype, policy_class) -> None:
    ours, fsdp2 = both(run_once, mixed_precision_script, reduce_dtype, policy_class)
    # Same bf16 compute from the same fp32 weights; the reduce and the fp32 update agree to rounding.
    compare(ours, fsdp2, tol=1e-4, facts=False)
    got = {k: v for k, v in ours[0]["facts"].items() if k != "sharded_dtype"}
    want = {k: v for k, v in fsdp2[0]["facts"].items() if k != "sharded_dtype"}
    assert got == want == {"block_input": "torch.bfloat16", "output": "torch.bfloat16"}, (got, want)
    assert ours[0]["facts"]["sharded_dtype"] == "torch.float32", f"main weights: {ours[0]['facts']}"


@pytest.mark.parametrize(
    ("output_dtype", "cast_forward_inputs"), [("float32", True), (None, False), ("float16", False)]
)
def test_output_dtype_and_cast_forward_inputs_as_fsdp2(run_once, output_dtype, cast_forward_inputs) -> None:
    ours, fsdp2 = both(run_once, forward_casts_script, output_dtype, cast_forward_inputs)
    compare(ours, fsdp2, tol=1e-4)
    want = {
        "root_input": ["torch.bfloat16" if cast_forward_inputs else "torch.float32"],
        "output": f"torch.{output_dtype or 'bfloat16'}",
    }
    assert ours[0]["facts"] == want, f"want {want}, got {ours[0]['facts']}"


# -- the policy itself ------------------------------------------------------------------------------


def test_policy_takes_keywords_only_naming_them() -> None:
    from fsdp_patch import MixedPrecisionPolicy

    with pytest.raises(TypeError, match="keyword arguments only .*param_dtype=.*reduce_dtype="):
        MixedPrecisionPolicy(BF16, torch.float32)  # type: ignore[misc]


def test_policy_reduce_dtype_is_main_grads_dtype() -> None:
    from fsdp_patch import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    got = (policy.main_grads_dtype, policy.reduce_dtype, policy.compute_dtype_for(torch.float32))
    assert got == (torch.float32, torch.float32, BF16), f"got {got}"
    assert policy == MixedPrecisionPolicy(param_dtype=BF16, main_grads_dtype=torch.float32)
    assert MixedPrecisionPolicy().compute_dtype_for(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="reduce_dtype .* and main_grads_dtype name one setting"):
        MixedPrecisionPolicy(reduce_dtype=torch.float32, main_grads_dtype=BF16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"param_dtype": torch.int8}, "param_dtype must be a floating-point"),
        ({"reduce_dtype": "float32"}, "reduce_dtype must be a floating-point"),
        ({"output_dtype": torch.bool}, "output_dtype must be a floating-point"),
        ({"cast_forward_inputs": 1}, "cast_forward_inputs must be a bool"),
    ],
    ids=repr,
)
def test_policy_refuses_wrong_types(kwargs: dict, match: str) -> None:
    from fsdp_patch import MixedPrecisionPolicy

    with pytest.raises(TypeError, match=match):
        MixedPrecisionPolicy(**kwargs)


def test_policy_is_immutable_hashable_and_pickles() -> None:
    from fsdp_patch import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=BF16, output_dtype=torch.float32, compute_copy="per_gather")
    with pytest.raises(AttributeError, match="immutable"):
        policy.param_dtype = torch.float16  # type: ignore[misc]
    again = pickle.loads(pickle.dumps(policy))
    assert again == policy and hash(again) == hash(policy), f"{again} != {policy}"
    assert "param_dtype=torch.bfloat16" in repr(policy), repr(policy)


def test_torch_policy_maps_field_for_field() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    from fsdp_patch.mixed_precision import MixedPrecisionPolicy, as_policy

    got = as_policy(
        TorchPolicy(param_dtype=BF16, reduce_dtype=torch.float32, output_dtype=torch.float16, cast_forward_inputs=False)
    )
    want = MixedPrecisionPolicy(
        param_dtype=BF16, reduce_dtype=torch.float32, output_dtype=torch.float16, cast_forward_inputs=False
    )
    assert got == want, f"got {got}, want {want}"


def test_torch_policy_with_a_field_fully_shard_lacks_is_refused() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    from fsdp_patch.mixed_precision import as_policy

    @dataclasses.dataclass(frozen=True)
    class LaterPolicy(TorchPolicy):  # a field a later torch might add
        param_dtype_override_fn: Any = None

    with pytest.raises(ValueError, match=r"sets \['param_dtype_override_fn'\], which fully_shard does not implement"):
        as_policy(LaterPolicy(param_dtype=BF16, param_dtype_override_fn=len))
    assert as_policy(LaterPolicy(param_dtype=BF16)).param_dtype == BF16
    with pytest.raises(TypeError, match="MixedPrecisionPolicy .*or None, got <class 'dict'>"):
        as_policy({"param_dtype": BF16})
