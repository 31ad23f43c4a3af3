"""fsdp_patch's telemetry names, in one place: spans, metrics, attribute keys and values.

Semantic-convention style (as ``opentelemetry.semconv`` does for the standard names): every
span name, metric name, attribute key and enumerated attribute value that the package emits is
a constant of this module, and nothing else spells them: the observer, the instrument table, the
tests and the dashboards' checks import them. The values are fixed by docs/conventions.md;
dashboards and alert rules query them, so a change here is a change of that contract.

The step's names and the attribution's are spelled here; three families of findings are spelled in
modules of their own and re-exported here, so that code reads every name as ``semconv.NAME``:
:mod:`.semconv_iterations` (the per-iteration checks: origin, step accounting, lr jumps,
escalation), :mod:`.semconv_audits` (the operation audit, the float32 shadow, the headroom
forecast) and :mod:`.semconv_float8` (the float8 cast watch).

Imports nothing else (no torch, no OpenTelemetry): naming a constant costs nothing.
"""

from __future__ import annotations

from .semconv_audits import *  # noqa: F403
from .semconv_float8 import *  # noqa: F403
from .semconv_iterations import *  # noqa: F403

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
ATTR_MESH_COORDINATE = "fsdp.mesh.coordinate"
"""On SPAN_STEP: this rank's place on a mesh of 2 or more dimensions (HSDP, tensor parallel x
FSDP), ``name=index`` per dimension (``replicate=1,shard=0``). A span attribute because an
application's resource is fixed before any mesh exists; providers built after sharding also carry
it on their resource (RESOURCE_MESH_COORDINATE)."""
ATTR_OPTIMIZER_CLASS = "fsdp.optimizer.class"
ATTR_PARAMS_COUNT = "fsdp.params.count"
ATTR_GROUPS_COUNT = "fsdp.groups.count"
ATTR_CAST_BYTES = "fsdp.cast.bytes"
ATTR_PRECISION_AWARE = "fsdp.precision_aware"
ATTR_ZERO_GRAD_SET_TO_NONE = "fsdp.zero_grad.set_to_none"
ATTR_ERROR_TYPE = "error.type"  # OpenTelemetry semantic conventions
ATTR_EXCEPTION_TYPE = "exception.type"  # on the exception event

# Every attribute of a SPAN_STEP span, rejected steps included (docs/conventions.md).
STEP_ATTRIBUTES = (
    ATTR_STEP,
    ATTR_RANK,
    ATTR_WORLD_SIZE,
    ATTR_OPTIMIZER_CLASS,
    ATTR_PARAMS_COUNT,
    ATTR_GROUPS_COUNT,
    ATTR_CAST_BYTES,
    ATTR_PRECISION_AWARE,
)

# -- resource attributes ---------------------------------------------------------------------------

RESOURCE_RANK = "fsdp.rank"
RESOURCE_WORLD_SIZE = "fsdp.world_size"
RESOURCE_LOCAL_RANK = "fsdp.local_rank"
RESOURCE_RUN_ID = "fsdp.run_id"
RESOURCE_MESH_COORDINATE = ATTR_MESH_COORDINATE
"""Where the providers are built after a model on a mesh of 2 or more dimensions was sharded (the
embedded default, at the first step): the rank's mesh coordinate, as on the step spans."""

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
    METRIC_REFRESH_OVERFLOW,
    METRIC_REFRESH_UNDERFLOW,
    METRIC_REFRESH_ERROR,
    METRIC_LOST_RATIO,
    METRIC_GRAD_AMAX,
    METRIC_NONFINITE,
)

# -- counts of diagnosed steps ------------------------------------------------------------------------
# The precision counters above add each diagnosed step's count, so their totals are element-steps;
# these count the diagnosed steps themselves, which per-step panels divide by and alert rules count.

METRIC_PRECISION_STEPS = "fsdp.precision.steps"
METRIC_NONFINITE_STEPS = "fsdp.precision.nonfinite.steps"

# -- attribution: where a precision problem is (docs/conventions.md, "Attribution") ------------------------------
# Per-parameter and per-unit detail goes on spans and into the report; a metric label only for
# units, and only when FSDP_PATCH_PRECISION_DETAIL=unit.

