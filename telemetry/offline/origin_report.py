"""Where a run's first NaN/Inf began, and how its iterations were counted, from its trace files.

:mod:`fsdp_patch.telemetry.offline.precision_report` judges the diagnosed steps; this module reads
what the per-iteration checks recorded (``semconv``'s origin names):

- ``fsdp.precision.origin`` events of every rank, merged: the earliest step wins, then the
  earliest stage of an iteration, and every rank that saw that origin is named;
- ``fsdp.precision.grads_zeroed`` events: grads non-zero after the reduce, all 0 at the step;
- ``fsdp.precision.replica_divergence`` events: HSDP replicas that differ, with each one's ranks;
- ``fsdp.optimizer.lr_jump`` events, which a NaN/Inf beginning soon after is tied to;
- ``fsdp.optimizer.skipped_step`` spans (a GradScaler skipped the iteration), with the scale;
- ``fsdp.backward.count`` on the step spans, against the optimizer steps that ran.

No torch and no OpenTelemetry here, as in the report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import semconv
from ..precision_thresholds import LR_JUMP_WINDOW

_STAGE_ORDER = {stage: index for index, stage in enumerate(semconv.ORIGIN_STAGES)}


@dataclass
class OriginSeen:
    """One origin, with every rank that reported it."""

    step: int
    stage: str
    where: str
    dtype: str
    kind: str
    detail: str
    microbatch: int
    refined: bool
    ranks: set[int] = field(default_factory=set)

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.step, _STAGE_ORDER.get(self.stage, len(_STAGE_ORDER)), self.where)


@dataclass
class LrJump:
    """A param group's learning rate rising LR_JUMP_FACTOR-fold or more from one step to the next."""

    step: int
    group: int
    before: float
    after: float


@dataclass
class ZeroedSeen:
    """An iteration whose grads something zeroed between backward and step, with the units every
    rank named and the ranks."""

    step: int
    units: str
    ranks: set[int] = field(default_factory=set)


@dataclass
class DivergenceSeen:
    """A diagnosed step at which HSDP's replicas differed.

    Attributes:
        step: The step.
        diff: What differed (``semconv.REPLICA_DIFF_*``).
        params: The parameters named (at most the events' top K), and how many differed.
        nonfinite: Per replica, the NaN/Inf elements of those parameters.
        replicas: Per replica, the ranks whose events named it (each event names one per replica).
    """

    step: int
    diff: str
    params: list[str]
    params_count: int
    nonfinite: list[int]
    replicas: list[set[int]] = field(default_factory=list)


# Stages an lr cannot cause: writes from outside the optimizer, and grads changed before it ran
# (nor can a batch that held NaN/Inf before any module ran).
_NOT_FROM_LR = (semconv.ORIGIN_WEIGHT_WRITE, semconv.ORIGIN_GRAD_WRITE)


@dataclass
class RankSteps:
    """One rank's iterations."""

    steps: set[int] = field(default_factory=set)
    skipped: list[tuple[float, float, int]] = field(default_factory=list)  # (span start, scale, step)
    backward: int = 0


