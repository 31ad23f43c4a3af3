"""Telemetry's host cost per training step, by the number of parameter tensors.

A GPU runs a step of a model of the size people train in less time than its host takes to issue
it when the model is split into many small tensors, and then what telemetry costs is what its
Python and launches cost on the host. This benchmark measures that on a CPU: case 5's blocks at a
width whose kernels cost next to nothing (``HOST_BOUND``: dimension 16), with the number of blocks
set so that the model holds from under 10 to about 1000 parameter tensors. For each size and each
sharding (``fully_shard``, torch FSDP2), three models built alike train side by side, a step each
in rotating order (:func:`~benchmarks.common.paired`):

- ``off``: the adapter alone (``FSDP_PATCH_TELEMETRY`` unset);
- ``on``: telemetry at its defaults (trace files, the origin checks, the diagnostics at the default
  interval, which no measured step reaches: the steps measured are undiagnosed ones);
- ``diagnosed``: the same, every step diagnosed with the attribution (``FSDP_PATCH_PRECISION_EVERY=1``).

What it reports, per sharding: the ratio ``on / off`` at each size (the median of the per-round
ratios), the host time telemetry adds to an undiagnosed step (``on - off``, medians) fitted as a
fixed part plus a part per parameter tensor (least squares over the sizes), and ``diagnosed / off``.

Usage::

    python -m benchmarks.host_cost [--rounds 40] [--layers 0 1 6 24 80] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any
from unittest import mock

import torch
from fsdp_patch.app.demo.model import GPT, GPTConfig, lm_loss

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

KINDS = ("fully_shard", "fsdp2")
SETTINGS: dict[str, dict[str, str]] = {
    "off": {},
    "on": {"FSDP_PATCH_TELEMETRY": "1"},
    "diagnosed": {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "1"},
}
DEFAULT_LAYERS = (0, 1, 6, 24, 80)  # 6, 18, 78, 294 and 966 parameter tensors
# Past the dense start of the default schedule (steps 1-3, 5, 10, 20, 50 diagnosed) and short of
# step 100: every measured step of the ``on`` model is undiagnosed.
WARMUP_STEPS = 52
MAX_ROUNDS = 100 - WARMUP_STEPS - 2


def _config(layers: int) -> GPTConfig:
    return GPTConfig(vocab=64, dim=16, heads=8, layers=layers, seq=8)


def _built(kind: str, layers: int, setting: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(_config(layers))
    if kind == "fully_shard":
        from fsdp_patch.app.demo.model import shard

        from fsdp_patch import MixedPrecisionPolicy

        shard(model, mp_policy=MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16))
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    adapt_in_environment(optimizer, SETTINGS[setting])
    return model, optimizer


def _fit(counts: list[int], added: list[float]) -> tuple[float, float]:
    """Least squares ``added = fixed + per_tensor * count``: ``(fixed, per_tensor)``."""
    if len(counts) < 2:
        return (added[0] if added else 0.0), 0.0
    slope, intercept = statistics.linear_regression(counts, added)
    return intercept, slope


def measure(kind: str, layers: int, rounds: int) -> dict[str, Any]:
    built = {setting: _built(kind, layers, setting) for setting in SETTINGS}
    tensors = len(list(built["off"][0].parameters()))
    batches = [torch.randint(0, 64, (8, 9), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    step = training_steps(built, batches, Clock("cpu"), lm_loss)
    for name in built:
        for _ in range(WARMUP_STEPS):
            step(name)
    times = paired({name: (lambda name=name: step(name)) for name in built}, rounds=rounds, warmup=0)
    off, on = median(times["off"]), median(times["on"])
    return {
        "layers": layers,
        "tensors": tensors,
        "step_s_off": off,
        "step_s_on": on,
        "step_s_diagnosed": median(times["diagnosed"]),
        "ratio_on_off": paired_ratio(times, "on", "off"),
        "ratio_diagnosed_off": paired_ratio(times, "diagnosed", "off"),
        "added_s": statistics.median(a - b for a, b in zip(times["on"], times["off"], strict=True)),
    }


def run(layers: tuple[int, ...], rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": rounds, "width": _config(0).dim}
    traces = tempfile.mkdtemp(prefix="host-cost-traces-")
    # The trace files where the run can write them, and no summary at exit: neither is per step.
    quiet = {"FSDP_PATCH_TRACE_DIR": traces, "FSDP_PATCH_SUMMARY": "none"}
    with process_group("cpu"), mock.patch.dict(os.environ, quiet):
        for kind in KINDS:
            sizes = [measure(kind, n, rounds) for n in layers]
            fixed, per_tensor = _fit([s["tensors"] for s in sizes], [s["added_s"] for s in sizes])
            out[kind] = {"sizes": sizes, "added_fixed_s": fixed, "added_per_tensor_s": per_tensor}
            for s in sizes:
                print(
                    f"{kind:>11} {s['tensors']:>5} tensors: on/off {s['ratio_on_off']:.3f}, "
                    f"diagnosed/off {s['ratio_diagnosed_off']:.3f}, added {s['added_s'] * 1e6:.0f} us "
                    f"(off {s['step_s_off'] * 1e3:.2f} ms)",
                    flush=True,
                )
            print(f"{kind:>11} added per undiagnosed step: {fixed * 1e6:.0f} us + {per_tensor * 1e6:.2f} us per tensor")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_cost", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=40, help=f"measured steps per model and size (at most {MAX_ROUNDS})"
    )
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS), help="blocks per model size")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= MAX_ROUNDS:
        parser.error(f"--rounds {args.rounds}: expected 1 to {MAX_ROUNDS} (the measured steps stay undiagnosed)")
    if any(n < 0 for n in args.layers):
        parser.error(f"--layers {args.layers}: expected block counts >= 0")
    results = run(tuple(args.layers), args.rounds)
    if args.json:
        write_results(args.json, "host_cost", results, world_size=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
