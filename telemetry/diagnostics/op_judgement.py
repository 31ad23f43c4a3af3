"""The operation audit's judgement: from each operation's statistics to findings that name the line.

:mod:`.op_audit` measures; this module decides, on the host, from the values read back once. No
device work here (torch only for its dtypes' limits). Each finding is an :class:`OpFinding`: the
kind (``semconv.OP_KIND_*``), the operation and dtype, where it ran (:class:`~.op_sites.Site`),
what was measured, and the fix. The thresholds are :mod:`..precision_thresholds`' ``OP_*``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import precision_thresholds as limits
from .. import semconv
from .op_sites import Site

__all__ = ["STATS", "OpFinding", "OpRecord", "judge"]

STATS = (
    # the operation's inputs
    "in_nonfinite",
    "in_amax",
    # its low-precision results against the reference on the same inputs
    "nonfinite",
    "new_nonfinite",
    "out_amax",
    "ref_amax",
    "err_sq",
    "rnd_sq",
    "ref_sq",
    "flushed",
    "maxrel",
    "ref_nonzero",
    "elements",
    "intended",
    "lost",
    "sensitive",
    # a selection's rows
    "int_ref",
    "int_wrong",
    "tied",
    "rows",
    # every floating result against its float32 shadow
    "out_nonfinite",
    "shadow_nonfinite",
    "shadow_new_nonfinite",
    "shadow_err_sq",
    "shadow_sq",
    "shadow_maxrel",
)
"""What the audit keeps per operation, in this order (one float64 vector on the device)."""


@dataclass(frozen=True)
class OpRecord:
    """One measured operation, as dispatched.

    Attributes:
        op: ``aten.<name>``.
        dtype: The low-precision dtype it computed in.
        elements: Elements of its low-precision results.
        constants: ``(argument, value, value in dtype)`` for constants that round to 0, inf or 1.
        accumulated: Elements summed into each result element (0: not a reduction).
        pointwise: Whether its sensitivity to its inputs' rounding was measured.
        inplace: Whether it writes into its inputs.
        selection: Whether its ties were counted.
        site: Where it ran.
        phase: One of ``semconv.OP_PHASES``.
        made_from: The records of the operations that made its inputs (views passed through).
        constants_only: Whether its values come from constants alone (a fill, a creation).
    """

    op: str
    dtype: torch.dtype
    elements: int
    constants: tuple[tuple[str, float, float], ...] = ()
    accumulated: int = 0
    pointwise: bool = False
    inplace: bool = False
    selection: bool = False
    site: Site | None = None
    phase: str = ""
    made_from: tuple[int, ...] = ()
    constants_only: bool = False


@dataclass(frozen=True)
class OpFinding:
    """A judged operation: what the report names.

    Attributes:
        kind: ``semconv.OP_KIND_*``.
        op: ``aten.<name>``.
        dtype: Its dtype's name (``bfloat16``).
        site: Where it ran.
        phase: The iteration's phase.
        detail: What was measured, in words.
        fix: What to change.
        share: The measured share (of elements, updates or rows) the finding is about, or 0.
        fp32_finite: For a non-finite result: whether float32 on the same inputs stays finite.
        order: The operation's place in the iteration (0: the first measured).
    """

    kind: str
    op: str
    dtype: str
    site: Site
    phase: str
    detail: str
    fix: str
    share: float = 0.0
    fp32_finite: bool = False
    order: int = 0

    @property
    def key(self) -> tuple[str, str, str, str]:
        """One finding per kind, operation, line and phase (a constant once per line: its
        backward uses it again)."""
        return (self.kind, self.op, self.site.where, "" if self.kind == semconv.OP_KIND_CONSTANT else self.phase)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Operations that replace their destination's values (a cast when the source is wider), not update them.
_COPIES = frozenset({"aten.copy_", "aten._foreach_copy_", "aten._copy_from", "aten.set_"})


def _integers_exact(dtype: torch.dtype) -> int:
    """The largest integer up to which ``dtype`` holds every integer: 2 ** (significand bits)."""
    return int(round(2.0 / float(torch.finfo(dtype).eps)))


def _spacing(dtype: torch.dtype, magnitude: float) -> float:
    """The distance between neighbouring values of ``dtype`` at ``magnitude``."""
    info = torch.finfo(dtype)
    if magnitude <= info.smallest_normal:
        return float(info.smallest_normal * info.eps)
    return float(2.0 ** math.floor(math.log2(magnitude)) * info.eps)


def judge(records: Sequence[OpRecord], values: Sequence[Sequence[float]], top_k: int) -> list[OpFinding]:
    """The findings of one audited iteration, at most ``top_k`` per kind, in the order the
    operations ran (the first non-finite result is where a NaN/Inf began)."""
    stats = [dict(zip(STATS, row, strict=True)) for row in values]
    found: dict[tuple[str, str, str, str], OpFinding] = {}
    per_kind: dict[str, int] = {}
    for order in range(len(records)):
        for finding in _judge_one(records, stats, order):
            if finding.key in found or per_kind.get(finding.kind, 0) >= top_k:
                continue
            found[finding.key] = finding
            per_kind[finding.kind] = per_kind.get(finding.kind, 0) + 1
    return sorted(found.values(), key=lambda f: f.order)


def _shadow_error(s: dict[str, float]) -> float:
    return math.sqrt(s["shadow_err_sq"] / s["shadow_sq"]) if s["shadow_sq"] > 0 else 0.0


def _inputs_error(records: Sequence[OpRecord], stats: Sequence[dict[str, float]], index: int, measure: str) -> float:
    made_from = records[index].made_from
    if measure == "norm":
        return max((_shadow_error(stats[i]) for i in made_from), default=0.0)
    return max((stats[i]["shadow_maxrel"] for i in made_from), default=0.0)


def loss_point(records: Sequence[OpRecord], stats: Sequence[dict[str, float]], index: int) -> int | None:
    """Where precision was lost on the way to operation ``index``, nearest first through what made
    its inputs: an operation that lost every correct digit of some result itself (against float32
    on its own inputs: a flush to zero, an overflow); else one whose result lost them against its
    float32 shadow while its inputs were still close to theirs (a cancellation of rounded values).
    At most ``OP_PROVENANCE_DEPTH`` operations are looked at."""
    order: list[int] = []
    queue, seen = list(records[index].made_from), set(records[index].made_from)
    while queue and len(order) < limits.OP_PROVENANCE_DEPTH:
        candidate = queue.pop(0)
        order.append(candidate)
        for producer in records[candidate].made_from:
            if producer not in seen:
                seen.add(producer)
                queue.append(producer)
    for candidate in order:
        if stats[candidate]["maxrel"] >= limits.OP_LOST_DIGITS:
            return candidate
    for candidate in order:
        inputs = _inputs_error(records, stats, candidate, "elementwise")
        if stats[candidate]["shadow_maxrel"] >= limits.OP_LOST_DIGITS and inputs < limits.OP_INPUTS_CLOSE:
            return candidate
    return None


def _judge_one(records: Sequence[OpRecord], stats: Sequence[dict[str, float]], order: int) -> list[OpFinding]:
    record, s = records[order], stats[order]
    site = record.site or Site("", 0, "")
    dtype = _name(record.dtype)
    info = torch.finfo(record.dtype)
    unit = float(info.eps) / 2
    out: list[OpFinding] = []

    def add(kind: str, detail: str, fix: str, share: float = 0.0, fp32_finite: bool = False) -> None:
        out.append(OpFinding(kind, record.op, dtype, site, record.phase, detail, fix, share, fp32_finite, order))

    rounding = math.sqrt(s["rnd_sq"] / s["ref_sq"]) if s["ref_sq"] > 0 else 0.0
    nonfinite = max(s["nonfinite"], s["out_nonfinite"])
    began = s["new_nonfinite"] > 0 or (nonfinite > 0 and s["in_nonfinite"] == 0)
    if began:
        add(semconv.OP_KIND_NONFINITE, *_nonfinite_text(records, stats, order, nonfinite, dtype, info.max))
    elif (
        record.dtype == torch.float16
        and record.phase != "backward"  # a GradScaler scales grads up to float16's range on purpose
        and not record.constants_only
        and s["out_amax"] > max(info.max * limits.OP_HEADROOM_SHARE, s["in_amax"])
    ):
        add(
            semconv.OP_KIND_HEADROOM,
            f"largest |x| {s['out_amax']:.6g}, {s['out_amax'] / info.max:.0%} of {dtype}'s largest finite value "
            f"{info.max:.6g}",
            f"{record.op} at {site.where} is close to overflowing {dtype}: run it in float32 (or bfloat16, which "
            f"has float32's range), or scale its inputs down",
            s["out_amax"] / info.max,
        )
    # A copy into a low-precision destination is a cast (its source keeps the values), not an update.
    updates = record.inplace and record.op not in _COPIES
    if updates and s["intended"] >= limits.OP_LOST_AT_LEAST and s["lost"] / s["intended"] > limits.OP_LOST_SHARE:
        share = s["lost"] / s["intended"]
        spacing = _spacing(record.dtype, max(s["out_amax"], 1e-30))
        add(
            semconv.OP_KIND_LOST_UPDATE,
            f"{share:.0%} of the {s['intended']:.0f} changes it was to make to its {dtype} destination are smaller "
            f"than half a unit in the last place there, and leave it unchanged (its values up to |x| "
            f"{s['out_amax']:.6g}, where {dtype}'s spacing is {spacing:.3g})",
            f"the tensor {record.op} writes at {site.where} cannot take updates this small: keep it in float32 (a "
            f"copy of the weights kept outside the optimizer, an EMA, an accumulator, optimizer state)",
            share,
        )
    elif not began and s["int_ref"] == s["elements"] and s["int_wrong"] > limits.OP_INTEGERS_WRONG * s["int_ref"] > 0:
        share = s["int_wrong"] / s["int_ref"]
        add(
            semconv.OP_KIND_PRECISION_LOSS,
            f"{share:.0%} of its results, exact integers in float32 (up to {s['ref_amax']:.6g}), are other values "
            f"in {dtype}, which holds every integer only up to {_integers_exact(record.dtype)}: positions, counts or "
            f"indices made in {dtype} repeat or skip",
            f"make the integers {record.op} computes at {site.where} in an integer dtype or float32 (torch.arange(n) "
            f"without dtype=, .long()), and cast only what is computed from them",
            share,
        )
    elif not began and rounding > limits.OP_RANGE_LOSS:
        flushed = s["flushed"] / s["ref_nonzero"] if s["ref_nonzero"] else 0.0
        add(
            semconv.OP_KIND_PRECISION_LOSS,
            f"its results are outside what {dtype} holds: rounding them to {dtype} loses {rounding:.0%} of their norm "
            f"({flushed:.0%} of the non-zero ones flushed to 0; {dtype}'s smallest value is "
            f"{float(info.smallest_normal) * float(info.eps):.3g})",
            f"{record.op} at {site.where} underflows {dtype}: compute it in float32 (or scale its inputs)",
            rounding,
        )
    elif not began and s["ref_sq"] > 0 and s["elements"] >= limits.OP_ERROR_AT_LEAST:
        error = math.sqrt(s["err_sq"] / s["ref_sq"])
        if error > max(limits.OP_ERROR_FACTOR * rounding, limits.OP_ERROR_FLOOR):
            flushed = s["flushed"] / s["ref_nonzero"] if s["ref_nonzero"] else 0.0
            summed = f"; {record.accumulated} elements summed into each result" if record.accumulated else ""
            flush = f"; {flushed:.0%} of its non-zero results flushed to 0" if flushed >= 0.01 else ""
            add(
                semconv.OP_KIND_PRECISION_LOSS,
                f"relative error {error:.3g} against float32 on the same inputs, {error / max(rounding, 1e-30):.3g}x "
                f"what rounding its result to {dtype} explains ({rounding:.3g}){summed}{flush}",
                f"{record.op} at {site.where} loses precision inside the operation in {dtype}: run it in float32 "
                f"(cast its inputs with .float() and the result back)",
                error,
            )
    sensitive = s["sensitive"] / s["elements"] if record.pointwise and s["elements"] else 0.0
    drift, drift_in = _shadow_error(s), _inputs_error(records, stats, order, "norm")
    if sensitive > limits.OP_SENSITIVE_SHARE:
        add(
            semconv.OP_KIND_ILL_CONDITIONED,
            f"{sensitive:.0%} of its results move by over a quarter of their scale when an input moves by half a "
            f"unit in the last place of {dtype}, the rounding its inputs went through (inputs up to |x| "
            f"{s['in_amax']:.6g}, where {dtype}'s spacing is {_spacing(record.dtype, max(s['in_amax'], 1e-30)):.3g})",
            _conditioning_fix(record, site, dtype),
            sensitive,
        )
    elif (
        not began
        and rounding <= limits.OP_RANGE_LOSS
        and drift > limits.OP_SHADOW_ERROR
        and drift > limits.OP_ERROR_FACTOR * max(drift_in, rounding, unit)
        and s["shadow_nonfinite"] == 0
    ):
        add(
            semconv.OP_KIND_ILL_CONDITIONED,
            f"its result is {drift:.0%} off what float32 computes throughout (norm of the difference), where its "
            f"inputs were within {drift_in:.2%} of theirs: it turns their {dtype} rounding into a wrong result",
            _conditioning_fix(record, site, dtype),
            drift,
        )
    for argument, value, stored in record.constants:
        if record.dtype in (torch.float32, torch.float64):
            fix = (
                f"{record.op} at {site.where} is given {value:.10g}, which {dtype} holds as {stored:g}: what it stands "
                f"for is lost at every call (AdamW's 1 - lr * weight_decay: a decay below {dtype}'s resolution, "
                f"torch.finfo(torch.{dtype}).eps / 2). Make the change representable: a larger factor applied every "
                "k-th step, or a learning rate and decay whose product is above that resolution"
            )
        else:
            fix = (
                f"{record.op} at {site.where} cannot use {value:g} in {dtype}: use a value {dtype} holds "
                f"(torch.finfo(torch.{dtype}).min, .tiny, .eps) or compute it in float32"
            )
        add(semconv.OP_KIND_CONSTANT, f"the constant {argument}={value:.10g} is {stored:g} in {dtype}", fix)
    if record.selection and s["rows"] and s["tied"] / s["rows"] > limits.OP_TIE_SHARE:
        share = s["tied"] / s["rows"]
        add(
            semconv.OP_KIND_TIES,
            f"{share:.0%} of {s['rows']:.0f} rows tie at the value selected in {dtype}: which element is chosen "
            f"follows its index, not its value",
            f"compute the values {record.op} selects from at {site.where} in float32 (router logits, scores)",
            share,
        )
    return out


def _conditioning_fix(record: OpRecord, site: Site, dtype: str) -> str:
    return (
        f"its result is not determined by {dtype} inputs: compute the inputs of {record.op} at {site.where} in "
        f"float32 where they are made (positions or angles, a difference of large values), and {record.op} itself"
    )


def _nonfinite_text(
    records: Sequence[OpRecord], stats: Sequence[dict[str, float]], order: int, count: float, dtype: str, top: float
) -> tuple[str, str, float, bool]:
    """(detail, fix, share, whether float32 keeps it finite) of an operation where NaN/Inf began."""
    record, s = records[order], stats[order]
    where = (record.site or Site("", 0, "")).where
    share = count / max(s["elements"], 1.0)
    inputs = "its inputs finite" if s["in_nonfinite"] == 0 else "beside NaN/Inf its inputs carried"
    head = f"{count:.0f} results NaN/Inf in {dtype}, {inputs} (largest |x| {s['in_amax']:.6g})"
    if s["new_nonfinite"] > 0:
        detail = (
            f"{head}; float32 on the same inputs stays finite (largest |x| {s['ref_amax']:.6g}; {dtype} reaches "
            f"{top:.6g}): the operation overflowed {dtype}"
        )
        fix = (
            f"a precision problem: run {record.op} in float32 at {where} (cast its inputs with .float() and the "
            f"result back), or scale its inputs down"
        )
        return detail, fix, share, True
    if s["shadow_new_nonfinite"] > 0:
        lost = loss_point(records, stats, order)
        if lost is None:
            detail = f"{head}; float32 throughout keeps it finite: its inputs had already lost precision upstream"
            fix = f"a precision problem upstream of {record.op} at {where}: compute its inputs in float32"
            return detail, fix, share, True
        source, at = records[lost], stats[lost]
        there = (source.site or Site("", 0, "")).where
        if at["maxrel"] >= limits.OP_LOST_DIGITS:
            how = (
                f"it lost every digit of some results itself ({at['flushed']:.0f} flushed to 0 where float32 on "
                f"its inputs is not 0)"
            )
        else:
            how = (
                f"its result is up to {at['shadow_maxrel']:.3g}x its own size off float32's where its inputs were "
                f"within {_inputs_error(records, stats, lost, 'elementwise'):.2g} of theirs (a cancellation)"
            )
        detail = (
            f"{head}; float32 throughout keeps it finite. Precision was lost upstream, at {source.op} in "
            f"{_name(source.dtype)} at {there}: {how}"
        )
        fix = (
            f"a precision problem at {there}: compute {source.op} (and what follows it up to {record.op}) in float32, "
            f"or rewrite it so that it does not cancel or flush (log-space, a stable formula)"
        )
        return detail, fix, share, True
    detail = f"{head}; float32 makes NaN/Inf too"
    fix = (
        f"not the dtype: the values reaching {record.op} at {where} make NaN/Inf in any precision (a log or "
        f"division of 0, a sqrt of a negative value, an exp of a huge one): guard them there or fix what feeds "
        f"them (the data or the model)"
    )
    return detail, fix, share, False
