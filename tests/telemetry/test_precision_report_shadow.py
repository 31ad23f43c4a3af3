"""The precision report on the float32 shadow's events: the module whose float32 recompute differs
most is named and ranked per step over the ranks; a shadow within rounding is no finding.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_patch.telemetry.offline import precision_report
from report_traces import HEALTHY, rank_tracer


def _write_shadowed(directory: Path, modules: dict[int, list[tuple[str, float, float]]]) -> None:
    """Steps 1-4 on 2 ranks, diagnosed; ``fsdp.precision.shadow`` events as the observer writes them:
    per step, ``(module, error, weight_error)`` (rank 1's errors half rank 0's)."""
    import torch
    from fsdp_patch.telemetry import semconv
    from fsdp_patch.telemetry.diagnostics.module_shadow import ModuleCost
    from fsdp_patch.telemetry.instrumentation.module_shadows import event_attributes

    for rank in range(2):
        provider, tracer = rank_tracer(directory, rank, 2)
        for step in range(1, 5):
            with tracer.start_as_current_span(semconv.SPAN_STEP, attributes={semconv.ATTR_STEP: step}) as span:
                with tracer.start_as_current_span(semconv.SPAN_PRECISION) as child:
                    child.set_attributes(HEALTHY)
                for order, (module, error, weight_error) in enumerate(modules.get(step, [])):
                    cost = ModuleCost(
                        module,
                        "Linear",
                        torch.bfloat16,
                        error / (rank + 1),
                        weight_error / (rank + 1),
                        2**-8,
                        1e-3,
                        0.0,
                        0,
                        1,
                        64,
                    )
                    span.add_event(semconv.EVENT_SHADOW, event_attributes(cost, step, rank, order))
        provider.shutdown()


def test_the_report_names_the_module_whose_float32_shadow_differs_and_ranks_the_last_shadow(tmp_path: Path) -> None:
    _write_shadowed(
        tmp_path,
        {
            2: [("blocks.0.fc1", 0.004, 0.0), ("blocks.1.gain", 0.004, 0.004)],
            4: [("blocks.1.gain", 0.9, 0.85), ("blocks.0.fc1", 0.004, 0.0)],
        },
    )
    text = precision_report.report(str(tmp_path))
    want_line = "float32 shadow, step 4: where low precision costs most: blocks.1.gain (Linear, bfloat16) 230x rounding"
    assert want_line in text, text
    assert "overall: warning: a module whose output is far from its float32 recompute" in text, text
    assert "module 'blocks.1.gain' (Linear, bfloat16) at step 4: differs from float32 by 0.9 (230x" in text, text
    assert "0.85 of it from its compute weights" in text, text
    data = precision_report.report_json(str(tmp_path))
    findings = [(f["check"], f["first_step"]) for f in data["findings"]]
    assert findings == [("shadow_precision", 4)], f"want the shadow's finding at step 4 alone, got {findings}"
    got = [(s["step"], s["module"], s["costly"], s["ranks"]) for s in data["shadow"]]
    want = [
        (2, "blocks.0.fc1", False, [0, 1]),
        (2, "blocks.1.gain", False, [0, 1]),
        (4, "blocks.1.gain", True, [0, 1]),
        (4, "blocks.0.fc1", False, [0, 1]),
    ]
    assert got == want, f"per step, costliest first, the worst rank's values and every rank: want {want}, got {got}"
    assert data["shadow"][2]["error"] == 0.9, f"the worst rank's error: {data['shadow'][2]}"


def test_a_shadow_within_rounding_is_no_finding(tmp_path: Path) -> None:
    _write_shadowed(tmp_path, {2: [("blocks.0.fc1", 0.02, 0.0)]})  # 5x bf16 rounding: not 8x
    data = precision_report.report_json(str(tmp_path))
    assert data["findings"] == [], f"want no finding, got {data['findings']}"
    assert "float32 shadow, step 2" in precision_report.report(str(tmp_path))
