"""What the precision report finds in a run: thresholds crossed per step range, what the
per-iteration checks, the operation audit, the headroom forecast and the float32 shadow found, in
order of precedence (the float8 casts' among them), each with its text, its advice and the lines that say where it began.

Judged with :mod:`fsdp_patch.telemetry.precision_thresholds` (the thresholds of the Prometheus
alerts). The text report (:mod:`.precision_report`) and the HTML report (:mod:`.html_report`)
show the same findings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from .. import float8_thresholds, semconv
from .. import precision_thresholds as thresholds
from .attribution_report import details
from .float8_report import CastSeen, cast_text, fix, layer_text, trend_text
from .headroom_report import forecast_text
from .op_report import OpSeen, op_text, place
from .origin_report import OriginSeen, advice, divergence_text, origin_text
from .run_trace import RunTrace, worse
from .shadow_report import shadow_text

DEFAULT_MAX_LINES = 10
NAMED_PER_FINDING = 5


@dataclass
class Finding:
    """A threshold crossed in a step range."""

    threshold: thresholds.Threshold
    first_step: int


@dataclass
class RangeLine:
    """One line of the report: steps ``first``..``last`` and their worst values."""

    first: int
    last: int
    values: dict[str, float]
    failed: int
    findings: list[Finding]

    @property
    def verdict(self) -> str:
        return thresholds.worst([f.threshold.severity for f in self.findings])


def _judge(
    samples: list[tuple[int, dict[str, float]]], failed: list[int], contract: Sequence[int] = ()
) -> list[Finding]:
    first_fired: dict[str, int] = {}
    for step, values in samples:
        fired = {t.check for t in thresholds.THRESHOLDS if t.metric in values and t.fires(values[t.metric])}
        for threshold in thresholds.THRESHOLDS:
            if threshold.check in fired and threshold.unless not in fired:
                first_fired.setdefault(threshold.check, step)
    findings = [Finding(thresholds.BY_CHECK[check], step) for check, step in first_fired.items()]
    if failed:
        findings.append(Finding(thresholds.FAILED_STEPS, min(failed)))
    if contract:
        findings.append(Finding(thresholds.DTYPE_CONTRACT, min(contract)))
    return findings


def _chunks(steps: list[int], count: int) -> list[list[int]]:
    size, extra = divmod(len(steps), count)
    out, start = [], 0
    for index in range(count):
        end = start + size + (1 if index < extra else 0)
        if end > start:
            out.append(steps[start:end])
        start = end
    return out


def range_lines(run: RunTrace, max_lines: int = DEFAULT_MAX_LINES) -> list[RangeLine]:
    """Split the diagnosed steps into at most ``max_lines`` contiguous ranges and judge each."""
    steps = sorted(run.samples)
    lines: list[RangeLine] = []
    # The first range starts where the files do: steps before it are not in them (rotated away).
    previous_last = min(run.first_step or 1, steps[0] if steps else 1) - 1
    chunks = _chunks(steps, max(1, min(max_lines, len(steps))))
    for index, chunk in enumerate(chunks):
        first = previous_last + 1
        last = run.last_step if index == len(chunks) - 1 else chunk[-1]
        samples = [(step, run.samples[step]) for step in chunk]
        values: dict[str, float] = {}
        for _, sample in samples:
            for key, value in sample.items():
                values[key] = worse(values.get(key), value)
        failed = [step for step in run.failed_steps if first <= step <= last]
        contract = [v.step for v in run.attribution.violations.values() if first <= v.step <= last]
        lines.append(RangeLine(first, last, values, len(failed), _judge(samples, failed, contract)))
        previous_last = last
    return lines


def iteration_findings(run: RunTrace) -> list[Finding]:
    """What the per-iteration checks found: where the first NaN/Inf began, HSDP replicas that
    differ, a GradScaler skipping many iterations, backward passes with no optimizer step."""
    found: list[Finding] = []
    first = run.iterations.first()
    if first is not None:
        found.append(Finding(thresholds.NAN_ORIGIN, first.step))
        jump = run.iterations.lr_jump_before(first)
        if jump is not None:
            found.append(Finding(thresholds.LR_JUMP, jump.step))
    zeroed = run.iterations.zeroed_steps()
    if zeroed:
        found.append(Finding(thresholds.GRADS_ZEROED, zeroed[0].step))
    diverged = run.iterations.divergence_steps()
    if diverged:
        found.append(Finding(thresholds.REPLICA_DIVERGENCE, diverged[0].step))
    skipped, iterations, _, _ = run.iterations.skipped()
    if skipped >= thresholds.SCALER_SKIPS_AT_LEAST and skipped > thresholds.SCALER_SKIPS_WARN_SHARE * iterations:
        threshold = thresholds.SCALER_SKIPPED
        if skipped > thresholds.SCALER_SKIPS_PROBLEM_SHARE * iterations:
            threshold = replace(threshold, severity=thresholds.PROBLEM)
        found.append(Finding(threshold, run.iterations.first_skip() or run.first_step or 1))
    if run.iterations.backward_without_steps():
        found.append(Finding(thresholds.NO_OPTIMIZER_STEPS, 1))
    forecasts = run.headroom.forecasts()
    if forecasts:
        found.append(Finding(thresholds.HEADROOM_FORECAST, forecasts[0].step))
    costly = run.shadow.costly()
    if costly:
        found.append(Finding(thresholds.SHADOW_PRECISION, costly[0].step))
    for threshold, seen in run.float8.findings():
        found.append(Finding(threshold, seen.step))
    for kind in run.ops.kinds():
        if kind == semconv.OP_KIND_NONFINITE and origin_operation(run) is not None:
            continue  # named with the origin it refines
        found.append(Finding(thresholds.OP_CHECKS[kind], run.ops.of_kind(kind)[0].step))
    return found


def origin_operation(run: RunTrace) -> OpSeen | None:
    """The operation where the run's first NaN/Inf began, where an audited iteration saw it."""
    first = run.iterations.first()
    if first is None:
        return None
    return run.ops.first_nonfinite(first.step, before=run.iterations.episode_end(first))


