"""Cases 1 to 4: the optimizer adapter's own cost, against floors measured side by side.

1. ``floor``: few large tensors (6 x 4M elements): an adapted step of an optimizer whose update
   does nothing (plan, cast, restore, refresh) against the two flat ``copy_`` it cannot avoid
   (main grads into an fp32 buffer, main weights into the compute copy). Also: the cast buffer
   freed after every step (``keep_cast_buffers(opt, False)``) against kept.
2. ``step``: 2000 x 256 elements, SGD foreach: the adapted step (bf16 main grads) against the
   bare step (fp32 main grads, no adapter); and the adapter's work against a per-tensor loop
   (a cast, restore and refresh per tensor, as a hand-written adapter would do).
3. ``scaling``: 10 to 10,000 tensors at 2.56M elements in all: (adapter - floor) per parameter,
   and the slope of a least-squares line through it.
4. ``attachments``: fp32 everywhere, nothing cast: the adapter's attachment (the wrapt wrapper,
   telemetry off) against no adapter; and ``fully_shard``'s own forward/backward hooks per unit
   (``benchmarks.hook_overhead``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fsdp_patch import keep_cast_buffers
from fsdp_patch.adapter import adapt_optimizer

from .common import CaseResult, Clock, median, paired, paired_ratio, process_group, target_row
from .flat_model import NoStep, PerTensorCast, flat_copy_floor, many_params

__all__ = ["attachments", "floor", "scaling", "step"]


def _adapt(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    adapt_optimizer(optimizer, precision_aware=False)  # telemetry off: a NullObserver
    return optimizer


def _floor_fn(model: torch.nn.Module) -> Callable[[], None]:
    target, grads, compute, main = flat_copy_floor(model)

    def copies() -> None:
        with torch.no_grad():
            target.copy_(grads)
            compute.copy_(main)

    return copies


def _timed(clock: Clock, fn: Callable[[], Any]) -> Callable[[], float]:
    return lambda: clock.time(fn)


def floor(device: str, quick: bool) -> CaseResult:
    count, numel, rounds = (6, 1 << 18, 15) if quick else (6, 1 << 22, 31)
    with process_group(device) as dev:
        clock = Clock(dev)
        model = many_params(count, numel, dev)
        kept, freed = _adapt(NoStep(model.parameters())), _adapt(NoStep(model.parameters()))
        keep_cast_buffers(kept, True)
        keep_cast_buffers(freed, False)
        times = paired(
            {
                "adapter": _timed(clock, kept.step),
                "freed": _timed(clock, freed.step),
                "floor": _timed(clock, _floor_fn(model)),
            },
            rounds,
        )
    ratio = paired_ratio(times, "adapter", "floor")
    medians = {name: median(values) * 1e3 for name, values in times.items()}
    elements = f"{count} x {numel / 1e6:.2f}M elements"
    return CaseResult(
        [
            target_row(
                "1 floor",
                "adapter work / flat-copy floor",
                ratio,
                at_most=1.3,
                note=f"{elements}: {medians['adapter']:.1f} vs {medians['floor']:.1f} ms",
            ),
            target_row(
                "1 floor",
                "cast buffer freed per step / kept",
                paired_ratio(times, "freed", "adapter"),
                note=f"{medians['freed']:.1f} vs {medians['adapter']:.1f} ms",
            ),
        ],
        {"count": count, "numel": numel, "rounds": rounds, "ms": medians, "samples_s": times},
    )


def step(device: str, quick: bool) -> CaseResult:
    count, numel, rounds = (500, 256, 21) if quick else (2000, 256, 41)
    with process_group(device) as dev:
        clock = Clock(dev)
        adapted_model = many_params(count, numel, dev)
        bare_model = many_params(count, numel, dev, grads=torch.float32, variant=1)
        loop_model = many_params(count, numel, dev, variant=2)
        adapted = _adapt(torch.optim.SGD(adapted_model.parameters(), lr=1e-6, foreach=True))
        bare = torch.optim.SGD(bare_model.parameters(), lr=1e-6, foreach=True)
        adapter_only = _adapt(NoStep(adapted_model.parameters()))
        loop = PerTensorCast(loop_model, NoStep(loop_model.parameters()))
        times = paired(
            {
                "adapted": _timed(clock, adapted.step),
                "bare": _timed(clock, bare.step),
                "adapter_only": _timed(clock, adapter_only.step),
                "per_tensor": _timed(clock, loop.step),
            },
            rounds,
        )
    medians = {name: median(values) * 1e3 for name, values in times.items()}
    size = f"{count} x {numel}"
    return CaseResult(
        [
            target_row(
                "2 step",
                "adapted step / bare step (fp32 main grads)",
                paired_ratio(times, "adapted", "bare"),
                at_most=1.3,
                note=f"{size}, SGD foreach: {medians['adapted']:.2f} vs {medians['bare']:.2f} ms",
            ),
            target_row(
                "2 step",
                "per-tensor cast loop / adapter (work around the step)",
                paired_ratio(times, "per_tensor", "adapter_only"),
                at_least=10.0,
                note=f"{medians['per_tensor']:.2f} vs {medians['adapter_only']:.2f} ms",
            ),
        ],
        {"count": count, "numel": numel, "rounds": rounds, "ms": medians, "samples_s": times},
    )


def _slope(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares line through ``(n, seconds)``: (seconds per unit of n, intercept)."""
    xs, ys = [float(n) for n, _ in points], [s for _, s in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def scaling(device: str, quick: bool) -> CaseResult:
    total, counts, rounds = (256_000, (10, 100, 1000), 9) if quick else (2_560_000, (10, 100, 1000, 10_000), 15)
    per_count: dict[int, dict[str, float]] = {}
    with process_group(device) as dev:
        clock = Clock(dev)
        for count in counts:
            model = many_params(count, total // count, dev)
            adapted = _adapt(NoStep(model.parameters()))
            times = paired({"adapter": _timed(clock, adapted.step), "floor": _timed(clock, _floor_fn(model))}, rounds)
            adapter_s, floor_s = median(times["adapter"]), median(times["floor"])
            per_count[count] = {
                "adapter_ms": adapter_s * 1e3,
                "floor_ms": floor_s * 1e3,
                "per_param_us": (adapter_s - floor_s) / count * 1e6,
            }
            del model, adapted
    slope, intercept = _slope([(n, (f["adapter_ms"] - f["floor_ms"]) / 1e3) for n, f in per_count.items()])
    spread = ", ".join(f"{n}: {f['per_param_us']:.2f}" for n, f in per_count.items())
    return CaseResult(
        [
            target_row(
                "3 scaling",
                "adapter cost per parameter (slope)",
                slope * 1e6,
                at_most=3.0,
                unit="us",
                note=f"{counts[0]}-{counts[-1]} tensors, {total / 1e6:.2f}M elements; fixed {intercept * 1e6:.0f} us; "
                f"per count (us/param) {spread}",
            )
        ],
        {
            "total": total,
            "rounds": rounds,
            "by_count": per_count,
            "slope_us": slope * 1e6,
            "intercept_us": intercept * 1e6,
        },
    )


def attachments(device: str, quick: bool) -> CaseResult:
    from . import hook_overhead

    count, numel, rounds = (500, 256, 21) if quick else (2000, 256, 41)
    with process_group(device) as dev:
        clock = Clock(dev)
        model = many_params(count, numel, dev, compute=torch.float32)
        bare = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)
        adapted = _adapt(torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True))
        times = paired({"bare": _timed(clock, bare.step), "adapted": _timed(clock, adapted.step)}, rounds)
        units = hook_overhead.run(rounds=60 if quick else 300) if device == "cpu" else None
    medians = {name: median(values) * 1e3 for name, values in times.items()}
    rows = [
        target_row(
            "4 attachments",
            "adapter (telemetry off) / no adapter (fp32, nothing cast)",
            paired_ratio(times, "adapted", "bare"),
            note=f"{count} x {numel}, SGD foreach: {medians['adapted']:.2f} vs {medians['bare']:.2f} ms",
        ),
    ]
    if units is not None:
        rows.append(
            target_row(
                "4 attachments",
                "fully_shard fwd+bwd / unsharded (tiny units)",
                units["ratio"],
                note=f"{units['units']} units: {units['overhead_per_unit_us']:.0f} us per unit",
            )
        )
    return CaseResult(
        rows,
        {
            "count": count,
            "numel": numel,
            "rounds": rounds,
            "ms": medians,
            "samples_s": times,
            "fully_shard_hooks": units,
        },
    )
