"""Where a precision problem is: findings per parameter from the reduced rows, across steps.

No OpenTelemetry here: :class:`Attribution` reads each diagnosed step's rows (from
:mod:`fsdp_patch.telemetry.diagnostics.param_stats`, already reduced over ranks) and returns plain findings,
which :mod:`fsdp_patch.telemetry.instrumentation.observer` puts on the precision span as events.

What it keeps from step to step, per parameter: how many diagnosed steps in a row it was stuck
(the main weight moved, not one element of the compute weight did) and unstepped (a non-zero
grad, a main weight that did not change at all); whether the first NaN/Inf was recorded. A parameter is named stuck or unstepped once that count reaches the
window (``FSDP_PATCH_PRECISION_WINDOW``), and in every diagnosed step it stays so.

Alternatives considered:
    - Comparing each compute weight with a copy kept from N diagnosed steps ago: it sees slow
      drift that crosses a rounding step only over many steps, but keeps 2 bytes per element
      between steps; the run of steps without a single changed element costs nothing and names
      the weights that cannot move.
    - Ranking the first NaN/Inf by element count: a NaN loss makes every grad NaN at once; the
      kind comes first (grad, then state, then main, then compute weight: the order it spreads
      within a step), then the parameters in model order, all of them counted and the first K named.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .. import semconv
from . import precision
from . import rows as row_spec
from .optimizer_state import ParamContext
from .rows import ParamSlot
from .update_jumps import UpdateHistory

_NONFINITE_SLOTS = (
    row_spec.GRAD_NAN,
    row_spec.GRAD_INF,
    row_spec.MAIN_NAN,
    row_spec.MAIN_INF,
    row_spec.COMPUTE_NAN,
    row_spec.COMPUTE_INF,
)
STATE_SLOTS = tuple(range(row_spec.STATE_NAN, row_spec.STATE_END))
"""Row slots of the state tensors' NaN/Inf counts (pairs per state index)."""
PER_RANK_SLOTS = (*_NONFINITE_SLOTS, *STATE_SLOTS)
"""Slots read per rank when something is non-finite (to name the ranks)."""

_KIND_SLOTS = {
    semconv.TENSOR_MAIN_GRAD: (row_spec.GRAD_NAN, row_spec.GRAD_INF),
    semconv.TENSOR_MAIN_WEIGHT: (row_spec.MAIN_NAN, row_spec.MAIN_INF),
    semconv.TENSOR_COMPUTE_WEIGHT: (row_spec.COMPUTE_NAN, row_spec.COMPUTE_INF),
}


STUCK_BELOW_RESOLUTION = 1e-3
"""A compute weight that did not move is named stuck only where its update is this far below the
compute dtype's rounding step (``update_resolution`` below it): with an fp32 master the compute
copy lags by design, and a weight near 1.0 in bfloat16 at a learning rate of 1e-4 moves once in
about 40 steps; an update 1000 times smaller takes over 1000 steps of one sign to move it once."""

LOW_PRECISION = (torch.bfloat16, torch.float16)

RESOLUTION_MEASURED_FROM = 0.5
"""The update of a parameter is measured against the compute dtype's rounding step (an extra pass
over its elements) where at least this fraction of its updates was lost at its last diagnosed
step: a parameter that keeps most of its updates has them above the rounding step."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number of ``dtype``: 2^-8 for bfloat16, 2^-11 for float16."""
    return torch.finfo(dtype).eps / 2


@dataclass(frozen=True)
class Offender:
    """One parameter among the top K of one diagnostic at one step."""

    diagnostic: str
    slot: int
    value: float
    state_key: str | None = None
    cause: str | None = None


@dataclass(frozen=True)
class FirstNonfinite:
    """The first NaN/Inf of the run.

    Attributes:
        step: The optimizer step.
        tensor: Where it showed first (``semconv.FIRST_NONFINITE_ORDER``).
        state_key: The optimizer state key when ``tensor`` is the optimizer state.
        slots: Every parameter with a NaN/Inf in that tensor at that step, in table order.
        ranks: Ranks where the first of them has it.
        nan: NaN elements of the first of them (over all ranks).
        inf: Inf elements of the first of them.
    """

    step: int
    tensor: str
    state_key: str | None
    slots: tuple[int, ...]
    ranks: tuple[int, ...]
    nan: int
    inf: int