_OP_KIND_OF_CHECK = {threshold.check: kind for kind, threshold in thresholds.OP_CHECKS.items()}
_FLOAT8_CHECKS = frozenset(t.check for t in float8_thresholds.FLOAT8_CHECKS)


def float8_cast(run: RunTrace, check: str) -> CastSeen | None:
    """The float8 cast a float8 finding leads with: the first it fired on."""
    named = run.float8.named(check)
    return named[0] if named else None


def origin_lines(run: RunTrace, check: str, step_offset: int) -> list[str]:
    first = run.iterations.first()
    at = run.iterations.coordinates
    lines: list[str] = []
    if check == thresholds.NAN_ORIGIN.check and first is not None:
        lines.append(origin_text(first, step_offset, at))
        lines.extend(f"refined: {origin_text(o, step_offset, at)}" for o in run.iterations.refinements(first)[:3])
        operation = origin_operation(run)
        if operation is not None:
            lines.append(f"operation: {op_text(operation, step_offset)}")
            lines.append(f"fix: {operation.fix}")
    elif check == thresholds.HEADROOM_FORECAST.check:
        lines.extend(forecast_text(f, step_offset) for f in run.headroom.forecasts()[:NAMED_PER_FINDING])
    elif check == float8_thresholds.FLOAT8_SENSITIVE_LAYER.check:
        lines.extend(layer_text(run.float8, seen, step_offset) for seen in run.float8.named(check))
    elif check in _FLOAT8_CHECKS:
        named = run.float8.named(check)
        lines.extend(cast_text(seen, step_offset) for seen in named[:NAMED_PER_FINDING])
        trend = trend_text(run.float8, named[0], step_offset) if named else None
        if trend is not None:
            lines.append(trend)
    elif check == thresholds.SHADOW_PRECISION.check:
        lines.extend(shadow_text(seen, step_offset) for seen in run.shadow.costly()[:NAMED_PER_FINDING])
    elif check in _OP_KIND_OF_CHECK:
        for seen in run.ops.of_kind(_OP_KIND_OF_CHECK[check])[:NAMED_PER_FINDING]:
            lines.append(op_text(seen, step_offset))
    elif check == thresholds.SCALER_SKIPPED.check:
        skipped, iterations, scale_first, scale_last = run.iterations.skipped()
        where = f"; the first overflow: {origin_text(first, step_offset, at)}" if first is not None else ""
        lines.append(
            f"skipped {skipped} of {iterations} iterations; scale {scale_first:g} at the first skip, "
            f"{scale_last:g} at the last{where}"
        )
    elif check == thresholds.NO_OPTIMIZER_STEPS.check:
        lines.append(f"{run.iterations.backward_without_steps()} backward passes, 0 optimizer steps, 0 skipped")
    elif check == thresholds.LR_JUMP.check and first is not None:
        lines.append(f"then: {origin_text(first, step_offset, at)}")
    elif check == thresholds.REPLICA_DIVERGENCE.check and run.iterations.divergence:
        lines.append(divergence_text(run.iterations.divergence_steps(), step_offset))
    elif check == thresholds.GRADS_ZEROED.check:
        zeroed = run.iterations.zeroed_steps()
        steps = ", ".join(str(z.step + step_offset) for z in zeroed[:10]) + (", ..." if len(zeroed) > 10 else "")
        ranks = ", ".join(str(r) for r in sorted(set().union(*(z.ranks for z in zeroed)))) or "?"
        lines.append(f"{len(zeroed)} iteration(s) (steps {steps}); units {zeroed[0].units}; ranks {ranks}")
    return lines


def no_fp32_master(run: RunTrace, finding: Finding) -> bool:
    """Whether every unstepped parameter named is so because its main weight is low precision."""
    if finding.threshold.check != "unstepped_weights":
        return False
    named = run.attribution.worst(semconv.DIAGNOSTIC_UNSTEPPED, 1000, first=finding.first_step)
    return bool(named) and all(n.cause == semconv.UNSTEPPED_LOW_PRECISION_MASTER for n, _ in named)


