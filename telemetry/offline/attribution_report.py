"""The parameters behind the precision report's findings, from the attribution's span events.

:mod:`fsdp_patch.telemetry.offline.precision_report` judges step ranges from the precision spans'
attributes; this module reads the events the observer puts beside them (the first NaN/Inf,
the top-K offenders of every diagnostic, dtype-contract violations; see ``semconv``) and says,
per finding, which parameters it is about. Every traced rank writes the same (reduced) offenders,
so they are kept once per step; dtype-contract events are each rank's own, merged by violation.

No torch and no OpenTelemetry here, as in the report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, SupportsIndex, SupportsInt

from .. import semconv

# Trace-file keys (written by the trace-file exporter next to the span attributes).
SPAN_ID = "span_id"


@dataclass(frozen=True)
class Named:
    """One parameter an offender event names."""

    param: str
    unit: str
    value: float
    state: str | None = None
    cause: str | None = None
    site: str | None = None


@dataclass
class FirstBad:
    """The first NaN/Inf of the run, as its event says."""

    step: int
    param: str
    unit: str
    tensor: str
    state: str | None
    ranks: list[int]
    kind: str
    elements: int
    params: list[str]
    params_count: int


@dataclass
class Violation:
    """A dtype-contract violation, with every rank and the first step that reported it."""

    step: int
    param: str
    unit: str
    tensor: str
    state: str | None
    expected: str
    actual: str
    ranks: set[int] = field(default_factory=set)
    detail: str = ""


@dataclass
class AttributionTrace:
    """What the attribution events of a run's trace files say.

    Attributes:
        first: The first NaN/Inf (the earliest step any rank recorded).
        offenders: Per step, per diagnostic, the named parameters, worst first.
        violations: Dtype-contract violations, by (param, tensor, state, actual dtype).
    """

    first: FirstBad | None = None
    offenders: dict[int, dict[str, list[Named]]] = field(default_factory=dict)
    violations: dict[tuple[str, str, str | None, str], Violation] = field(default_factory=dict)
    _pending: dict[str, list[Mapping[str, Any]]] = field(default_factory=dict)

    def feed(self, event: Mapping[str, Any]) -> None:
        """Take one instant ("i") event of a trace file."""
        name, args = event.get("name"), event.get("args") or {}
        if name == semconv.EVENT_OFFENDER:
            self._pending.setdefault(str(args.get(SPAN_ID, "")), []).append(args)
        elif name == semconv.EVENT_FIRST_NONFINITE:
            step = _int(args.get(semconv.ATTR_STEP))
            if step is not None and (self.first is None or step < self.first.step):
                self.first = FirstBad(
                    step,
                    str(args.get(semconv.ATTR_PARAM, "?")),
                    str(args.get(semconv.ATTR_UNIT, "")),
                    str(args.get(semconv.ATTR_TENSOR, "?")),
                    args.get(semconv.ATTR_OPTIMIZER_STATE),
                    [int(r) for r in args.get(semconv.ATTR_RANKS) or []],
                    str(args.get(semconv.ATTR_NONFINITE_KIND, "")),
                    _int(args.get(semconv.ATTR_PRECISION_ELEMENTS)) or 0,
                    [str(p) for p in args.get(semconv.ATTR_PRECISION_PARAMS) or []],
                    _int(args.get(semconv.ATTR_PRECISION_PARAMS_COUNT)) or 0,
                )
        elif name == semconv.EVENT_DTYPE_CONTRACT:
            step = _int(args.get(semconv.ATTR_STEP)) or 0
            key = (
                str(args.get(semconv.ATTR_PARAM, "?")),
                str(args.get(semconv.ATTR_TENSOR, "?")),
                args.get(semconv.ATTR_OPTIMIZER_STATE),
                str(args.get(semconv.ATTR_DTYPE_ACTUAL, "?")),
            )
            found = self.violations.get(key)
            if found is None:
                found = self.violations[key] = Violation(
                    step,
                    key[0],
                    str(args.get(semconv.ATTR_UNIT, "")),
                    key[1],
                    key[2],
                    str(args.get(semconv.ATTR_DTYPE_EXPECTED, "?")),
                    key[3],
                    detail=str(args.get(semconv.ATTR_DTYPE_DETAIL, "")),
                )
            found.step = min(found.step, step)
            rank = _int(args.get(semconv.ATTR_RANK))
            if rank is not None:
                found.ranks.add(rank)

    def resolve(self, step_of_precision_span: Mapping[str, int]) -> None:
        """Attach the offenders read so far to their steps (``precision span id -> step``)."""
        for span_id, events in self._pending.items():
            step = step_of_precision_span.get(span_id)
            if step is None or step in self.offenders:  # rotated away, or another rank's copy
                continue
            by_diagnostic: dict[str, list[Named]] = {}
            for args in events:
                value = _float(args.get(semconv.ATTR_VALUE))
                diagnostic = args.get(semconv.ATTR_DIAGNOSTIC)
                if value is None or not isinstance(diagnostic, str):
                    continue
                by_diagnostic.setdefault(diagnostic, []).append(
                    Named(
                        str(args.get(semconv.ATTR_PARAM, "?")),
                        str(args.get(semconv.ATTR_UNIT, "")),
                        value,
                        args.get(semconv.ATTR_OPTIMIZER_STATE),
                        args.get(semconv.ATTR_CAUSE),
                        args.get(semconv.ATTR_LOAD_SITE),
                    )
                )
            self.offenders[step] = by_diagnostic
        self._pending.clear()

    def worst(
        self, diagnostic: str, limit: int, lowest: bool = False, first: int = 0, last: int | None = None
    ) -> list[tuple[Named, int]]:
        """The parameters ``diagnostic`` named in steps ``first..last``, each with its worst value
        and the step of it (highest, or ``lowest``), worst first, at most ``limit``."""
        best: dict[tuple[str, str | None], tuple[Named, int]] = {}
        for step, diagnostics in sorted(self.offenders.items()):
            if step < first or (last is not None and step > last):
                continue
            for named in diagnostics.get(diagnostic, ()):
                key = (named.param, named.state)
                held = best.get(key)
                if held is None or (named.value < held[0].value if lowest else named.value > held[0].value):
                    best[key] = (named, step)
        ordered = sorted(best.values(), key=lambda e: (e[0].value if lowest else -e[0].value, e[1]))
        return ordered[:limit]


def _int(value: object) -> int | None:
    if not isinstance(value, str | bytes | bytearray | SupportsInt | SupportsIndex):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _float(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _where(unit: str) -> str:
    return f"unit '{unit}'" if unit else "root unit"


def _value(diagnostic: str, value: float) -> str:
    if diagnostic in (semconv.DIAGNOSTIC_STUCK, semconv.DIAGNOSTIC_UNSTEPPED):
        return f"{value:.0f} diagnosed steps"
    if diagnostic in (
        semconv.METRIC_NONFINITE,
        semconv.METRIC_REFRESH_OVERFLOW,
        semconv.METRIC_REFRESH_UNDERFLOW,
        semconv.DIAGNOSTIC_STATE_NONFINITE,
    ):
        return f"{value:.0f} element{'s' if value != 1 else ''}"
    if diagnostic == semconv.DIAGNOSTIC_UPDATE_RESOLUTION:
        return f"update {value:.2g}x the compute dtype's rounding step"
    if diagnostic == semconv.DIAGNOSTIC_GRAD_UNDERFLOW:
        return f"{value:.0%} of its grad elements"
    if diagnostic == semconv.DIAGNOSTIC_UPDATE_JUMP:
        return f"update {value:.3g}x its usual size or Adam's bound"
    return f"{value:.3g}"


# Which diagnostics name the parameters of which report check, and whether lower is worse.
CHECK_DIAGNOSTICS: dict[str, tuple[tuple[str, bool], ...]] = {
    "refresh_overflow": ((semconv.METRIC_REFRESH_OVERFLOW, False),),
    "nonfinite": ((semconv.METRIC_NONFINITE, False), (semconv.DIAGNOSTIC_STATE_NONFINITE, False)),
    "lost_updates": ((semconv.METRIC_LOST_RATIO, False), (semconv.DIAGNOSTIC_UPDATE_RESOLUTION, True)),
    "refresh_underflow": ((semconv.METRIC_REFRESH_UNDERFLOW, False),),
    "refresh_error": ((semconv.METRIC_REFRESH_ERROR, False),),
    "grad_amax_fp16": ((semconv.METRIC_GRAD_AMAX, False),),
    "stuck_weights": ((semconv.DIAGNOSTIC_STUCK, False), (semconv.DIAGNOSTIC_UPDATE_RESOLUTION, True)),
    "unstepped_weights": ((semconv.DIAGNOSTIC_UNSTEPPED, False),),
    "state_nonfinite": ((semconv.DIAGNOSTIC_STATE_NONFINITE, False),),
    "state_flushed": ((semconv.DIAGNOSTIC_STATE_FLUSHED, False),),
    "grad_underflow": ((semconv.DIAGNOSTIC_GRAD_UNDERFLOW, False),),
    "update_jump": ((semconv.DIAGNOSTIC_UPDATE_JUMP, False),),
}
# Checks whose first step is where to look: what spreads from there (NaN, Inf) names every
# parameter a step later, so only the first step's parameters are listed.
AT_FIRST_STEP = {"nonfinite", "state_nonfinite", "refresh_overflow"}


def _span(check: str, first_step: int) -> tuple[int, int | None]:
    if check in AT_FIRST_STEP:
        return first_step, first_step
    return (0 if check == "lost_updates" else first_step), None


_LABELS = {
    semconv.METRIC_REFRESH_OVERFLOW: "overflowing",
    semconv.METRIC_NONFINITE: "with NaN/Inf",
    semconv.DIAGNOSTIC_STATE_NONFINITE: "optimizer state with NaN/Inf",
    semconv.METRIC_LOST_RATIO: "top lost-update layers",
    semconv.DIAGNOSTIC_UPDATE_RESOLUTION: "updates below the compute dtype's resolution",
    semconv.METRIC_REFRESH_UNDERFLOW: "underflowing",
    semconv.METRIC_REFRESH_ERROR: "largest refresh error",
    semconv.METRIC_GRAD_AMAX: "largest grads",
    semconv.DIAGNOSTIC_STUCK: "stuck",
    semconv.DIAGNOSTIC_UNSTEPPED: "unstepped",
    semconv.DIAGNOSTIC_STATE_FLUSHED: "exp_avg_sq flushed to zero",
    semconv.DIAGNOSTIC_GRAD_UNDERFLOW: "grads 0 or below float16's smallest normal",
    semconv.DIAGNOSTIC_UPDATE_JUMP: "update jumps",
}


def _named_text(named: Named, diagnostic: str, step: int, step_offset: int) -> str:
    extra = f" [{named.state}]" if named.state else ""
    cause = f", {named.cause.replace('_', ' ')}" if named.cause else ""
    if named.site:
        cause += f" (load_state_dict at {named.site})"
    return f"{named.param}{extra} ({_where(named.unit)}): {_value(diagnostic, named.value)} at step {step + step_offset}{cause}"


def first_text(first: FirstBad, step_offset: int) -> str:
    """One line on the first NaN/Inf."""
    tensor = f"{first.tensor} '{first.state}'" if first.state else first.tensor
    ranks = ", ".join(str(r) for r in first.ranks) or "?"
    others = first.params_count - 1
    also = (
        f"; {others} other parameter{'s' if others != 1 else ''} too ({', '.join(first.params[1:])}{', ...' if others > len(first.params) - 1 else ''})"
        if others > 0
        else ""
    )
    kind = {"nan": "NaN", "inf": "Inf"}.get(first.kind, "non-finite")
    return (
        f"first NaN/Inf: step {first.step + step_offset}, rank{'s' if len(first.ranks) != 1 else ''} {ranks}, "
        f"{first.param} ({_where(first.unit)}), {tensor}: {first.elements} {kind} "
        f"element{'s' if first.elements != 1 else ''}{also}"
    )


_MODEL_AUDIT_PLACE = {
    semconv.TENSOR_BUFFER: "buffer",
    semconv.TENSOR_LOSS: "loss from",
    semconv.TENSOR_NORM_STATISTICS: "normalization",
    semconv.TENSOR_GRAD_ACCUMULATION: "grads of unit",
    semconv.TENSOR_MAIN_WEIGHT: "main weights, from",
}


def details(trace: AttributionTrace, check: str, first_step: int, limit: int, step_offset: int = 0) -> list[str]:
    """Lines naming the parameters behind the report check ``check`` (first found at ``first_step``)."""
    lines: list[str] = []
    if check == "nonfinite" and trace.first is not None:
        lines.append(first_text(trace.first, step_offset))
    if check == "dtype_contract":
        for v in sorted(trace.violations.values(), key=lambda v: (v.step, v.param)):
            ranks = ", ".join(str(r) for r in sorted(v.ranks)) or "?"
            when = f"step {v.step + step_offset}, ranks {ranks}"
            if v.detail:  # the model audit's: where it is, what the dtype does there, and the fix
                place = f"{_MODEL_AUDIT_PLACE.get(v.tensor, v.tensor)} {v.param or 'the root'}"
                lines.append(f"{place}: {v.actual}: {v.detail} ({when})")
                continue
            what = f"{v.tensor} '{v.state}'" if v.state else v.tensor
            lines.append(f"{v.param} ({_where(v.unit)}): {what} is {v.actual}, expected {v.expected} ({when})")
        return lines
    first, last = _span(check, first_step)
    for diagnostic, lowest in CHECK_DIAGNOSTICS.get(check, ()):
        named = trace.worst(diagnostic, limit, lowest=lowest, first=first, last=last)
        if named:
            lines.append(
                f"{_LABELS[diagnostic]}: " + "; ".join(_named_text(n, diagnostic, s, step_offset) for n, s in named)
            )
    return lines


def details_json(
    trace: AttributionTrace, check: str, first_step: int, limit: int, step_offset: int = 0
) -> dict[str, Any]:
    """The same as :func:`details`, for machines."""
    out: dict[str, Any] = {}
    if check == "nonfinite" and trace.first is not None:
        f = trace.first
        out["first_nonfinite"] = {
            "step": f.step + step_offset,
            "param": f.param,
            "unit": f.unit,
            "tensor": f.tensor,
            "state": f.state,
            "ranks": f.ranks,
            "kind": f.kind,
            "elements": f.elements,
            "params": f.params,
            "params_count": f.params_count,
        }
    if check == "dtype_contract":
        out["violations"] = [
            {
                "param": v.param,
                "unit": v.unit,
                "tensor": v.tensor,
                "state": v.state,
                "expected": v.expected,
                "actual": v.actual,
                "step": v.step + step_offset,
                "ranks": sorted(v.ranks),
                "detail": v.detail,
            }
            for v in sorted(trace.violations.values(), key=lambda v: (v.step, v.param))
        ]
        return out
    first, last = _span(check, first_step)
    for diagnostic, lowest in CHECK_DIAGNOSTICS.get(check, ()):
        named = trace.worst(diagnostic, limit, lowest=lowest, first=first, last=last)
        if named:
            out.setdefault("parameters", []).extend(
                {
                    "diagnostic": diagnostic,
                    "param": n.param,
                    "unit": n.unit,
                    "value": n.value,
                    "state": n.state,
                    "cause": n.cause,
                    "site": n.site,
                    "step": s + step_offset,
                }
                for n, s in named
            )
    return out
