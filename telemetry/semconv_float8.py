"""The names of the float8 cast watch (docs/conventions.md, "Float8 casts"): what torchao's float8
casts make of each ``Float8Linear``'s inputs, weights and grad outputs on a diagnosed iteration.

:mod:`.semconv` re-exports every name here: code reads them as ``semconv.NAME``, as it reads the
others. Imports nothing.
"""

from __future__ import annotations

__all__ = [
    "ATTR_FLOAT8_AMAX",
    "ATTR_FLOAT8_AMAX_RATIO",
    "ATTR_FLOAT8_CALLS",
    "ATTR_FLOAT8_DTYPE",
    "ATTR_FLOAT8_FLUSHED",
    "ATTR_FLOAT8_GATHERED",
    "ATTR_FLOAT8_GRANULARITY",
    "ATTR_FLOAT8_MODULE",
    "ATTR_FLOAT8_NONFINITE",
    "ATTR_FLOAT8_POSITION",
    "ATTR_FLOAT8_ROLE",
    "ATTR_FLOAT8_ROWWISE_FLUSHED",
    "ATTR_FLOAT8_SATURATED",
    "ATTR_FLOAT8_SCALE",
    "ATTR_FLOAT8_SCALE_MAX",
    "ATTR_FLOAT8_SQNR",
    "ATTR_FLOAT8_SUBNORMAL",
    "EVENT_FLOAT8_CAST",
    "FLOAT8_POSITIONS",
    "FLOAT8_POSITION_FIRST",
    "FLOAT8_POSITION_LAST",
    "FLOAT8_POSITION_MIDDLE",
    "FLOAT8_ROLES",
    "FLOAT8_ROLE_GRAD_OUTPUT",
    "FLOAT8_ROLE_INPUT",
    "FLOAT8_ROLE_WEIGHT",
]

EVENT_FLOAT8_CAST = "fsdp.precision.float8"
"""On SPAN_STEP of the step that ends a diagnosed iteration (the diagnostics' schedule, and every
escalated one): one float8 cast of a torchao float8 module, its input, weight or grad output, as
torchao's own cast function makes it; one event per module, role and rank, aggregated over the
iteration's calls (microbatches, recomputation) to the worst of each value."""
ATTR_FLOAT8_MODULE = "fsdp.float8.module"
"""The float8 module's qualified name (``model.named_modules()``)."""
ATTR_FLOAT8_ROLE = "fsdp.float8.role"
"""What was cast: ``input``, ``weight`` or ``grad_output``."""
FLOAT8_ROLE_INPUT = "input"
FLOAT8_ROLE_WEIGHT = "weight"
FLOAT8_ROLE_GRAD_OUTPUT = "grad_output"
FLOAT8_ROLES = (FLOAT8_ROLE_INPUT, FLOAT8_ROLE_WEIGHT, FLOAT8_ROLE_GRAD_OUTPUT)
ATTR_FLOAT8_DTYPE = "fsdp.float8.dtype"
"""The float8 dtype cast to (``float8_e4m3fn``, ``float8_e5m2``)."""
ATTR_FLOAT8_GRANULARITY = "fsdp.float8.granularity"
"""torchao's scaling granularity: ``tensorwise`` (one scale) or ``axiswise`` (a scale per row)."""
ATTR_FLOAT8_GATHERED = "fsdp.float8.gathered"
"""Whether the weight arrived in float8 (an fp8 all-gather): its values are read as gathered, and the
high-precision weight they came from is not there to compare with."""
ATTR_FLOAT8_AMAX = "fsdp.float8.amax"
"""The largest ``|x|`` of the high-precision tensor (NaN where it holds NaN)."""
ATTR_FLOAT8_SCALE = "fsdp.float8.scale"
"""The scale the cast multiplied by (``finfo(float8).max / amax``): the smallest, where there is one
per row."""
ATTR_FLOAT8_SCALE_MAX = "fsdp.float8.scale_max"
"""The largest scale (the same as ``fsdp.float8.scale`` for tensorwise scaling)."""
ATTR_FLOAT8_AMAX_RATIO = "fsdp.float8.amax_ratio"
"""``amax / median |x|`` over the non-zero elements: how far the tensor's largest element stands
above a typical one (an outlier that sets a tensorwise scale); NaN where every element is 0."""
ATTR_FLOAT8_FLUSHED = "fsdp.float8.flushed"
"""Share of the non-zero elements the cast made 0."""
ATTR_FLOAT8_SUBNORMAL = "fsdp.float8.subnormal"
"""Share of the non-zero elements cast below the float8 dtype's smallest normal, where they keep
fewer than its mantissa bits, zeros included."""
ATTR_FLOAT8_ROWWISE_FLUSHED = "fsdp.float8.rowwise_flushed"
"""Where the cast is tensorwise: the share of the non-zero elements a scale per row (along the axis
torchao's rowwise recipe scales) would flush to 0. Low where rowwise scaling is the fix (an outlier
token), as high as ``fsdp.float8.flushed`` where it is not (an outlier feature, in every row)."""
ATTR_FLOAT8_SATURATED = "fsdp.float8.saturated"
"""Share of the elements whose scaled value is beyond the dtype's largest finite value: clamped to it.
For a gathered weight (no high-precision tensor to compare with), estimated from the count at the
largest value beyond what rounding puts there (the value below's count): 0 under a scale from the
weight's own amax."""
ATTR_FLOAT8_SQNR = "fsdp.float8.sqnr"
"""The cast's signal to quantization noise ratio in dB, ``10 log10(sum x^2 / sum (x - dequant)^2)``,
against the high-precision tensor (float32 holds ``x`` exactly); about 31 dB for e4m3 and 25 dB for
e5m2 on Gaussian values; ``inf`` where nothing was lost (an all-zero tensor, a gathered weight: no
high-precision tensor to compare with); NaN where the cast made NaN/Inf. An outlier's energy
dominates both sums: a tensor whose other elements were flushed can read high."""
ATTR_FLOAT8_NONFINITE = "fsdp.float8.nonfinite"
"""Elements NaN/Inf after the cast where the high-precision tensor is finite (a non-finite scale);
0 where that tensor holds NaN/Inf itself (its amax and scale are NaN: the cast did not make them)."""
ATTR_FLOAT8_CALLS = "fsdp.float8.calls"
"""Casts of this module and role in the iteration."""
ATTR_FLOAT8_POSITION = "fsdp.float8.position"
"""Where the module ran among the model's modules that hold parameters, in the iteration's forward:
``first``, ``last`` or ``middle``."""
FLOAT8_POSITION_FIRST = "first"
FLOAT8_POSITION_LAST = "last"
FLOAT8_POSITION_MIDDLE = "middle"
FLOAT8_POSITIONS = (FLOAT8_POSITION_FIRST, FLOAT8_POSITION_LAST, FLOAT8_POSITION_MIDDLE)
