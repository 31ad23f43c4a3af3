"""The names of the audits of the model's computations (docs/conventions.md, "Operation audit"):
the operation audit's findings, the float32 shadow of modules, and the headroom forecast of unit
outputs.

:mod:`.semconv` re-exports every name here: code reads them as ``semconv.NAME``, as it reads the
others. Imports nothing.
"""

from __future__ import annotations

__all__ = [
    "ATTR_HEADROOM_AMAX",
    "ATTR_HEADROOM_DTYPE",
    "ATTR_HEADROOM_FROM_AMAX",
    "ATTR_HEADROOM_FROM_STEP",
    "ATTR_HEADROOM_LIMIT",
    "ATTR_HEADROOM_STEPS_LEFT",
    "ATTR_OP_CALLER",
    "ATTR_OP_DETAIL",
    "ATTR_OP_DTYPE",
    "ATTR_OP_FIX",
    "ATTR_OP_FP32_FINITE",
    "ATTR_OP_KIND",
    "ATTR_OP_MODULE",
    "ATTR_OP_NAME",
    "ATTR_OP_ORDER",
    "ATTR_OP_PHASE",
    "ATTR_OP_SHARE",
    "ATTR_OP_SITE",
    "ATTR_SHADOW_DTYPE",
    "ATTR_SHADOW_ERROR",
    "ATTR_SHADOW_HEADROOM",
    "ATTR_SHADOW_MODULE",
    "ATTR_SHADOW_MODULE_TYPE",
    "ATTR_SHADOW_NONFINITE",
    "ATTR_SHADOW_ORDER",
    "ATTR_SHADOW_ROUNDING",
    "ATTR_SHADOW_UNDERFLOW",
    "ATTR_SHADOW_WEIGHT_ERROR",
    "EVENT_HEADROOM_FORECAST",
    "EVENT_OP",
    "EVENT_SHADOW",
    "OP_KINDS",
    "OP_KIND_CONSTANT",
    "OP_KIND_HEADROOM",
    "OP_KIND_ILL_CONDITIONED",
    "OP_KIND_LOST_UPDATE",
    "OP_KIND_NONFINITE",
    "OP_KIND_PRECISION_LOSS",
    "OP_KIND_TIES",
    "OP_PHASES",
    "SETTING_PRECISION_AUDIT_EVERY",
    "SETTING_PRECISION_SHADOW_EVERY",
]

# -- the operation audit (docs/conventions.md, "Operation audit") ---------------------------------------

EVENT_OP = "fsdp.precision.op"
"""On SPAN_STEP of the step that ends an audited iteration: one low-precision operation judged
against float32 on the same inputs, once per run for each (kind, operation, source line, phase)."""
ATTR_OP_KIND = "fsdp.op.kind"
"""One of OP_KINDS: what was found."""
ATTR_OP_NAME = "fsdp.op.name"
"""The ATen operation (``aten.sin``)."""
ATTR_OP_DTYPE = "fsdp.op.dtype"
"""The low-precision dtype it computed in (``bfloat16``)."""
ATTR_OP_PHASE = "fsdp.op.phase"
"""One of OP_PHASES: the part of the iteration it ran in."""
ATTR_OP_MODULE = "fsdp.op.module"
"""The running module as the model names it (``blocks.1.attn``; ``""`` the root), or its class name
in angle brackets for a module outside the watched model, or absent outside any module."""
ATTR_OP_SITE = "fsdp.op.site"
"""The source line that called it: ``file:line in function``."""
ATTR_OP_CALLER = "fsdp.op.caller"
"""The caller of that line, likewise (``""``: none in the user's code)."""
ATTR_OP_DETAIL = "fsdp.op.detail"
"""What was measured, in words (ranges against the dtype's, errors against float32, shares)."""
ATTR_OP_FIX = "fsdp.op.fix"
"""What to change there."""
ATTR_OP_SHARE = "fsdp.op.share"
"""The measured share the finding is about (of results, updates or rows), or the relative error."""
ATTR_OP_FP32_FINITE = "fsdp.op.fp32_finite"
"""For OP_KIND_NONFINITE: whether float32 on the same inputs stays finite (a precision problem)."""
ATTR_OP_ORDER = "fsdp.op.order"
"""The operation's place among the iteration's measured operations (0: the first)."""
OP_KIND_NONFINITE = "nonfinite"
OP_KIND_HEADROOM = "headroom"
OP_KIND_PRECISION_LOSS = "precision_loss"
OP_KIND_ILL_CONDITIONED = "ill_conditioned"
OP_KIND_LOST_UPDATE = "lost_update"
OP_KIND_CONSTANT = "constant"
OP_KIND_TIES = "ties"
OP_KINDS = (
    OP_KIND_NONFINITE,
    OP_KIND_HEADROOM,
    OP_KIND_PRECISION_LOSS,
    OP_KIND_ILL_CONDITIONED,
    OP_KIND_LOST_UPDATE,
    OP_KIND_CONSTANT,
    OP_KIND_TIES,
)
OP_PHASES = ("between_steps", "forward", "loss", "backward", "after_backward", "optimizer")
SETTING_PRECISION_AUDIT_EVERY = "FSDP_PATCH_PRECISION_AUDIT_EVERY"
"""Iterations between operation audits (default 1000; 0 turns the audit off). The second iteration is
audited too, and so is every escalated one."""