@dataclass
class OriginTrace:
    """What the per-iteration checks of a run's trace files say.

    Attributes:
        origins: Every unit-level origin, by (step, stage, where).
        refined: Every module-level origin an escalated iteration found, likewise.
        escalations: Steps at which any rank escalated.
        ranks: Per rank, its optimizer steps, skipped iterations and backward passes.
    """

    origins: dict[tuple[int, str, str], OriginSeen] = field(default_factory=dict)
    refined: dict[tuple[int, str, str], OriginSeen] = field(default_factory=dict)
    escalations: set[int] = field(default_factory=set)
    ranks: dict[int, RankSteps] = field(default_factory=dict)
    lr_jumps: dict[tuple[int, int], LrJump] = field(default_factory=dict)
    zeroed: dict[int, ZeroedSeen] = field(default_factory=dict)
    divergence: dict[int, DivergenceSeen] = field(default_factory=dict)
    coordinates: dict[int, str] = field(default_factory=dict)

    def feed_instant(self, args: Mapping[str, Any], name: str) -> None:
        """Take an instant event of a trace file (``name`` its event name)."""
        if name == semconv.EVENT_LR_JUMP:
            step, group = _int(args.get(semconv.ATTR_STEP)), _int(args.get(semconv.ATTR_PARAM_GROUP))
            before, after = _float(args.get(semconv.ATTR_LR_BEFORE)), _float(args.get(semconv.ATTR_LR_AFTER))
            if step is not None and group is not None and before is not None and after is not None:
                self.lr_jumps.setdefault((step, group), LrJump(step, group, before, after))
            return
        if name == semconv.EVENT_GRADS_ZEROED:
            step = _int(args.get(semconv.ATTR_STEP))
            if step is not None:
                units = str(args.get(semconv.ATTR_GRADS_ZEROED_UNITS, ""))
                zeroed = self.zeroed.setdefault(step, ZeroedSeen(step, units))
                if units != zeroed.units:  # each rank names the units whose shards it saw zeroed
                    zeroed.units = _merged_units(zeroed.units, units)
                rank = _int(args.get(semconv.ATTR_RANK))
                if rank is not None:
                    zeroed.ranks.add(rank)
            return
        if name == semconv.EVENT_REPLICA_DIVERGENCE:
            self._feed_divergence(args)
            return
        if name == semconv.EVENT_ESCALATION:
            step = _int(args.get(semconv.ATTR_STEP))
            if step is not None:
                self.escalations.add(step)
            return
        if name != semconv.EVENT_ORIGIN:
            return
        step = _int(args.get(semconv.ATTR_STEP))
        if step is None:
            return
        seen = OriginSeen(
            step,
            str(args.get(semconv.ATTR_ORIGIN_STAGE, "")),
            str(args.get(semconv.ATTR_ORIGIN_WHERE, "")),
            str(args.get(semconv.ATTR_ORIGIN_DTYPE, "")),
            str(args.get(semconv.ATTR_NONFINITE_KIND, "")),
            str(args.get(semconv.ATTR_ORIGIN_DETAIL, "")),
            _int(args.get(semconv.ATTR_MICROBATCH)) or 0,
            bool(args.get(semconv.ATTR_ORIGIN_REFINED)),
        )
        into = self.refined if seen.refined else self.origins
        held = into.setdefault((seen.step, seen.stage, seen.where), seen)
        rank = _int(args.get(semconv.ATTR_RANK))
        if rank is not None:
            held.ranks.add(rank)

    def _feed_divergence(self, args: Mapping[str, Any]) -> None:
        step = _int(args.get(semconv.ATTR_STEP))
        peers = [_int(r) for r in _list(args.get(semconv.ATTR_RANKS))]
        if step is None:
            return
        seen = self.divergence.setdefault(
            step,
            DivergenceSeen(
                step,
                str(args.get(semconv.ATTR_REPLICA_DIFF, "")),
                [str(p) for p in _list(args.get(semconv.ATTR_PRECISION_PARAMS))],
                _int(args.get(semconv.ATTR_PRECISION_PARAMS_COUNT)) or 0,
                [_int(n) or 0 for n in _list(args.get(semconv.ATTR_REPLICA_NONFINITE))],
            ),
        )
        while len(seen.replicas) < len(peers):
            seen.replicas.append(set())
        for ranks, peer in zip(seen.replicas, peers, strict=False):
            if peer is not None:
                ranks.add(peer)

    def feed_span(self, name: str, args: Mapping[str, Any], rank: int, start: float) -> None:
        """Take a complete ("X") event: step spans and skipped-step spans."""
        steps = self.ranks.setdefault(rank, RankSteps())
        if name == semconv.SPAN_STEP:
            coordinate = args.get(semconv.ATTR_MESH_COORDINATE)
            if coordinate:
                self.coordinates[rank] = str(coordinate)
            step = _int(args.get(semconv.ATTR_STEP))
            if step is not None:
                steps.steps.add(step)
            steps.backward += _int(args.get(semconv.ATTR_BACKWARD_COUNT)) or 0
        elif name == semconv.SPAN_CHECKS:  # at exit: backward passes no step followed
            steps.backward += _int(args.get(semconv.ATTR_BACKWARD_COUNT)) or 0
        elif name == semconv.SPAN_SKIPPED_STEP:
            scale = args.get(semconv.ATTR_GRAD_SCALER_SCALE)
            steps.skipped.append(
                (
                    start,
                    float(scale) if isinstance(scale, int | float) else float("nan"),
                    _int(args.get(semconv.ATTR_STEP)) or 0,
                )
            )
            steps.backward += _int(args.get(semconv.ATTR_BACKWARD_COUNT)) or 0

    # -- what it adds up to ----------------------------------------------------------------------

    def first(self) -> OriginSeen | None:
        """The run's first origin: the earliest step, then the earliest stage of an iteration."""
        return min(self.origins.values(), key=lambda o: o.key, default=None)

    def episode_end(self, of: OriginSeen) -> int | None:
        """The step at which the next run of iterations holding NaN/Inf (an episode: each has its
        own unit-level origin, the same on every rank) began after ``of``'s, or ``None``."""
        return min((o.step for o in self.origins.values() if o.step > of.step), default=None)

    def refinements(self, of: OriginSeen) -> list[OriginSeen]:
        """Module-level origins found by the escalation that followed ``of``, in order: those of
        its episode, not of a later one."""
        end = self.episode_end(of)
        return sorted(
            (o for o in self.refined.values() if of.step <= o.step and (end is None or o.step < end)),
            key=lambda o: o.key,
        )

    def skipped(self) -> tuple[int, int, float, float]:
        """``(skipped, iterations, first scale, last scale)`` of the rank that skipped most."""
        if not self.ranks:
            return 0, 0, float("nan"), float("nan")
        rank = max(self.ranks.values(), key=lambda r: (len(r.skipped), len(r.steps)))
        scales = [scale for _, scale, _ in sorted(rank.skipped)]
        first, last = (scales[0], scales[-1]) if scales else (float("nan"), float("nan"))
        return len(rank.skipped), len(rank.skipped) + len(rank.steps), first, last

    def first_skip(self) -> int | None:
        """The step of the first iteration a GradScaler skipped (the step it would have made)."""
        steps = [step for r in self.ranks.values() for _, _, step in r.skipped]
        return min(steps) if steps else None

    def lr_jump_before(self, origin: OriginSeen) -> LrJump | None:
        """The largest lr jump a NaN/Inf that began at ``origin`` followed: at most LR_JUMP_WINDOW
        iterations before it (the same step for the optimizer's own update)."""
        if origin.stage in _NOT_FROM_LR or _is_model_input(origin):
            return None
        earliest = origin.step - LR_JUMP_WINDOW
        latest = origin.step if origin.stage == semconv.ORIGIN_OPTIMIZER else origin.step - 1
        jumps = [j for j in self.lr_jumps.values() if earliest <= j.step <= latest]
        return max(jumps, key=lambda j: (j.after / j.before, j.step), default=None)

    def zeroed_steps(self) -> list[ZeroedSeen]:
        """The iterations whose grads were zeroed between backward and step, in order."""
        return [self.zeroed[step] for step in sorted(self.zeroed)]

    def divergence_steps(self) -> list[DivergenceSeen]:
        """The diagnosed steps at which replicas differed, in order."""
        return [self.divergence[step] for step in sorted(self.divergence)]

    def backward_without_steps(self) -> int:
        """Backward passes on a rank that ran no optimizer step and skipped none (0 otherwise)."""
        return max((r.backward for r in self.ranks.values() if not r.steps and not r.skipped), default=0)