@dataclass
class StepFindings:
    """What one diagnosed step says per parameter.

    Attributes:
        offenders: The top K parameters of every diagnostic with something to show, in the
            order of ``semconv.DIAGNOSTICS``, worst first.
        first_nonfinite: Set on the step where the first NaN/Inf of the run showed.
        stuck: Parameters stuck for at least the window.
        unstepped: Parameters unstepped for at least the window.
        state_nonfinite: NaN and Inf elements of all state tensors.
        state_flushed: The largest fraction of flushed ``exp_avg_sq`` elements of a parameter.
        skipped: No main weight the optimizer steps changed, though grads were non-zero and finite.
        grad_underflow: ``None`` where not measured; else the model's share of grad elements 0 or
            below float16's smallest normal, of parameters that have some of the latter.
        update_jump: The largest update jump of a parameter (:class:`~.update_jumps.UpdateHistory`), 0 where
            none.
    """

    offenders: list[Offender] = field(default_factory=list)
    first_nonfinite: FirstNonfinite | None = None
    stuck: int = 0
    unstepped: int = 0
    state_nonfinite: int = 0
    state_flushed: float = 0.0
    skipped: bool = False
    grad_underflow: float | None = None
    update_jump: float = 0.0


def _nonfinite(row: Sequence[float], slots: Iterable[int]) -> int:
    return int(sum(row[s] for s in slots))


def _state_counts(row: Sequence[float]) -> list[tuple[int, int, int]]:
    """``(state index, nan, inf)`` of the state tensors with a NaN or Inf."""
    out = []
    for index in range(row_spec.MAX_STATES):
        nan, inf = int(row[row_spec.STATE_NAN + 2 * index]), int(row[row_spec.STATE_INF + 2 * index])
        if nan or inf:
            out.append((index, nan, inf))
    return out


def refresh_error(row: Sequence[float]) -> float:
    """``||compute - main|| / ||main||`` of one row (0 when ``||main||`` is 0)."""
    return math.sqrt(row[row_spec.DIFF_SQ] / row[row_spec.MAIN_SQ]) if row[row_spec.MAIN_SQ] > 0 else 0.0


def lost_ratio(row: Sequence[float]) -> float:
    """Lost among changed elements of one row (0 when none changed)."""
    return row[row_spec.LOST] / row[row_spec.CHANGED] if row[row_spec.CHANGED] else 0.0


def update_resolution(slot: ParamSlot, row: Sequence[float]) -> float | None:
    """``||Δ|| / (u ||w||)`` (see ``semconv.DIAGNOSTIC_UPDATE_RESOLUTION``); ``None`` where it is
    not defined: compute dtype as wide as the main dtype, no update, or zero weights."""
    if (
        not slot.lossy
        or row[row_spec.UPDATE_SQ] <= 0
        or row[row_spec.MAIN_SQ] <= 0
        or not math.isfinite(row[row_spec.UPDATE_SQ])
    ):
        return None
    assert slot.compute_dtype is not None
    return math.sqrt(row[row_spec.UPDATE_SQ] / row[row_spec.MAIN_SQ]) / unit_roundoff(slot.compute_dtype)


def _grad_moves(row: Sequence[float]) -> bool:
    amax = row[row_spec.GRAD_AMAX]
    return 0 < amax < row_spec.GRAD_AMAX_NONFINITE


