"""What the float8 cast watch costs: a diagnosed step with and without it, and at the default interval.

A stack of torchao ``Float8Linear`` layers (tensorwise scaling, gathered in float8 by ``fully_shard``'s
float8 compute copy; fp8 matmuls emulated on a CPU, real on a GPU) on one rank, four models built
alike, a step each in rotating order (:func:`~benchmarks.common.paired`):

- ``off``: the adapter alone (``FSDP_PATCH_TELEMETRY`` unset);
- ``on``: telemetry at its defaults, measured past the dense start of the schedule: undiagnosed
  steps, where the watch adds no hook;
- ``diagnosed``: every step diagnosed (``FSDP_PATCH_PRECISION_EVERY=1``), the watch measuring every
  float8 module's input, weight and grad output casts;
- ``diagnosed_no_watch``: the same with this model's watch turned off: what the other diagnostics
  cost.

Reported: ``on / off`` (the cost on the steps the default schedule leaves undiagnosed), the watch's
own time on a diagnosed step (``diagnosed - diagnosed_no_watch``, medians) and as a share of an
``off`` step, and the cost at the default interval, that time spread over the 100 steps of the
interval: ``1 + watch / (100 * off)``.

Usage::

    python -m benchmarks.float8_watch_cost [--layers 4] [--width 256] [--rounds 20] [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from .common import (
    Clock,
    adapt_in_environment,
    median,
    paired,
    paired_ratio,
    process_group,
    training_steps,
    write_results,
)

SETTINGS: dict[str, dict[str, str]] = {
    "off": {},
    "on": {"FSDP_PATCH_TELEMETRY": "1"},
    "diagnosed": {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "1"},
    "diagnosed_no_watch": {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "1"},
}
# Past the dense start of the default schedule (steps 1-3, 5, 10, 20, 50) and short of step 100.
WARMUP_STEPS = 52
MAX_ROUNDS = 100 - WARMUP_STEPS - 2
DEFAULT_INTERVAL = 100
BATCH = 64


def _built(setting: str, layers: int, width: int, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fsdp_patch import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
    model = model.to(device=device, dtype=torch.bfloat16)
    native = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=not native, enable_fsdp_float8_all_gather=True))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    adapt_in_environment(optimizer, SETTINGS[setting])
    if setting == "diagnosed_no_watch":
        _watch_of(model).on = False
    return model, optimizer


def _watch_of(model: nn.Module) -> Any:
    """The float8 watch of the optimizer adapted over ``model``'s parameters."""
    from fsdp_patch.telemetry.instrumentation.float8_watch import Float8Watch

    first = next(model.parameters())
    found = [o for o in gc.get_objects() if isinstance(o, Float8Watch) and o._params and o._params[0] is first]
    if len(found) != 1:
        raise RuntimeError(f"expected one float8 watch over the model, found {len(found)}")
    return found[0]


def bench(layers: int, width: int, rounds: int, json_path: str | None, device_kind: str) -> dict[str, Any]:
    if rounds > MAX_ROUNDS:
        raise SystemExit(
            f"--rounds {rounds}: at most {MAX_ROUNDS}, so the `on` model's measured steps stay undiagnosed"
        )
    # The trace files where the run can write them, and no summary at exit: neither is per step.
    quiet = {"FSDP_PATCH_TRACE_DIR": tempfile.mkdtemp(prefix="float8-watch-traces-"), "FSDP_PATCH_SUMMARY": "none"}
    with process_group(device_kind) as device, mock.patch.dict(os.environ, quiet):
        clock = Clock(device)
        built = {setting: _built(setting, layers, width, device) for setting in SETTINGS}
        generator = torch.Generator().manual_seed(1)
        batches = [torch.randn(BATCH, width, generator=generator).to(device, torch.bfloat16) for _ in range(8)]
        step = training_steps(built, batches, clock, lambda model, x: F.mse_loss(model(x).float(), x.float()))

        for setting in SETTINGS:
            for _ in range(WARMUP_STEPS):
                step(setting)
        times = paired({s: (lambda s=s: step(s)) for s in SETTINGS}, rounds=rounds, warmup=0)
        import fsdp_patch.telemetry as telemetry

        telemetry.shutdown()
        return _report(times, layers, width, rounds, json_path, device_kind)


def _report(
    times: dict[str, list[float]], layers: int, width: int, rounds: int, json_path: str | None, device_kind: str
) -> dict[str, Any]:
    medians = {s: median(t) for s, t in times.items()}
    watch_s = medians["diagnosed"] - medians["diagnosed_no_watch"]
    results: dict[str, Any] = {
        "layers": layers,
        "width": width,
        "float8_modules": layers,
        "rounds": rounds,
        **{f"step_s_{s}": v for s, v in medians.items()},
        "ratio_on_off": paired_ratio(times, "on", "off"),
        "ratio_diagnosed_off": paired_ratio(times, "diagnosed", "off"),
        "ratio_diagnosed_no_watch_off": paired_ratio(times, "diagnosed_no_watch", "off"),
        "watch_s_per_diagnosed_step": watch_s,
        "watch_share_of_step": watch_s / medians["off"],
        "ratio_default_interval": 1 + max(watch_s, 0.0) / (DEFAULT_INTERVAL * medians["off"]),
    }
    print(
        f"float8 watch, {layers} Float8Linear layers of width {width}, {device_kind}: on/off {results['ratio_on_off']:.3f} "
        f"(undiagnosed steps); a diagnosed step {results['ratio_diagnosed_off']:.3f}x off, "
        f"{results['ratio_diagnosed_no_watch_off']:.3f}x without the watch; the watch {watch_s * 1e3:.2f} ms a "
        f"diagnosed step ({results['watch_share_of_step']:.1%} of a step), {results['ratio_default_interval']:.4f}x "
        f"at the default interval ({DEFAULT_INTERVAL})"
    )
    if json_path:
        write_results(json_path, "float8_watch_cost", {"world_size": 1, **results})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.float8_watch_cost", description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20, help=f"paired measured steps (at most {MAX_ROUNDS})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", default=None, help="where to write the results")
    args = parser.parse_args(argv)
    if args.width % 16 or args.layers < 1 or args.rounds < 1:
        parser.error(
            f"--width {args.width}, --layers {args.layers}, --rounds {args.rounds}: expected a multiple of 16 "
            "(float8 matmuls need one) and at least 1 of each"
        )
    if args.rounds > MAX_ROUNDS:
        parser.error(
            f"--rounds {args.rounds}: at most {MAX_ROUNDS}, so the `on` model's measured steps stay undiagnosed"
        )
    bench(args.layers, args.width, args.rounds, args.json, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
