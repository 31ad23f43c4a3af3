"""When a precision diagnostic is healthy, a warning or a problem: the one table of thresholds.

The precision report (:mod:`fsdp_patch.telemetry.offline.precision_report`) judges every step range
with this table, and the Prometheus alerts in ``dashboards/prometheus/rules.yml`` fire on the
same thresholds: each row that names an ``alert`` has that alert's comparison, threshold and
severity (``critical`` is a problem, ``warning`` a warning), which ``tests/dashboards`` checks
against the rules file. Rows without an alert are the report's own, documented in
``telemetry/README.md``.

The rows of each diagnosed step's values (:data:`THRESHOLDS`) are here; those of events and spans
are :mod:`.event_thresholds`'; the verdicts and the row type are :mod:`.verdicts`'. This module
names them all (``BY_CHECK``, in order of precedence), so that a reader of the table imports one
module. It also holds the limits the operation audit judges by (``OP_*``).

No torch and no OpenTelemetry here (the instrument table's names only).
"""

from __future__ import annotations

from . import semconv
from .event_thresholds import (
    DTYPE_CONTRACT,
    FAILED_STEPS,
    GRADS_ZEROED,
    HEADROOM_FORECAST,
    LR_JUMP,
    LR_JUMP_WINDOW,
    NAN_ORIGIN,
    NO_OPTIMIZER_STEPS,
    OP_CHECKS,
    REPLICA_DIVERGENCE,
    SCALER_SKIPPED,
    SCALER_SKIPS_AT_LEAST,
    SCALER_SKIPS_PROBLEM_SHARE,
    SCALER_SKIPS_WARN_SHARE,
    SHADOW_PRECISION,
)
from .float8_thresholds import (
    FLOAT8_CHECKS,
    FLOAT8_FLUSH,
    FLOAT8_GRAD_UNDERFLOW,
    FLOAT8_NONFINITE,
    FLOAT8_SATURATION,
    FLOAT8_SENSITIVE_LAYER,
    SUBNORMAL_SHARE,
)
from .verdicts import ALERT_SEVERITY, HEALTHY, PROBLEM, SEVERITY_ORDER, WARNING, Threshold, worst

__all__ = [
    "ALERT_SEVERITY",
    "BF16_UNIT_ROUNDOFF",
    "BY_CHECK",
    "DTYPE_CONTRACT",
    "FAILED_STEPS",
    "FP16_MAX",
    "GRADS_ZEROED",
    "GRAD_AMAX_NONFINITE_MARK",
    "HEADROOM_FORECAST",
    "HEALTHY",
    "LR_JUMP",
    "LR_JUMP_WINDOW",
    "NAN_ORIGIN",
    "NO_OPTIMIZER_STEPS",
    "OP_CHECKS",
    "OP_ERROR_AT_LEAST",
    "OP_ERROR_FACTOR",
    "OP_ERROR_FLOOR",
    "OP_HEADROOM_SHARE",
    "OP_INPUTS_CLOSE",
    "OP_INTEGERS_WRONG",
    "OP_LOST_AT_LEAST",
    "OP_LOST_DIGITS",
    "OP_LOST_SHARE",
    "OP_PROVENANCE_DEPTH",
    "OP_RANGE_LOSS",
    "OP_SENSITIVE_SHARE",
    "OP_SHADOW_ERROR",
    "OP_TIE_SHARE",
    "PROBLEM",
    "REPLICA_DIVERGENCE",
    "SCALER_SKIPPED",
    "SCALER_SKIPS_AT_LEAST",
    "SCALER_SKIPS_PROBLEM_SHARE",
    "SCALER_SKIPS_WARN_SHARE",
    "SEVERITY_ORDER",
    "SHADOW_PRECISION",
    "THRESHOLDS",
    "Threshold",
    "WARNING",
    "markdown_table",
    "precedence",
    "worst",
]

