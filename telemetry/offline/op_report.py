"""What a run's operation audits found, from its trace files: the operations named by line.

Reads the ``fsdp.precision.op`` events (:mod:`fsdp_patch.telemetry.instrumentation.op_audits`) of
every rank, merged: one :class:`OpSeen` per (kind, operation, source line, phase), at the earliest
step any rank saw it, with every rank that did. No torch and no OpenTelemetry here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import semconv
from .rank_merge import merge

__all__ = ["OpSeen", "OpTrace", "op_json", "op_text", "place"]


@dataclass
class OpSeen:
    """One operation an audit judged, with every rank that reported it.

    Attributes:
        kind: ``semconv.OP_KIND_*``.
        step: The earliest step whose iteration showed it.
        order: Its place among that iteration's measured operations.
        ranks: The ranks that reported it.
    """

    kind: str
    op: str
    dtype: str
    phase: str
    module: str | None
    site: str
    caller: str
    detail: str
    fix: str
    share: float
    fp32_finite: bool | None
    step: int
    order: int
    ranks: set[int] = field(default_factory=set)

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.step, self.order, self.op)


@dataclass
class OpTrace:
    """Every operation the audits named, by (kind, operation, line, phase)."""

    seen: dict[tuple[str, str, str, str], OpSeen] = field(default_factory=dict)

    def feed_instant(self, args: Mapping[str, Any], name: str) -> None:
        """Take an instant event of a trace file (``name`` its event name)."""
        if name != semconv.EVENT_OP:
            return
        step = args.get(semconv.ATTR_STEP)
        if not isinstance(step, int):
            return
        module = args.get(semconv.ATTR_OP_MODULE)
        finite = args.get(semconv.ATTR_OP_FP32_FINITE)
        share = args.get(semconv.ATTR_OP_SHARE)
        order = args.get(semconv.ATTR_OP_ORDER)
        seen = OpSeen(
            kind=str(args.get(semconv.ATTR_OP_KIND, "")),
            op=str(args.get(semconv.ATTR_OP_NAME, "")),
            dtype=str(args.get(semconv.ATTR_OP_DTYPE, "")),
            phase=str(args.get(semconv.ATTR_OP_PHASE, "")),
            module=None if module is None else str(module),
            site=str(args.get(semconv.ATTR_OP_SITE, "")),
            caller=str(args.get(semconv.ATTR_OP_CALLER, "")),
            detail=str(args.get(semconv.ATTR_OP_DETAIL, "")),
            fix=str(args.get(semconv.ATTR_OP_FIX, "")),
            share=float(share) if isinstance(share, int | float) else 0.0,
            fp32_finite=bool(finite) if isinstance(finite, bool) else None,
            step=step,
            order=order if isinstance(order, int) else 0,
        )
        key = (seen.kind, seen.op, seen.site, seen.phase)
        merge(self.seen, key, seen, lambda new, held: new.key < held.key, args.get(semconv.ATTR_RANK))

    def of_kind(self, kind: str) -> list[OpSeen]:
        """The operations of one kind, earliest first (step, then order in the iteration)."""
        return sorted((s for s in self.seen.values() if s.kind == kind), key=lambda s: s.key)

    def kinds(self) -> list[str]:
        """The kinds found, in ``semconv.OP_KINDS`` order."""
        found = {s.kind for s in self.seen.values()}
        return [kind for kind in semconv.OP_KINDS if kind in found]

    def first_nonfinite(self, from_step: int = 0, before: int | None = None) -> OpSeen | None:
        """The first operation whose result went NaN/Inf from finite inputs, at ``from_step`` or
        later and before step ``before`` (``None``: any later step)."""
        return next(
            (
                s
                for s in self.of_kind(semconv.OP_KIND_NONFINITE)
                if s.step >= from_step and (before is None or s.step < before)
            ),
            None,
        )


_PHASE_TEXT = {
    "between_steps": "between steps",
    "forward": "forward",
    "loss": "loss",
    "backward": "backward",
    "after_backward": "between backward and step",
    "optimizer": "optimizer step",
}


def place(seen: OpSeen) -> str:
    """``aten.sin in bfloat16 at model.py:12 in forward``."""
    at = f" at {seen.site}" if seen.site else ""
    return f"{seen.op} in {seen.dtype}{at}"


def op_text(seen: OpSeen, step_offset: int = 0) -> str:
    """One line: the operation, its line and caller, module, phase, step, ranks, what was measured."""
    module = ""
    if seen.module is not None:
        module = f", module '{seen.module}'" if not seen.module.startswith("<") else f", module {seen.module}"
    caller = f" (called from {seen.caller})" if seen.caller else ""
    ranks = ", ".join(str(r) for r in sorted(seen.ranks)) or "?"
    phase = _PHASE_TEXT.get(seen.phase, seen.phase)
    return (
        f"{place(seen)}{caller}; {phase}{module}, step {seen.step + step_offset}, "
        f"rank{'s' if len(seen.ranks) != 1 else ''} {ranks}: {seen.detail}"
    )


def op_json(seen: OpSeen, step_offset: int = 0) -> dict[str, Any]:
    return {
        "kind": seen.kind,
        "op": seen.op,
        "dtype": seen.dtype,
        "phase": seen.phase,
        "module": seen.module,
        "site": seen.site,
        "caller": seen.caller,
        "detail": seen.detail,
        "fix": seen.fix,
        "share": seen.share,
        "fp32_finite": seen.fp32_finite,
        "step": seen.step + step_offset,
        "ranks": sorted(seen.ranks),
    }
