"""The operation audit's measurements: references in float32, and statistics kept on the device.

:mod:`.op_audit` decides what to measure; the functions here run the references and add each
measurement into an operation's statistics vector (:data:`~.op_judgement.STATS`, float64 on the
operation's device): no value is read back to the host here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .op_judgement import STATS

__all__ = [
    "LOW_PRECISION",
    "floats",
    "input_stats",
    "local",
    "mutated_arguments",
    "reference",
    "result_stats",
    "sensitivity_stats",
    "shadow_stats",
    "tie_stats",
]

LOW_PRECISION = (torch.float16, torch.bfloat16)
_S = {name: index for index, name in enumerate(STATS)}

SENSITIVE_CHANGE = 0.25
"""A result that moves by more than this share of its scale under its inputs' rounding has no
correct leading digit left."""


def local(t: Any) -> Any:
    """A tensor's own values: torch FSDP2's sharded parameters are DTensors (their local shard)."""
    return t._local_tensor if type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor") else t


def floats(out: Any) -> list[torch.Tensor]:
    """The floating tensors of an operation's result, in order."""
    return [local(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def mutated_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors the operation writes into (its schema's mutable arguments), flattened."""
    out: list[torch.Tensor] = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        out.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return out


def reference(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    source: Callable[[torch.Tensor], torch.Tensor | None],
    written: bool,
) -> list[torch.Tensor]:
    """The operation run on float32 values: each tensor argument replaced by ``source(t)`` (a fresh
    float32 tensor, or ``None`` to keep ``t``). Returns, as float32, the tensors it wrote into
    (``written``: an in-place operation) or its floating results, in the order the operation's own
    are listed; a ``dtype`` argument of low precision is float32 here."""
    ref_args = tree_map(lambda t: _lifted(t, source), args)
    ref_kwargs = {
        key: (
            torch.float32
            if key == "dtype" and value in LOW_PRECISION
            else tree_map(lambda t: _lifted(t, source), value)
        )
        for key, value in kwargs.items()
    }
    result = func(*ref_args, **ref_kwargs)
    if not written:
        return [t.to(torch.float32) for t in floats(result)]
    return [t.to(torch.float32) for t in mutated_arguments(func, ref_args, ref_kwargs)]


def _lifted(t: Any, source: Callable[[torch.Tensor], torch.Tensor | None]) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    lifted = source(t)
    return local(t) if lifted is None else lifted


# -- statistics ---------------------------------------------------------------------------------------


def _add(stats: torch.Tensor, name: str, value: torch.Tensor | int) -> None:
    stats[_S[name]] += value.to(torch.float64) if isinstance(value, torch.Tensor) else value


def _max(stats: torch.Tensor, name: str, value: torch.Tensor) -> None:
    stats[_S[name]] = torch.maximum(stats[_S[name]], value.to(torch.float64))


def _masked_amax(t: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    return torch.where(finite, t.abs(), 0.0).amax()


def _count(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum()


def input_stats(stats: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """NaN/Inf elements and the largest finite magnitude of the operation's floating inputs."""
    for t in inputs:
        if t.numel():
            finite = torch.isfinite(t)
            _add(stats, "in_nonfinite", t.numel() - _count(finite))
            _max(stats, "in_amax", _masked_amax(t.to(torch.float32), finite))


def _compare(
    stats: torch.Tensor, names: tuple[str, str, str, str], a: torch.Tensor, finite_a: torch.Tensor, ref: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``a`` against ``ref``: NaN/Inf only ``a`` holds, the squared norms of the difference and of
    ``ref``, the largest elementwise relative difference (``names``, in that order). Returns the
    masks both finite and ref non-zero, and the difference (0 where either is not finite)."""
    finite_r = torch.isfinite(ref)
    both = finite_a & finite_r
    _add(stats, names[0], _count(finite_r) - _count(both))
    difference = torch.where(both, a - ref, 0.0).flatten()
    kept = torch.where(both, ref, 0.0).flatten()
    _add(stats, names[1], torch.dot(difference, difference))
    _add(stats, names[2], torch.dot(kept, kept))
    nonzero = kept != 0
    relative = torch.where(nonzero, difference.abs() / kept.abs().clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    _max(stats, names[3], relative.amax())
    return both, nonzero.view(ref.shape), difference


def result_stats(
    stats: torch.Tensor, actual: torch.Tensor, ref: torch.Tensor, before: torch.Tensor | None, integers: bool
) -> torch.Tensor:
    """One low-precision result against the float32 reference on the same inputs (``before``: the
    destination's value before an in-place operation; ``integers``: whether the operation read no
    low-precision value, so that its results may be meant as integers). Returns the result's
    finite mask (for :func:`shadow_stats`)."""
    a = actual.to(torch.float32)
    finite_a = torch.isfinite(a)
    if actual.numel() == 0 or actual.shape != ref.shape:
        return finite_a
    _add(stats, "nonfinite", a.numel() - _count(finite_a))
    both, nonzero, _ = _compare(stats, ("new_nonfinite", "err_sq", "ref_sq", "maxrel"), a, finite_a, ref)
    _max(stats, "out_amax", _masked_amax(a, finite_a))
    _max(stats, "ref_amax", _masked_amax(ref, torch.isfinite(ref)))
    rounding = torch.where(both, torch.nan_to_num(ref.to(actual.dtype).to(torch.float32) - ref, 0.0, 0.0, 0.0), 0.0)
    _add(stats, "rnd_sq", torch.dot(rounding.flatten(), rounding.flatten()))
    _add(stats, "ref_nonzero", _count(nonzero))
    _add(stats, "flushed", _count(nonzero & (a == 0)))
    _add(stats, "elements", torch.tensor(a.numel(), device=a.device))
    if integers:
        integral = both & (ref == ref.round()) & (ref.abs() <= 2.0**24)
        _add(stats, "int_ref", _count(integral))
        _add(stats, "int_wrong", _count(integral & (a != ref)))
    if before is not None and before.shape == actual.shape:
        old = before.to(torch.float32)
        intended = (ref != old) & both & torch.isfinite(old)
        _add(stats, "intended", _count(intended))
        _add(stats, "lost", _count(intended & (a == old)))
    return finite_a


def shadow_stats(
    stats: torch.Tensor, actual: torch.Tensor, shadow: torch.Tensor, finite_a: torch.Tensor | None = None
) -> None:
    """One result against its float32 shadow (the iteration's computation in float32 up to here):
    NaN/Inf the shadow does not hold, the norm error, and the largest elementwise relative error."""
    if actual.numel() == 0 or actual.shape != shadow.shape:
        return
    a = actual.to(torch.float32)
    finite_a = torch.isfinite(a) if finite_a is None else finite_a
    _add(stats, "out_nonfinite", a.numel() - _count(finite_a))
    _compare(stats, ("shadow_new_nonfinite", "shadow_err_sq", "shadow_sq", "shadow_maxrel"), a, finite_a, shadow)
    _add(stats, "shadow_nonfinite", shadow.numel() - _count(torch.isfinite(shadow)))


def sensitivity_stats(
    stats: torch.Tensor,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    source: Callable[[torch.Tensor], torch.Tensor | None],
    ref: torch.Tensor,
    index: int,
    written: bool,
) -> None:
    """Elements whose result moves by over :data:`SENSITIVE_CHANGE` of its scale when one
    low-precision input moves by its dtype's unit roundoff (the rounding it went through)."""
    scale = torch.where(torch.isfinite(ref), ref.abs(), torch.zeros((), device=ref.device))
    rms = scale.square().mean().sqrt()
    worst = torch.zeros_like(ref)
    for t in [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION]:
        if t.numel() <= 1:
            continue  # a scalar's rounding is the constants' check
        by = 1.0 + float(torch.finfo(t.dtype).eps) / 2

        def nudged(u: torch.Tensor, moved: torch.Tensor = t, by: float = by) -> torch.Tensor | None:
            value = source(u)
            return value * by if u is moved and value is not None else value

        result = reference(func, args, kwargs, nudged, written)[index]
        if result.shape != ref.shape:
            continue
        change = (result - ref).abs() / (scale + rms + torch.finfo(torch.float32).tiny)
        worst = torch.maximum(worst, torch.nan_to_num(change, nan=0.0, posinf=0.0))
    _add(stats, "sensitive", (worst > SENSITIVE_CHANGE).sum())


def tie_stats(stats: torch.Tensor, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Rows of a selection (``topk``, ``max``/``argmax`` along a dimension) whose selected value
    equals the next candidate."""
    x = local(args[0]).to(torch.float32)
    if name == "topk":
        k = int(args[1]) if len(args) > 1 else int(kwargs.get("k", 1))
        dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", -1))
        largest = bool(args[3]) if len(args) > 3 else bool(kwargs.get("largest", True))
    else:
        dim_arg = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim_arg is None:
            x, dim_arg = x.flatten(), 0
        k, dim, largest = 1, int(dim_arg), name in ("max", "argmax")
    if x.dim() == 0 or x.size(dim) <= k:
        return
    top = x.topk(k + 1, dim=dim, largest=largest).values
    tied = top.select(dim, k - 1) == top.select(dim, k)
    _add(stats, "tied", tied.sum())
    _add(stats, "rows", torch.tensor(tied.numel(), device=x.device))


def accumulated(name: str, inputs: list[torch.Tensor], results: list[torch.Tensor]) -> int:
    """Elements summed into each result element, where the operation reduces (0: it does not)."""
    if not inputs or not results:
        return 0
    if name in ("mm", "bmm", "addmm", "matmul", "baddbmm", "addbmm", "linear"):
        return int(inputs[-1].shape[-2]) if inputs[-1].dim() >= 2 else 0
    biggest = max(t.numel() for t in inputs)
    out = max(t.numel() for t in results)
    return biggest // out if out and biggest > out else 0


# Operations whose result is a constant they are given (the constants' check reads any float argument).
_CONSTANT_PLACES = ("scalar", "value", "other", "alpha", "beta", "fill_value", "exponent", "eps", "min", "max")
FILLS = frozenset({"full", "full_like", "new_full", "fill", "masked_fill", "scalar_tensor"})


# Within float32's rounding of 1, below its smallest subnormal, beyond its largest value: a Python
# constant a float32 (or wider) operation may hold as 1, 0 or infinity; anything else it holds.
_NEAR_ONE = 2.0**-24
_BELOW_ANY = 1.5e-45
_BEYOND = 3.4e38


def may_vanish(value: float) -> bool:
    """Whether float32 may hold the Python constant ``value`` as 0, infinity or 1 while it is
    none of them (a cheap test before :func:`constants`, for operations of float32 or wider)."""
    magnitude = abs(value)
    if value in (0.0, 1.0) or magnitude == float("inf") or value != value:
        return False
    return abs(value - 1.0) <= _NEAR_ONE or magnitude < _BELOW_ANY or magnitude > _BEYOND


def constants(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype
) -> tuple[tuple[str, float, float], ...]:
    """``(argument, value, value in dtype)`` for each Python float constant of the operation that
    rounds to 0, to infinity or to 1 in ``dtype``."""
    name = func.__name__.split(".")[0].rstrip("_")
    found = []
    for index, argument in enumerate(func._schema.arguments):
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if isinstance(value, bool) or not isinstance(value, float):
            continue
        if argument.name not in _CONSTANT_PLACES and name not in FILLS:
            continue
        stored = torch.tensor(value, dtype=torch.float64).to(dtype).item()
        infinite = abs(value) != float("inf") and abs(stored) == float("inf")
        if (value != 0 and stored == 0) or infinite or (value != 1.0 and stored == 1.0):
            found.append((argument.name, value, float(stored)))
    return tuple(found)
