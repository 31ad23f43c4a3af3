"""What a correct precision report says about a bug pattern, and the comparison of a report with it.

An expectation (:class:`Expect`) is the diagnosis a correct report gives, whether or not the report
gives it; each ``Expect.lead`` is a check of ``telemetry/precision_thresholds.py``. :func:`judge`
compares a report (``report_json``'s dict) with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .tiny_lm import Settings
from .training import Plant

__all__ = ["Expect", "Judgement", "OpWant", "OriginWant", "Pattern", "judge"]

HEALTHY, WARNING, PROBLEM = "healthy", "warning", "problem"


@dataclass(frozen=True)
class OriginWant:
    """What the report's ``origin`` must hold (``None`` fields are not checked).

    Attributes:
        stage: One of weight_write, forward, loss, backward, reduce, grad_write, optimizer.
        where: The unit (``""``: the root), module or parameter named.
        step: The iteration it began in.
        ranks: The ranks that saw it, where the plant decides them (not the shard layout).
        kind: ``nan`` or ``inf``.
        refined: The module the first refined (module-level) origin names.
    """

    stage: str
    where: str | None = None
    step: int | None = None
    ranks: tuple[int, ...] | None = None
    kind: str | None = None
    refined: str | None = None


@dataclass(frozen=True)
class OpWant:
    """An operation the report must name (among ``report["ops"]``, or as the origin's operation).

    Attributes:
        kind: The audit's kind (``nonfinite``, ``ties``, ``lost_update``, ...).
        op: The operation (``aten.topk``), or operations any of which may be named, ``|``-separated.
        site: Words its source line must hold (a file and function: ``op_plants.py:`` and ``in forward``).
        module: The module named, where the operation runs in one (``None``: not checked).
        phase: The phase it ran in (``None``: not checked).
        detail: Words its detail or fix must hold (``None``: not checked).
        fp32_finite: For a NaN/Inf, whether float32 keeps it finite (``None``: not checked).
    """

    kind: str
    op: str
    site: tuple[str, ...]
    module: str | None = None
    phase: str | None = None
    detail: str | None = None
    fp32_finite: bool | None = None

    def matches(self, seen: dict[str, Any]) -> bool:
        return (
            seen["kind"] == self.kind
            and seen["op"] in self.op.split("|")
            and all(words in seen["site"] for words in self.site)
            and (self.module is None or seen["module"] == self.module)
            and (self.phase is None or seen["phase"] == self.phase)
            and (self.detail is None or self.detail in seen["detail"] + " " + seen["fix"])
            and (self.fp32_finite is None or seen["fp32_finite"] == self.fp32_finite)
        )

    def __str__(self) -> str:
        where = f" in module {self.module}" if self.module is not None else ""
        return f"{self.kind} {self.op} at {' ... '.join(self.site)}{where}"


@dataclass(frozen=True)
class Expect:
    """What a correct report says.

    Attributes:
        verdict: healthy, warning or problem.
        lead: The checks the report may lead with (``findings[0]["check"]``); empty for a
            healthy run (no finding at all).
        cause: The diagnosis, in words.
        origin: What the origin must hold, when the cause is a NaN/Inf's.
        skipped: ``iterations.skipped`` (iterations a GradScaler skipped), when it matters.
        scales: ``(scale_first, scale_last)`` of the skipped iterations, when they matter.
        finding: Words the lead finding's text must hold, where the check alone says too little.
        contract: The role (``fsdp.tensor``) a dtype-contract violation of the report must name.
        op: An operation the report must name, with its source line.
        jump_cause: What changed at an update jump (``fsdp.precision.cause``), which every
            parameter the lead finding names must say.
        load_site: Words the line that loaded the optimizer's state must hold (a file and
            function), as a dtype-contract detail or an update jump's site names it.
    """

    verdict: str
    lead: tuple[str, ...]
    cause: str
    origin: OriginWant | None = None
    skipped: int | None = None
    scales: tuple[float, float] | None = None
    finding: str | None = None
    contract: str | None = None
    op: OpWant | None = None
    jump_cause: str | None = None
    load_site: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Pattern:
    """One bug pattern or healthy control.

    Attributes:
        name: Short identifier (``fp16_forward_overflow``).
        number: The research's pattern number (``"1"``, ``"2a"``), ``"C1"`` for controls.
        title: One line.
        sources: ``owner/repo#N — title`` of each public thread it reproduces.
        plants: What is planted, where, when and on which ranks.
        settings: How it trains.
        plant: The code that plants it.
        expect: What the report must say.
        every: ``FSDP_PATCH_PRECISION_EVERY`` values it runs at (``None``: unset, the default 100).
            Patterns run with the diagnostics on every step, so that the checks that need a
            diagnosed step see each one; the controls also run on the default schedule.
    """

    name: str
    number: str
    title: str
    sources: tuple[str, ...]
    plants: str
    settings: Settings
    plant: Plant
    expect: Expect
    every: tuple[int | None, ...] = (1,)

    @property
    def control(self) -> bool:
        return self.number.startswith("C")


@dataclass(frozen=True)
class Judgement:
    """What a report led with, and whether it named the catalogue's cause.

    Attributes:
        verdict: The report's verdict.
        lead: The lead finding's check and text (``""`` when there is none).
        origin: The origin as ``stage at where (dtype), step S, ranks R``, and its first refinement.
        named: Whether verdict, lead and origin are what the catalogue expects.
        mismatches: What differs from the expectation, one line each.
    """

    verdict: str
    lead_check: str
    lead: str
    origin: str
    named: bool
    mismatches: tuple[str, ...]


def _origin_text(origin: dict[str, Any] | None) -> str:
    if not origin:
        return ""
    where = origin["where"] or "(root)"
    text = f"{origin['stage']} at {where} ({origin['dtype']}, {origin['kind']}), step {origin['step']}, ranks {origin['ranks']}"
    refined = origin.get("refined") or []
    if refined:
        text += f"; refined: {refined[0]['stage']} at {refined[0]['where'] or '(root)'}"
    return text


def judge(pattern: Pattern, report: dict[str, Any]) -> Judgement:
    """Compares ``report`` (``report_json``'s dict) with ``pattern.expect``."""
    want = pattern.expect
    findings = report["findings"]
    lead = findings[0] if findings else None
    origin = report.get("origin")
    mismatches: list[str] = []
    if report["verdict"] != want.verdict:
        mismatches.append(f"verdict {report['verdict']}, want {want.verdict}")
    got_lead = lead["check"] if lead else ""
    if want.lead and got_lead not in want.lead:
        mismatches.append(f"lead {got_lead or '(none)'}, want {' or '.join(want.lead)}")
    if want.finding and lead is not None and want.finding not in lead["finding"]:
        mismatches.append(f"lead finding {lead['finding']!r}, want it to say {want.finding!r}")
    if want.jump_cause and lead is not None:
        causes = sorted({p.get("cause") or "" for p in lead.get("parameters", ())})
        if causes != [want.jump_cause]:
            mismatches.append(f"update-jump causes {causes}, want {want.jump_cause}")
    if want.load_site:
        texts = [v.get("detail") or "" for f in findings for v in f.get("violations", ())]
        texts += [p.get("site") or "" for f in findings for p in f.get("parameters", ())]
        if not any(all(words in text for words in want.load_site) for text in texts):
            mismatches.append(f"no finding names the load at {' '.join(want.load_site)}")
    if want.contract:
        roles = [v["tensor"] for f in findings for v in f.get("violations", ())]
        if want.contract not in roles:
            mismatches.append(f"dtype-contract roles {roles}, want {want.contract}")
    if not want.lead and findings:
        mismatches.append(f"findings {[f['check'] for f in findings]}, want none")
    if want.origin is not None:
        if not origin:
            mismatches.append(f"no origin, want {want.origin.stage}")
        else:
            checks = {
                "stage": (origin["stage"], want.origin.stage),
                "where": (origin["where"], want.origin.where),
                "step": (origin["step"], want.origin.step),
                "ranks": (tuple(origin["ranks"]), want.origin.ranks),
                "kind": (origin["kind"], want.origin.kind),
            }
            refined = origin.get("refined") or []
            checks["refined"] = (refined[0]["where"] if refined else None, want.origin.refined)
            for key, (got, expected) in checks.items():
                if expected is not None and got != expected:
                    mismatches.append(f"origin {key} {got!r}, want {expected!r}")
    if want.op is not None:
        ops = [*report.get("ops", ())]
        if origin and origin.get("operation"):
            ops.append(origin["operation"])
        if not any(want.op.matches(seen) for seen in ops):
            named = [f"{o['kind']} {o['op']} at {o['site']} ({o['module']})" for o in ops[:5]]
            mismatches.append(f"operations {named}, want {want.op}")
    iterations = report["iterations"]
    if want.skipped is not None and iterations["skipped"] != want.skipped:
        mismatches.append(f"skipped {iterations['skipped']}, want {want.skipped}")
    if want.scales is not None and (iterations["scale_first"], iterations["scale_last"]) != want.scales:
        mismatches.append(f"scales {iterations['scale_first']}..{iterations['scale_last']}, want {want.scales}")
    return Judgement(
        verdict=report["verdict"],
        lead_check=got_lead,
        lead=lead["finding"] if lead else "",
        origin=_origin_text(origin),
        named=not mismatches,
        mismatches=tuple(mismatches),
    )
