"""What a run's float8 casts kept, from its trace files: each float8 module's input, weight and grad
output per diagnosed step, the findings they make and the fix each names.

Reads the ``fsdp.precision.float8`` events (:mod:`fsdp_patch.telemetry.instrumentation.float8_watch`)
of every rank, merged per (step, module, role) to the worst value any rank measured, with the ranks
that reported it. The checks are :mod:`fsdp_patch.telemetry.float8_thresholds`'; the fix each
finding gives is chosen from what was measured: rowwise scaling where a scale per row would keep
what the tensorwise one flushes, the layer in bf16 where it would not. No torch and no
OpenTelemetry here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import float8_thresholds as checks
from .. import semconv
from ..verdicts import Threshold

__all__ = ["CastSeen", "Float8Trace", "cast_json", "cast_text", "fix", "layer_text", "trend_text"]

_VALUE_KEYS = {
    "amax": semconv.ATTR_FLOAT8_AMAX,
    "scale": semconv.ATTR_FLOAT8_SCALE,
    "scale_max": semconv.ATTR_FLOAT8_SCALE_MAX,
    "amax_ratio": semconv.ATTR_FLOAT8_AMAX_RATIO,
    "flushed": semconv.ATTR_FLOAT8_FLUSHED,
    "subnormal": semconv.ATTR_FLOAT8_SUBNORMAL,
    "saturated": semconv.ATTR_FLOAT8_SATURATED,
    "sqnr": semconv.ATTR_FLOAT8_SQNR,
    "nonfinite": semconv.ATTR_FLOAT8_NONFINITE,
    "rowwise_flushed": semconv.ATTR_FLOAT8_ROWWISE_FLUSHED,
}


def _number(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


@dataclass
class CastSeen:
    """One module's cast of one role at one diagnosed step, the worst of the ranks that reported it."""

    step: int
    module: str
    role: str
    dtype: str
    granularity: str
    gathered: bool
    position: str
    values: dict[str, float]
    ranks: set[int] = field(default_factory=set)

    def checks(self) -> list[Threshold]:
        return checks.fired(self.role, self.values, self.position)

    def merge(self, other: CastSeen) -> None:
        for key, value in other.values.items():
            self.values[key] = checks.worst(key, [self.values.get(key, value), value])
        self.ranks |= other.ranks


@dataclass
class Float8Trace:
    """Every float8 cast the run reported, by (step, module, role)."""

    seen: dict[tuple[int, str, str], CastSeen] = field(default_factory=dict)

    def feed_instant(self, args: Mapping[str, Any], name: str) -> None:
        """Take an instant event of a trace file (``name`` its event name)."""
        if name != semconv.EVENT_FLOAT8_CAST:
            return
        step = args.get(semconv.ATTR_STEP)
        role = args.get(semconv.ATTR_FLOAT8_ROLE)
        if not isinstance(step, int) or role not in semconv.FLOAT8_ROLES:
            return
        rank = args.get(semconv.ATTR_RANK)
        seen = CastSeen(
            step,
            str(args.get(semconv.ATTR_FLOAT8_MODULE, "")),
            str(role),
            str(args.get(semconv.ATTR_FLOAT8_DTYPE, "")),
            str(args.get(semconv.ATTR_FLOAT8_GRANULARITY, "")),
            bool(args.get(semconv.ATTR_FLOAT8_GATHERED, False)),
            str(args.get(semconv.ATTR_FLOAT8_POSITION, semconv.FLOAT8_POSITION_MIDDLE)),
            {key: _number(args.get(attribute)) for key, attribute in _VALUE_KEYS.items()},
            {rank} if isinstance(rank, int) else set(),
        )
        key = (step, seen.module, seen.role)
        if key in self.seen:
            self.seen[key].merge(seen)
        else:
            self.seen[key] = seen

    def findings(self) -> list[tuple[Threshold, CastSeen]]:
        """Each check that fired, with the cast it first fired on (earliest step, then the worst
        share, then the model's order), once per check; the sensitive-layer check once per module."""
        first: dict[str, tuple[Threshold, CastSeen]] = {}
        for seen in sorted(self.seen.values(), key=lambda s: (s.step, -_badness(s))):
            for threshold in seen.checks():
                held = first.get(threshold.check)
                if held is None or (held[1].step == seen.step and _more_severe(threshold, held[0])):
                    first[threshold.check] = (threshold, seen)
        return list(first.values())

    def named(self, check: str) -> list[CastSeen]:
        """Every cast the check fired on, one per (module, role), the first step it did."""
        per_module = check == checks.FLOAT8_SENSITIVE_LAYER.check  # a finding of the module, not of a cast
        out: dict[tuple[str, str], CastSeen] = {}
        for seen in sorted(self.seen.values(), key=lambda s: (s.step, -_badness(s))):
            if any(t.check == check for t in seen.checks()):
                out.setdefault((seen.module, "" if per_module else seen.role), seen)
        return list(out.values())

    def sqnr_by_role(self, module: str, step: int) -> dict[str, float]:
        """The SQNR of each of ``module``'s casts at ``step``."""
        return {s.role: s.values["sqnr"] for s in self.seen.values() if (s.module, s.step) == (module, step)}

    def trend(self, module: str, role: str) -> list[tuple[int, float]]:
        """The scale of ``module``'s ``role`` cast at each step it was reported."""
        return sorted((s.step, s.values["scale"]) for s in self.seen.values() if (s.module, s.role) == (module, role))

    def latest(self) -> list[CastSeen]:
        """Each (module, role) at the last step it was reported."""
        out: dict[tuple[str, str], CastSeen] = {}
        for seen in sorted(self.seen.values(), key=lambda s: s.step):
            out[(seen.module, seen.role)] = seen
        return list(out.values())


