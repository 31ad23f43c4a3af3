"""When a precision diagnostic is healthy, a warning or a problem: the one table of thresholds.

The precision report (:mod:`fsdp_patch.telemetry.offline.precision_report`) judges every step range
with this table, and the Prometheus alerts in ``dashboards/prometheus/rules.yml`` fire on the
same thresholds: each row that names an ``alert`` has that alert's comparison, threshold and
severity (``critical`` is a problem, ``warning`` a warning), which ``tests/dashboards`` checks
against the rules file. Rows without an alert are the report's own, documented in
``telemetry/README.md``.

No torch and no OpenTelemetry here (the instrument table's names only).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import semconv

HEALTHY = "healthy"
WARNING = "warning"
PROBLEM = "problem"
SEVERITY_ORDER = (HEALTHY, WARNING, PROBLEM)
# Prometheus alert severity label -> verdict.
ALERT_SEVERITY = {"critical": PROBLEM, "warning": WARNING}

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


@dataclass(frozen=True)
class Threshold:
    """One check of a diagnostic value.

    Attributes:
        check: Short name of the check.
        metric: The instrument (docs/conventions.md) the value comes from.
        above: The check fires when the value is strictly greater than this...
        at_most: ...or, when set instead, when the value is at most this.
        severity: :data:`WARNING` or :data:`PROBLEM` when it fires.
        finding: What went wrong, naming the bug, for the report line.
        advice: Where to look next.
        alert: The Prometheus alert in ``dashboards/prometheus/rules.yml`` with the same
            threshold and severity, if any.
        unless: Another check whose firing makes this one meaningless for the same sample.
        marker: Values at or above this are a marker, not a measurement (the grad amax of a
            step whose grads hold NaN/Inf): the check never fires on them.
    """

    check: str
    metric: str
    severity: str
    finding: str
    advice: str
    above: float | None = None
    at_most: float | None = None
    alert: str | None = None
    unless: str | None = None
    marker: float | None = None

    def fires(self, value: float) -> bool:
        """Whether ``value`` crosses this threshold (NaN never does: it is counted as non-finite)."""
        if self.marker is not None and value >= self.marker:
            return False
        if self.above is not None:
            return value > self.above
        return self.at_most is not None and value <= self.at_most


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

FAILED_STEPS = Threshold(
    check="failed_steps",
    metric=semconv.SPAN_STEP,
    above=0,
    severity=WARNING,
    finding="optimizer steps raised",
    advice=(
        "steps whose span has status ERROR (tag error=true in Jaeger); a rejected dtype mismatch is one cause "
        "(alert FsdpDtypeMismatchRejected). The span's exception event holds the message."
    ),
)

DTYPE_CONTRACT = Threshold(
    check="dtype_contract",
    metric=semconv.EVENT_DTYPE_CONTRACT,
    above=0,
    severity=WARNING,
    finding="dtypes the mixed-precision contract does not expect",
    advice=(
        "the tensors named are not in the dtype their role needs: main weights in low precision lose updates "
        "(a checkpoint loaded into bf16 parameters), optimizer state in bf16 overflows or stalls. Find where "
        "they were made or loaded (the step named: the first step, or the one after a state load)."
    ),
)

# The per-iteration checks' findings (offline/origin_report.py): where a NaN/Inf began (and the lr
# jump it followed), grads zeroed before the step, and iterations that ran no optimizer step. The
# origin's advice is its stage's own.
NAN_ORIGIN = Threshold(
    check="origin",
    metric=semconv.EVENT_ORIGIN,
    above=0,
    severity=PROBLEM,
    finding="NaN/Inf began",
    advice="see the origin: the stage of the iteration it began in says what to change.",
)
REPLICA_DIVERGENCE = Threshold(
    check="replica_divergence",
    metric=semconv.EVENT_REPLICA_DIVERGENCE,
    above=0,
    severity=PROBLEM,
    finding="HSDP replicas diverged: weights or NaN/Inf counts that every replica holds alike differ between them",
    advice=(
        "every replica holds the same weights (the grads are all-reduced over the replicas and each steps alike), so "
        "a difference comes from outside the training step or from a faulty node: a write on some ranks only (a "
        "checkpoint load, an EMA or an edit on some ranks, an initialization after sharding seeded per rank: load and "
        "edit on every rank, or broadcast from one replica), or a node that computes wrongly (silent data corruption: "
        "the replica named holds one node's ranks; rerun a step there and check its GPUs' error counters). From "
        "here on each replica trains its own model."
    ),
)
SCALER_SKIPPED = Threshold(
    check="scaler_skipped",
    metric=semconv.SPAN_SKIPPED_STEP,
    above=0,
    severity=WARNING,
    finding="a GradScaler skipped many iterations",
    advice=(
        "each skipped iteration held NaN/Inf grads, and lowering the scale did not stop it: the overflow is not "
        "the loss scale's but begins where the origin says. A few skips while the scale settles are normal."
    ),
)
NO_OPTIMIZER_STEPS = Threshold(
    check="no_optimizer_steps",
    metric=semconv.ATTR_BACKWARD_COUNT,
    above=0,
    severity=PROBLEM,
    finding="backward passes and no optimizer step",
    advice=(
        "the model ran backward and its adapted optimizer never stepped and was never skipped: optimizer.step() is "
        "not called, or is called on another optimizer than the one over this model's parameters."
    ),
)
HEADROOM_FORECAST = Threshold(
    check="headroom_forecast",
    metric=semconv.EVENT_HEADROOM_FORECAST,
    above=0,
    severity=WARNING,
    finding="a unit's output grows steadily toward its dtype's largest value",
    advice=(
        "over the diagnosed steps the unit's largest output magnitude grew by a steady factor per step; at that "
        "rate it overflows its dtype (float16: 65504) in the steps named, and the forward then makes Inf/NaN. Find "
        "what grows (a residual stream without normalization, a learning rate too high for that layer, weights "
        "growing without weight decay), or run that unit in bfloat16 or float32 before it gets there."
    ),
)
SHADOW_PRECISION = Threshold(
    check="shadow_precision",
    metric=semconv.EVENT_SHADOW,
    above=0,
    severity=WARNING,
    finding="a module whose output is far from its float32 recompute from the fp32 main weights",
    advice=(
        "the float32 shadow recomputed the module named on its own inputs, in float32, from the fp32 main weights: "
        "its output differs far beyond what rounding it to its dtype explains (the error is the module's own, not "
        "what it was given). Where most of it is its compute weights', the compute copy rounds away what the module "
        "needs (a parameter near a large constant): keep that parameter in float32, or store it as an offset from "
        "that constant; otherwise an operation inside it loses precision (the operation audit names which, by "
        "line): run that module in float32 (its inputs and weights .float(), autocast off around it)."
    ),
)
# An lr jump explains a NaN/Inf that begins within this many iterations after it (the update with
# the jumped lr moves the weights; the following forwards run on them).
LR_JUMP_WINDOW = 3
LR_JUMP = Threshold(
    check="lr_jump",
    metric=semconv.EVENT_LR_JUMP,
    above=0,
    severity=PROBLEM,
    finding="a learning-rate jump, then NaN/Inf",
    advice=(
        "the update made with the jumped learning rate moved the weights out of what the model's dtypes hold, and "
        "the NaN/Inf below followed from it: that module or stage is where the damage showed, not its cause. Check "
        "the learning-rate schedule at that step (a warm-up or restart that jumps, a scheduler stepped per "
        "microbatch or resumed at the wrong step, a value off by a power of ten)."
    ),
)
GRADS_ZEROED = Threshold(
    check="grads_zeroed",
    metric=semconv.EVENT_GRADS_ZEROED,
    above=0,
    severity=WARNING,
    finding="grads zeroed between backward and step: non-zero after the backward and its reduce, all 0 at the step",
    advice=(
        "code between loss.backward() and optimizer.step() multiplied every grad by 0, so that step learned "
        "nothing: a clip of one's own whose total norm was Inf or NaN (a sum of squares in float16 or bfloat16 "
        "overflows: compute the norm in float32, or use torch.nn.utils.clip_grad_norm_, whose norm the checks "
        "read), optimizer.zero_grad() called before step(), or a grad hook."
    ),
)
# Above this share of skipped iterations (and at least SCALER_SKIPS_AT_LEAST of them) a GradScaler's
# skips are a warning, and once every iteration (or most) is skipped a problem: a healthy fp16 run
# skips a handful while the scale settles from its initial 2**16, and one per growth interval.
SCALER_SKIPS_WARN_SHARE = 0.25
SCALER_SKIPS_PROBLEM_SHARE = 0.5
SCALER_SKIPS_AT_LEAST = 3

# The operation audit's findings (offline/op_report.py): one row per kind of semconv.OP_KINDS; the
# advice of each is the first operation's own fix.
OP_CHECKS = {
    kind: Threshold(
        check=f"op_{kind}",
        metric=semconv.EVENT_OP,
        above=0,
        severity=severity,
        finding=finding,
        advice="see the operation's fix.",
    )
    for kind, severity, finding in (
        (semconv.OP_KIND_NONFINITE, PROBLEM, "an operation made NaN/Inf from finite inputs"),
        (
            semconv.OP_KIND_LOST_UPDATE,
            PROBLEM,
            "an in-place update too small for its low-precision destination, which does not move",
        ),
        (
            semconv.OP_KIND_ILL_CONDITIONED,
            WARNING,
            "an operation whose result its low-precision inputs do not determine",
        ),
        (
            semconv.OP_KIND_PRECISION_LOSS,
            WARNING,
            "an operation that loses precision inside itself in low precision",
        ),
        (semconv.OP_KIND_CONSTANT, WARNING, "a constant its dtype holds as 0, infinity or 1"),
        (semconv.OP_KIND_TIES, WARNING, "a selection decided by ties that low precision made"),
        (semconv.OP_KIND_HEADROOM, WARNING, "an operation close to overflowing its low-precision dtype"),
    )
}

BY_CHECK = {
    threshold.check: threshold
    for threshold in (
        LR_JUMP,
        NAN_ORIGIN,
        REPLICA_DIVERGENCE,
        GRADS_ZEROED,
        HEADROOM_FORECAST,
        *THRESHOLDS,
        *OP_CHECKS.values(),
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


def worst(severities: list[str]) -> str:
    """The most severe of ``severities``; healthy when empty."""
    return max(severities, key=SEVERITY_ORDER.index, default=HEALTHY)


def _condition(threshold: Threshold) -> str:
    condition = f"> {threshold.above:g}" if threshold.above is not None else f"<= {threshold.at_most:g}"
    if threshold.marker is not None:
        condition += f" (not {threshold.marker:.2g}, which marks NaN/Inf grads)"
    return condition


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
