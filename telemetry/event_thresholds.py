"""The precision report's checks of events and spans: what the trace records as it happens (an
optimizer step that raised, a dtype-contract event, the per-iteration checks' events, the
operation audit's and the float32 shadow's findings), as against the values of each diagnosed
step that :data:`.precision_thresholds.THRESHOLDS` judges.

Each check fires on a count of what it names (``above=0``); the report counts them
(:mod:`.offline`), with the few limits here (:data:`LR_JUMP_WINDOW`, the GradScaler's
skip shares). :mod:`.precision_thresholds` lists them with the rest, in order of precedence
(``BY_CHECK``). None has a Prometheus alert. No torch and no OpenTelemetry here (the instrument
table's names only).
"""

from __future__ import annotations

from . import semconv
from .verdicts import PROBLEM, WARNING, Threshold

__all__ = [
    "DTYPE_CONTRACT",
    "FAILED_STEPS",
    "GRADS_ZEROED",
    "HEADROOM_FORECAST",
    "LR_JUMP",
    "LR_JUMP_WINDOW",
    "NAN_ORIGIN",
    "NO_OPTIMIZER_STEPS",
    "OP_CHECKS",
    "REPLICA_DIVERGENCE",
    "SCALER_SKIPPED",
    "SCALER_SKIPS_AT_LEAST",
    "SCALER_SKIPS_PROBLEM_SHARE",
    "SCALER_SKIPS_WARN_SHARE",
    "SHADOW_PRECISION",
]

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
