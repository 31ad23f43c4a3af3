"""FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on a
parameter's tensor) is never dropped silently. torchao's tensorwise float8 weight is honored by
a float8 compute copy (``test_float8_compute_copy.py``); every other tensor defining it, and
torchao's weights where that copy does not apply (``compute_copy="per_gather"``, a weight tensor
parallelism placed), is refused by ``fully_shard`` naming the parameter, the class, the methods
and the alternatives, with the module left as it was (same parameter objects of the same types,
same class, no hooks, no FSDP state; a retry with plain tensors then shards it); such a tensor
replacing a sharded parameter is refused at the next forward, the sharded parameter put back.

On 2 gloo ranks, with torchao's ``Float8Linear`` weights (emulated fp8) and with a minimal
hand-written subclass that FSDP2 calls (the control: the extension is a working one). torchao's
float8 training without the fp8 all-gather trains under ``fully_shard`` as under FSDP2, and so
does rowwise scaling, for which torchao has no float8 all-gather (its config refuses
``enable_fsdp_float8_all_gather`` with rowwise): its weights gather in bf16 and are cast rowwise
in forward, under either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor

from tests.fsdp import float8_models
from tests.fsdp.sharded_views import rank0, world
from tests.fsdp.test_errors import module_snapshot
from tests.fsdp.training_runs import Run, assert_same_training, global_losses

aten = torch.ops.aten
# What FSDP2 does to the sharded parameter (pads, chunks, views, copies): the subclass must survive it.
_KEEPS_SUBCLASS = {
    aten.detach.default,
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten.split.Tensor,
    aten.clone.default,
}


class GatheredInBf16(torch.Tensor):
    """A weight that all-gathers itself in bf16 through FSDP2's extension: the smallest wrapper
    subclass FSDP2 shards and calls (``calls`` records each call on this process)."""

    calls: list[str] = []

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> GatheredInBf16:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, cls, out) if func in _KEEPS_SUBCLASS else out

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: Any, size: Any, stride: Any) -> GatheredInBf16:
        return GatheredInBf16(inner["_data"])

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        GatheredInBf16.calls.append("pre")
        return (self._data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(
        self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *, out: Any = None
    ) -> Any:
        GatheredInBf16.calls.append("post")
        (data,) = outputs
        if out is not None:
            return None
        return data.to(param_dtype), (data,)


class PreOnly(torch.Tensor):
    """Defines half of the extension (FSDP2 asserts both or neither)."""

    def fsdp_pre_all_gather(self, mesh: Any) -> Any:
        raise AssertionError("never called")


def _subclassed_linear() -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(8, 6)
    layer.weight = nn.Parameter(GatheredInBf16(layer.weight.detach().clone()))
    return layer


def _plain_weights(model: nn.Module) -> None:
    """The fix a retry gets: each weight that is not a plain tensor replaced by one of its values."""
    for layer in float8_models.linears(model):
        weight = layer.weight
        if isinstance(weight, DTensor):
            weight = weight._local_tensor
        if type(weight) is not nn.Parameter:
            inner = getattr(weight, "_data", getattr(weight, "_tensor", None))
            layer.weight = nn.Parameter(inner.detach().clone())


def _types(module: nn.Module) -> list[tuple[str, str]]:
    return [(name, type(p).__name__) for name, p in module.named_parameters()]


def _torchao_weight(tensor: torch.Tensor) -> torch.Tensor:
    """torchao's tensorwise float8 weight over ``tensor``, as ``Float8Linear.from_float`` makes it."""
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return WeightWithDynamicFloat8CastTensor(tensor, LinearMMConfig(), torch.float8_e4m3fn)