# Largest relative rounding error of a correct round-to-nearest refresh: the unit roundoff of the
# compute dtype, 2**-8 for bfloat16 (2**-11 for float16, 0 when compute and main dtypes agree).
# The report does not know the compute dtype, so it uses the loosest bound: anything above it is
# beyond rounding for every supported compute dtype.
BF16_UNIT_ROUNDOFF = 2.0**-8
# Largest finite float16: the dashboards' red line on gradient amax.
FP16_MAX = 65504.0
# What the diagnostics record as grad amax once a grad element is NaN or Inf: float32's largest
# finite value (``precision.GRAD_AMAX_NONFINITE``; gauges take finite numbers only). It marks
# "no finite largest value", never a measurement, so no check on the grad amax fires on it: the
# NaN/Inf itself is the ``nonfinite`` check's finding.
GRAD_AMAX_NONFINITE_MARK = 3.4028234663852886e38


# In order of precedence among findings of equal severity and first step: an overflow also makes
# Inf compute weights, which the non-finite count includes, so the overflow is named first.
THRESHOLDS: tuple[Threshold, ...] = (
    Threshold(
        check="refresh_overflow",
        metric=semconv.METRIC_REFRESH_OVERFLOW,
        above=0,
        severity=PROBLEM,
        alert="FsdpRefreshOverflow",
        finding="refresh overflow: main weights beyond the compute dtype's range (65504 for fp16)",
        advice=(
            "a main weight grew past what the compute dtype holds, so forward runs on Inf. Use bf16 compute "
            "weights (fp32's range), or find what grew the weights (LR, missing weight decay, a bad update)."
        ),
    ),
    Threshold(
        check="nonfinite",
        metric=semconv.METRIC_NONFINITE,
        above=0,
        severity=PROBLEM,
        alert="FsdpNonFiniteValues",
        finding="NaN/Inf in gradients or weights",
        advice=(
            f"the metric {semconv.METRIC_NONFINITE} by {semconv.ATTR_TENSOR} (dashboard panel 'Non-finite elements "
            f"per diagnosed step, by tensor and kind') says where it began: {semconv.TENSOR_MAIN_GRAD} first means the backward produced "
            f"it (overflowing fp16 grads, a bad batch, a NaN loss); {semconv.TENSOR_MAIN_WEIGHT} the optimizer wrote "
            f"it (eps, LR); {semconv.TENSOR_COMPUTE_WEIGHT} only the refresh overflowed. Open the first bad step in "
            f"the trace (tag {semconv.ATTR_STEP})."
        ),
    ),
    Threshold(
        check="lost_updates",
        metric=semconv.METRIC_LOST_RATIO,
        above=0.9,
        severity=WARNING,
        alert="FsdpLostUpdateRatioHigh",
        # NaN weights change bits without a finite update, which reads as lost updates.
        unless="nonfinite",
        finding="lost updates: learning rate too small for the compute dtype (bf16/fp16 weights stop moving)",
        advice=(
            "over 90% of the main-weight changes are below half a unit in the last place of the compute "
            "weights, so the model run forward does not change. Raise the LR (or the warm-up's start), or keep "
            "compute weights in fp32. Expected only at the very end of a decay to 0."
        ),
    ),
    Threshold(
        check="refresh_underflow",
        metric=semconv.METRIC_REFRESH_UNDERFLOW,
        above=0,
        severity=WARNING,
        finding="refresh underflow: non-zero main weights flushed to 0 in the compute dtype",
        advice=(
            "weights below the compute dtype's smallest subnormal (about 6e-8 for fp16) read as 0 in forward; "
            "bf16 compute weights keep fp32's exponent range."
        ),
    ),
    Threshold(
        check="refresh_error",
        metric=semconv.METRIC_REFRESH_ERROR,
        above=BF16_UNIT_ROUNDOFF,
        severity=WARNING,
        finding="refresh error above bf16 rounding (2^-8): compute weights do not follow the main weights",
        advice=(
            "a correct refresh is off by at most the compute dtype's unit roundoff; more means a stale or partial "
            f"refresh, or overflow/underflow. Look at the {semconv.SPAN_REFRESH} spans and the overflow/underflow counts."
        ),
    ),
    Threshold(
        check="grad_amax_fp16",
        metric=semconv.METRIC_GRAD_AMAX,
        above=FP16_MAX,
        severity=WARNING,
        marker=GRAD_AMAX_NONFINITE_MARK,
        finding="gradients beyond fp16's range (65504)",
        advice=(
            "fp16 grads this large overflow to Inf; scale the loss down or keep grads in bf16/fp32. A jump of "
            "orders of magnitude comes before NaN: look at the steps just before."
        ),
    ),
    Threshold(
        check="grad_zero",
        metric=semconv.METRIC_GRAD_AMAX,
        at_most=0,
        severity=WARNING,
        unless="nonfinite",
        finding="all gradients are zero",
        advice="nothing reached the optimizer: a detached loss, frozen parameters, or vanished gradients.",
    ),
    # The attribution's whole-model values (precision span attributes; the parameters are in its events).
    Threshold(
        check="unstepped_weights",
        metric=semconv.ATTR_UNSTEPPED_PARAMS,
        above=0,
        severity=PROBLEM,
        finding="unstepped weights: parameters that get grads but whose main weights never change",
        advice=(
            "the parameters named get non-zero grads, and no step changes them: left out of every optimizer "
            "param group, frozen in a copy, or updated somewhere the model does not read. Build the optimizer "
            "from model.parameters() after sharding, or set requires_grad=False where they should not train."
        ),
    ),
    Threshold(
        check="state_nonfinite",
        metric=semconv.ATTR_STATE_NONFINITE,
        above=0,
        severity=PROBLEM,
        finding="NaN/Inf in optimizer state",
        advice=(
            "once exp_avg or exp_avg_sq holds NaN/Inf (an overflowing bf16/fp16 state, a NaN grad) every later "
            "update of those elements is NaN, or 0 for an infinite exp_avg_sq. Keep optimizer state in fp32 and "
            "look at the first NaN/Inf and the grads of the steps before it."
        ),
    ),
    Threshold(
        check="stuck_weights",
        metric=semconv.ATTR_STUCK_PARAMS,
        above=0,
        severity=WARNING,
        finding="stuck weights: compute weights that do not move while their main weights do",
        advice=(
            f"for {semconv.SETTING_PRECISION_WINDOW} diagnosed steps in a row not one element of the parameters "
            "named changed in the compute dtype: their updates are below its rounding step (a learning rate too "
            "small for them, or large weights such as norm scales near 1.0 in bf16). Raise their learning rate, "
            "or keep them in fp32."
        ),
    ),
    Threshold(
        check="state_flushed",
        metric=semconv.ATTR_STATE_FLUSHED,
        above=0,
        severity=WARNING,
        finding="exp_avg_sq flushed to zero: squared grads underflow",
        advice=(
            "where a grad is tiny its square underflows (in fp32 below about 1e-23; far sooner in bf16 state) "
            "and Adam divides by eps alone, updating by lr * grad / eps. Scale the loss up, or look for the "
            "vanishing grads of the parameters named."
        ),
    ),
    Threshold(
        check="grad_underflow",
        metric=semconv.ATTR_GRAD_UNDERFLOW,
        above=0.5,
        severity=PROBLEM,
        finding="gradient underflow: most grads of the float16 backward are 0 or below float16's smallest normal",
        advice=(
            "a float16 backward without loss scaling flushes grads below 6e-8 to 0 and keeps those below 6.1e-5 "
            "with few bits, so the parameters named barely train. Scale the loss: torch.amp.GradScaler (FSDP: "
            "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler), or compute in bfloat16, whose range is "
            "float32's."
        ),
    ),
    Threshold(
        check="skipped_steps",
        metric=semconv.ATTR_STEP_SKIPPED,
        above=0,
        severity=WARNING,
        finding="silently skipped steps: grads non-zero and finite, and no main weight changed",
        advice=(
            "the optimizer's step changed nothing although its parameters had grads: a loss scaler skipping "
            "steps without Inf grads, a step applied to a copy of the parameters, or a learning rate of 0 in "
            "every param group."
        ),
    ),
    Threshold(
        check="update_jump",
        metric=semconv.ATTR_UPDATE_JUMP,
        above=0,
        severity=PROBLEM,
        finding="update jump: parameters updated orders of magnitude beyond their usual size, or beyond what Adam's "
        "moments allow",
        advice=(
            "the parameters named moved far more in one step than they did before, or than Adam can move them with "
            "moments that match each other: look at what changed at that step (the cause given). An optimizer state "
            "loaded since the last diagnosed step: was it saved cast (float16 flushes small exp_avg_sq values to 0, and "
            "Adam then divides by eps alone) or onto other parameters (a changed parameter order)? A learning rate "
            "that jumped: the scheduler's state, or its step unit. Grads that jumped: the loss or the batch of that "
            "step. Save and load optimizer state in float32 with the parameters' names."
        ),
    ),
)

