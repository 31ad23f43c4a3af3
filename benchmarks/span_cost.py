"""What a step's spans cost: recorded in plain Python against the SDK's own, paired.

The host-bound proxy of :mod:`benchmarks.host_cost` at its smallest size (case 5's structure at
width 16, no blocks: what an undiagnosed step costs beyond its checks is mostly its six spans and
its metrics), under ``fully_shard`` and torch FSDP2, three models of each built alike, a step each
in rotating order (:func:`~benchmarks.common.paired`):

- ``off``: the adapter alone;
- ``recorded``: telemetry at its defaults, its spans recorded in plain Python and handed to the
  SDK's processors whole (``telemetry/instrumentation/recorded_spans.py``);
- ``sdk``: the same with every span made by the SDK's ``Tracer.start_span``
  (``SpanMaker.record`` off during its steps).

Measured on undiagnosed steps only: the models are built anew every ``46`` rounds (past the dense
start of the diagnostics schedule, short of its step 100), ``--repeats`` times. Reported per
sharding: the time each telemetry setting adds to an ``off`` step and what recording saves a step
(medians of the paired per-round differences).

Usage::

    python -m benchmarks.span_cost [--repeats 8] [--layers 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from fsdp_patch.app.demo.model import lm_loss
from fsdp_patch.telemetry.instrumentation.recorded_spans import SpanMaker

from .common import Clock, paired, process_group, training_steps, write_results
from .host_cost import HOST_BOUND, KINDS, MAX_ROUNDS, WARMUP_STEPS, _built, quiet_telemetry

CONTENDERS = ("off", "recorded", "sdk")


def _with_sdk_spans(step: Callable[[str], float]) -> Callable[[str], float]:
    """``step`` with every span the SDK's own (as a tracer whose processors look at starting spans gets)."""

    def run(name: str) -> float:
        SpanMaker.record = False
        try:
            return step(name)
        finally:
            SpanMaker.record = True

    return run


def measure(kind: str, layers: int, repeats: int) -> dict[str, Any]:
    """``repeats`` sets of three fresh models, each measured for ``MAX_ROUNDS`` paired rounds."""
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    tensors = 0
    for _ in range(repeats):
        built = {name: _built(kind, layers, "off" if name == "off" else "on") for name in CONTENDERS}
        tensors = len(list(built["off"][0].parameters()))
        batches = [
            torch.randint(0, HOST_BOUND.model.vocab, (HOST_BOUND.batch, HOST_BOUND.model.seq + 1), generator=g)
            for g in (torch.Generator().manual_seed(i) for i in range(4))
        ]
        step = training_steps(built, batches, Clock("cpu"), lm_loss)
        sdk_step = _with_sdk_spans(step)
        steps = {"off": step, "recorded": step, "sdk": sdk_step}
        for name in CONTENDERS:
            for _ in range(WARMUP_STEPS):
                steps[name](name)
        got = paired({name: (lambda name=name: steps[name](name)) for name in CONTENDERS}, MAX_ROUNDS, warmup=0)
        for name in CONTENDERS:
            times[name] += got[name]
    return {
        "layers": layers,
        "tensors": tensors,
        "rounds": len(times["off"]),
        "step_s_off": statistics.median(times["off"]),
        "added_s_recorded": _added(times["recorded"], times["off"]),
        "added_s_sdk": _added(times["sdk"], times["off"]),
        "saved_s": _added(times["sdk"], times["recorded"]),
    }


def _added(these: list[float], those: list[float]) -> float:
    return statistics.median(a - b for a, b in zip(these, those, strict=True))


def run(layers: int, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"width": HOST_BOUND.model.dim, "repeats": repeats}
    with process_group("cpu"), quiet_telemetry():
        for kind in KINDS:
            got = out[kind] = measure(kind, layers, repeats)
            print(
                f"{kind:>11}, {got['tensors']} tensors, {got['rounds']} paired rounds: telemetry adds "
                f"{got['added_s_recorded'] * 1e6:.0f} us a step with recorded spans, {got['added_s_sdk'] * 1e6:.0f} us "
                f"with the SDK's; recording saves {got['saved_s'] * 1e6:.0f} us a step"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.span_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=8, help=f"sets of fresh models, {MAX_ROUNDS} rounds each")
    parser.add_argument("--layers", type=int, default=0, help="blocks of the model (0: the fixed part)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.layers < 0:
        parser.error(f"--repeats {args.repeats}, --layers {args.layers}: expected at least 1 repeat and 0 blocks")
    results = run(args.layers, args.repeats)
    if args.json:
        write_results(args.json, "span_cost", results, world_size=1, device="cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
