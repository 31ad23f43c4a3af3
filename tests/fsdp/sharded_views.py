"""What the fsdp tests read off a sharded model on the ranks: full tensors gathered from the
shards, unsharded storage per unit, the collectives issued, where the shards' storage lives, and
what differs where tensors should be equal (for failure messages that carry the values).

Full tensors are gathered on every rank (``full_tensor`` is a collective); :func:`rank0` keeps a
value on rank 0 only, so that what a rank body returns pickles small.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tests import comparison


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def rank0(value: Any) -> Any:
    """``value`` on rank 0, ``None`` elsewhere (compute collectives on every rank first)."""
    return value if dist.get_rank() == 0 else None


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: full(p.grad) for n, p in model.named_parameters()}


@contextmanager
def count_collectives() -> Iterator[dict[str, int]]:
    """Counts the all-gathers and reduce-scatters ``fsdp_patch`` issues (it calls them through
    ``torch.distributed``'s module attributes)."""
    counts = {"all_gather": 0, "reduce_scatter": 0}
    # fsdp_patch.torch_interop.torch_compat looks up whichever flat collective this torch has at each call.
    names = [
        (name, kind)
        for name, kind in (
            ("all_gather_single", "all_gather"),
            ("all_gather_into_tensor", "all_gather"),
            ("reduce_scatter_single", "reduce_scatter"),
            ("reduce_scatter_tensor", "reduce_scatter"),
        )
        if hasattr(dist, name)
    ]
    originals = {name: getattr(dist, name) for name, _ in names}

    def counting(name: str, kind: str) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            counts[kind] += 1
            return originals[name](*args, **kwargs)

        return collective

    for name, kind in names:
        setattr(dist, name, counting(name, kind))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


@contextmanager
def record_all_gathers() -> Iterator[list[dict[str, Any]]]:
    """Records each flat all-gather ``fsdp_patch`` issues, as it is issued: the output's and the
    input's element counts, the input's element offset in the output (``None`` when the input
    is not in the output's storage: not gathered in place), and a copy of the input."""
    gathers: list[dict[str, Any]] = []
    names = [name for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)]
    originals = {name: getattr(dist, name) for name in names}

    def recording(name: str) -> Any:
        def collective(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            same = output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
            offset = (input.data_ptr() - output.data_ptr()) // input.element_size() if same else None
            gathers.append(
                {
                    "output_numel": output.numel(),
                    "input_numel": input.numel(),
                    "offset": offset,
                    "input": input.detach().clone(),
                }
            )
            return originals[name](output, input, *args, **kwargs)

        return collective

    for name in names:
        setattr(dist, name, recording(name))
    try:
        yield gathers
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def unsharded_bytes(model: nn.Module) -> dict[str, int]:
    from fsdp_patch import FSDPModule

    return {
        f"{name or '<root>'}[{i}]": group.unsharded_storage_bytes()
        for name, module in model.named_modules()
        if isinstance(module, FSDPModule)
        for i, group in enumerate(module.fsdp_parameter_groups)
    }


def shard_storage_facts(model: nn.Module) -> dict[str, Any]:
    """The parameters whose local data do not live in their group's main-weight buffer, and the
    bytes of parameter storage, of those buffers and of unsharded parameters."""
    from fsdp_patch import parameter_group_of, parameter_groups

    groups = parameter_groups(model)
    buffers = {g.main_weight.untyped_storage().data_ptr(): g.main_weight.untyped_storage().nbytes() for g in groups}
    param_storages = {}
    outside: list[str] = []
    for name, p in model.named_parameters():
        local = p.to_local()
        ptr = local.untyped_storage().data_ptr()
        param_storages[ptr] = local.untyped_storage().nbytes()
        g = parameter_group_of(p)
        if g is None or ptr != g.main_weight.untyped_storage().data_ptr():
            outside.append(name)
    return {
        "params_outside_main_buffers": outside,
        "param_storage_bytes": sum(param_storages.values()),
        "main_buffer_bytes": sum(buffers.values()),
        "shard_bytes_expected": sum(g.layout.shard_numel * g.main_weight.element_size() for g in groups),
        "unsharded_param_storage_bytes": sum(p.untyped_storage().nbytes() for g in groups for p in g.unsharded_params),
    }


# By value, as torch.equal compares (0.0 == -0.0): the values these tests compare come from
# different computations of the same result, whose zeros' signs may differ.
difference = functools.partial(comparison.difference, bitwise=False)


def stale_compute_copies(groups: Iterable[Any], dtype: torch.dtype | None = None) -> dict[str, str]:
    """The groups (by parameter names) whose compute copy is not their main weights cast to the
    compute dtype (``dtype`` when given), with what differs; empty when every copy is fresh."""
    stale = {}
    for g in groups:
        diff = difference(g.compute_weight, g.main_weight.to(dtype or g.compute_dtype))
        if diff is not None:
            stale[",".join(sorted(g.names))] = diff
    return stale


def param_differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, str]:
    """The tensors of ``got`` not ``torch.equal`` to ``want``'s of the same name, with what differs
    (under ``"<names>"`` when the names themselves differ); empty when all are equal."""
    if list(got) != list(want):
        return {"<names>": f"got {list(got)}, want {list(want)}"}
    return {n: diff for n in want if (diff := difference(got[n], want[n])) is not None}
