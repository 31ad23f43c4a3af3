"""FSDP2's public API under ``fully_shard``: each script below uses one part of it and trains on 2
ranks with ``fully_shard`` ("ours") and with torch's FSDP2 (the control), which must agree.

A script is written once, against whichever ``fully_shard`` / ``MixedPrecisionPolicy`` it is
given, as a user migrating by changing one import would have it; what it observes besides its
losses and final weights (dtypes, what stayed gathered, hook calls) is compared too.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tests.comparison import max_abs_difference
from tests.fsdp import pattern_models
from tests.fsdp.pattern_models import Net, data, rows

WORLD_SIZE = 2
STEPS = 3
LR = 0.05
# fp32: the two reduce over ranks in different orders of rounding (FSDP2 pre- and post-divides on
# gloo, which has no averaging op), so final weights agree to float32 rounding after 3 steps.
FP32_TOL = 1e-5
BF16 = torch.bfloat16


@dataclasses.dataclass
class Api:
    """What a script imports: FSDP2's or ours."""

    impl: str
    fully_shard: Callable[..., nn.Module]
    policy: type

    @classmethod
    def of(cls, impl: str) -> Api:
        if impl == "ours":
            from fsdp_patch import MixedPrecisionPolicy, fully_shard

            return cls(impl, fully_shard, MixedPrecisionPolicy)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        return cls(impl, fully_shard, MixedPrecisionPolicy)

    def shard(self, model: Net, **kwargs: Any) -> Net:
        for block in model.blocks:
            self.fully_shard(block, **kwargs)
        self.fully_shard(model, **kwargs)
        return model

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        if self.impl == "ours":
            from fsdp_patch.optimizer import fully_shard_optimizer

            fully_shard_optimizer(optimizer)
        return optimizer


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float().clone()