class Attribution:
    """Per-parameter findings of one optimizer's diagnosed steps (every rank computes the same).

    Args:
        top_k: Offenders per diagnostic (at least 1).
        window: Diagnosed steps in a row before a parameter is named stuck or unstepped.
    """

    def __init__(self, top_k: int, window: int) -> None:
        self.top_k = max(1, top_k)
        self.window = window
        self.first_nonfinite: FirstNonfinite | None = None
        self._stuck: dict[str, int] = {}
        self._unstepped: dict[str, int] = {}
        # Lost ratio of each parameter at its last diagnosed step (reduced: the same on every rank).
        self._last_lost: dict[str, float] = {}
        self._updates = UpdateHistory()

    def analyze(
        self,
        step: int,
        table: Sequence[ParamSlot],
        rows: Sequence[Sequence[float]],
        contexts: Sequence[ParamContext],
        ranks_of: Callable[[int, Sequence[int]], tuple[int, ...]],
        underflow_measured: bool = False,
        state_loaded: bool = False,
    ) -> StepFindings:
        """The findings of one diagnosed step.

        Args:
            step: The optimizer step.
            table: The slots, as the rows were computed for.
            rows: Global rows (reduced over ranks), one per slot.
            contexts: One per slot.
            ranks_of: ``(slot, row slots) -> ranks`` whose count in any of those slots is
                non-zero (called only when something is non-finite).
            underflow_measured: Whether the rows count the grads' zeros and tiny elements.
            state_loaded: Whether the optimizer's state was replaced since the last diagnosed step.
        """
        findings = StepFindings()
        ranked: dict[str, list[tuple[float, int, str | None, str | None]]] = {d: [] for d in semconv.DIAGNOSTICS}
        stepped_changed, stepped_grad, stepped_any, stepped_nonfinite = 0.0, False, False, False
        flushed_grads, grad_elements, tiny_grads = 0.0, 0.0, 0.0
        for index, (slot, row, context) in enumerate(zip(table, rows, contexts, strict=True)):
            total_nonfinite = _nonfinite(row, _NONFINITE_SLOTS)
            for diagnostic, value in (
                (semconv.METRIC_NONFINITE, total_nonfinite),
                (semconv.METRIC_REFRESH_OVERFLOW, row[row_spec.OVERFLOW]),
                (semconv.METRIC_REFRESH_UNDERFLOW, row[row_spec.UNDERFLOW]),
                (semconv.METRIC_REFRESH_ERROR, refresh_error(row)),
                (semconv.METRIC_LOST_RATIO, lost_ratio(row)),
                (semconv.METRIC_GRAD_AMAX, row[row_spec.GRAD_AMAX]),
            ):
                if value > 0 and math.isfinite(value):
                    ranked[diagnostic].append((value, index, None, None))
            # The resolution is judged where the last diagnosed step lost at least half the
            # updates (or where there was none yet): a parameter that keeps most of its updates
            # has them above the rounding step, whatever their RMS says.
            gated = self._last_lost.get(slot.name, 1.0) >= RESOLUTION_MEASURED_FROM
            self._last_lost[slot.name] = (
                lost_ratio(row) if row[row_spec.CHANGED] else self._last_lost.get(slot.name, 1.0)
            )
            resolution = update_resolution(slot, row) if gated else None
            jump = self._updates.judge(slot.name, row, context, state_loaded)
            if jump is not None:
                findings.update_jump = max(findings.update_jump, jump[0])
                ranked[semconv.DIAGNOSTIC_UPDATE_JUMP].append((jump[0], index, None, jump[1]))
            if resolution is not None and resolution < 1:
                ranked[semconv.DIAGNOSTIC_UPDATE_RESOLUTION].append((-resolution, index, None, None))
            for state_index, nan, inf in _state_counts(row):
                findings.state_nonfinite += nan + inf
                key = context.state_keys[state_index] if state_index < len(context.state_keys) else str(state_index)
                ranked[semconv.DIAGNOSTIC_STATE_NONFINITE].append((nan + inf, index, key, None))
            if row[row_spec.STATE_FLUSHED] > 0 and row[row_spec.NUMEL] > 0:
                fraction = row[row_spec.STATE_FLUSHED] / row[row_spec.NUMEL]
                findings.state_flushed = max(findings.state_flushed, fraction)
                ranked[semconv.DIAGNOSTIC_STATE_FLUSHED].append((fraction, index, row_spec.SECOND_MOMENT_KEY, None))

            # The master accumulated, the compute copy did not follow: stuck only if it cannot follow
            # within a long horizon (a lag of a few steps is what an fp32 master is for).
            stuck = (
                slot.lossy
                and row[row_spec.CHANGED] > 0
                and row[row_spec.LOST] == row[row_spec.CHANGED]
                and resolution is not None
                and resolution < STUCK_BELOW_RESOLUTION
            )
            count = self._stuck[slot.name] = self._stuck.get(slot.name, 0) + 1 if stuck else 0
            if count >= self.window:
                findings.stuck += 1
                ranked[semconv.DIAGNOSTIC_STUCK].append((count, index, None, None))
            if underflow_measured and (row[row_spec.GRAD_AMAX] > 0 or row[row_spec.GRAD_ZERO] > 0):
                grad_elements += row[row_spec.NUMEL]
                tiny_grads += row[row_spec.GRAD_TINY]
                flushed = row[row_spec.GRAD_ZERO] + row[row_spec.GRAD_TINY]
                flushed_grads += flushed
                if flushed:
                    ranked[semconv.DIAGNOSTIC_GRAD_UNDERFLOW].append(
                        (flushed / max(row[row_spec.NUMEL], 1.0), index, None, None)
                    )
            stepping = context.in_optimizer and (context.lr is None or context.lr > 0)
            unstepped = _grad_moves(row) and row[row_spec.CHANGED] == 0 and (stepping or not context.in_optimizer)
            count = self._unstepped[slot.name] = self._unstepped.get(slot.name, 0) + 1 if unstepped else 0
            if count >= self.window:
                findings.unstepped += 1
                if not context.in_optimizer:
                    why = semconv.UNSTEPPED_NOT_IN_OPTIMIZER
                elif slot.main_dtype in LOW_PRECISION:
                    why = semconv.UNSTEPPED_LOW_PRECISION_MASTER
                else:
                    why = semconv.UNSTEPPED_NO_UPDATE
                ranked[semconv.DIAGNOSTIC_UNSTEPPED].append((count, index, None, why))
            if stepping:
                stepped_any = True
                stepped_changed += row[row_spec.CHANGED]
                stepped_grad = stepped_grad or _grad_moves(row)
                stepped_nonfinite = stepped_nonfinite or row[row_spec.GRAD_AMAX] >= row_spec.GRAD_AMAX_NONFINITE
        findings.skipped = stepped_any and stepped_changed == 0 and stepped_grad and not stepped_nonfinite
        if underflow_measured:
            # Zeros alone are no sign of a flushing backward (an embedding's unused rows, a part of
            # the model this batch did not reach); with grads below float16's normal range beside
            # them, they are what it flushed completely.
            underflowing = tiny_grads > 0 and grad_elements > 0
            findings.grad_underflow = flushed_grads / grad_elements if underflowing else 0.0
            if not underflowing:
                ranked[semconv.DIAGNOSTIC_GRAD_UNDERFLOW].clear()
        for diagnostic in semconv.DIAGNOSTICS:
            entries = sorted(ranked[diagnostic], key=lambda e: (-e[0], e[1]))[: self.top_k]
            for value, index, state_key, cause in entries:
                shown = -value if diagnostic == semconv.DIAGNOSTIC_UPDATE_RESOLUTION else value
                findings.offenders.append(Offender(diagnostic, index, float(shown), state_key, cause))
        if self.first_nonfinite is None:
            self.first_nonfinite = findings.first_nonfinite = _first_nonfinite(step, rows, contexts, ranks_of)
        return findings


