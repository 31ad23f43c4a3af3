"""Telemetry's host cost per training step, by the number of parameter tensors, and on a model of
the size people train.

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

``--preset 1b`` is the same structure at the size people train, on one GPU: width 2048, 18 blocks,
a 32000-token vocabulary, about 1.04B parameters, bf16 compute, AdamW (``--device cuda``). There
each sharding's undiagnosed ``on`` and ``off`` steps are also traced once with ``torch.profiler``
and their CUDA synchronizations counted (``syncs_on``, ``syncs_off``): telemetry adds none.

``--clip MAX_NORM`` clips the grads before each step (``clip_grad_norm_``), as most training scripts
do: the step then takes the clip's path through the checks too.

Usage::

    python -m benchmarks.host_cost [--rounds 40] [--layers 0 1 6 24 80] [--clip 1.0] [--json out.json]
    python -m benchmarks.host_cost --device cuda --preset 1b --rounds 10 [--kinds fully_shard]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Shape:
    """The model's sizes (its block count is each size's ``--layers``), batch and compute dtype."""

    model: GPTConfig = GPTConfig(vocab=64, dim=16, heads=8, layers=0, seq=8)
    batch: int = 8
    compute_dtype: torch.dtype | None = None  # None: fully_shard's and FSDP2's defaults

    def config(self, layers: int) -> GPTConfig:
        return dataclasses.replace(self.model, layers=layers)


HOST_BOUND = Shape()
# About 1.04B parameters at 18 blocks (GPTConfig.approx_params), bf16 compute.
PRESETS: dict[str, tuple[Shape, tuple[int, ...]]] = {
    "host-bound": (HOST_BOUND, DEFAULT_LAYERS),
    "1b": (Shape(GPTConfig(vocab=32000, dim=2048, heads=16, layers=18, seq=512), 4, torch.bfloat16), (18,)),
}

# The CUDA runtime calls that make the host wait for the device.
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"})


def _built(
    kind: str, layers: int, setting: str, shape: Shape = HOST_BOUND, device: torch.device | str = "cpu"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(shape.config(layers))
    if kind == "fully_shard":
        from fsdp_patch.app.demo.model import shard

        from fsdp_patch import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16)
        if shape.compute_dtype is not None:
            policy = MixedPrecisionPolicy(param_dtype=shape.compute_dtype, main_grads_dtype=torch.float32)
        shard(model, mp_policy=policy)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy
        from torch.distributed.fsdp import fully_shard

        fsdp2_policy = FSDP2Policy(param_dtype=shape.compute_dtype)
        for block in model.blocks:
            fully_shard(block, mp_policy=fsdp2_policy)
        fully_shard(model, mp_policy=fsdp2_policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    adapt_in_environment(optimizer, SETTINGS[setting])
    return model, optimizer


def count_synchronizations(names: Iterable[str]) -> int:
    """How many of the profiled calls ``names`` make the host wait for a CUDA device."""
    return sum(1 for name in names if name in SYNC_CALLS)


def _synchronizations(step: Callable[[str], float], setting: str) -> int:
    """One step of ``setting`` under ``torch.profiler``: its CUDA synchronizations (the clock's
    read of its end event included, in every setting alike)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(setting)
    return count_synchronizations(event.name for event in prof.events())


def _fit(counts: list[int], added: list[float]) -> tuple[float, float]:
    """Least squares ``added = fixed + per_tensor * count``: ``(fixed, per_tensor)``."""
    if len(counts) < 2:
        return (added[0] if added else 0.0), 0.0
    slope, intercept = statistics.linear_regression(counts, added)
    return intercept, slope


def measure(
    kind: str, layers: int, rounds: int, shape: Shape = HOST_BOUND, device: str = "cpu", clip: float | None = None
) -> dict[str, Any]:
    built = {setting: _built(kind, layers, setting, shape, device) for setting in SETTINGS}
    tensors = len(list(built["off"][0].parameters()))
    params = sum(p.numel() for p in built["off"][0].parameters())
    batches = [
        torch.randint(
            0, shape.model.vocab, (shape.batch, shape.model.seq + 1), generator=torch.Generator().manual_seed(i)
        ).to(device)
        for i in range(4)
    ]
    step = training_steps(built, batches, Clock(device), lm_loss, clip)
    for name in built:
        for _ in range(WARMUP_STEPS):
            step(name)
    times = paired({name: (lambda name=name: step(name)) for name in built}, rounds=rounds, warmup=0)
    off, on = median(times["off"]), median(times["on"])
    result = {
        "layers": layers,
        "tensors": tensors,
        "params": params,
        "step_s_off": off,
        "step_s_on": on,
        "step_s_diagnosed": median(times["diagnosed"]),
        "ratio_on_off": paired_ratio(times, "on", "off"),
        "ratio_diagnosed_off": paired_ratio(times, "diagnosed", "off"),
        "added_s": statistics.median(a - b for a, b in zip(times["on"], times["off"], strict=True)),
    }
    if device == "cuda":
        result["syncs_off"] = _synchronizations(step, "off")
        result["syncs_on"] = _synchronizations(step, "on")
    return result


