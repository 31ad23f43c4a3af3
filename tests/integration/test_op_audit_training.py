"""The operation audit and the float32 shadow in training on 2 gloo ranks, under fully_shard and torch
FSDP2: training is bitwise the same with every iteration audited and shadowed as with both off; the audit runs on the
iterations its schedule names; its setting is checked like every other."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from fsdp_patch.telemetry import env, semconv

from benchmarks.bug_patterns.catalogue import CATALOGUE
from benchmarks.bug_patterns.run import quiet_warnings
from benchmarks.bug_patterns.training import KINDS, Context, environment, train_on_rank
from tests.integration.otel_training import reset_otel

WORLD = 2


class _Weights:
    """Wraps a catalogue plant: after the last step, this rank's shard of every weight, as bytes."""

    def __init__(self, plant: Any, steps: int) -> None:
        self.plant, self.steps = plant, steps

    def __getattr__(self, name: str) -> Any:
        return getattr(self.plant, name)

    def between_steps(self, ctx: Context) -> None:
        self.plant.between_steps(ctx)
        if ctx.step == self.steps:
            ctx.notes["weights"] = {
                name: (p.to_local() if hasattr(p, "to_local") else p).detach().float().numpy().tobytes().hex()
                for name, p in ctx.named.items()
            }


def audited_training(name: str, kind: str, trace_dir: str, audit_every: str) -> dict[str, Any]:
    quiet_warnings()
    reset_otel()
    pattern = CATALOGUE[name]
    try:
        with environment(
            {semconv.SETTING_PRECISION_AUDIT_EVERY: audit_every, semconv.SETTING_PRECISION_SHADOW_EVERY: audit_every}
        ):
            result = train_on_rank(
                kind, pattern.settings, _Weights(pattern.plant, pattern.settings.steps), trace_dir, 1
            )
    finally:
        gc.collect()
        reset_otel()
    return {"losses": result["losses"], "scales": result["scales"], "weights": result["notes"]["weights"]}


def _op_events(trace_dir: Path, name: str = semconv.EVENT_OP) -> list[int]:
    import json

    steps = []
    for path in sorted(trace_dir.glob("rank*.trace.json")):
        for event in json.loads(path.read_text(encoding="utf-8")).get("traceEvents", []):
            if event.get("name") == name:
                steps.append(event["args"][semconv.ATTR_STEP])
    return sorted(set(steps))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["moe_router_ties_bf16", "focal_loss_fp16", "bf16_ema"])
def test_training_is_bitwise_the_same_with_every_iteration_audited(
    dist_pool: Any, tmp_path: Path, name: str, kind: str
) -> None:
    """A router (forward), a focal loss whose NaN a GradScaler skips (loss, escalation) and an EMA
    (between steps): losses, scales and every rank's weights equal, byte for byte."""
    audited = dist_pool(WORLD).run(audited_training, name, kind, str(tmp_path / "on"), "1")
    plain = dist_pool(WORLD).run(audited_training, name, kind, str(tmp_path / "off"), "0")
    for rank, (on, off) in enumerate(zip(audited, plain, strict=True)):
        assert on["losses"] == off["losses"], f"{name}, {kind}, rank {rank}: losses {on['losses']} vs {off['losses']}"
        assert on["scales"] == off["scales"], f"{name}, {kind}, rank {rank}: scales {on['scales']} vs {off['scales']}"
        differ = [n for n in on["weights"] if on["weights"][n] != off["weights"][n]]
        assert not differ, f"{name}, {kind}, rank {rank}: weights differ audited and not: {differ}"
    got = (bool(_op_events(tmp_path / "on")), _op_events(tmp_path / "off"))
    assert got == (True, []), f"{name}, {kind}: audited steps with findings (on, off): {got}"
    got_shadowed = (
        bool(_op_events(tmp_path / "on", semconv.EVENT_SHADOW)),
        _op_events(tmp_path / "off", semconv.EVENT_SHADOW),
    )
    want_shadowed = (True, [])
    assert got_shadowed == want_shadowed, f"{name}, {kind}: shadowed steps (on, off): {got_shadowed}"


def test_the_schedule_audits_the_second_iteration_and_every_nth() -> None:
    """With the audit every 4 iterations (``FSDP_PATCH_PRECISION_AUDIT_EVERY=4``), and an
    escalation of iterations 6 and 7."""
    from fsdp_patch.telemetry.instrumentation.op_audits import OperationAudits

    audits = OperationAudits(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), 4)
    got = [i for i in range(1, 13) if audits.due(i, escalated=i in (6, 7))]
    assert got == [2, 4, 6, 7, 8, 12], f"audited iterations {got}"
    off = OperationAudits(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), 0)
    assert [i for i in range(1, 13) if off.due(i, escalated=True)] == []


@pytest.mark.parametrize("value", ["-1", "often", "1.5"])
def test_a_malformed_audit_setting_is_refused_naming_it(value: str) -> None:
    with pytest.raises(ValueError, match=semconv.SETTING_PRECISION_AUDIT_EVERY) as raised:
        env.precision_audit_every({semconv.SETTING_PRECISION_AUDIT_EVERY: value})
    assert "non-negative integer" in str(raised.value), str(raised.value)
    assert env.precision_audit_every({}) == env.DEFAULT_PRECISION_AUDIT_EVERY == 1000


def test_the_shadow_runs_on_the_second_iteration_and_every_nth_and_never_because_of_escalation() -> None:
    """Every rank must shadow the same iterations (the shadow gathers weights): no rank-local reason
    (an escalation) decides it."""
    from fsdp_patch.telemetry.instrumentation.module_shadows import ModuleShadows

    shadows = ModuleShadows(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), 4)
    got = [i for i in range(1, 13) if shadows.due(i)]
    assert got == [2, 4, 8, 12], f"shadowed iterations {got}"
    off = ModuleShadows(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), 0)
    assert [i for i in range(1, 13) if off.due(i)] == [], "0 turns the shadow off"


@pytest.mark.parametrize("value", ["-1", "often", "1.5"])
def test_a_malformed_shadow_setting_is_refused_naming_it(value: str) -> None:
    with pytest.raises(ValueError, match=semconv.SETTING_PRECISION_SHADOW_EVERY) as raised:
        env.precision_shadow_every({semconv.SETTING_PRECISION_SHADOW_EVERY: value})
    assert "non-negative integer" in str(raised.value), str(raised.value)
    assert env.precision_shadow_every({}) == env.DEFAULT_PRECISION_SHADOW_EVERY == 1000
