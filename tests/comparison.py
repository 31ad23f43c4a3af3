"""Comparing what a test got with what it wanted, tensors included, with the difference in the message.

- :func:`difference`: ``None`` when two values are equal, else the first place they differ and by
  how much. Tensors (DTensors by their local shard) compared bitwise by default, or by value
  (``bitwise=False``: ``0.0 == -0.0``, a NaN never equal), nested in dicts, lists and tuples;
  ``None`` equals only ``None``; anything else by ``==``.
- :func:`same`, :func:`assert_same`: the same, as a boolean and as an assertion naming what was compared.
- :func:`max_abs_difference`: the largest absolute difference over tensors of the same names,
  and the name it is at, for tests that hold two runs to a tolerance.
- :func:`whole`, :func:`full_state`: a tensor whole (a DTensor gathered) in float32; a model's
  parameters and optimizer state so, by name.
- :func:`assert_as_fsdp2_and_reference`: per rank, ours bitwise FSDP2's and both within a
  tolerance of the unsharded model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "assert_as_fsdp2_and_reference",
    "assert_same",
    "bits",
    "difference",
    "full_state",
    "local",
    "max_abs_difference",
    "same",
    "whole",
]

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor: a DTensor's local shard, else the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, as integers of its element size."""
    t = local(t).detach().contiguous()
    return t.view(_INT[t.element_size()])


def _tensor_difference(got: torch.Tensor, want: torch.Tensor, at: str, bitwise: bool) -> str | None:
    if isinstance(got, DTensor) != isinstance(want, DTensor):
        return f"{at}: got {type(got).__name__}, want {type(want).__name__}"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{at}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    g, w = local(got).detach(), local(want).detach()
    unequal = (bits(g) != bits(w) if bitwise else g != w).flatten()
    if not unequal.any():
        return None
    first = int(unequal.nonzero()[0])
    gap = (g.double() - w.double()).abs().nan_to_num(nan=float("inf")).max().item()
    return (
        f"{at}: {int(unequal.sum())} of {unequal.numel()} elements differ{' bitwise' if bitwise else ''} "
        f"(max |difference| {gap:.3g}), first at flat index {first}: got {g.flatten()[first].item()!r}, "
        f"want {w.flatten()[first].item()!r}"
    )


def difference(got: Any, want: Any, where: str = "", *, bitwise: bool = True) -> str | None:
    """``None`` when ``got`` equals ``want`` (see the module's docstring); else the first place they
    differ, with both values."""
    at = where or "value"
    if got is None or want is None:
        return None if got is want else f"{at}: got {type(got).__name__}, want {type(want).__name__}"
    if isinstance(got, torch.Tensor) or isinstance(want, torch.Tensor):
        if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
            return f"{at}: got {type(got).__name__}, want {type(want).__name__}"
        return _tensor_difference(got, want, at, bitwise)
    if isinstance(got, dict) and isinstance(want, dict):
        if got.keys() != want.keys():
            return f"{at}: keys {sorted(map(str, got))}, want {sorted(map(str, want))}"
        return next(
            (d for k in got if (d := difference(got[k], want[k], f"{where}[{k!r}]", bitwise=bitwise)) is not None),
            None,
        )
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return f"{at}: {len(got)} items, want {len(want)}"
        pairs = enumerate(zip(got, want, strict=True))
        return next(
            (d for i, (x, y) in pairs if (d := difference(x, y, f"{where}[{i}]", bitwise=bitwise)) is not None), None
        )
    return None if got == want else f"{at}: got {got!r}, want {want!r}"


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of tensors (DTensors compared by local shard), or ``==`` otherwise."""
    return difference(a, b) is None


def assert_same(got: Any, want: Any, what: str) -> None:
    """Asserts ``same(got, want)``, naming ``what`` and the first difference."""
    found = difference(got, want)
    assert found is None, f"{what}: {found}"


def max_abs_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference over all tensors of the same names, and the name it is at."""
    assert got.keys() == want.keys(), f"names differ: got {sorted(got)}, want {sorted(want)}"
    worst, where = 0.0, ""
    for name, value in want.items():
        assert got[name].shape == value.shape, f"{name}: shape {tuple(got[name].shape)}, want {tuple(value.shape)}"
        diff = (got[name].double() - value.double()).abs().max().item() if value.numel() else 0.0
        if diff > worst or not where:
            worst, where = diff, name
    return worst, where


def assert_as_fsdp2_and_reference(
    ours: list[dict[str, torch.Tensor]],
    fsdp2: list[dict[str, torch.Tensor]],
    reference: dict[str, torch.Tensor],
    tolerance: float,
) -> None:
    """Each rank's parameters (full tensors by name): FSDP2's (the control) and ours within
    ``tolerance`` of the unsharded model's, and ours bitwise FSDP2's."""
    for rank, (got, control) in enumerate(zip(ours, fsdp2, strict=True)):
        diff, where = max_abs_difference(control, reference)
        assert diff <= tolerance, (
            f"rank {rank}: FSDP2 (the control) differs from the unsharded model by {diff:.3g} at {where}"
        )
        diff, where = max_abs_difference(got, reference)
        assert diff <= tolerance, f"rank {rank}: ours differs from the unsharded model by {diff:.3g} at {where}"
        diff, where = max_abs_difference(got, control)
        assert diff == 0.0, f"rank {rank}: ours differs from FSDP2 by {diff:.3g} at {where}; expected bitwise equal"


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole (a DTensor gathered: a collective), detached, as a float32 copy."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float().clone()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer-state tensor of ``model``, :func:`whole`, by name
    (``param NAME``, ``KEY NAME``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"param {n}": whole(p) for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out[f"{key} {names[id(param)]}"] = whole(value)
    return out
