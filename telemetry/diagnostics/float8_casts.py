"""What torchao's float8 casts make of a float8 module's inputs, weights and grad outputs.

A torchao ``Float8Linear`` (or any module shaped like one: a ``config`` with the three
``cast_config_*`` and a ``linear_mm_config``) casts its input and weight to float8 in forward and
its grad output in backward, each with a scale computed from the tensor's amax. :func:`measure`
runs the same cast on the same high-precision tensor, through torchao's own function and the
module's own config, so that whatever torchao computes (its amax floor, power-of-2 rounding,
rowwise scales) is what is measured, and reads what the cast kept of it (:data:`VALUES`): the amax
and the scales; the shares of elements flushed to 0, left subnormal, and saturated; the SQNR; the
elements made NaN/Inf. A weight that arrives already in float8 (an fp8 all-gather, FSDP2's or
``fully_shard``'s float8 compute copy) is measured as it arrived (:func:`measure_gathered`): its
own scale, the share of its values at the dtype's largest value (clamped by a stale scale) and
at 0.

The values stay on the device, one small tensor per cast; the watch that calls these functions
(:mod:`..instrumentation.float8_watch`) reads them once per iteration. torchao is imported only
here and only once a float8 module has been found: by then the user's script has imported it.

Alternatives considered:
    - Wrapping torchao's cast function to observe the casts it makes: the grad output's cast in
      backward cannot be told apart between modules whose backward interleaves (q, k and v
      projections), and it patches a library's internals. The module's hooks give the tensor
      and the module; torchao's function gives the cast.
    - Recomputing the scale here: a bug in how the scale is computed (no amax floor) would be
      measured away.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import semconv

__all__ = [
    "VALUES",
    "CastKind",
    "cast_kind",
    "float8_modules",
    "is_float8_module",
    "is_gathered_float8",
    "measure",
    "measure_gathered",
]

# The values of one cast, in the order :func:`measure` stacks them.
VALUES = (
    "amax",
    "scale",
    "scale_max",
    "amax_ratio",
    "flushed",
    "subnormal",
    "saturated",
    "sqnr",
    "nonfinite",
    "rowwise_flushed",
)
_CONFIG_OF_ROLE = {
    semconv.FLOAT8_ROLE_INPUT: "cast_config_input",
    semconv.FLOAT8_ROLE_WEIGHT: "cast_config_weight",
    semconv.FLOAT8_ROLE_GRAD_OUTPUT: "cast_config_grad_output",
}
# The dimension each role is scaled along where the scaling is per row (torchao's Float8Linear:
# the input's and grad output's last, the transposed weight's first).
_AXIS_OF_ROLE = {semconv.FLOAT8_ROLE_INPUT: -1, semconv.FLOAT8_ROLE_WEIGHT: 0, semconv.FLOAT8_ROLE_GRAD_OUTPUT: -1}
_GEMM_ROLE = {
    semconv.FLOAT8_ROLE_INPUT: "INPUT",
    semconv.FLOAT8_ROLE_WEIGHT: "WEIGHT",
    semconv.FLOAT8_ROLE_GRAD_OUTPUT: "GRAD_OUTPUT",
}


def is_float8_module(module: nn.Module) -> bool:
    """Whether ``module`` casts to float8 as torchao's ``Float8Linear`` does."""
    config = getattr(module, "config", None)
    return (
        hasattr(module, "linear_mm_config")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and all(hasattr(config, name) for name in _CONFIG_OF_ROLE.values())
    )


def float8_modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every float8 module under ``root``, named from it."""
    return ((name, m) for name, m in root.named_modules() if is_float8_module(m))


def is_gathered_float8(tensor: Any) -> bool:
    """Whether ``tensor`` is already a torchao float8 tensor (its data and scale), not a high-precision one."""
    return isinstance(getattr(tensor, "_data", None), torch.Tensor) and isinstance(
        getattr(tensor, "_scale", None), torch.Tensor
    )


@dataclass(frozen=True)
class CastKind:
    """How a module casts one role: the float8 dtype and torchao's scaling granularity."""

    dtype: torch.dtype
    granularity: str