ATTR_PARAM = "fsdp.param"
"""A parameter's fully qualified name, as ``model.named_parameters()`` gives it."""
ATTR_UNIT = "fsdp.unit"
"""The fully qualified name of the sharded module holding the parameter; ``""`` for the root."""
ATTR_OPTIMIZER_STATE = "fsdp.optimizer.state"
"""An optimizer state key: ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ..."""
ATTR_RANKS = "fsdp.ranks"
"""Global ranks (int array, as ATTR_RANK) where something was found, also when the diagnostics
gather over a process group of some ranks only."""
ATTR_PRECISION_PARAMS = "fsdp.precision.params"
"""Names (string array, at most FSDP_PATCH_PRECISION_TOP_K) of the parameters a finding covers."""
ATTR_PRECISION_PARAMS_COUNT = "fsdp.precision.params.count"
"""How many parameters a finding covers (``fsdp.precision.params`` lists the first of them)."""
ATTR_PRECISION_ELEMENTS = "fsdp.precision.elements"
"""Elements a finding counts (over all ranks)."""
ATTR_DIAGNOSTIC = "fsdp.precision.diagnostic"
"""Which diagnostic an offender event ranks parameters by (one of DIAGNOSTICS)."""
ATTR_VALUE = "fsdp.precision.value"
"""The diagnostic's value for the parameter."""
ATTR_CAUSE = "fsdp.precision.cause"
"""Why an unstepped parameter does not move: one of UNSTEPPED_CAUSES."""
ATTR_DTYPE_EXPECTED = "fsdp.dtype.expected"
ATTR_DTYPE_ACTUAL = "fsdp.dtype.actual"
ATTR_DTYPE_DETAIL = "fsdp.dtype.detail"
"""On a dtype-contract event of the model audit: what the dtype does there, and the fix."""

TENSOR_OPTIMIZER_STATE = "optimizer_state"
# What the model audit names beside the optimizer's tensors (diagnostics/model_audit.py).
TENSOR_BUFFER = "buffer"
"""A floating buffer of the model (``fsdp.param``: its fully qualified name)."""
TENSOR_LOSS = "loss"
"""The loss, or the operation it was computed in (``fsdp.param``: that operation)."""
TENSOR_NORM_STATISTICS = "norm_statistics"
"""A normalization module's statistics (``fsdp.param``: the module)."""
TENSOR_GRAD_ACCUMULATION = "grad_accumulation"
"""A group's grads summed over microbatches (``fsdp.param``: its unit)."""
MODEL_AUDIT_TENSORS = (TENSOR_BUFFER, TENSOR_LOSS, TENSOR_NORM_STATISTICS, TENSOR_GRAD_ACCUMULATION)
CONTRACT_TENSORS = (*TENSORS, TENSOR_OPTIMIZER_STATE, *MODEL_AUDIT_TENSORS)
"""Values of ATTR_TENSOR on METRIC_DTYPE_CONTRACT: the audit also checks the optimizer's state."""
"""``fsdp.tensor`` of an optimizer state tensor (its key in ``fsdp.optimizer.state``)."""
# Where a NaN/Inf shows first, in the order it spreads within a step: the backward writes the
# grad, the optimizer its state from the grad, then the main weight, the refresh the compute weight.
FIRST_NONFINITE_ORDER = (TENSOR_MAIN_GRAD, TENSOR_OPTIMIZER_STATE, TENSOR_MAIN_WEIGHT, TENSOR_COMPUTE_WEIGHT)

EVENT_FIRST_NONFINITE = "fsdp.precision.first_nonfinite"
"""On SPAN_PRECISION, once per run: the first NaN/Inf (step, parameter, tensor or state key, ranks)."""
EVENT_OFFENDER = "fsdp.precision.offender"
"""On SPAN_PRECISION: one per (diagnostic, parameter) among the top K of that step, with the value."""
EVENT_DTYPE_CONTRACT = "fsdp.precision.dtype_contract"
"""On SPAN_STEP: a dtype the contract does not expect, with what was expected (once per violation)."""
EVENT_REPLICA_DIVERGENCE = "fsdp.precision.replica_divergence"
"""On SPAN_PRECISION, every diagnosed step at which HSDP's replicas differ: NaN/Inf counts or main
weights that replicas should hold alike (ATTR_PRECISION_PARAMS: where; ATTR_RANKS: one rank per
replica, this rank's peers; ATTR_REPLICA_NONFINITE: each replica's NaN/Inf elements there)."""
ATTR_REPLICA_DIFF = "fsdp.replica.diff"
"""On EVENT_REPLICA_DIVERGENCE: what differs, REPLICA_DIFF_NONFINITE or REPLICA_DIFF_MAIN_WEIGHT."""
REPLICA_DIFF_NONFINITE = "nonfinite"
REPLICA_DIFF_MAIN_WEIGHT = "main_weight"
ATTR_REPLICA_NONFINITE = "fsdp.replica.nonfinite"
"""On EVENT_REPLICA_DIVERGENCE: per replica, in the order of ATTR_RANKS, the NaN/Inf elements of
the parameters that differ (main grads, main and compute weights, optimizer state)."""

