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


def _add(stats: torch.Tensor, name: str, value: torch.Tensor) -> None:
    stats[_S[name]] += value.to(torch.float64)


def _max(stats: torch.Tensor, name: str, value: torch.Tensor) -> None:
    stats[_S[name]] = torch.maximum(stats[_S[name]], value.to(torch.float64))


def _finite_amax(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return torch.zeros((), device=t.device)
    t = t.to(torch.float32)
    return torch.where(torch.isfinite(t), t.abs(), torch.zeros((), device=t.device)).amax()


def input_stats(stats: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """NaN/Inf elements and the largest finite magnitude of the operation's floating inputs."""
    for t in inputs:
        if t.numel():
            _add(stats, "in_nonfinite", (~torch.isfinite(t)).sum())
            _max(stats, "in_amax", _finite_amax(t))


def result_stats(stats: torch.Tensor, actual: torch.Tensor, ref: torch.Tensor, before: torch.Tensor | None) -> None:
    """One low-precision result against the float32 reference on the same inputs (``before``: the
    destination's value before an in-place operation)."""
    if actual.numel() == 0 or actual.shape != ref.shape:
        return
    a = actual.to(torch.float32)
    finite_a, finite_r = torch.isfinite(a), torch.isfinite(ref)
    _add(stats, "nonfinite", (~finite_a).sum())
    _add(stats, "new_nonfinite", (~finite_a & finite_r).sum())
    _max(stats, "out_amax", _finite_amax(a))
    _max(stats, "ref_amax", _finite_amax(ref))
    both = finite_a & finite_r
    zero = torch.zeros((), device=a.device)
    _add(stats, "err_sq", torch.where(both, a - ref, zero).double().square().sum())
    rounded = ref.to(actual.dtype).to(torch.float32)
    _add(stats, "rnd_sq", torch.where(both & torch.isfinite(rounded), rounded - ref, zero).double().square().sum())
    _add(stats, "ref_sq", torch.where(both, ref, zero).double().square().sum())
    _add(stats, "flushed", ((a == 0) & (ref != 0) & finite_r).sum())
    nonzero = both & (ref != 0)
    relative = torch.where(nonzero, (a - ref).abs() / ref.abs().clamp_min(torch.finfo(torch.float32).tiny), zero)
    _max(stats, "maxrel", relative.amax())
    _add(stats, "ref_nonzero", ((ref != 0) & finite_r).sum())
    _add(stats, "elements", torch.tensor(a.numel(), device=a.device))
    integral = finite_r & (ref == ref.round()) & (ref.abs() <= 2.0**24)
    _add(stats, "int_ref", integral.sum())
    _add(stats, "int_wrong", (integral & (a != ref)).sum())
    if before is not None and before.shape == actual.shape:
        old = before.to(torch.float32)
        intended = (ref != old) & finite_r & torch.isfinite(old)
        _add(stats, "intended", intended.sum())
        _add(stats, "lost", (intended & (a == old)).sum())


def shadow_stats(stats: torch.Tensor, actual: torch.Tensor, shadow: torch.Tensor) -> None:
    """One result against its float32 shadow (the iteration's computation in float32 up to here):
    NaN/Inf the shadow does not hold, the norm error, and the largest elementwise relative error."""
    if actual.numel() == 0 or actual.shape != shadow.shape:
        return
    a = actual.to(torch.float32)
    finite_a, finite_s = torch.isfinite(a), torch.isfinite(shadow)
    _add(stats, "out_nonfinite", (~finite_a).sum())
    _add(stats, "shadow_nonfinite", (~finite_s).sum())
    _add(stats, "shadow_new_nonfinite", (~finite_a & finite_s).sum())
    both = finite_a & finite_s
    zero = torch.zeros((), device=a.device)
    _add(stats, "shadow_err_sq", torch.where(both, a - shadow, zero).double().square().sum())
    _add(stats, "shadow_sq", torch.where(both, shadow, zero).double().square().sum())
    nonzero = both & (shadow != 0)
    relative = torch.where(nonzero, (a - shadow).abs() / shadow.abs().clamp_min(torch.finfo(torch.float32).tiny), zero)
    _max(stats, "shadow_maxrel", relative.amax() if relative.numel() else zero)


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
