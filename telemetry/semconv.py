"""fsdp_patch's telemetry names, in one place: spans, metrics, attribute keys and values.

Semantic-convention style (as ``opentelemetry.semconv`` does for the standard names): every
span name, metric name, attribute key and enumerated attribute value that the package emits is
a constant here, and nothing else spells them: the observer, the instrument table, the tests and
the dashboards' checks import them. The values are fixed by the project's design page;
dashboards and alert rules query them, so a change here is a change of that contract.

Imports nothing (no torch, no OpenTelemetry): naming a constant costs nothing.
"""

from __future__ import annotations

# -- instrumentation scope -------------------------------------------------------------------

SCOPE_NAME = "fsdp_patch"
"""Name of the tracer and the meter (the instrumentation library)."""

SCHEMA_URL = "https://opentelemetry.io/schemas/1.37.0"
"""Semantic-conventions schema of the standard names used here (``error.type``, ``exception.*``,
``service.name``); stable for these names since 1.21."""

# -- spans -------------------------------------------------------------------------------------

SPAN_STEP = "fsdp.optimizer.step"
SPAN_ZERO_GRAD = "fsdp.optimizer.zero_grad"
SPAN_CAST_GRADS = "fsdp.optimizer.cast_grads"
SPAN_INNER_STEP = "fsdp.optimizer.inner_step"
SPAN_RESTORE_GRADS = "fsdp.optimizer.restore_grads"
SPAN_REFRESH = "fsdp.optimizer.refresh"
SPAN_PRECISION = "fsdp.optimizer.precision"

# Children of SPAN_STEP in the order a step runs them (PRECISION only on diagnostic steps).
STEP_PHASE_SPANS = (SPAN_CAST_GRADS, SPAN_INNER_STEP, SPAN_RESTORE_GRADS, SPAN_REFRESH, SPAN_PRECISION)

# -- span attributes -----------------------------------------------------------------------------

ATTR_STEP = "fsdp.step"
ATTR_RANK = "fsdp.rank"
ATTR_WORLD_SIZE = "fsdp.world_size"
ATTR_OPTIMIZER_CLASS = "fsdp.optimizer.class"
ATTR_PARAMS_COUNT = "fsdp.params.count"
ATTR_GROUPS_COUNT = "fsdp.groups.count"
ATTR_CAST_BYTES = "fsdp.cast.bytes"
ATTR_PRECISION_AWARE = "fsdp.precision_aware"
ATTR_ZERO_GRAD_SET_TO_NONE = "fsdp.zero_grad.set_to_none"
ATTR_ERROR_TYPE = "error.type"  # OpenTelemetry semantic conventions
ATTR_EXCEPTION_TYPE = "exception.type"  # on the exception event

# Every attribute of a SPAN_STEP span, rejected steps included (design page).
STEP_ATTRIBUTES = (
    ATTR_STEP, ATTR_RANK, ATTR_WORLD_SIZE, ATTR_OPTIMIZER_CLASS,
    ATTR_PARAMS_COUNT, ATTR_GROUPS_COUNT, ATTR_CAST_BYTES, ATTR_PRECISION_AWARE,
)  # fmt: skip

# -- resource attributes ---------------------------------------------------------------------------

RESOURCE_RANK = "fsdp.rank"
RESOURCE_WORLD_SIZE = "fsdp.world_size"
RESOURCE_LOCAL_RANK = "fsdp.local_rank"
RESOURCE_RUN_ID = "fsdp.run_id"

# -- metrics -------------------------------------------------------------------------------------

METRIC_CAST_SIZE = "fsdp.optimizer.cast.size"
METRIC_REFRESH_DURATION = "fsdp.optimizer.refresh.duration"
METRIC_STEP_DURATION = "fsdp.optimizer.step.duration"
METRIC_DTYPE_MISMATCHES = "fsdp.optimizer.dtype_mismatches"
METRIC_NONFINITE = "fsdp.precision.nonfinite"
METRIC_REFRESH_OVERFLOW = "fsdp.precision.refresh.overflow"
METRIC_REFRESH_UNDERFLOW = "fsdp.precision.refresh.underflow"
METRIC_REFRESH_ERROR = "fsdp.precision.refresh.error"
METRIC_LOST_RATIO = "fsdp.precision.update.lost_ratio"
METRIC_GRAD_AMAX = "fsdp.precision.grad.amax"

# -- metric attributes and their values ----------------------------------------------------------------

ATTR_CAST_KIND = "fsdp.cast.kind"
CAST_KIND_GRAD = "grad"
CAST_KIND_WEIGHT_REFRESH = "weight_refresh"
CAST_KINDS = (CAST_KIND_GRAD, CAST_KIND_WEIGHT_REFRESH)

ATTR_DTYPE_SOURCE = "fsdp.dtype.source"
ATTR_DTYPE_TARGET = "fsdp.dtype.target"
ATTR_DTYPE_PARAM = "fsdp.dtype.param"
ATTR_DTYPE_GRAD = "fsdp.dtype.grad"

ATTR_MISMATCH_ACTION = "fsdp.mismatch.action"
MISMATCH_CAST = "cast"
MISMATCH_PASSTHROUGH = "passthrough"
MISMATCH_REJECTED = "rejected"
MISMATCH_ACTIONS = (MISMATCH_CAST, MISMATCH_PASSTHROUGH, MISMATCH_REJECTED)

ATTR_TENSOR = "fsdp.tensor"
TENSOR_MAIN_GRAD = "main_grad"
TENSOR_MAIN_WEIGHT = "main_weight"
TENSOR_COMPUTE_WEIGHT = "compute_weight"
TENSORS = (TENSOR_MAIN_GRAD, TENSOR_MAIN_WEIGHT, TENSOR_COMPUTE_WEIGHT)

ATTR_NONFINITE_KIND = "fsdp.nonfinite.kind"
NONFINITE_NAN = "nan"
NONFINITE_INF = "inf"
NONFINITE_KINDS = (NONFINITE_NAN, NONFINITE_INF)

# -- attributes of the SPAN_PRECISION span: the step's diagnostics -----------------------------------

# Same keys as the metrics whose values they carry; the non-finite total sums every kind.
PRECISION_SPAN_ATTRIBUTES = (
    METRIC_REFRESH_OVERFLOW, METRIC_REFRESH_UNDERFLOW, METRIC_REFRESH_ERROR,
    METRIC_LOST_RATIO, METRIC_GRAD_AMAX, METRIC_NONFINITE,
)  # fmt: skip

# -- counts of diagnosed steps ------------------------------------------------------------------------
# The precision counters above add each diagnosed step's count, so their totals are element-steps;
# these count the diagnosed steps themselves, which per-step panels divide by and alert rules count.

METRIC_PRECISION_STEPS = "fsdp.precision.steps"
METRIC_NONFINITE_STEPS = "fsdp.precision.nonfinite.steps"