def cast_kind(module: nn.Module, role: str) -> CastKind | None:
    """How ``module`` casts ``role`` (``None``: that role is not cast, its scaling disabled)."""
    config = getattr(module.config, _CONFIG_OF_ROLE[role])
    if _enum_name(config.scaling_type) == "disabled":
        return None
    return CastKind(config.target_dtype, _enum_name(config.scaling_granularity))


def _enum_name(value: Any) -> str:
    return str(getattr(value, "value", value)).lower()


def measure(module: nn.Module, role: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """The values (:data:`VALUES`) of ``module``'s float8 cast of ``tensor`` as ``role``, on the
    tensor's device; ``None`` where the role is not cast or the cast cannot run on it."""
    kind = cast_kind(module, role)
    if kind is None or not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    scaling = importlib.import_module("torchao.float8.float8_scaling_utils")
    training = importlib.import_module("torchao.float8.float8_training_tensor")
    config = getattr(module.config, _CONFIG_OF_ROLE[role])
    with torch.no_grad():
        hp = tensor.detach()
        if role != semconv.FLOAT8_ROLE_WEIGHT:
            hp = hp.reshape(-1, hp.shape[-1])  # as Float8Linear's backward reshapes the grad output
        else:
            hp = hp.t()  # Float8Linear casts the transposed weight
        cast = scaling.hp_tensor_to_float8_dynamic(
            hp,
            kind.dtype,
            module.linear_mm_config,
            gemm_input_role=getattr(training.GemmInputRole, _GEMM_ROLE[role]),
            scaling_granularity=config.scaling_granularity,
            axiswise_dim=scaling.get_maybe_axiswise_dim(_AXIS_OF_ROLE[role], config.scaling_granularity),
            round_scales_to_power_of_2=bool(getattr(module.config, "round_scales_to_power_of_2", False)),
        )
        axis = _AXIS_OF_ROLE[role] if kind.granularity == "tensorwise" else None
        return _values(hp.float(), cast._data, cast._scale.float(), kind.dtype, axis)


def measure_gathered(tensor: Any) -> torch.Tensor:
    """The values of a weight that arrived in float8 (its data and scale): the amax and SQNR of
    what it holds, against itself (no high-precision weight to compare with: SQNR ``inf``), the
    share of its values at 0 (flushed), and the share clamped at the dtype's largest value
    (saturated), estimated (:func:`_clamped`)."""
    with torch.no_grad():
        data = tensor._data
        scale = tensor._scale.float()
        values = data.float() / scale
        finfo = torch.finfo(data.dtype)
        numel = float(max(data.numel(), 1))
        magnitude = values.abs()
        amax = magnitude.amax()
        return torch.stack(
            [
                amax,
                scale.amin(),
                scale.amax(),
                amax / _typical(magnitude, torch.isfinite(values) & (values != 0)),
                (data.float() == 0).sum().float() / numel,
                (data.float().abs() < finfo.smallest_normal).sum().float() / numel,
                _clamped(data.float().abs(), finfo) / numel,
                torch.full((), float("inf"), device=data.device),
                (~torch.isfinite(values)).sum().float(),
                torch.full((), float("nan"), device=data.device),
            ]
        )


def _clamped(codes: torch.Tensor, finfo: torch.finfo) -> torch.Tensor:
    """How many of a float8 tensor's values (``codes``: their magnitudes) were clamped at the
    dtype's largest value, estimated without the high-precision tensor they came from.

    A scale from the tensor's own amax maps that amax to the largest value, which then holds the
    amax and the elements rounded up to it, from half a unit below: half as wide a band as the
    value below it holds, and where the elements are not denser toward the max (weights: uniform
    or bell-shaped) no fuller. A scale from an older, smaller amax rounds a full unit's band onto
    the largest value and clamps every element beyond it there too. The estimate: the largest
    value's count less the amax's own element and the count of the value below; 0 under a fresh
    scale, about the clamped count under a stale one where the elements are spread evenly near the
    top. Counting every element at the largest value instead calls a fresh uniform weight's top 4%
    (e4m3) clamped.
    """
    mantissa_bits = round(-math.log2(finfo.eps))
    below = finfo.max - 2.0 ** (math.floor(math.log2(finfo.max)) - mantissa_bits)
    at_max = (codes >= finfo.max).sum().float()
    at_below = (codes == below).sum().float()
    return (at_max - 1 - at_below).clamp(min=0)


# The median is taken over an evenly strided sample of at most this many elements: a sort of the
# whole tensor costs more than the rest of the measurement (an estimate of the median is enough
# for the ratio, which says whether an element stands orders of magnitude above the rest).
_MEDIAN_SAMPLE = 4096


def _typical(magnitude: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    """The median of the non-zero magnitudes (``magnitude`` 0 where ``nonzero`` is not), estimated
    on a sample, on the device without a read: the zeros of a ReLU's output would make the median
    of them all 0 and the amax ratio infinite. NaN where none is non-zero."""
    stride = -(-magnitude.numel() // _MEDIAN_SAMPLE)
    flat = torch.where(nonzero, magnitude, torch.zeros((), device=magnitude.device)).flatten()[::stride]
    count = nonzero.flatten()[::stride].sum()
    index = (flat.numel() - count + (count - 1).clamp(min=0) // 2).clamp(max=flat.numel() - 1)
    median = flat.sort().values.gather(0, index.reshape(1)).squeeze(0)
    return torch.where(count > 0, median, torch.full((), float("nan"), device=magnitude.device))


def _values(
    hp: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, axis: int | None
) -> torch.Tensor:
    """``axis``: where the cast is tensorwise, the dimension a per-row scale would be computed along
    (the share that scaling would flush is measured too: whether rowwise scaling is the fix)."""
    finfo = torch.finfo(dtype)
    finite = torch.isfinite(hp)
    nonzero = (hp != 0) & finite
    count = nonzero.sum().clamp(min=1).float()
    bits = data.float()
    dequantized = bits / scale
    magnitude = torch.where(finite, hp.abs(), torch.zeros((), device=hp.device))
    nan = torch.full((), float("nan"), device=hp.device)
    amax = torch.where(finite.all(), magnitude.amax(), nan)
    # The median, not the mean: an outlier column raises the mean with it.
    typical = _typical(magnitude, nonzero)
    rowwise_flushed = nan
    if axis is not None:
        # Below half the smallest subnormal a value rounds to 0.
        row_scale = finfo.max / magnitude.amax(dim=axis, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        flushes_below = finfo.smallest_normal * finfo.eps / 2
        rowwise_flushed = (((hp * row_scale).abs() < flushes_below) & nonzero).sum().float() / count
    # Round to nearest keeps a scaled value up to half a unit in the last place above the largest
    # finite one; past that the cast clamps it.
    clamp_above = finfo.max * (1 + finfo.eps / 2)
    saturated = (((hp * scale).abs() > clamp_above) & finite).sum().float() / max(hp.numel(), 1)
    error = torch.where(finite, hp - dequantized, torch.zeros((), device=hp.device))
    signal = torch.where(finite, hp, torch.zeros((), device=hp.device)).square().sum()
    noise = error.square().sum()
    # Nothing lost (an all-zero tensor, values float8 holds exactly): inf, not 0/0.
    sqnr = torch.where(noise == 0, torch.full((), float("inf"), device=hp.device), 10 * torch.log10(signal / noise))
    # A tensor holding NaN/Inf has a NaN amax and scale and comes out all NaN: the cast made none.
    made = torch.where(finite.all(), (~torch.isfinite(dequantized) & finite).sum().float(), 0.0)
    return torch.stack(
        [
            amax,
            scale.amin(),
            scale.amax(),
            amax / typical,
            ((bits == 0) & nonzero).sum().float() / count,
            ((bits.abs() < finfo.smallest_normal) & nonzero).sum().float() / count,
            saturated,
            sqnr,
            made,
            rowwise_flushed,
        ]
    )
