"""What a run's float32 shadows found, from its trace files: what low precision costs each module.

Reads the ``fsdp.precision.shadow`` events (:mod:`fsdp_patch.telemetry.instrumentation.module_shadows`)
of every rank, merged per shadowed step and module: the largest error any rank measured, with every
rank that reported the module. No torch and no OpenTelemetry here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import precision_thresholds as thresholds
from .. import semconv
from .rank_merge import merge

__all__ = ["ModuleSeen", "ShadowTrace", "costliest_text", "shadow_json", "shadow_text"]


@dataclass
class ModuleSeen:
    """One module of one shadowed step, the worst of the ranks that reported it."""

    step: int
    module: str
    module_type: str
    dtype: str
    error: float
    weight_error: float
    rounding: float
    headroom: float
    underflow: float
    nonfinite: int
    ranks: set[int] = field(default_factory=set)

    @property
    def cost(self) -> float:
        """The local error in units of the dtype's rounding (``inf`` where float32 stayed finite and it did not)."""
        if self.nonfinite:
            return float("inf")
        return self.error / self.rounding if self.rounding > 0 else 0.0

    @property
    def costly(self) -> bool:
        """Whether its local error is a finding: ``OP_ERROR_FACTOR`` times its rounding and over
        ``OP_ERROR_FLOOR`` of its output, as an operation's (or NaN/Inf float32 would not make)."""
        return bool(self.nonfinite) or (
            self.cost >= thresholds.OP_ERROR_FACTOR and self.error >= thresholds.OP_ERROR_FLOOR
        )


@dataclass
class ShadowTrace:
    """Every module the shadows reported, by (step, module)."""

    seen: dict[tuple[int, str], ModuleSeen] = field(default_factory=dict)

    def feed_instant(self, args: Mapping[str, Any], name: str) -> None:
        """Take an instant event of a trace file (``name`` its event name)."""
        if name != semconv.EVENT_SHADOW:
            return
        step = args.get(semconv.ATTR_STEP)
        numbers = [
            args.get(key)
            for key in (
                semconv.ATTR_SHADOW_ERROR,
                semconv.ATTR_SHADOW_WEIGHT_ERROR,
                semconv.ATTR_SHADOW_ROUNDING,
                semconv.ATTR_SHADOW_HEADROOM,
                semconv.ATTR_SHADOW_UNDERFLOW,
            )
        ]
        if not isinstance(step, int) or not all(isinstance(v, int | float) for v in numbers):
            return
        error, weight_error, rounding, headroom, underflow = (float(v) for v in numbers)  # type: ignore[arg-type]
        nonfinite = args.get(semconv.ATTR_SHADOW_NONFINITE)
        seen = ModuleSeen(
            step,
            str(args.get(semconv.ATTR_SHADOW_MODULE, "")),
            str(args.get(semconv.ATTR_SHADOW_MODULE_TYPE, "")),
            str(args.get(semconv.ATTR_SHADOW_DTYPE, "")),
            error,
            weight_error,
            rounding,
            headroom,
            underflow,
            int(nonfinite) if isinstance(nonfinite, int) else 0,
        )
        merge(self.seen, (step, seen.module), seen, _worse, args.get(semconv.ATTR_RANK))

    def steps(self) -> list[int]:
        return sorted({step for step, _ in self.seen})

    def at(self, step: int) -> list[ModuleSeen]:
        """The modules of one shadowed step, costliest first."""
        return sorted((s for (at, _), s in self.seen.items() if at == step), key=lambda s: (-s.cost, s.module))

    def costly(self) -> list[ModuleSeen]:
        """Each module whose local error is a finding, at the first step it was, earliest and costliest first."""
        first: dict[str, ModuleSeen] = {}
        for step in self.steps():
            for seen in self.at(step):
                if seen.costly and seen.module not in first:
                    first[seen.module] = seen
        return sorted(first.values(), key=lambda s: (s.step, -s.cost, s.module))


def _worse(new: ModuleSeen, held: ModuleSeen) -> bool:
    return (new.cost, new.headroom) > (held.cost, held.headroom)


def _where(seen: ModuleSeen) -> str:
    return f"module '{seen.module}' ({seen.module_type}, {seen.dtype})"


def shadow_text(seen: ModuleSeen, step_offset: int = 0) -> str:
    """One line: the module, its local error against its rounding, the weights' part, its headroom."""
    ranks = ", ".join(str(r) for r in sorted(seen.ranks)) or "?"
    if seen.nonfinite:
        error = f"{seen.nonfinite} NaN/Inf elements where float32 is finite"
    else:
        error = f"differs from float32 by {seen.error:.3g} ({seen.cost:.3g}x its dtype's rounding {seen.rounding:.3g})"
    weights = (
        f", {seen.weight_error:.3g} of it from its compute weights (what the compute copy rounds away)"
        if seen.weight_error >= 0.5 * seen.error and seen.weight_error > 0
        else ""
    )
    return (
        f"{_where(seen)} at step {seen.step + step_offset}: {error}{weights}; largest |x| {seen.headroom:.3g} of "
        f"{seen.dtype}'s largest value, {seen.underflow:.3g} of its elements below its smallest normal; "
        f"rank{'s' if len(seen.ranks) != 1 else ''} {ranks}"
    )


def costliest_text(trace: ShadowTrace, step_offset: int = 0, shown: int = 3) -> str | None:
    """One line on the last shadowed step: the modules where low precision costs most."""
    steps = trace.steps()
    if not steps:
        return None
    modules = trace.at(steps[-1])[:shown]
    parts = [
        f"{s.module or '(root)'} ({s.module_type}, {s.dtype}) {s.cost:.3g}x rounding, |x| {s.headroom:.2g} of max"
        for s in modules
    ]
    return f"  float32 shadow, step {steps[-1] + step_offset}: where low precision costs most: " + "; ".join(parts)


def shadow_json(seen: ModuleSeen, step_offset: int = 0) -> dict[str, Any]:
    return {
        "step": seen.step + step_offset,
        "module": seen.module,
        "module_type": seen.module_type,
        "dtype": seen.dtype,
        "error": seen.error,
        "weight_error": seen.weight_error,
        "rounding": seen.rounding,
        "cost": seen.cost if seen.cost != float("inf") else "inf",
        "headroom": seen.headroom,
        "underflow": seen.underflow,
        "nonfinite": seen.nonfinite,
        "costly": seen.costly,
        "ranks": sorted(seen.ranks),
    }
