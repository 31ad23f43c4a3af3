"""The names of the per-iteration checks (docs/conventions.md, "Origin"): where an iteration's first
NaN/Inf began, grads zeroed before the step, the step accounting (skipped steps, backward passes),
learning-rate jumps and escalation.

:mod:`.semconv` re-exports every name here: code reads them as ``semconv.NAME``, as it reads the
others. Imports nothing.
"""

from __future__ import annotations

__all__ = [
    "ATTR_BACKWARD_COUNT",
    "ATTR_ESCALATION_STEPS",
    "ATTR_GRADS_ZEROED_UNITS",
    "ATTR_GRAD_SCALER_SCALE",
    "ATTR_LR_AFTER",
    "ATTR_LR_BEFORE",
    "ATTR_MICROBATCH",
    "ATTR_ORIGIN_DETAIL",
    "ATTR_ORIGIN_DTYPE",
    "ATTR_ORIGIN_REFINED",
    "ATTR_ORIGIN_STAGE",
    "ATTR_ORIGIN_WHERE",
    "ATTR_PARAM_GROUP",
    "EVENT_ESCALATION",
    "EVENT_GRADS_ZEROED",
    "EVENT_LR_JUMP",
    "EVENT_ORIGIN",
    "LR_JUMP_FACTOR",
    "METRIC_OPTIMIZER_SKIPPED_STEPS",
    "ORIGIN_BACKWARD",
    "ORIGIN_FORWARD",
    "ORIGIN_GRAD_WRITE",
    "ORIGIN_LOSS",
    "ORIGIN_OPTIMIZER",
    "ORIGIN_REDUCE",
    "ORIGIN_STAGES",
    "ORIGIN_WEIGHT_WRITE",
    "ORIGIN_WHERE_CLIP",
    "SETTING_PRECISION_ESCALATION",
    "SETTING_PRECISION_ORIGIN",
    "SPAN_CHECKS",
    "SPAN_SKIPPED_STEP",
]

# -- the origin of an iteration's first NaN/Inf (docs/conventions.md, "Origin") ----------------------

EVENT_ORIGIN = "fsdp.precision.origin"
"""On SPAN_STEP (or SPAN_SKIPPED_STEP) of the step after it: where the first NaN/Inf of an
iteration began, once per run of iterations that hold one (and again when escalation refines it)."""
ATTR_ORIGIN_STAGE = "fsdp.origin.stage"
"""One of ORIGIN_STAGES: the part of the iteration where it began."""
ATTR_ORIGIN_WHERE = "fsdp.origin.where"
"""The module (forward, backward), parameter (weight_write, optimizer) or unit (reduce,
grad_write) named, as ``model.named_modules()`` / ``named_parameters()`` name it, ``model`` the outermost
module holding the sharded root (``fsdp_patch.module.model_units.holder_prefix``); ``""`` is that module."""
ATTR_ORIGIN_DTYPE = "fsdp.origin.dtype"
"""The dtype of the tensor where it was seen (``float16``)."""
ATTR_ORIGIN_DETAIL = "fsdp.origin.detail"
"""What else the checks know: the value that overflowed, the reduce dtype, the clip norm."""
ATTR_ORIGIN_REFINED = "fsdp.origin.refined"
"""True when module-level checks of an escalated iteration found it (else a unit-level check did)."""
ATTR_MICROBATCH = "fsdp.microbatch"
"""Which backward pass of the iteration (0 before the first; gradient accumulation counts up)."""

ORIGIN_WEIGHT_WRITE = "weight_write"
ORIGIN_FORWARD = "forward"
ORIGIN_LOSS = "loss"
ORIGIN_BACKWARD = "backward"
ORIGIN_REDUCE = "reduce"
ORIGIN_GRAD_WRITE = "grad_write"
ORIGIN_OPTIMIZER = "optimizer"
ORIGIN_WHERE_CLIP = "clip_grad_norm_"
"""``fsdp.origin.where`` of the total norm ``torch.nn.utils.clip_grad_norm_`` returned (stage grad_write)."""
ORIGIN_STAGES = (
    ORIGIN_WEIGHT_WRITE,
    ORIGIN_FORWARD,
    ORIGIN_LOSS,
    ORIGIN_BACKWARD,
    ORIGIN_REDUCE,
    ORIGIN_GRAD_WRITE,
    ORIGIN_OPTIMIZER,
)
"""In the order an iteration runs them: a write between steps, then forward, loss, backward, the
reduce-scatter, what changed the grads between backward and step, and the optimizer's update."""

EVENT_GRADS_ZEROED = "fsdp.precision.grads_zeroed"
"""On SPAN_STEP of the step after it: every unit's grads were non-zero after the backward and its
reduce, and all exactly 0 at the optimizer's step (something between multiplied them by 0)."""
ATTR_GRADS_ZEROED_UNITS = "fsdp.grads_zeroed.units"
"""The units whose grads were zeroed, comma-separated (``(root)`` is the root)."""

# -- step accounting -----------------------------------------------------------------------------------

SPAN_CHECKS = "fsdp.optimizer.checks"
"""The last iteration's checks, read at a flush or at exit when no later step read them (its
origin event, if any)."""
SPAN_SKIPPED_STEP = "fsdp.optimizer.skipped_step"
"""An iteration whose ``torch.amp.GradScaler.step(optimizer)`` did not step the optimizer (its
grads held NaN/Inf); parent: the caller's span."""
ATTR_BACKWARD_COUNT = "fsdp.backward.count"
"""On SPAN_STEP and SPAN_SKIPPED_STEP: backward passes since the previous step or skipped step; on
SPAN_CHECKS at exit: those no step followed."""
ATTR_GRAD_SCALER_SCALE = "fsdp.grad_scaler.scale"
"""On SPAN_SKIPPED_STEP: the GradScaler's scale in that iteration (before its update halves it)."""
METRIC_OPTIMIZER_SKIPPED_STEPS = "fsdp.optimizer.skipped_steps"
"""Counter, ``{step}``: iterations a GradScaler skipped (no optimizer step ran)."""

EVENT_LR_JUMP = "fsdp.optimizer.lr_jump"
"""On SPAN_STEP: a param group's learning rate at this step is at least LR_JUMP_FACTOR times the
one the previous step used (a previous lr of 0 is no jump: a warm-up from 0)."""
ATTR_PARAM_GROUP = "fsdp.param_group"
"""The index of the optimizer's param group."""
ATTR_LR_BEFORE = "fsdp.lr.before"
"""The learning rate the previous step used."""
ATTR_LR_AFTER = "fsdp.lr.after"
"""The learning rate this step uses."""
LR_JUMP_FACTOR = 10.0

# -- escalation -----------------------------------------------------------------------------------------

EVENT_ESCALATION = "fsdp.precision.escalation"
"""On SPAN_STEP: a NaN/Inf was seen at ``fsdp.step``; the next ``fsdp.precision.escalation.steps``
iterations run module-level checks and diagnostics every step."""
ATTR_ESCALATION_STEPS = "fsdp.precision.escalation.steps"
SETTING_PRECISION_ORIGIN = "FSDP_PATCH_PRECISION_ORIGIN"
"""``on`` (default) or ``off``: the per-iteration checks that find where a NaN/Inf began (off:
escalation off too; skipped steps are still counted)."""
SETTING_PRECISION_ESCALATION = "FSDP_PATCH_PRECISION_ESCALATION"
"""Iterations of full detail after a NaN/Inf is seen (default 3; 0 turns escalation off)."""