# Values of ATTR_DIAGNOSTIC. The whole-model diagnostics keep their metric's name; the others:
DIAGNOSTIC_UPDATE_RESOLUTION = "fsdp.precision.update.resolution"
"""RMS of the applied update over the compute dtype's rounding step at the weight's RMS
(``||Δ||₂ / (u ||w||₂)``, u the unit roundoff): below 1, a typical update is lost in the compute
weights; offenders are the smallest. Measured where a parameter lost at least half its updates
at its last diagnosed step (every parameter at its first)."""
DIAGNOSTIC_STUCK = "fsdp.precision.update.stuck"
"""Diagnosed steps in a row (at least FSDP_PATCH_PRECISION_WINDOW) in which the main weight moved
and not one element of the compute weight did."""
DIAGNOSTIC_UNSTEPPED = "fsdp.precision.update.unstepped"
"""Diagnosed steps in a row (at least FSDP_PATCH_PRECISION_WINDOW) with a non-zero grad and a
main weight that did not change at all."""
DIAGNOSTIC_STATE_NONFINITE = "fsdp.precision.state.nonfinite"
"""NaN and Inf elements of one optimizer state tensor (with ATTR_OPTIMIZER_STATE)."""
DIAGNOSTIC_STATE_FLUSHED = "fsdp.precision.state.flushed"
"""Fraction of a parameter's ``exp_avg_sq`` elements that are 0 where the grad is not: the
squared grad underflowed, and the update divides by eps alone."""
DIAGNOSTIC_GRAD_UNDERFLOW = "fsdp.precision.grad.underflow"
"""Where a float16 backward runs without loss scaling: the fraction of a parameter's grad elements
that are 0 or below float16's smallest normal (6.1e-5); named only where some grad of the model
is below that normal and not 0 (the sign of a flushing backward: an embedding's unused rows alone
are exact zeros)."""
DIAGNOSTIC_UPDATE_JUMP = "fsdp.precision.update.jump"
"""How many times larger a parameter's update was than it can be: its RMS against the median of
its last diagnosed steps (at least 100x), or, for Adam and AdamW, its RMS per unit of learning
rate against the largest one moments consistent with each other allow (at least twice it); with
ATTR_CAUSE, what changed at that step (UPDATE_JUMP_CAUSES)."""
DIAGNOSTICS = (
    METRIC_NONFINITE,
    METRIC_REFRESH_OVERFLOW,
    METRIC_REFRESH_UNDERFLOW,
    METRIC_REFRESH_ERROR,
    METRIC_LOST_RATIO,
    METRIC_GRAD_AMAX,
    DIAGNOSTIC_UPDATE_RESOLUTION,
    DIAGNOSTIC_STUCK,
    DIAGNOSTIC_UNSTEPPED,
    DIAGNOSTIC_STATE_NONFINITE,
    DIAGNOSTIC_STATE_FLUSHED,
    DIAGNOSTIC_GRAD_UNDERFLOW,
    DIAGNOSTIC_UPDATE_JUMP,
)

UPDATE_JUMP_STATE_LOADED = "optimizer_state_loaded"
"""The optimizer's state was replaced (``load_state_dict``) since the last diagnosed step."""
UPDATE_JUMP_LR = "learning_rate_jumped"
"""Its learning rate grew at least tenfold since the last diagnosed step."""
UPDATE_JUMP_GRADS = "grads_jumped"
"""Its largest grad grew at least tenfold since the last diagnosed step."""
UPDATE_JUMP_STATE = "state_inconsistent"
"""Neither a load, the learning rate nor the grads changed that much: the optimizer's state (its
moments no longer match each other or the parameter)."""
UPDATE_JUMP_CAUSES = (UPDATE_JUMP_STATE_LOADED, UPDATE_JUMP_LR, UPDATE_JUMP_GRADS, UPDATE_JUMP_STATE)
ATTR_LOAD_SITE = "fsdp.optimizer.load_site"
"""On an update-jump offender whose cause is UPDATE_JUMP_STATE_LOADED: the line of the script that
called ``Optimizer.load_state_dict`` (``file:line in function``), where the state came in."""

