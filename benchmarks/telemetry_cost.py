"""Case 5: telemetry on (diagnostics off) and diagnostics every step, against telemetry off.

Folds in ``benchmarks.telemetry_overhead`` (a >= 20M-parameter transformer sharded by
``fully_shard``, AdamW, whole training steps, the three settings side by side on one model) and
``benchmarks.fsdp2_diagnostics`` (the same with torch FSDP2 sharding the model, diagnostics
every step against telemetry off; CPU only).
"""

from __future__ import annotations

from . import fsdp2_diagnostics, telemetry_overhead
from .common import CaseResult, target_row

__all__ = ["run"]


def run(device: str, quick: bool) -> CaseResult:
    config = telemetry_overhead.SMALL if quick else telemetry_overhead.LARGE
    steps, tiny_steps = (4, 60) if quick else (10, 400)
    ours = telemetry_overhead.run(steps, tiny_steps, 1, config=config, settings=("off", "on", "diagnostics"), device=device)
    large, tiny = ours["large"], ours["tiny"]
    ms = {setting: large[f"step_s_{setting}"] * 1e3 for setting in ("off", "on", "diagnostics")}
    size = f"{large['params'] / 1e6:.1f}M params, AdamW"
    rows = [
        target_row("5 telemetry", "telemetry on (diagnostics off) / off, training step", large["ratio_on_off"],
                   at_most=1.03, note=f"{size}: {ms['on']:.0f} vs {ms['off']:.0f} ms"),
        target_row("5 telemetry", "diagnostics every step / telemetry off, training step",
                   large["ratio_diagnostics_off"], at_most=1.15, note=f"{ms['diagnostics']:.0f} vs {ms['off']:.0f} ms"),
        target_row("5 telemetry", "fixed cost of a traced step (tiny model)", tiny["fixed_cost_s"] * 1e6, unit="us",
                   note=f"{tiny['params']} params, SGD"),
    ]
    raw = {"fully_shard": ours}
    if device == "cpu":
        fsdp2 = fsdp2_diagnostics.run(steps=steps, warmup=1, batch=4 if quick else 16, config=config)
        rows.append(target_row("5 telemetry", "FSDP2 model: diagnostics every step / off, training step",
                               fsdp2["step_ratio"], at_most=1.15,
                               note=f"{fsdp2['params'] / 1e6:.1f}M params: {fsdp2['step_ms_on']:.0f} vs {fsdp2['step_ms_off']:.0f} ms"))
        raw["fsdp2"] = fsdp2
    return CaseResult(rows, raw)