BY_CHECK = {
    threshold.check: threshold
    for threshold in (
        LR_JUMP,
        FLOAT8_NONFINITE,
        NAN_ORIGIN,
        REPLICA_DIVERGENCE,
        GRADS_ZEROED,
        HEADROOM_FORECAST,
        *THRESHOLDS,
        *OP_CHECKS.values(),
        *(check for check in FLOAT8_CHECKS if check is not FLOAT8_NONFINITE),
        SHADOW_PRECISION,
        FAILED_STEPS,
        DTYPE_CONTRACT,
        SCALER_SKIPPED,
        NO_OPTIMIZER_STEPS,
    )
}
_PRECEDENCE = {check: index for index, check in enumerate(BY_CHECK)}


def precedence(threshold: Threshold, first_step: int) -> tuple[int, int, int]:
    """Sort key putting the finding to name first at the front: most severe, earliest, then table order."""
    return (-SEVERITY_ORDER.index(threshold.severity), first_step, _PRECEDENCE[threshold.check])


def _condition(threshold: Threshold) -> str:
    condition = f"> {threshold.above:g}" if threshold.above is not None else f"<= {threshold.at_most:g}"
    if threshold.marker is not None:
        condition += f" (not {threshold.marker:.2g}, which marks NaN/Inf grads)"
    return condition