def _first_nonfinite(
    step: int,
    rows: Sequence[Sequence[float]],
    contexts: Sequence[ParamContext],
    ranks_of: Callable[[int, Sequence[int]], tuple[int, ...]],
) -> FirstNonfinite | None:
    for tensor in semconv.FIRST_NONFINITE_ORDER:
        if tensor == semconv.TENSOR_OPTIMIZER_STATE:
            hits = [(i, _state_counts(row)) for i, row in enumerate(rows)]
            hits = [(i, counts) for i, counts in hits if counts]
            if not hits:
                continue
            first, counts = hits[0]
            state_index, nan, inf = counts[0]
            keys = contexts[first].state_keys
            key = keys[state_index] if state_index < len(keys) else str(state_index)
            slots = (row_spec.STATE_NAN + 2 * state_index, row_spec.STATE_INF + 2 * state_index)
            return FirstNonfinite(step, tensor, key, tuple(i for i, _ in hits), ranks_of(first, slots), nan, inf)
        nan_slot, inf_slot = _KIND_SLOTS[tensor]
        hits_plain = [i for i, row in enumerate(rows) if row[nan_slot] or row[inf_slot]]
        if hits_plain:
            first = hits_plain[0]
            row = rows[first]
            return FirstNonfinite(
                step,
                tensor,
                None,
                tuple(hits_plain),
                ranks_of(first, (nan_slot, inf_slot)),
                int(row[nan_slot]),
                int(row[inf_slot]),
            )
    return None


def any_nonfinite(rows: Sequence[Sequence[float]]) -> bool:
    """Whether some row counts a NaN/Inf (then the ranks are worth reading)."""
    return any(row[s] for row in rows for s in PER_RANK_SLOTS)


# -- per unit ------------------------------------------------------------------------------------


def unit_rows(table: Sequence[ParamSlot], rows: Sequence[Sequence[float]]) -> dict[str, list[float]]:
    """Rows summed per unit (``GRAD_AMAX`` the largest), in the order units first appear."""
    units: dict[str, list[float]] = {}
    for slot, row in zip(table, rows, strict=True):
        total = units.get(slot.unit)
        if total is None:
            units[slot.unit] = list(row)
            continue
        for i, value in enumerate(row):
            total[i] = max(total[i], value) if i == row_spec.GRAD_AMAX else total[i] + value
    return units


def stats_of_row(row: Sequence[float]) -> precision.PrecisionStats:
    """The whole-model statistics type for one (unit's) row."""
    return precision.stats_from_values(row[: row_spec.WHOLE_MODEL_SLOTS])
