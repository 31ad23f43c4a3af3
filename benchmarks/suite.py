"""The benchmark suite: every case, one table of ratios measured side by side, the raw figures as JSON.

Cases (see each module's docstring for what is measured and against what):

====  ===============  =========================================================================
 1    ``floor``        adapter work vs the flat-copy floor, few large tensors (``adapter_cost``)
 2    ``step``         adapted vs bare step, 2000 x 256; adapter vs a per-tensor cast loop
 3    ``scaling``      adapter cost per parameter, 10 to 10,000 tensors
 4    ``attachments``  nothing cast: the adapter (telemetry off) vs none; ``fully_shard`` hooks
 5    ``telemetry``    telemetry on, diagnostics every step (whole-model, attribution) vs off
 6    ``end_to_end``   ours vs torch FSDP2 on the demo transformer, 2 ranks (``end_to_end``)
====  ===============  =========================================================================

Usage::

    python -m benchmarks                       # every case; make bench
    python -m benchmarks --case 2 --case 6     # some cases (number or name)
    python -m benchmarks --quick               # small sizes: a smoke run, not figures to quote
    python -m benchmarks --device cuda --case 1 --json FILE   # scripts/gpu_check.sh

The JSON goes to ``--json`` or ``benchmarks/results/suite-DEVICE.json`` (``DEVICE``: the GPU's
name, or the CPU's architecture and core count), holding every case's rows and raw samples, the
machine, torch's version and the timer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import adapter_cost, end_to_end, hsdp, telemetry_cost
from .common import CaseResult, Row, device_name, device_slug

__all__ = ["CASES", "main", "run_cases", "table"]

CASES: dict[str, tuple[str, Callable[[str, bool], CaseResult]]] = {
    "1": ("floor", adapter_cost.floor),
    "2": ("step", adapter_cost.step),
    "3": ("scaling", adapter_cost.scaling),
    "4": ("attachments", adapter_cost.attachments),
    "5": ("telemetry", telemetry_cost.run),
    "6": ("end_to_end", end_to_end.run),
    "7": ("hsdp", hsdp.run),
}
RESULTS = Path(__file__).resolve().parent / "results"


def _case_key(value: str) -> str:
    for key, (name, _) in CASES.items():
        if value in (key, name):
            return key
    raise argparse.ArgumentTypeError(
        f"unknown case {value!r}; expected one of {', '.join(f'{k} ({n})' for k, (n, _) in CASES.items())}"
    )


def run_cases(keys: list[str], device: str, quick: bool) -> dict[str, CaseResult]:
    """Runs the cases in order, printing each one's rows as it finishes."""
    results = {}
    for key in keys:
        name, fn = CASES[key]
        started = time.perf_counter()
        print(f"== case {key} ({name}) ...", flush=True)
        results[key] = result = fn(device, quick)
        print(table(result.rows), f"   ({time.perf_counter() - started:.0f} s)", sep="\n", flush=True)
    return results


def _value(row: Row) -> str:
    if row.unit == "x":
        return f"{row.value:.3f}x"
    if row.unit == "share":
        return f"{row.value:.0%}"
    return f"{row.value:.2f} {row.unit}"


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table: case, measure, value, target, met, note."""
    lines = ["| case | measure | value | target | met | note |", "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        met = "" if row.met is None else ("yes" if row.met else "**no**")
        lines.append(f"| {row.case} | {row.measure} | {_value(row)} | {row.target or '-'} | {met} | {row.note} |")
    return "\n".join(lines)


def document(results: dict[str, CaseResult], device: str, quick: bool) -> dict[str, Any]:
    return {
        "benchmark": "suite",
        "device": device_name(device),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "timer": "cuda_events" if device == "cuda" else "perf_counter",
        "quick": quick,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cases": {f"{key} {CASES[key][0]}": result.as_json() for key, result in results.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--case", action="append", type=_case_key, help="a case by number or name (repeatable; default: all)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: CUDA-event timing on GPU 0")
    parser.add_argument("--quick", action="store_true", help="small sizes and few rounds (a smoke run)")
    parser.add_argument(
        "--json", default=None, help="where to write the figures (default: benchmarks/results/suite-DEVICE.json)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("python -m benchmarks: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    keys = sorted(set(args.case or CASES), key=int)
    results = run_cases(keys, args.device, args.quick)
    print(
        f"\nfsdp_patch benchmark suite on {device_name(args.device)}, torch {torch.__version__}"
        f"{' (quick sizes)' if args.quick else ''}:\n"
    )
    print(table([row for result in results.values() for row in result.rows]))
    path = (
        Path(args.json)
        if args.json
        else RESULTS / f"suite-{device_slug(args.device)}{'-quick' if args.quick else ''}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document(results, args.device, args.quick), indent=1) + "\n", encoding="utf-8")
    print(f"\nwrote {path}")
    return 0