def _badness(seen: CastSeen) -> float:
    values = seen.values
    return sum(0.0 if math.isnan(values[k]) else values[k] for k in ("flushed", "subnormal", "saturated"))


def _more_severe(new: Threshold, old: Threshold) -> bool:
    order = ("healthy", "warning", "problem")
    return order.index(new.severity) > order.index(old.severity)


def _share(value: float) -> str:
    return "?" if math.isnan(value) else f"{100 * value:.3g}%"


def cast_text(seen: CastSeen, step_offset: int = 0) -> str:
    """One line: the module, the role, what its cast kept, the ranks."""
    v = seen.values
    ranks = ", ".join(str(r) for r in sorted(seen.ranks)) or "?"
    where = f"{seen.module}'s {seen.role.replace('_', ' ')}"
    if seen.position != semconv.FLOAT8_POSITION_MIDDLE:
        where += f" (the {seen.position} module with parameters in the forward)"
    cast = f"{seen.granularity} {seen.dtype}" + (", gathered in float8" if seen.gathered else "")
    ratio = f" ({v['amax_ratio']:.3g}x the median |x|)" if math.isfinite(v["amax_ratio"]) else ""
    return (
        f"{where}, step {seen.step + step_offset}: {cast}; amax {v['amax']:.4g}{ratio}, scale {v['scale']:.4g}; "
        f"flushed to 0 {_share(v['flushed'])}, subnormal {_share(v['subnormal'])}, "
        f"saturated {_share(v['saturated'])}, SQNR {v['sqnr']:.3g} dB, NaN/Inf made {v['nonfinite']:.0f}; ranks {ranks}"
    )


def layer_text(trace: Float8Trace, seen: CastSeen, step_offset: int = 0) -> str:
    """One line for a float8 module at the start or end of the forward: its casts' SQNR."""
    sqnr = trace.sqnr_by_role(seen.module, seen.step)
    kept = ", ".join(f"{role.replace('_', ' ')} {sqnr[role]:.3g} dB" for role in semconv.FLOAT8_ROLES if role in sqnr)
    return (
        f"{seen.module}: the {seen.position} module with parameters in the forward, in float8 ({seen.granularity}); "
        f"its casts' SQNR at step {seen.step + step_offset}: {kept}"
    )


def trend_text(trace: Float8Trace, seen: CastSeen, step_offset: int = 0) -> str | None:
    """The scale of the cast over the steps reported, where there are two or more."""
    trend = trace.trend(seen.module, seen.role)
    if len(trend) < 2:
        return None
    (first_step, first), (last_step, last) = trend[0], trend[-1]
    change = f" (x{last / first:.3g})" if first and math.isfinite(first) and math.isfinite(last) else ""
    return (
        f"scale of {seen.module}'s {seen.role.replace('_', ' ')}: {first:.4g} at step {first_step + step_offset}, "
        f"{last:.4g} at step {last_step + step_offset}{change}"
    )