# -- float32 shadow -------------------------------------------------------------------------------------

EVENT_SHADOW = "fsdp.precision.shadow"
"""On SPAN_STEP of the step that ends a shadowed iteration: one module of the
``FSDP_PATCH_PRECISION_TOP_K`` whose float32 recompute (from the fp32 main weights, on its own inputs)
differs most from its output, in units of its dtype's rounding; one event per module and rank."""
ATTR_SHADOW_MODULE = "fsdp.shadow.module"
"""The module's qualified name."""
ATTR_SHADOW_MODULE_TYPE = "fsdp.shadow.module_type"
"""Its class's name."""
ATTR_SHADOW_DTYPE = "fsdp.shadow.dtype"
"""Its output's dtype (``bfloat16``)."""
ATTR_SHADOW_ERROR = "fsdp.shadow.error"
"""``||out - ref|| / ||ref||``, ``ref`` the module recomputed in float32 from the fp32 main weights on
its own inputs: the error the module adds."""
ATTR_SHADOW_WEIGHT_ERROR = "fsdp.shadow.weight_error"
"""``||ref_compute - ref|| / ||ref||``: the part its compute weights (widened) make."""
ATTR_SHADOW_ROUNDING = "fsdp.shadow.rounding"
"""The output dtype's unit roundoff (2^-8 for bfloat16): the error of rounding the result alone."""
ATTR_SHADOW_HEADROOM = "fsdp.shadow.headroom"
"""Its largest finite ``|output|`` over the dtype's largest finite value."""
ATTR_SHADOW_UNDERFLOW = "fsdp.shadow.underflow"
"""Share of its output elements non-zero in float32 and below the dtype's smallest normal."""
ATTR_SHADOW_NONFINITE = "fsdp.shadow.nonfinite"
"""Output elements NaN/Inf where float32 is finite."""
ATTR_SHADOW_ORDER = "fsdp.shadow.order"
"""Its place in the ranking, costliest first (0)."""
SETTING_PRECISION_SHADOW_EVERY = "FSDP_PATCH_PRECISION_SHADOW_EVERY"
"""Iterations between float32 shadows of the forward (default 1000; 0 turns the shadow off). The second
iteration is shadowed too; escalated ones are not (the shadow gathers weights: ranks must agree)."""

# -- headroom forecast ----------------------------------------------------------------------------------

EVENT_HEADROOM_FORECAST = "fsdp.precision.headroom_forecast"
"""On SPAN_STEP of a diagnosed step: a unit's output (``fsdp.unit``) grows steadily over the diagnosed
steps and reaches its dtype's largest finite value in ``fsdp.headroom.steps_left`` steps at that
rate; once per unit and dtype per run."""
ATTR_HEADROOM_DTYPE = "fsdp.headroom.dtype"
"""The output's dtype (``float16``)."""
ATTR_HEADROOM_AMAX = "fsdp.headroom.amax"
"""Its largest finite magnitude at ``fsdp.step``."""
ATTR_HEADROOM_LIMIT = "fsdp.headroom.limit"
"""The dtype's largest finite value."""
ATTR_HEADROOM_STEPS_LEFT = "fsdp.headroom.steps_left"
"""Steps until the output reaches the limit at the rate fitted over the last diagnosed steps."""
ATTR_HEADROOM_FROM_STEP = "fsdp.headroom.from_step"
"""The first diagnosed step of the fit."""
ATTR_HEADROOM_FROM_AMAX = "fsdp.headroom.from_amax"
"""The output's largest finite magnitude then."""