def _train(
    api: Api,
    model: Net,
    *,
    microbatches: int = 1,
    before_forward: Callable[[Net, int, int], None] | None = None,
    after_backward: Callable[[Net, int, int], None] | None = None,
    input_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """SGD with momentum over ``STEPS`` steps of this rank's rows, ``microbatches`` per step
    (gradient sync on the last only); the callbacks run around each microbatch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    optimizer = api.optimizer(model)
    losses = []
    for step, (x, y) in enumerate(data(STEPS)):
        x, y = rows(x, rank, world_size), rows(y, rank, world_size)
        for micro, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches), strict=True)):
            last = micro == microbatches - 1
            if microbatches > 1:
                model.set_requires_gradient_sync(last)
            if before_forward is not None:
                before_forward(model, step, micro)
            out = model(xm if input_dtype is None else xm.to(input_dtype))
            loss = F.mse_loss(out.float(), ym)
            loss.backward()
            if after_backward is not None:
                after_backward(model, step, micro)
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()}}


def _net(seed: int = 0, **options: Any) -> Net:
    torch.manual_seed(seed)
    return Net(norm=True, **options)


# ---------------------------------------------------------------------------- scripts (run on the ranks)


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
    model = api.shard(_net(), mp_policy=policy_type(param_dtype=BF16, reduce_dtype=reduce))
    seen: dict[str, Any] = {}
    model.blocks[0].register_forward_pre_hook(
        lambda m, args: seen.setdefault("block_input", str(args[0].dtype)) and None
    )
    result = _train(api, model)
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
    model = _net()
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
    result = _train(api, model)
    result["facts"] = {"root_input": sorted(set(seen)), "output": str(model(torch.randn(2, pattern_models.IN)).dtype)}
    return result


def unshard_async_script(impl: str, wait: bool) -> dict[str, Any]:
    """``unshard(async_op=True)`` on every unit before each forward, the handles waited for
    (``wait``) or left to the forward."""
    api = Api.of(impl)
    model = api.shard(_net())
    handles: list[Any] = []

    def prefetch(model: Net, step: int, micro: int) -> None:
        for unit in (model, *model.blocks):
            handle = unit.unshard(async_op=True)
            handles.append(type(handle).__name__)
            if wait:
                handle.wait()

    result = _train(api, model, before_forward=prefetch)
    result["facts"] = {"handle": handles[0], "handles": len(handles), "sync_returns": repr(model.unshard())}
    model.reshard()
    return result


def reshard_by_hand_script(impl: str) -> dict[str, Any]:
    """``reshard_after_forward=False`` on every unit, a forward with grad whose backward never
    runs, then ``reshard()`` on every unit: the module holds its sharded parameters again, and
    training goes on."""
    api = Api.of(impl)
    model = api.shard(_net(), reshard_after_forward=False)
    model(torch.randn(2, pattern_models.IN))
    held_after_forward = sorted({type(p).__name__ for p in model.parameters()})
    for unit in (model, *model.blocks):
        unit.reshard()
    held_after_reshard = sorted({type(p).__name__ for p in model.parameters()})
    result = _train(api, model)
    result["facts"] = {"after_forward": held_after_forward, "after_reshard": held_after_reshard}
    return result


def reshard_after_forward_setter_script(impl: str) -> dict[str, Any]:
    """``set_reshard_after_forward``: ``False`` on every unit keeps the blocks gathered after a
    forward; ``True`` frees every unit after forward, the root's too (whose default keeps them)."""
    api = Api.of(impl)
    model = api.shard(_net())
    kinds = {}
    for setting in (False, True):
        model.set_reshard_after_forward(setting)
        out = model(torch.randn(2, pattern_models.IN))
        kinds[str(setting)] = {
            "block": sorted({type(p).__name__ for p in model.blocks[0].parameters()}),
            "root": sorted({type(p).__name__ for p in model.head.parameters()}),
        }
        out.sum().backward()
        model.zero_grad(set_to_none=True)
    result = _train(api, model)
    try:
        model.set_reshard_after_forward(1)  # type: ignore[arg-type]
        refusal = "accepted"
    except ValueError as error:
        refusal = type(error).__name__
    result["facts"] = {"kinds": kinds, "non_bool": refusal}
    return result


def reshard_after_backward_script(impl: str) -> dict[str, Any]:
    """Gradient accumulation over 2 microbatches with ``set_reshard_after_backward(last)``: the
    blocks stay gathered between the microbatches without sync."""
    api = Api.of(impl)
    model = api.shard(_net())
    gathered: list[bool] = []

    def before(model: Net, step: int, micro: int) -> None:
        model.set_reshard_after_backward(micro == 1)

    def after(model: Net, step: int, micro: int) -> None:
        gathered.append(_block_gathered(model.blocks[0], impl))

    result = _train(api, model, microbatches=2, before_forward=before, after_backward=after)
    result["facts"] = {"gathered": gathered}
    return result


def _block_gathered(block: nn.Module, impl: str) -> bool:
    if impl == "ours":
        return any(group.unsharded_storage_bytes() > 0 for group in block.fsdp_parameter_groups)
    from fsdp_patch.torch_interop.torch_compat import fsdp2_state_param_groups

    return any(group.is_unsharded for group in fsdp2_state_param_groups(block._get_fsdp_state()))


def _divide_by_4(unit: Any, impl: str, calls: list) -> None:
    unit.set_gradient_divide_factor(4.0)
    if impl == "fsdp2":
        # FSDP2 divides by a factor with a premultiplied sum, which gloo lacks, unless told to sum
        # and divide apart; the arithmetic is the same.
        unit.set_force_sum_reduction_for_comms(True)


def _divide_by_4_deprecated(unit: Any, impl: str, calls: list) -> None:
    unit.set_reduce_scatter_divide_factor(4.0)
    if impl == "fsdp2":
        unit.set_force_sum_reduction_for_comms(True)


def _force_sum(unit: Any, impl: str, calls: list) -> None:
    unit.set_force_sum_reduction_for_comms(True)


def _divide_by_half_force_sum(unit: Any, impl: str, calls: list) -> None:
    unit.set_gradient_divide_factor(0.5)
    unit.set_force_sum_reduction_for_comms(True)


def _divide_by_4_on_the_root(unit: Any, impl: str, calls: list) -> None:
    # Not recursive, in FSDP2 as here: set on the root, the blocks' grads stay the mean.
    if isinstance(unit, Net):
        _divide_by_4(unit, impl, calls)


def _halving_all_reduce_hook(unit: Any, impl: str, calls: list) -> None:
    unit.set_all_reduce_hook(lambda output: (calls.append(tuple(output.shape)), output.mul_(0.5)))


def _not_last_backward(unit: Any, impl: str, calls: list) -> None:
    unit.set_is_last_backward(False)


def _no_all_reduce(unit: Any, impl: str, calls: list) -> None:
    unit.set_requires_all_reduce(False)


def _where_fsdp2_has_it(unit: Any, impl: str, method: str, *args: Any, **kwargs: Any) -> None:
    """Calls a setting that leaves the arithmetic as it is; an FSDP2 control of a torch without
    it (before 2.13) trains without it, which must come out the same."""
    if impl == "ours" or hasattr(unit, method):
        getattr(unit, method)(*args, **kwargs)


def _separate_reduce_scatter_group(unit: Any, impl: str, calls: list) -> None:
    _where_fsdp2_has_it(unit, impl, "set_separate_reduce_scatter_group", True, recurse=False)


def _reduce_unused(unit: Any, impl: str, calls: list) -> None:
    _where_fsdp2_has_it(unit, impl, "set_reduce_scatter_unused_params", True, recurse=False)


def _one_reduce_buffer(unit: Any, impl: str, calls: list) -> None:
    _where_fsdp2_has_it(unit, impl, "set_reduce_scatter_max_input_buffers", 1, recurse=False)


def _default_allocation(unit: Any, impl: str, calls: list) -> None:
    unit.set_allocate_memory_from_process_group_for_comm(False)


SETTINGS: dict[str, Callable[[Any, str, list], None]] = {
    "divide_factor": _divide_by_4,
    "divide_factor_deprecated": _divide_by_4_deprecated,
    "force_sum": _force_sum,
    "divide_factor_force_sum": _divide_by_half_force_sum,
    "divide_factor_on_the_root": _divide_by_4_on_the_root,
    "all_reduce_hook": _halving_all_reduce_hook,
    "is_last_backward": _not_last_backward,
    "requires_all_reduce": _no_all_reduce,
    "separate_reduce_scatter_group": _separate_reduce_scatter_group,
    "reduce_scatter_unused_params": _reduce_unused,
    "reduce_scatter_max_input_buffers": _one_reduce_buffer,
    "allocation_from_process_group_off": _default_allocation,
}


def settings_script(impl: str, method: str) -> dict[str, Any]:
    """One of FSDP2's settings that change how grads are reduced (or nothing), set on every unit."""
    api = Api.of(impl)
    model = api.shard(_net())
    calls: list[tuple[int, ...]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for unit in (model, *model.blocks):
            SETTINGS[method](unit, impl, calls)
    result = _train(api, model)
    result["facts"] = {
        "hook_calls": len(calls),
        "warnings": sorted({type(w.message).__name__ for w in caught if "divide_factor" in str(w.message)}),
    }
    return result


class Embedded(nn.Module):
    """An embedding (its own unit) in front of the pattern model's layers: an embedding's weight
    grad reads the indices only, so its backward needs no all-gather."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, pattern_models.IN)
        self.net = Net(norm=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(self.embed(ids))


def unshard_in_backward_script(impl: str) -> dict[str, Any]:
    """``set_unshard_in_backward(False)`` on an embedding unit; the rest as usual."""
    api = Api.of(impl)
    torch.manual_seed(0)
    model = Embedded()
    api.fully_shard(model.embed)
    api.shard(model.net)
    api.fully_shard(model)
    model.embed.set_unshard_in_backward(False)
    optimizer = api.optimizer(model)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(STEPS):
        ids = rows(torch.randint(0, 10, (pattern_models.BATCH,), generator=gen), rank, world_size)
        target = rows(torch.randn(pattern_models.BATCH, pattern_models.OUT, generator=gen), rank, world_size)
        loss = F.mse_loss(model(ids), target)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()}}


def arguments_script(impl: str, argument: str) -> dict[str, Any]:
    """One of ``fully_shard``'s other arguments, as FSDP2 takes it."""
    from torch.distributed.fsdp import OffloadPolicy
    from torch.distributed.tensor import Shard

    api = Api.of(impl)
    model = _net()
    ignored = model.blocks[0].norm.weight
    kwargs: dict[str, Any] = {
        "ignored_params": {"ignored_params": {ignored}},
        "shard_placement_fn": {"shard_placement_fn": lambda p: Shard(0) if p.dim() == 2 else None},
        "offload_policy": {"offload_policy": OffloadPolicy()},
    }[argument]
    api.shard(model, **kwargs)
    result = _train(api, model)
    result["facts"] = {"ignored": type(ignored).__name__ if argument == "ignored_params" else None}
    return result


class CountingAllGather:
    """A custom all-gather (FSDP2's ``AllGather`` interface) that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter:
    """A custom reduce-scatter (FSDP2's ``ReduceScatter`` interface) that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.ops: set[str] = set()

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        self.calls += 1
        self.ops.add(str(op))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def custom_comms_script(impl: str) -> dict[str, Any]:
    api = Api.of(impl)
    model = api.shard(_net())
    gather, reduce = CountingAllGather(), CountingReduceScatter()
    for unit in (model, *model.blocks):
        unit.set_custom_all_gather(gather)
        unit.set_custom_reduce_scatter(reduce)
    result = _train(api, model)
    result["facts"] = {"all_gathers": gather.calls > 0, "reduce_scatters": reduce.calls > 0}
    return result


class RecordingEvent:
    """Stands in for the ``torch.Event`` a GPU script records after its step (the CPU has none)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait(self, stream: Any = None) -> None:
        self.log.append("waited")


def post_optim_event_script(impl: str) -> dict[str, Any]:
    """``set_post_optim_event`` after each step: the next forward waits for it, once."""
    api = Api.of(impl)
    model = api.shard(_net())
    log: list[str] = []

    def before(model: Net, step: int, micro: int) -> None:
        log.append(f"forward {step}")

    def after(model: Net, step: int, micro: int) -> None:
        model.set_post_optim_event(RecordingEvent(log))

    result = _train(api, model, before_forward=before, after_backward=after)
    result["facts"] = {"log": log}
    return result


# ---------------------------------------------------------------------------- tests


def _compare(
    results: list[dict[str, Any]], fsdp2: list[dict[str, Any]], tol: float = FP32_TOL, facts: bool = True
) -> None:
    for rank, (got, want) in enumerate(zip(results, fsdp2, strict=True)):
        diff, where = max_abs_difference(got["params"], want["params"])
        assert diff <= tol, f"rank {rank}: final weights differ from FSDP2's by {diff:.3g} at {where} (tolerance {tol})"
        losses = max(abs(a - b) for a, b in zip(got["losses"], want["losses"], strict=True))
        assert losses <= max(tol, 1e-5) * 10, f"rank {rank}: losses {got['losses']} against FSDP2's {want['losses']}"
        if facts:
            assert got.get("facts") == want.get("facts"), (
                f"rank {rank}: observed {got.get('facts')}, FSDP2 {want.get('facts')}"
            )


def _both(run_once: Callable[..., list[Any]], fn: Callable[..., dict[str, Any]], *args: Any) -> tuple[list, list]:
    return run_once(WORLD_SIZE, fn, "ours", *args), run_once(WORLD_SIZE, fn, "fsdp2", *args)


@pytest.mark.parametrize("policy_class", ["own", "torch"])
@pytest.mark.parametrize("reduce_dtype", ["float32", None])
def test_fsdp2_mixed_precision_policy_trains_like_fsdp2(run_once, reduce_dtype, policy_class) -> None:
    ours, fsdp2 = _both(run_once, mixed_precision_script, reduce_dtype, policy_class)
    # Same bf16 compute from the same fp32 weights; the reduce and the fp32 update agree to rounding.
    _compare(ours, fsdp2, tol=1e-4, facts=False)
    got = {k: v for k, v in ours[0]["facts"].items() if k != "sharded_dtype"}
    want = {k: v for k, v in fsdp2[0]["facts"].items() if k != "sharded_dtype"}
    assert got == want == {"block_input": "torch.bfloat16", "output": "torch.bfloat16"}, (got, want)
    assert ours[0]["facts"]["sharded_dtype"] == "torch.float32", f"main weights: {ours[0]['facts']}"


@pytest.mark.parametrize(
    ("output_dtype", "cast_forward_inputs"), [("float32", True), (None, False), ("float16", False)]
)
def test_output_dtype_and_cast_forward_inputs_as_fsdp2(run_once, output_dtype, cast_forward_inputs) -> None:
    ours, fsdp2 = _both(run_once, forward_casts_script, output_dtype, cast_forward_inputs)
    _compare(ours, fsdp2, tol=1e-4)
    want = {
        "root_input": ["torch.bfloat16" if cast_forward_inputs else "torch.float32"],
        "output": f"torch.{output_dtype or 'bfloat16'}",
    }
    assert ours[0]["facts"] == want, f"want {want}, got {ours[0]['facts']}"


@pytest.mark.parametrize("wait", [True, False])
def test_unshard_async_op_returns_a_handle_and_trains_like_fsdp2(run_once, wait) -> None:
    ours, fsdp2 = _both(run_once, unshard_async_script, wait)
    _compare(ours, fsdp2, facts=False)
    assert ours[0]["facts"]["handles"] == fsdp2[0]["facts"]["handles"] == 3 * STEPS
    assert ours[0]["facts"]["handle"] == "UnshardHandle", ours[0]["facts"]
    assert ours[0]["facts"]["sync_returns"] == fsdp2[0]["facts"]["sync_returns"] == "None"


def test_reshard_puts_the_sharded_parameters_back_after_a_forward_that_kept_them(run_once) -> None:
    ours, fsdp2 = _both(run_once, reshard_by_hand_script)
    _compare(ours, fsdp2)
    facts = ours[0]["facts"]
    assert facts == {"after_forward": ["Parameter"], "after_reshard": ["DTensor"]}, f"ours: {facts}"


def test_set_reshard_after_forward_at_run_time(run_once) -> None:
    ours, fsdp2 = _both(run_once, reshard_after_forward_setter_script)
    _compare(ours, fsdp2)
    want = {
        "False": {"block": ["Parameter"], "root": ["Parameter"]},
        "True": {"block": ["DTensor"], "root": ["DTensor"]},
    }
    assert ours[0]["facts"] == {"kinds": want, "non_bool": "ValueError"}, ours[0]["facts"]


def test_set_reshard_after_backward_keeps_the_blocks_gathered_between_microbatches(run_once) -> None:
    ours, fsdp2 = _both(run_once, reshard_after_backward_script)
    _compare(ours, fsdp2)
    want = [True, False] * STEPS
    assert ours[0]["facts"]["gathered"] == want, f"want gathered after the first microbatch only: {ours[0]['facts']}"


@pytest.mark.parametrize("method", sorted(SETTINGS))
def test_reduction_settings_train_like_fsdp2(run_once, method) -> None:
    ours, fsdp2 = _both(run_once, settings_script, method)
    _compare(ours, fsdp2)
    if method == "all_reduce_hook":
        assert ours[0]["facts"]["hook_calls"] == 3 * STEPS, ours[0]["facts"]
    if method == "divide_factor_deprecated":
        assert ours[0]["facts"]["warnings"] == ["DeprecationWarning"], ours[0]["facts"]


@pytest.mark.parametrize("argument", ["ignored_params", "shard_placement_fn", "offload_policy"])
def test_fully_shard_arguments_train_like_fsdp2(run_once, argument) -> None:
    ours, fsdp2 = _both(run_once, arguments_script, argument)
    _compare(ours, fsdp2)
    if argument == "ignored_params":
        # Not reduced: each rank's copy followed its own rows' grads, in both.
        key = "blocks.0.norm.weight"
        assert not torch.equal(ours[0]["params"][key], ours[1]["params"][key]), "the ignored parameter was reduced"
        assert ours[0]["facts"]["ignored"] == "Parameter", ours[0]["facts"]


def refused_arguments_script(argument: str) -> dict[str, Any]:
    """``fully_shard`` with an argument it refuses: the error, and the module as it was."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import Shard

    # FSDP2's class from torch 2.13 on; before, any value stands for it.
    mesh_dims = torch_fsdp.DataParallelMeshDims(shard="dp") if hasattr(torch_fsdp, "DataParallelMeshDims") else "dp"

    from fsdp_patch import fully_shard

    model = _net()
    if argument == "tensor_parallel":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model.inp.weight = nn.Parameter(distribute_tensor(model.inp.weight.detach(), tp_mesh, [Replicate()]))
    kwargs: dict[str, Any] = {
        "tensor_parallel": {},
        "placement_dim_1": {"shard_placement_fn": lambda p: Shard(1) if p.dim() == 2 else None},
        "cpu_offload": {"offload_policy": CPUOffloadPolicy()},
        "dp_mesh_dims": {"dp_mesh_dims": mesh_dims},
        "ignored_not_parameters": {"ignored_params": {"blocks.0.norm.weight"}},
    }[argument]
    before = {name: (type(p).__name__, p.detach().clone()) for name, p in model.named_parameters()}
    try:
        fully_shard(model, **kwargs)
        error = "accepted"
    except (NotImplementedError, TypeError) as caught:
        error = f"{type(caught).__name__}: {caught}"
    after = {name: (type(p).__name__, p.detach().clone()) for name, p in model.named_parameters()}
    unchanged = before.keys() == after.keys() and all(
        before[k][0] == after[k][0] and torch.equal(before[k][1], after[k][1]) for k in before
    )
    return {"error": error, "unchanged": unchanged, "class": type(model).__name__}


@pytest.mark.parametrize(
    ("argument", "want"),
    [
        (
            "placement_dim_1",
            "NotImplementedError: fully_shard: shard_placement_fn placed parameter 'inp.weight' as Shard(dim=1)",
        ),
        ("cpu_offload", "NotImplementedError: fully_shard: CPUOffloadPolicy is not supported"),
        ("dp_mesh_dims", "NotImplementedError: fully_shard: dp_mesh_dims="),
        ("ignored_not_parameters", "TypeError: fully_shard expected ignored_params to hold parameters, got ['str']"),
        ("tensor_parallel", "NotImplementedError: fully_shard: parameter 'inp.weight' is a DTensor on DeviceMesh"),
    ],
)
def test_refused_arguments_name_why_and_leave_the_module_as_it_was(run_once, argument, want) -> None:
    got = run_once(WORLD_SIZE, refused_arguments_script, argument)[0]
    assert got["error"].startswith(want), f"want an error starting {want!r}, got {got['error']!r}"
    assert got["unchanged"] and got["class"] == "Net", f"the module changed: {got}"


def refused_methods_script() -> dict[str, str]:
    from fsdp_patch import fully_shard, share_comm_ctx

    model = fully_shard(_net())
    errors = {}
    for name, call in {
        "allocation_from_process_group": lambda: model.set_allocate_memory_from_process_group_for_comm(True),
        "symm_mem": lambda: model.set_symm_mem_for_comm(),
        "all_reduce_hook_stream": lambda: model.set_all_reduce_hook(lambda t: None, stream=object()),
        "custom_all_gather_not_a_comm": lambda: model.set_custom_all_gather(object()),
        "share_comm_ctx_plain_module": lambda: share_comm_ctx([nn.Linear(1, 1)]),
        "divide_factor_zero": lambda: model.set_gradient_divide_factor(0),
        "share_comm_ctx": lambda: share_comm_ctx([model]),
    }.items():
        try:
            call()
            errors[name] = "accepted"
        except (NotImplementedError, ValueError, TypeError) as caught:
            errors[name] = type(caught).__name__
    return errors


def test_methods_that_cannot_apply_are_refused_naming_why(run_once) -> None:
    got = run_once(WORLD_SIZE, refused_methods_script)[0]
    want = {
        "allocation_from_process_group": "NotImplementedError",
        "symm_mem": "NotImplementedError",
        "all_reduce_hook_stream": "ValueError",
        "custom_all_gather_not_a_comm": "TypeError",
        "share_comm_ctx_plain_module": "ValueError",
        "divide_factor_zero": "ValueError",
        "share_comm_ctx": "accepted",
    }
    assert got == want, f"want {want}, got {got}"


def test_set_unshard_in_backward_false_on_an_embedding(run_once) -> None:
    ours, fsdp2 = _both(run_once, unshard_in_backward_script)
    _compare(ours, fsdp2)


def test_custom_all_gather_and_reduce_scatter_are_used(run_once) -> None:
    ours, fsdp2 = _both(run_once, custom_comms_script)
    _compare(ours, fsdp2)
    assert ours[0]["facts"] == {"all_gathers": True, "reduce_scatters": True}, ours[0]["facts"]


def test_post_optim_event_is_waited_for_once_by_the_next_forward(run_once) -> None:
    ours, _ = _both(run_once, post_optim_event_script)
    want = ["forward 0", "forward 1", "waited", "forward 2", "waited"]
    assert ours[0]["facts"]["log"] == want, f"want each event waited by the next forward: {ours[0]['facts']}"


# ---------------------------------------------------------------------------- the policy itself


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


# ---------------------------------------------------------------------------- reshard_after_forward=<int>, 4 ranks


class SizeRecordingAllGather(CountingAllGather):
    """A custom all-gather that notes the size of each group it gathers over."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        self.sizes.append(dist.get_world_size(group))
        return super().__call__(output_tensor, input_tensor, group, async_op)


def reshard_to_group_script(impl: str) -> dict[str, Any]:
    """``reshard_after_forward=2`` on 4 ranks: after forward each block keeps half of its
    unsharded parameters, and backward re-gathers over 2 ranks."""
    api = Api.of(impl)
    model = api.shard(_net(), reshard_after_forward=2)
    comm = SizeRecordingAllGather()
    for block in model.blocks:
        block.set_custom_all_gather(comm)
    kept: list[float] = []

    def after_forward_probe(model: Net, step: int, micro: int) -> None:
        if impl == "ours" and step == 0:
            out = model(torch.randn(2, pattern_models.IN))
            group = model.blocks[0].fsdp_parameter_groups[0]
            whole = group.layout.unsharded_numel * group.compute_weight.element_size()
            kept.append(group.unsharded_storage_bytes() / whole)
            kept.append(float(isinstance(model.blocks[0].ff.fc1.weight, DTensor)))
            out.sum().backward()
            model.zero_grad(set_to_none=True)

    result = _train(api, model, before_forward=after_forward_probe)
    result["facts"] = {"kept": kept, "sizes": sorted(set(comm.sizes))}
    return result


def test_reshard_after_forward_int_regathers_over_the_smaller_group(run_once) -> None:
    ours, fsdp2 = run_once(4, reshard_to_group_script, "ours"), run_once(4, reshard_to_group_script, "fsdp2")
    _compare(ours, fsdp2, facts=False)
    facts = ours[0]["facts"]
    # Half kept after forward, the sharded parameters registered; gathers over 4 (forward) and 2 (backward).
    assert facts == {"kept": [0.5, 1.0], "sizes": [2, 4]}, f"ours: {facts}"


def reshard_after_forward_arguments_script() -> dict[str, str]:
    from fsdp_patch import fully_shard

    got = {}
    for value in (3, 0, 2.5, 1, 4):
        model = _net()
        try:
            fully_shard(model, reshard_after_forward=value)  # type: ignore[arg-type]
            state = model._fsdp_state
            to_group = any(group.unsharding.post_forward_group is not None for group in state.groups)
            got[repr(value)] = f"reshard {state.reshard_after_forward_setting}, to group {to_group}"
        except (ValueError, TypeError) as error:
            got[repr(value)] = type(error).__name__
    return got


def test_reshard_after_forward_int_is_read_as_fsdp2_reads_it(run_once) -> None:
    got = run_once(4, reshard_after_forward_arguments_script)[0]
    want = {
        "3": "ValueError",
        "0": "ValueError",
        "2.5": "TypeError",
        "1": "reshard False, to group False",
        "4": "reshard True, to group False",
    }
    assert got == want, f"want {want}, got {got}"


# ---------------------------------------------------------------------------- fully_shard([a, b]): one unit over several modules


def grouped_blocks_script(impl: str, use_aux: bool) -> dict[str, Any]:
    """Both blocks one unit, then the head and the auxiliary head one unit that a forward runs
    wholly (``use_aux``) or in part (the auxiliary head unused), then the root."""
    api = Api.of(impl)
    torch.manual_seed(0)
    model = Net(norm=True, aux=True)
    api.fully_shard([model.blocks[0], model.blocks[1]])
    assert model.aux is not None
    api.fully_shard([model.head, model.aux])
    api.fully_shard(model)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    optimizer = api.optimizer(model)
    losses = []
    for x, y in data(STEPS):
        loss = F.mse_loss(model(rows(x, rank, world_size), use_aux=use_aux), rows(y, rank, world_size))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    facts: dict[str, Any] = {"classes": sorted({type(m).__name__ for m in (model.blocks[0], model.head, model.aux)})}
    if impl == "ours":
        from fsdp_patch import parameter_groups
        from fsdp_patch.module.shard_module import unit_name_of

        facts["units"] = sorted({unit_name_of(g) for g in parameter_groups(model)})
        facts["names"] = sorted(
            n for g in parameter_groups(model.blocks[1]) for n in g.names if n.endswith("fc1.weight")
        )
    return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()}, "facts": facts}


class ChunkedLoss(nn.Module):
    """A body and a final norm; the head is called per chunk of the hidden states outside the
    model's forward, as chunked cross-entropy does (``fully_shard([norm, head])``, FSDP2's
    motivating case)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Net(norm=True)
        self.norm = nn.LayerNorm(pattern_models.DIM)
        self.head = nn.Linear(pattern_models.DIM, pattern_models.OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body.inp(x))
        for block in self.body.blocks:
            h = block(h)
        return self.norm(h)


def chunked_loss_script(impl: str) -> dict[str, Any]:
    api = Api.of(impl)
    torch.manual_seed(0)
    model = ChunkedLoss()
    for block in model.body.blocks:
        api.fully_shard(block)
    api.fully_shard([model.norm, model.head])
    api.fully_shard(model)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    optimizer = api.optimizer(model)
    losses = []
    for x, y in data(STEPS):
        hidden = model(rows(x, rank, world_size))
        target = rows(y, rank, world_size)
        loss = sum(
            F.mse_loss(model.head(h), t, reduction="sum") for h, t in zip(hidden.chunk(2), target.chunk(2), strict=True)
        )
        loss = loss / target.numel()
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()}}