def _table(kind: str, sizes: list[dict[str, Any]]) -> None:
    """The sizes' figures as a Markdown table (what a GPU check's summary shows)."""
    print(f"\n| {kind} | parameters | step, off | on/off | diagnosed/off | added per step | CUDA syncs on / off |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in sizes:
        syncs = f"{s['syncs_on']} / {s['syncs_off']}" if "syncs_on" in s else "-"
        print(
            f"| {s['tensors']} tensors | {s['params']:,} | {s['step_s_off'] * 1e3:.2f} ms | {s['ratio_on_off']:.3f} "
            f"| {s['ratio_diagnosed_off']:.3f} | {s['added_s'] * 1e6:.0f} us | {syncs} |",
            flush=True,
        )
    print()


@contextlib.contextmanager
def quiet_telemetry() -> Iterator[None]:
    """The trace files in a temporary folder, and no summary at exit: neither is per step. The
    providers go before the folder does (they write into it until shut down)."""
    with tempfile.TemporaryDirectory(prefix="host-cost-traces-") as traces:
        with mock.patch.dict(os.environ, {"FSDP_PATCH_TRACE_DIR": traces, "FSDP_PATCH_SUMMARY": "none"}):
            try:
                yield
            finally:
                from fsdp_patch.telemetry.export import providers

                providers.uninstall()


def run(
    layers: tuple[int, ...],
    rounds: int,
    shape: Shape = HOST_BOUND,
    device: str = "cpu",
    kinds: tuple[str, ...] = KINDS,
    clip: float | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "rounds": rounds,
        "width": shape.model.dim,
        "compute_dtype": str(shape.compute_dtype or "default"),
        "clip": clip,
    }
    with process_group(device), quiet_telemetry():
        for kind in kinds:
            sizes = []
            for n in layers:
                sizes.append(measure(kind, n, rounds, shape, device, clip))
                if device == "cuda":
                    torch.cuda.empty_cache()  # three models of the size people train: one size at a time
            fixed, per_tensor = _fit([s["tensors"] for s in sizes], [s["added_s"] for s in sizes])
            out[kind] = {"sizes": sizes, "added_fixed_s": fixed, "added_per_tensor_s": per_tensor}
            _table(kind, sizes)
            if len(sizes) > 1:
                print(
                    f"{kind:>11} added per undiagnosed step: {fixed * 1e6:.0f} us + {per_tensor * 1e6:.2f} us per tensor"
                )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_cost", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=40, help=f"measured steps per model and size (at most {MAX_ROUNDS})"
    )
    parser.add_argument("--layers", type=int, nargs="+", help="blocks per model size (default: the preset's)")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="host-bound",
        help="the model's sizes: host-bound (width 16, the CPU sweep) or 1b (about 1.04B parameters, bf16)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="the shardings measured")
    parser.add_argument(
        "--clip",
        type=float,
        metavar="MAX_NORM",
        help="clip the grads to this total norm before each step (clip_grad_norm_; default: no clip)",
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= MAX_ROUNDS:
        parser.error(f"--rounds {args.rounds}: expected 1 to {MAX_ROUNDS} (the measured steps stay undiagnosed)")
    if args.clip is not None and not (math.isfinite(args.clip) and args.clip > 0):
        parser.error(f"--clip {args.clip}: expected a positive total norm")
    shape, preset_layers = PRESETS[args.preset]
    layers = tuple(args.layers) if args.layers else preset_layers
    if any(n < 0 for n in layers):
        parser.error(f"--layers {list(layers)}: expected block counts >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (leave --device out to measure on the CPU)")
    if args.preset == "1b" and args.device != "cuda":
        parser.error("--preset 1b: expected --device cuda (a 1B-parameter model's steps on a CPU take minutes)")
    results = run(layers, args.rounds, shape, args.device, tuple(args.kinds), args.clip)
    if args.json:
        write_results(args.json, "host_cost", results, world_size=1, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