UNSTEPPED_NOT_IN_OPTIMIZER = "not_in_optimizer"
"""The parameter gets grads but is in none of the optimizer's param groups."""
UNSTEPPED_NO_UPDATE = "no_update"
"""In the optimizer with a learning rate above 0, yet its main weight never changes (a frozen
copy, updates applied elsewhere, a step skipped for this parameter)."""
UNSTEPPED_LOW_PRECISION_MASTER = "low_precision_master"
"""In the optimizer, its main weight is bfloat16/float16 (no fp32 master weights): each update is
below the main dtype's resolution at the weight's magnitude and rounds away."""
UNSTEPPED_CAUSES = (UNSTEPPED_NOT_IN_OPTIMIZER, UNSTEPPED_NO_UPDATE, UNSTEPPED_LOW_PRECISION_MASTER)

# Whole-model values of the attribution on the SPAN_PRECISION span (the report judges them).
ATTR_STUCK_PARAMS = DIAGNOSTIC_STUCK
"""Parameters stuck (see DIAGNOSTIC_STUCK) at this step."""
ATTR_UNSTEPPED_PARAMS = DIAGNOSTIC_UNSTEPPED
"""Parameters unstepped (see DIAGNOSTIC_UNSTEPPED) at this step."""
ATTR_STATE_NONFINITE = DIAGNOSTIC_STATE_NONFINITE
"""NaN and Inf elements of all optimizer state tensors."""
ATTR_STATE_FLUSHED = DIAGNOSTIC_STATE_FLUSHED
"""The largest per-parameter fraction of flushed ``exp_avg_sq`` elements."""
ATTR_STEP_SKIPPED = "fsdp.precision.update.skipped"
"""1 when no main weight the optimizer steps changed although grads were non-zero and finite
(a silently skipped step), else 0."""
ATTR_GRAD_UNDERFLOW = DIAGNOSTIC_GRAD_UNDERFLOW
"""Over the model: grad elements 0 or below float16's smallest normal, over every grad element,
where some are below that normal and not 0 (else 0); only where a float16 backward runs without
loss scaling."""
ATTR_UPDATE_JUMP = DIAGNOSTIC_UPDATE_JUMP
"""The largest update jump (see DIAGNOSTIC_UPDATE_JUMP) of a parameter at this step, 0 where none."""
ATTRIBUTION_SPAN_ATTRIBUTES = (
    ATTR_STUCK_PARAMS,
    ATTR_UNSTEPPED_PARAMS,
    ATTR_STATE_NONFINITE,
    ATTR_STATE_FLUSHED,
    ATTR_STEP_SKIPPED,
    ATTR_GRAD_UNDERFLOW,
    ATTR_UPDATE_JUMP,
)

METRIC_DTYPE_CONTRACT = "fsdp.precision.dtype_contract.violations"
"""Counter, ``{tensor}``: tensors found in a dtype the contract does not expect, once each
(attributes ATTR_TENSOR, ATTR_DTYPE_EXPECTED, ATTR_DTYPE_ACTUAL)."""
METRIC_SKIPPED_STEPS = "fsdp.precision.update.skipped_steps"
"""Counter, ``{step}``: diagnosed steps that were silently skipped (see ATTR_STEP_SKIPPED)."""

SETTING_PRECISION_TOP_K = "FSDP_PATCH_PRECISION_TOP_K"
"""Offenders per diagnostic on the precision span (default 3; 0 turns the per-parameter detail off)."""
SETTING_PRECISION_DETAIL = "FSDP_PATCH_PRECISION_DETAIL"
"""``off`` (default) or ``unit``: the precision metrics also carry ATTR_UNIT."""
SETTING_PRECISION_WINDOW = "FSDP_PATCH_PRECISION_WINDOW"
"""Diagnosed steps in a row before a weight is named stuck or unstepped (default 3)."""
DETAIL_OFF = "off"
DETAIL_UNIT = "unit"
DETAILS = (DETAIL_OFF, DETAIL_UNIT)