def _merged_units(*named: str) -> str:
    """The units several ranks named (each a ``", "``-joined, sorted list), as one such list."""
    return ", ".join(sorted({unit for units in named for unit in units.split(", ") if unit}))


def _float(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _list(value: object) -> list[Any]:
    # A trace file writes an array attribute as a JSON list.
    return list(value) if isinstance(value, list | tuple) else []


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


# -- what the report says -----------------------------------------------------------------------------

_ADVICE = {
    semconv.ORIGIN_WEIGHT_WRITE: (
        "something outside the optimizer wrote it between steps (a checkpoint load, an EMA or weight average, a "
        "manual edit): find that write; the forward, the grads and the optimizer are not the cause"
    ),
    semconv.ORIGIN_FORWARD: (
        "an activation left its dtype's range in the forward: compute that module in float32 (or bfloat16, which has "
        "float32's range), or scale its input or weights down"
    ),
    semconv.ORIGIN_LOSS: (
        "the model's outputs were finite and the loss was not: the loss function made it (a log of 0, a division by a "
        "zero count such as every label ignored, a softmax in low precision); compute the loss in float32 and guard "
        "its denominators"
    ),
    semconv.ORIGIN_BACKWARD: (
        "the backward turned finite grads into NaN/Inf there: an operation whose derivative is infinite at its input "
        "(sqrt, norm or pow at 0, a division) or a grad that overflowed its dtype: add an epsilon, or keep that "
        "computation in float32"
    ),
    semconv.ORIGIN_REDUCE: (
        "the grads were finite on every rank and their reduce overflowed (the sum over ranks leaves the reduce "
        "dtype's range): reduce in float32 (torch FSDP2: MixedPrecisionPolicy(reduce_dtype=torch.float32); "
        "fully_shard: MixedPrecisionPolicy(main_grads_dtype=torch.float32))"
    ),
    semconv.ORIGIN_GRAD_WRITE: (
        "the grads were finite after backward and the reduce, and not at the step: something changed them in between "
        "(clip_grad_norm_ with a non-finite total norm, a grad hook, a manual edit)"
    ),
    semconv.ORIGIN_OPTIMIZER: (
        "grads and weights were finite before the update and not after it: the optimizer's arithmetic (an eps too "
        "small for its state's dtype, a learning rate too large, a non-finite state)"
    ),
}

_STAGE_TEXT = {
    semconv.ORIGIN_WEIGHT_WRITE: "a main weight written between steps",
    semconv.ORIGIN_FORWARD: "the forward",
    semconv.ORIGIN_LOSS: "the loss",
    semconv.ORIGIN_BACKWARD: "the backward",
    semconv.ORIGIN_REDUCE: "the reduce-scatter of the grads",
    semconv.ORIGIN_GRAD_WRITE: "the grads between backward and step",
    semconv.ORIGIN_OPTIMIZER: "the optimizer's update",
}


def _place(origin: OriginSeen) -> str:
    if _is_model_input(origin):
        return "the model's input"
    if origin.stage == semconv.ORIGIN_GRAD_WRITE and origin.where == semconv.ORIGIN_WHERE_CLIP:
        return "the total norm torch.nn.utils.clip_grad_norm_ returned"
    if origin.stage == semconv.ORIGIN_LOSS:
        return "the loss"
    if origin.stage in (semconv.ORIGIN_WEIGHT_WRITE, semconv.ORIGIN_OPTIMIZER):
        return f"parameter {origin.where}"
    what = (
        "unit"
        if origin.stage in (semconv.ORIGIN_REDUCE, semconv.ORIGIN_GRAD_WRITE) and not origin.refined
        else "module"
    )
    if origin.stage == semconv.ORIGIN_FORWARD:
        return f"{what} '{origin.where}' output" if origin.where else "the root's output"
    return f"{what} '{origin.where}'" if origin.where else "the root"


def rank_names(ranks: set[int], coordinates: Mapping[int, str] | None = None) -> str:
    """``ranks`` in order, each with its mesh coordinate where the trace gave one."""
    where = coordinates or {}
    return ", ".join(f"{r} ({where[r]})" if r in where else str(r) for r in sorted(ranks)) or "?"


def origin_text(origin: OriginSeen, step_offset: int = 0, coordinates: Mapping[int, str] | None = None) -> str:
    """One line: where and when it began, on which ranks (with their mesh coordinates)."""
    kind = {"nan": "NaN", "inf": "Inf"}.get(origin.kind, "NaN/Inf")
    ranks = rank_names(origin.ranks, coordinates)
    micro = (
        f", microbatch {origin.microbatch}"
        if origin.microbatch
        and origin.stage not in (semconv.ORIGIN_WEIGHT_WRITE, semconv.ORIGIN_GRAD_WRITE, semconv.ORIGIN_OPTIMIZER)
        else ""
    )
    detail = f" ({origin.detail})" if origin.detail and not _is_model_input(origin) else ""
    return (
        f"{kind} began in {_STAGE_TEXT.get(origin.stage, origin.stage)} at step {origin.step + step_offset}{micro}: "
        f"{_place(origin)}, {origin.dtype}{detail}; rank{'s' if len(origin.ranks) != 1 else ''} {ranks}"
    )


def _is_model_input(origin: OriginSeen) -> bool:
    return origin.stage == semconv.ORIGIN_FORWARD and origin.where == "" and "batch" in origin.detail


def advice(origin: OriginSeen) -> str:
    if _is_model_input(origin):
        return (
            "the batch held NaN/Inf before any module ran (or the code that builds the model's input made it): check "
            "the data pipeline and that code, not the model"
        )
    return _ADVICE.get(origin.stage, "")


def divergence_text(seen: list[DivergenceSeen], step_offset: int = 0) -> str:
    """One line: when replicas first differed, where, and each replica's ranks and NaN/Inf count."""
    first = seen[0]
    what = "NaN/Inf counts" if first.diff == semconv.REPLICA_DIFF_NONFINITE else "main weights"
    more = f" (and {first.params_count - len(first.params)} more)" if first.params_count > len(first.params) else ""
    replicas = "; ".join(
        f"replica {i} (rank{'s' if len(ranks) != 1 else ''} {', '.join(str(r) for r in sorted(ranks)) or '?'})"
        + (
            f": {first.nonfinite[i]} NaN/Inf"
            if first.diff == semconv.REPLICA_DIFF_NONFINITE and i < len(first.nonfinite)
            else ""
        )
        for i, ranks in enumerate(first.replicas)
    )
    return (
        f"{what} differ at step {first.step + step_offset} ({len(seen)} diagnosed step{'s' if len(seen) != 1 else ''}"
        f" in all): {', '.join(first.params)}{more}; {replicas}"
    )


def divergence_json(seen: list[DivergenceSeen], step_offset: int = 0) -> dict[str, Any]:
    first = seen[0]
    return {
        "step": first.step + step_offset,
        "diff": first.diff,
        "params": first.params,
        "params_count": first.params_count,
        "steps": [s.step + step_offset for s in seen],
        "replicas": [
            {"ranks": sorted(ranks), "nonfinite": first.nonfinite[i] if i < len(first.nonfinite) else None}
            for i, ranks in enumerate(first.replicas)
        ],
    }


def origin_json(origin: OriginSeen, step_offset: int = 0) -> dict[str, Any]:
    return {
        "step": origin.step + step_offset,
        "stage": origin.stage,
        "where": origin.where,
        "dtype": origin.dtype,
        "kind": origin.kind,
        "detail": origin.detail,
        "microbatch": origin.microbatch,
        "refined": origin.refined,
        "ranks": sorted(origin.ranks),
    }