@pytest.mark.parametrize("use_aux", [True, False])
def test_a_unit_over_several_modules_trains_like_fsdp2(run_once, use_aux) -> None:
    ours, fsdp2 = _both(run_once, grouped_blocks_script, use_aux)
    _compare(ours, fsdp2, facts=False)
    facts = ours[0]["facts"]
    assert facts["classes"] == fsdp2[0]["facts"]["classes"] == ["FSDPBlock", "FSDPLinear"], facts
    assert facts["units"] == ["", "blocks.0, blocks.1", "head, aux"], f"unit names: {facts['units']}"
    want = ["blocks.0.ff.fc1.weight", "blocks.1.ff.fc1.weight"]
    assert facts["names"] == want, f"parameter names from the root: {facts['names']}"


def test_chunked_loss_with_the_head_grouped_with_the_norm(run_once) -> None:
    ours, fsdp2 = _both(run_once, chunked_loss_script)
    _compare(ours, fsdp2, facts=False)


def grouping_refusals_script() -> dict[str, str]:
    from fsdp_patch import fully_shard

    model = _net()
    got = {}
    for name, modules in {
        "empty": [],
        "twice": [model.blocks[0], model.blocks[0]],
        "nested": [model.blocks[0], model.blocks[0].ff],
        "not_a_module": [model.blocks[0], "head"],
    }.items():
        try:
            fully_shard(modules)  # type: ignore[arg-type]
            got[name] = "accepted"
        except (TypeError, ValueError) as error:
            got[name] = f"{type(error).__name__}: {error}"
    from fsdp_patch import FSDPModule

    got["untouched"] = str(not any(isinstance(m, FSDPModule) for m in model.modules()))
    return got


def test_a_wrong_list_of_modules_is_refused_naming_why(run_once) -> None:
    got = run_once(WORLD_SIZE, grouping_refusals_script)[0]
    assert got["empty"] == "TypeError: fully_shard expected an nn.Module or a non-empty list of them, got []", got
    assert got["twice"].startswith("ValueError: fully_shard: Block is listed twice"), got
    assert "contain one another" in got["nested"], got
    want = "TypeError: fully_shard expected an nn.Module or a non-empty list of them, got ['Block', 'str']"
    assert got["not_a_module"] == want, got
    assert got["untouched"] == "True", f"a refused call changed the modules: {got}"