NO_FP32_MASTER_FINDING = "no fp32 master weights: updates below the main dtype's resolution round away"
NO_FP32_MASTER_ADVICE = (
    "the parameters named get grads, and their bfloat16/float16 main weights do not change: an update smaller than "
    "half the main dtype's spacing at the weight's magnitude (2^-8 of it in bfloat16) is lost at every step. Keep "
    "fp32 main weights (fully_shard: MixedPrecisionPolicy(main_params_dtype=torch.float32); torch FSDP2: fp32 "
    "parameters with MixedPrecisionPolicy(param_dtype=torch.bfloat16)) instead of model.bfloat16() on the optimizer's "
    "parameters."
)


def advice_for(run: RunTrace, finding: Finding) -> str:
    if finding.threshold.check in _FLOAT8_CHECKS and (seen := float8_cast(run, finding.threshold.check)) is not None:
        return fix(finding.threshold, seen)
    if finding.threshold.check in _OP_KIND_OF_CHECK:
        return run.ops.of_kind(_OP_KIND_OF_CHECK[finding.threshold.check])[0].fix
    first = run.iterations.first()
    if finding.threshold.check == thresholds.NAN_ORIGIN.check and first is not None:
        return advice(first)
    if no_fp32_master(run, finding):
        return NO_FP32_MASTER_ADVICE
    return finding.threshold.advice


def finding_text(run: RunTrace, finding: Finding) -> str:
    if finding.threshold.check == float8_thresholds.FLOAT8_SENSITIVE_LAYER.check:
        layers = ", ".join(f"{s.module} ({s.position})" for s in run.float8.named(finding.threshold.check))
        return f"{finding.threshold.finding}: {layers}"
    if finding.threshold.check in _FLOAT8_CHECKS and (seen := float8_cast(run, finding.threshold.check)) is not None:
        return f"{finding.threshold.finding}: {seen.module}'s {seen.role.replace('_', ' ')}"
    if finding.threshold.check in _OP_KIND_OF_CHECK:
        return f"{finding.threshold.finding}: {place(run.ops.of_kind(_OP_KIND_OF_CHECK[finding.threshold.check])[0])}"
    first = run.iterations.first()
    if finding.threshold.check == thresholds.NAN_ORIGIN.check and first is not None:
        operation = origin_operation(run)
        at = f", at {place(operation)}" if operation is not None else ""
        return f"NaN/Inf began in {_stage_phrase(first)}{at}"
    jump = run.iterations.lr_jump_before(first) if first is not None else None
    if finding.threshold.check == thresholds.LR_JUMP.check and jump is not None and first is not None:
        return (
            f"the learning rate jumped x{jump.after / jump.before:.3g} ({jump.before:g} to {jump.after:g}, param "
            f"group {jump.group}) at step {jump.step}, then NaN/Inf began in {_stage_phrase(first)} at step "
            f"{first.step}"
        )
    if no_fp32_master(run, finding):
        return NO_FP32_MASTER_FINDING
    return finding.threshold.finding


def _stage_phrase(origin: OriginSeen) -> str:
    return origin_text(origin).split(" began in ", 1)[1].split(" at step ", 1)[0]


def all_findings(run: RunTrace, lines: list[RangeLine]) -> list[Finding]:
    findings: dict[str, Finding] = {}
    for finding in iteration_findings(run):
        findings.setdefault(finding.threshold.check, finding)
    for line in lines:
        for finding in line.findings:
            findings.setdefault(finding.threshold.check, finding)
    if any(no_fp32_master(run, f) for f in findings.values()):
        # The optimizer's own updates lost in bfloat16/float16 main weights and state are what that
        # finding names (with its fix); the audit's operations inside the optimizer say it again.
        for kind, threshold in thresholds.OP_CHECKS.items():
            seen = run.ops.of_kind(kind)
            if seen and all(s.phase == "optimizer" for s in seen):
                findings.pop(threshold.check, None)
    zeroed = {z.step for z in run.iterations.zeroed_steps()}
    grad_zero = findings.get("grad_zero")
    if grad_zero is not None and grad_zero.first_step in zeroed:
        # Zero grads at the step are what the zeroing left: its finding names the cause, this
        # one's advice (a detached loss, frozen parameters) would lead away from it.
        del findings["grad_zero"]
    return ordered(findings.values())


def ordered(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: thresholds.precedence(f.threshold, f.first_step))


def finding_details(run: RunTrace, finding: Finding, step_offset: int = 0) -> list[str]:
    """The lines under a finding: where it began and what it names (the text report indents them)."""
    check = finding.threshold.check
    return [
        *origin_lines(run, check, step_offset),
        *details(run.attribution, check, finding.first_step, NAMED_PER_FINDING, step_offset),
    ]
