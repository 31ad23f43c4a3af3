"""The precision report's checks of float8 casts: when what a float8 cast kept of a tensor is a
finding (the events ``fsdp.precision.float8``).

Each check reads one cast's values (:mod:`.semconv_float8`); :func:`fired` says which fire, and
the report (:mod:`.offline.float8_report`) names the module, the role, the values and the fix.
:mod:`.precision_thresholds` lists them with the rest, in order of precedence (``BY_CHECK``). No
torch and no OpenTelemetry here (the instrument table's names only).

The limits, and why:

- ``FLUSH_SHARE``: an e4m3 cast keeps about 31 dB of a Gaussian tensor and flushes none of it;
  flushing a quarter of the non-zero elements is a scale set by a few elements far above the
  rest, never rounding;
- ``SUBNORMAL_SHARE``: half the elements below the smallest normal keep 2 mantissa bits or fewer:
  the same cause, milder;
- ``SATURATED_SHARE``: a scale computed from the tensor's own amax clamps nothing; one element in
  a thousand clamped is a scale computed from another (an older) amax.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from . import semconv
from .verdicts import PROBLEM, WARNING, Threshold

__all__ = [
    "FLOAT8_CHECKS",
    "FLOAT8_FLUSH",
    "FLOAT8_GRAD_UNDERFLOW",
    "FLOAT8_NONFINITE",
    "FLOAT8_SATURATION",
    "FLOAT8_SENSITIVE_LAYER",
    "FLUSH_SHARE",
    "SATURATED_SHARE",
    "SUBNORMAL_SHARE",
    "fired",
    "worst",
]

FLUSH_SHARE = 0.25
SUBNORMAL_SHARE = 0.5
SATURATED_SHARE = 1e-3

FLOAT8_NONFINITE = Threshold(
    check="float8_nonfinite",
    metric=semconv.EVENT_FLOAT8_CAST,
    above=0,
    severity=PROBLEM,
    finding="a float8 cast made NaN/Inf from finite values: its scale is not finite",
    advice=(
        "the scale is finfo(float8).max / amax: an amax of 0 (an all-zero tensor: a zero-initialized layer such "
        "as LoRA's B or adaLN-zero, a zeroed grad) with no floor on it gives an infinite scale, and 0 x inf is NaN. "
        "Floor the amax (torchao's EPS; activation_value_lb for Float8DynamicActivationFloat8WeightConfig), or keep "
        "the layer named out of float8 (module_filter_fn) while it is zero."
    ),
)
FLOAT8_FLUSH = Threshold(
    check="float8_flush",
    metric=semconv.EVENT_FLOAT8_CAST,
    above=FLUSH_SHARE,
    severity=PROBLEM,
    finding="a float8 cast flushes most of a layer's input or weight to zero: one outlier sets the scale",
    advice=(
        "a tensorwise scale maps the tensor's largest element to float8's largest value; an element far above the "
        "rest leaves them below float8's smallest subnormal, and they become 0. Where the outlier is one row (a "
        "token), rowwise scaling (Float8LinearConfig.from_recipe_name('rowwise')) gives each row its own scale; "
        "where it is in every row (a feature), keep the layer in bf16 (module_filter_fn returning False for it) or "
        "remove what makes that feature large (a missing norm before the layer)."
    ),
)
FLOAT8_GRAD_UNDERFLOW = Threshold(
    check="float8_grad_underflow",
    metric=semconv.EVENT_FLOAT8_CAST,
    above=FLUSH_SHARE,
    severity=PROBLEM,
    finding="a layer's grad output underflows in its float8 cast: its grads flush to zero in backward",
    advice=(
        "the grad output's scale is set by its largest element: a few grads far above the rest (a loss term weighted "
        "far above the others, an unmasked position) leave the rest below float8's smallest subnormal. Cast grad "
        "outputs with e5m2 (the widest range, torchao's default) and rowwise scaling, keep the layer in bf16, or "
        "find the loss term that makes those few grads large."
    ),
)
FLOAT8_SATURATION = Threshold(
    check="float8_saturation",
    metric=semconv.EVENT_FLOAT8_CAST,
    above=SATURATED_SHARE,
    severity=PROBLEM,
    finding="a float8 cast clamps values at float8's largest: its scale was computed from an older amax",
    advice=(
        "a scale computed from the tensor being cast clamps nothing; this one was computed before the tensor grew. "
        "Under FSDP2 with float8 all-gather, call torchao's precompute_float8_dynamic_scale_for_fsdp(model) after "
        "every optimizer.step() (not once, not before the step); with delayed scaling, sync the amax history every "
        "iteration; or let fully_shard's float8 compute copy compute the scale at its refresh."
    ),
)
FLOAT8_SENSITIVE_LAYER = Threshold(
    check="float8_sensitive_layer",
    metric=semconv.EVENT_FLOAT8_CAST,
    above=0,
    severity=WARNING,
    finding="the model's first or last layer runs in float8",
    advice=(
        "the first layer's error reaches every layer after it, the last one's goes straight into the logits and "
        "the loss; recipes keep both in bf16 (torchtitan's float8 converter filters its output layer). Pass "
        "convert_to_float8_training a module_filter_fn that returns False for the module named, by its name."
    ),
)
# The flush checks' findings where most elements are left subnormal rather than flushed: a warning.
_SUBNORMAL_FINDING = {
    FLOAT8_FLUSH.check: (
        "a float8 cast leaves most of a layer's input or weight below float8's smallest normal, with 2 mantissa "
        "bits or fewer: one outlier sets the scale"
    ),
    FLOAT8_GRAD_UNDERFLOW.check: (
        "a layer's grad output is left mostly subnormal by its float8 cast, with 2 mantissa bits or fewer: a few "
        "grads set the scale"
    ),
}
FLOAT8_CHECKS = (FLOAT8_NONFINITE, FLOAT8_FLUSH, FLOAT8_GRAD_UNDERFLOW, FLOAT8_SATURATION, FLOAT8_SENSITIVE_LAYER)


def fired(role: str, values: Mapping[str, float], position: str = semconv.FLOAT8_POSITION_MIDDLE) -> list[Threshold]:
    """The checks one cast's values fire (``values`` keyed as ``diagnostics.float8_casts.VALUES``),
    each with its severity for these values: the flush check is a warning where the elements are
    left subnormal rather than flushed."""
    found: list[Threshold] = []
    nonfinite = values.get("nonfinite", 0.0)
    # A tensor that already held NaN/Inf has a non-finite amax and scale, and makes every element
    # NaN: not the cast's doing.
    if math.isfinite(values.get("amax", 0.0)) and (
        not math.isfinite(values.get("scale", 1.0)) or (not math.isnan(nonfinite) and nonfinite > 0)
    ):
        found.append(FLOAT8_NONFINITE)
    flush = FLOAT8_GRAD_UNDERFLOW if role == semconv.FLOAT8_ROLE_GRAD_OUTPUT else FLOAT8_FLUSH
    if values.get("flushed", 0.0) > FLUSH_SHARE:
        found.append(flush)
    elif values.get("subnormal", 0.0) > SUBNORMAL_SHARE:
        found.append(replace(flush, severity=WARNING, finding=_SUBNORMAL_FINDING[flush.check]))
    if values.get("saturated", 0.0) > SATURATED_SHARE:
        found.append(FLOAT8_SATURATION)
    if position != semconv.FLOAT8_POSITION_MIDDLE:
        found.append(FLOAT8_SENSITIVE_LAYER)
    return found


# The values of a cast where less is worse (a smaller scale, a lower SQNR); more is worse elsewhere.
_LOWER_IS_WORSE = frozenset({"scale", "sqnr"})


def worst(key: str, values: list[float]) -> float:
    """The worst of several measurements of one cast's value ``key`` (calls of an iteration, ranks):
    NaN where any is NaN (a NaN amax, scale or SQNR is the finding), but for ``rowwise_flushed``,
    NaN where the cast was not tensorwise, which any measured value outranks."""
    if key != "rowwise_flushed" and any(math.isnan(v) for v in values):
        return math.nan
    measured = [v for v in values if not math.isnan(v)]
    if not measured:
        return math.nan
    return min(measured) if key in _LOWER_IS_WORSE else max(measured)