# What each float8 check reads of a float8-cast event (float8_thresholds.fired).
_FLOAT8_VALUES = {
    FLOAT8_NONFINITE.check: "float8-cast events: `fsdp.float8.nonfinite`, or a non-finite `fsdp.float8.scale` of a "
    "finite tensor",
    FLOAT8_FLUSH.check: "float8-cast events of an input or weight: `fsdp.float8.flushed` (a warning where "
    f"`fsdp.float8.subnormal` > {SUBNORMAL_SHARE:g} instead)",
    FLOAT8_GRAD_UNDERFLOW.check: "float8-cast events of a grad output: `fsdp.float8.flushed` (a warning where "
    f"`fsdp.float8.subnormal` > {SUBNORMAL_SHARE:g} instead)",
    FLOAT8_SATURATION.check: "float8-cast events: `fsdp.float8.saturated`",
    FLOAT8_SENSITIVE_LAYER.check: "float8-cast events of the first or last module (`fsdp.float8.position`)",
}


def markdown_table() -> str:
    """The thresholds as Markdown, the form ``telemetry/README.md`` embeds (a test keeps them equal)."""
    rows = [
        "| check | value | fires when | verdict | Prometheus alert | finding |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    special = {
        FAILED_STEPS.check: "steps with status ERROR",
        DTYPE_CONTRACT.check: "dtype-contract events",
        NAN_ORIGIN.check: "origin events",
        SCALER_SKIPPED.check: f"skipped iterations (over {SCALER_SKIPS_WARN_SHARE:.0%} and at least "
        f"{SCALER_SKIPS_AT_LEAST}; a problem over {SCALER_SKIPS_PROBLEM_SHARE:.0%})",
        NO_OPTIMIZER_STEPS.check: "backward passes of a rank that ran no step and skipped none",
        LR_JUMP.check: f"lr-jump events followed by an origin event within {LR_JUMP_WINDOW} iterations",
        GRADS_ZEROED.check: "grads-zeroed events",
        REPLICA_DIVERGENCE.check: "replica-divergence events (HSDP)",
        HEADROOM_FORECAST.check: "headroom-forecast events",
        **{threshold.check: f"operation-audit events of kind `{kind}`" for kind, threshold in OP_CHECKS.items()},
        **_FLOAT8_VALUES,
        SHADOW_PRECISION.check: "float32-shadow events of a module whose local error is 8x its dtype's rounding "
        "and over 5%, or NaN/Inf where float32 is finite",
    }
    for threshold in (
        *THRESHOLDS,
        FAILED_STEPS,
        DTYPE_CONTRACT,
        NAN_ORIGIN,
        LR_JUMP,
        REPLICA_DIVERGENCE,
        GRADS_ZEROED,
        SCALER_SKIPPED,
        NO_OPTIMIZER_STEPS,
        HEADROOM_FORECAST,
        *OP_CHECKS.values(),
        *FLOAT8_CHECKS,
        SHADOW_PRECISION,
    ):
        value = special.get(threshold.check, f"`{threshold.metric}`")
        unless = f" (unless `{threshold.unless}` fired)" if threshold.unless else ""
        alert = f"`{threshold.alert}`" if threshold.alert else "—"
        rows.append(
            f"| `{threshold.check}` | {value} | {_condition(threshold)}{unless} | {threshold.severity} | {alert} | {threshold.finding} |"
        )
    return "\n".join(rows)