def fix(threshold: Threshold, seen: CastSeen) -> str:
    """The fix for ``seen``, chosen from what was measured; the check's advice otherwise."""
    name = seen.module
    in_bf16 = f"module_filter_fn=lambda module, fqn: fqn != {name!r}"
    if threshold.check == checks.FLOAT8_GRAD_UNDERFLOW.check and seen.dtype.startswith("float8_e4m3"):
        return (
            f"{name}'s grad output is cast to {seen.dtype}, whose range (448 down to 2^-9) is 2^14 narrower than "
            "e5m2's: its largest grads set the scale and the rest flush. Cast grad outputs to float8_e5m2 (torchao's "
            "default tensorwise config; Transformer Engine's HYBRID format), and look for the loss term that makes "
            f"a few grads {seen.values['amax_ratio']:.3g}x the median."
        )
    if threshold.check in (checks.FLOAT8_FLUSH.check, checks.FLOAT8_GRAD_UNDERFLOW.check):
        return _flush_fix(seen, in_bf16)
    if threshold.check == checks.FLOAT8_SENSITIVE_LAYER.check:
        return (
            f"keep it in bf16: convert_to_float8_training(model, {in_bf16}) (and so for each module named; combine "
            "with any filter you pass). " + threshold.advice.split(". ")[0].capitalize() + "."
        )
    if threshold.check == checks.FLOAT8_NONFINITE.check and seen.values["amax"] == 0:
        return (
            f"{name}'s {seen.role.replace('_', ' ')} is all zeros (amax 0), and its scale {seen.values['scale']:.4g}: "
            "floor the amax before dividing (torchao's EPS), or keep the layer out of float8 until it is non-zero "
            f"({in_bf16})."
        )
    return threshold.advice


def _flush_fix(seen: CastSeen, in_bf16: str) -> str:
    """Rowwise scaling where a scale per row would keep what the tensorwise one flushes; the layer
    in bf16 where it would not (the outlier in every row) or the scales are per row already; where
    the elements are left subnormal rather than flushed, the choice is the user's, from the ratio."""
    name, role, v = seen.module, seen.role.replace("_", " "), seen.values
    rows = "output rows" if seen.role == semconv.FLOAT8_ROLE_WEIGHT else "rows (tokens)"
    ratio = f"{v['amax_ratio']:.3g}x the median" if math.isfinite(v["amax_ratio"]) else "far above the rest"
    if v["flushed"] <= checks.FLUSH_SHARE:
        return (
            f"{_share(v['subnormal'])} of {name}'s {role} is left below float8's smallest normal (flushed "
            f"{_share(v['flushed'])}): its largest element is {ratio}. Where that element is in a few {rows}, "
            f"rowwise scaling (Float8LinearConfig.from_recipe_name('rowwise')) keeps the others; where it is in "
            f"every row, keep {name} in bf16 ({in_bf16})."
        )
    if seen.granularity != "tensorwise":
        return (
            f"{name}'s {role} is scaled per row ({seen.granularity}) and still flushes {_share(v['flushed'])}: the "
            f"outlier is in every row (a feature {ratio}). Keep {name} in bf16 ({in_bf16} in "
            "convert_to_float8_training), or remove what makes that feature large (a missing norm before it)."
        )
    rowwise = v["rowwise_flushed"]
    if not math.isnan(rowwise) and rowwise < v["flushed"] / 4:
        return (
            f"a scale per row would flush {_share(rowwise)} of {name}'s {role}, not {_share(v['flushed'])}: the "
            f"outlier is in a few {rows}. Use rowwise scaling (Float8LinearConfig.from_recipe_name('rowwise')), or "
            f"keep {name} in bf16 ({in_bf16})."
        )
    return (
        f"a scale per row would flush as much ({_share(rowwise)}): the outlier is in every row (a feature {ratio}). "
        f"Keep {name} in bf16 ({in_bf16} in convert_to_float8_training), or remove what makes that feature large "
        "(a missing norm before it)."
    )


def cast_json(seen: CastSeen, trace: Float8Trace, step_offset: int = 0) -> dict[str, Any]:
    """One cast for the JSON report, with its scale at every step reported (non-finite values as
    strings, as the trace files write them)."""
    values = {k: (v if math.isfinite(v) else str(v)) for k, v in seen.values.items()}
    return {
        "step": seen.step + step_offset,
        "module": seen.module,
        "role": seen.role,
        "dtype": seen.dtype,
        "granularity": seen.granularity,
        "gathered": seen.gathered,
        "position": seen.position,
        "ranks": sorted(seen.ranks),
        **values,
        "scale_trend": [
            [step + step_offset, s if math.isfinite(s) else str(s)] for step, s in trace.trend(seen.module, seen.role)
        ],
    }
