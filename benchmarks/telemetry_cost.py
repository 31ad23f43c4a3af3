"""Case 5: telemetry on (diagnostics off) and diagnostics every step, against telemetry off.

Folds in ``benchmarks.telemetry_overhead`` (a >= 20M-parameter transformer sharded by
``fully_shard``, AdamW, whole training steps, the four settings side by side on one model) and
``benchmarks.fsdp2_diagnostics`` (the same with torch FSDP2 sharding the model; CPU only). The
diagnostics run with the per-parameter attribution (the default) and without it
(``FSDP_PATCH_PRECISION_TOP_K=0``, the whole-model diagnostics alone), side by side.
"""

from __future__ import annotations

from . import fsdp2_diagnostics, telemetry_overhead
from .common import CaseResult, target_row

__all__ = ["run"]


def run(device: str, quick: bool) -> CaseResult:
    config = telemetry_overhead.SMALL if quick else telemetry_overhead.LARGE
    # The fully_shard model's rounds are cheap: with 30 of them the medians of the per-round ratios
    # spread by about 6% over runs on a 2-core machine (telemetry on / off 0.98-1.04), with 10 by
    # about 13% (0.96-1.09), wider than the targets' margins. FSDP2's model computes in bf16, slow
    # on CPUs without bf16 instructions: 10 rounds.
    steps, fsdp2_steps, tiny_steps = (4, 4, 60) if quick else (30, 10, 400)
    settings = ("off", "on", "diagnostics", "attribution")
    ours = telemetry_overhead.run(steps, tiny_steps, 1, config=config, settings=settings, device=device)
    large, tiny = ours["large"], ours["tiny"]
    ms = {setting: large[f"step_s_{setting}"] * 1e3 for setting in settings}
    size = f"{large['params'] / 1e6:.1f}M params, AdamW"
    rows = [
        target_row(
            "5 telemetry",
            "telemetry on (diagnostics off) / off, training step",
            large["ratio_on_off"],
            at_most=1.03,
            note=f"{size}: {ms['on']:.0f} vs {ms['off']:.0f} ms",
        ),
        target_row(
            "5 telemetry",
            "whole-model diagnostics every step (TOP_K=0) / telemetry off, training step",
            large["ratio_diagnostics_off"],
            note=f"{ms['diagnostics']:.0f} vs {ms['off']:.0f} ms",
        ),
        target_row(
            "5 telemetry",
            "diagnostics with attribution every step / telemetry off, training step",
            large["ratio_attribution_off"],
            at_most=1.15,
            note=f"{ms['attribution']:.0f} vs {ms['off']:.0f} ms",
        ),
        target_row(
            "5 telemetry",
            "diagnostics with attribution / whole-model diagnostics, training step",
            large["ratio_attribution_diagnostics"],
            at_most=1.05,
            note=f"{ms['attribution']:.0f} vs {ms['diagnostics']:.0f} ms",
        ),
        target_row(
            "5 telemetry",
            "fixed cost of a traced step (tiny model)",
            tiny["fixed_cost_s"] * 1e6,
            unit="us",
            note=f"{tiny['params']} params, SGD",
        ),
    ]
    raw = {"fully_shard": ours}
    if device == "cpu":
        fsdp2 = fsdp2_diagnostics.run(steps=fsdp2_steps, warmup=1, batch=4 if quick else 16, config=config)
        rows.append(
            target_row(
                "5 telemetry",
                "FSDP2 model: diagnostics with attribution every step / off, training step",
                fsdp2["step_ratio"],
                at_most=1.15,
                note=f"{fsdp2['params'] / 1e6:.1f}M params: {fsdp2['step_ms_attribution']:.0f} vs "
                f"{fsdp2['step_ms_off']:.0f} ms",
            )
        )
        rows.append(
            target_row(
                "5 telemetry",
                "FSDP2 model: attribution / whole-model diagnostics, training step",
                fsdp2["step_ratio_attribution_diagnostics"],
                at_most=1.05,
                note=f"{fsdp2['step_ms_attribution']:.0f} vs {fsdp2['step_ms_diagnostics']:.0f} ms "
                f"(whole-model / off {fsdp2['step_ratio_diagnostics']:.3f}x)",
            )
        )
        raw["fsdp2"] = fsdp2
    return CaseResult(rows, raw)