def refusals_run() -> dict[str, Any]:
    """Each refused case: the exception, what it changed (``module_snapshot`` and the parameters'
    types before and after), and whether a retry with plain weights shards and runs a step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    from fsdp_patch import MixedPrecisionPolicy, fully_shard

    _, world_size = world()
    mesh = init_device_mesh("cpu", (world_size,))
    cases: dict[str, Any] = {}

    def case(name: str, build: Callable[[], nn.Module], call: Callable[[nn.Module], Any]) -> None:
        module = build()
        before = (module_snapshot(module), _types(module))
        try:
            call(module)
        except Exception as exc:
            outcome: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
        else:
            outcome = {"type": None, "message": ""}
        outcome["changed"] = before != (module_snapshot(module), _types(module))
        _plain_weights(module)
        call(module)
        module(torch.randn(4, module_input(module), dtype=next(module.parameters()).dtype)).sum().backward()
        outcome["retry_is_fsdp"] = type(module).__name__.startswith("FSDP")
        cases[name] = outcome

    case("subclass", _subclassed_linear, fully_shard)

    def per_gather(model: nn.Module) -> None:
        policy = MixedPrecisionPolicy(compute_copy="per_gather")
        for layer in float8_models.linears(model):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)

    case("torchao_per_gather", lambda: float8_models.float8_mlp(fp8_all_gather=True), per_gather)

    def tensor_parallel() -> nn.Module:
        # As torchao's tensor parallelism leaves a weight: a DTensor over its float8 weight.
        layer = float8_models.float8_mlp(fp8_all_gather=True)[0]
        layer.weight = nn.Parameter(DTensor.from_local(layer.weight, mesh, [Replicate()], run_check=False))
        return layer

    case("torchao_tensor_parallel", tensor_parallel, lambda m: fully_shard(m, mesh=mesh))

    def pre_only() -> nn.Linear:
        layer = nn.Linear(8, 6)
        layer.weight = nn.Parameter(torch.Tensor._make_subclass(PreOnly, layer.weight.detach()))
        return layer

    module = pre_only()
    try:
        fully_shard(module)
    except TypeError as exc:
        cases["pre_only"] = {"type": "TypeError", "message": str(exc), "is_fsdp": type(module).__name__}

    # A DTensor parameter (as tensor parallelism leaves one) whose local tensor defines it.
    layer = nn.Linear(8, 6)
    local = GatheredInBf16(layer.weight.detach().clone())
    layer.weight = nn.Parameter(DTensor.from_local(local, mesh, [Replicate()], run_check=False))
    try:
        fully_shard(layer, mesh=mesh)
    except TypeError as exc:
        cases["dtensor"] = {"type": "TypeError", "message": str(exc), "is_fsdp": type(layer).__name__}

    # Replacing a sharded parameter: refused at the next forward, the sharded one put back.
    for name, replacement in (("replaced", GatheredInBf16), ("replaced_torchao", _torchao_weight)):
        layer = fully_shard(nn.Linear(8, 6))
        sharded = layer.weight
        values = sharded.full_tensor().clone()
        layer.weight = nn.Parameter(replacement(torch.zeros(6, 8)))
        try:
            layer(torch.randn(2, 8))
        except TypeError as exc:
            cases[name] = {"type": "TypeError", "message": str(exc)}
        cases[name]["put_back"] = layer.weight is sharded
        cases[name]["values_kept"] = torch.equal(layer.weight.full_tensor(), values)
        layer(torch.randn(2, 8)).sum().backward()  # the next forward runs

    # Left out by ignored_params: not sharded, so nothing of it is dropped.
    layer = _subclassed_linear()
    weight = layer.weight
    fully_shard(layer, ignored_params={weight})
    cases["ignored"] = {"same_object": layer.weight is weight, "type": type(layer.weight).__name__}
    return rank0(cases)


def module_input(module: nn.Module) -> int:
    return float8_models.linears(module)[0].in_features  # type: ignore[return-value]


def fsdp2_calls_run() -> list[str]:
    """The control: FSDP2 shards the hand-written subclass and calls its extension at each all-gather."""
    from torch.distributed.fsdp import fully_shard

    GatheredInBf16.calls.clear()
    layer = fully_shard(_subclassed_linear())
    local_type = type(layer.weight._local_tensor).__name__
    layer(torch.randn(3, 8)).sum().backward()
    return [local_type, *GatheredInBf16.calls]


@pytest.fixture(scope="module")
def cases(run_once) -> dict[str, Any]:
    float8_models.require_torchao()
    return run_once(2, refusals_run)[0]


EXTENSION = "FSDP2's all-gather extension"
BOTH = "fsdp_pre_all_gather, fsdp_post_all_gather"
TORCHAO = "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"


@pytest.mark.parametrize("name", ["subclass", "torchao_per_gather", "torchao_tensor_parallel"])
def test_an_extension_fully_shard_cannot_honor_is_refused_and_the_module_left_untouched(cases, name: str) -> None:
    outcome = cases[name]
    assert outcome["type"] == "TypeError", f"expected a TypeError, got {outcome}"
    for words in ("parameter '", EXTENSION, BOTH, "Nothing was changed"):
        assert words in outcome["message"], f"expected {words!r} in {outcome['message']!r}"
    assert outcome["changed"] is False, f"{name}: the refused fully_shard changed the module"
    assert outcome["retry_is_fsdp"] is True, f"{name}: a retry with plain weights did not shard"


def test_hand_written_subclass_refusal_names_its_class_and_what_is_honored(cases) -> None:
    message = cases["subclass"]["message"]
    for words in (
        f"parameter 'weight' is a {__name__}.GatheredInBf16",
        "honors no all-gather extension but torchao's tensorwise float8 weight",
        "torch.distributed.fsdp.fully_shard",
    ):
        assert words in message, f"expected {words!r} in {message!r}"
    assert "enable_fsdp_float8_all_gather=False" not in message, f"a torchao hint for another class: {message!r}"


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("torchao_per_gather", ["parameter 'weight' is a " + TORCHAO, "compute_copy='per_gather'", "persistent"]),
        ("torchao_tensor_parallel", ["is a DTensor whose local tensor is a " + TORCHAO, "tensor parallelism"]),
    ],
)
def test_torchao_weights_the_float8_copy_cannot_keep_are_refused_naming_why_and_alternatives(
    cases, name: str, words: list[str]
) -> None:
    message = cases[name]["message"]
    for want in [*words, "Float8LinearConfig(enable_fsdp_float8_all_gather=False)", "torch.distributed.fsdp"]:
        assert want in message, f"expected {want!r} in {message!r}"


def test_half_an_extension_is_refused_naming_the_method_defined(cases) -> None:
    outcome = cases["pre_only"]
    assert "(fsdp_pre_all_gather)" in outcome["message"], f"expected the one method named, got {outcome['message']!r}"
    assert outcome["is_fsdp"] == "Linear", f"expected the module's class kept, got {outcome['is_fsdp']}"


def test_a_dtensor_whose_local_tensor_defines_it_is_refused(cases) -> None:
    outcome = cases["dtensor"]
    want = f"is a DTensor whose local tensor is a {__name__}.GatheredInBf16"
    assert want in outcome["message"], f"expected {want!r} in {outcome['message']!r}"
    assert outcome["is_fsdp"] == "Linear", f"expected the module's class kept, got {outcome['is_fsdp']}"


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("replaced", ["was replaced by a " + __name__ + ".GatheredInBf16"]),
        ("replaced_torchao", ["was replaced by a " + TORCHAO, "a plain one", "asks for a float8 all-gather"]),
    ],
)
def test_a_replacement_defining_it_is_refused_and_the_sharded_parameter_put_back(
    cases, name: str, words: list[str]
) -> None:
    outcome = cases[name]
    for want in ["parameter 'weight'", EXTENSION, "The sharded parameter was put back", *words]:
        assert want in outcome["message"], f"expected {want!r} in {outcome['message']!r}"
    assert outcome["put_back"] and outcome["values_kept"], f"expected the sharded parameter back as it was: {outcome}"


def test_an_ignored_parameter_defining_it_is_left_alone(cases) -> None:
    want = {"same_object": True, "type": "GatheredInBf16"}
    assert cases["ignored"] == want, f"expected {want}, got {cases['ignored']}"


def test_fsdp2_calls_the_hand_written_extension(run_once) -> None:
    for got in run_once(2, fsdp2_calls_run):
        want = ["GatheredInBf16", "pre", "post"]
        assert got == want, f"expected FSDP2 to keep the subclass and call its extension once each: {want}, got {got}"


def float8_training_run(recipe: str) -> dict[str, Any]:
    """torchao float8 training without a float8 all-gather (tensorwise with it turned off, or
    rowwise): fully_shard against FSDP2."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=False)
    else:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    runs = {
        impl: float8_models.train(float8_models.shard(float8_models.float8_mlp(False, config=config), impl), impl)
        for impl in ("ours", "fsdp2")
    }
    assert_same_training(Run(**runs["ours"]), Run(**runs["fsdp2"]), 0.0, f"fully_shard against FSDP2, {recipe}")
    return rank0(global_losses(runs["ours"]["losses"]))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_training_without_a_float8_all_gather_trains_as_fsdp2(run_once, recipe: str) -> None:
    float8_models.require_torchao()
    losses = run_once(2, float8_training_run, recipe)[0]
    assert losses[-1] < losses[0], f"expected the loss to fall, got {losses}"