# -- the operation audit's judgement (diagnostics/op_judgement.py) -------------------------------------
# A result whose largest magnitude passes this share of its dtype's largest finite value is close to
# overflowing (float16: 8188).
OP_HEADROOM_SHARE = 1.0 / 8
# An in-place write loses its updates when over this share of the changes it was to make leave the
# destination as it was (and it was to make at least OP_LOST_AT_LEAST: a running total is one element).
OP_LOST_SHARE = 0.5
OP_LOST_AT_LEAST = 1
# An operation loses precision inside itself when its error against float32 on the same inputs is over
# OP_ERROR_FACTOR times what rounding its result explains, and over OP_ERROR_FLOOR of the result's norm
# (over at least OP_ERROR_AT_LEAST result elements): torch's own bfloat16 kernels lose a few percent in
# their reductions (a LayerNorm backward's weight grad), which is what bfloat16 training is.
OP_ERROR_FACTOR = 8.0
OP_ERROR_FLOOR = 0.05
OP_ERROR_AT_LEAST = 16
# A result is outside its dtype's range when rounding it (float32 on the same inputs) to the dtype
# loses over this share of its norm (a flush to zero, mostly).
OP_RANGE_LOSS = 0.5
# An operation whose float32 results are all exact integers makes wrong ones in low precision when over
# this share of them differ (positions or counts past the dtype's integer range).
OP_INTEGERS_WRONG = 0.01
# A pointwise operation is ill-conditioned at its inputs when over this share of its results lose their
# leading digit to its inputs' rounding.
OP_SENSITIVE_SHARE = 0.01
# A selection follows index order when over this share of its rows tie at the selected value.
OP_TIE_SHARE = 0.05
# An operation turns its inputs' rounding into a wrong result when it is over this far (relative norm)
# from its float32 shadow, and OP_ERROR_FACTOR times further than its inputs were from theirs.
OP_SHADOW_ERROR = 0.1
# Where a NaN/Inf float32 would not have made began upstream: the nearest producer (of at most
# OP_PROVENANCE_DEPTH looked at) with an element off its shadow by OP_LOST_DIGITS of its size or
# more (no correct digit), whose inputs were all within OP_INPUTS_CLOSE of theirs.
OP_PROVENANCE_DEPTH = 64
OP_LOST_DIGITS = 0.5
OP_INPUTS_CLOSE = 0.1
