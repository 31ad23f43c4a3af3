"""``python -m benchmarks.bug_patterns``: every pattern and control under both shardings, and what
the precision report says about each.

Each run spawns 2 gloo CPU ranks (``torch.multiprocessing``, file:// rendezvous in a temporary
directory) that train the pattern with telemetry on, writing the trace files into a temporary
directory; this process then reads ``report_json`` of that directory and judges it against the
catalogue (:func:`.catalogue.judge`). The table: pattern | sharding | verdict | what the report
named first (the lead finding, and the origin's stage and place) | cause named?

Usage::

    python -m benchmarks.bug_patterns                       # everything (about 15 minutes on 2 cores)
    python -m benchmarks.bug_patterns --pattern 6 --pattern loss_all_targets_ignored
    python -m benchmarks.bug_patterns --kind fully_shard --no-controls

The JSON goes to ``--json`` or ``benchmarks/results/bug-patterns-DEVICE.json``: the catalogue
(sources, plants, settings, expectations) and per run the pattern, sharding, diagnostic schedule,
the judgement, ``report_json`` without its per-range lines, and each rank's losses and scales.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..common import device_name, device_slug
from .catalogue import CATALOGUE, CONTROLS, PATTERNS, Judgement, Pattern, judge
from .training import KINDS, train_on_rank

__all__ = ["RunResult", "main", "rank_main", "run_pattern", "table"]

RESULTS = Path(__file__).resolve().parents[1] / "results"
WORLD_SIZE = 2


def quiet_warnings() -> None:
    """Silences two warnings of torch that every run would repeat: FSDP2's, that a root returning
    a view could lose its pre-backward hook to an in-place op (no pattern runs one on the logits),
    and DTensor's, that ``ShardedGradScaler``'s one-element ``found_inf`` is made a replicated DTensor."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", message=".*implicitly creating a replicated DTensor.*")


def rank_main(rank: int, name: str, kind: str, every: int | None, work: str) -> None:
    """One spawned rank: joins the group, trains ``name`` under ``kind``, writes its result."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    quiet_warnings()
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(work, 'rendezvous')}", rank=rank, world_size=WORLD_SIZE
    )
    # Each run's start line of the trace files (and torch's warnings) would bury the table; they
    # are shown when the run fails.
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            pattern = CATALOGUE[name]
            result = train_on_rank(kind, pattern.settings, pattern.plant, os.path.join(work, "traces"), every)
        with open(os.path.join(work, f"rank{rank}.json"), "w", encoding="utf-8") as out:
            json.dump(result, out)
    except BaseException:
        sys.stderr.write(captured.getvalue())
        raise
    finally:
        dist.destroy_process_group()


def _rounded(values: list[float]) -> list[float]:
    return [float(f"{v:.6g}") for v in values]


def _kept(report: dict[str, Any]) -> dict[str, Any]:
    """The report without its per-range lines (the findings, origin and iterations hold what is judged)."""
    return {key: value for key, value in report.items() if key not in ("lines", "source")}


class RunResult(dict):
    """One run's row: ``pattern``, ``kind``, ``every``, ``judgement``, ``report``, ``ranks``, ``seconds``."""

    @property
    def judgement(self) -> Judgement:
        return Judgement(**self["judgement"])


def run_pattern(pattern: Pattern, kind: str, every: int | None) -> RunResult:
    """Trains ``pattern`` under ``kind`` on 2 spawned ranks and judges the report of its traces."""
    from fsdp_patch.telemetry.offline.precision_report import report_json

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bug-pattern-") as work:
        mp.start_processes(
            rank_main, args=(pattern.name, kind, every, work), nprocs=WORLD_SIZE, start_method="spawn", join=True
        )
        ranks = [json.loads(Path(work, f"rank{r}.json").read_text(encoding="utf-8")) for r in range(WORLD_SIZE)]
        report = report_json(os.path.join(work, "traces"))
    return RunResult(
        pattern=pattern.name,
        number=pattern.number,
        kind=kind,
        every=every,
        judgement=asdict(judge(pattern, report)),
        report=_kept(report),
        ranks=[{**r, "losses": _rounded(r["losses"]), "scales": _rounded(r["scales"])} for r in ranks],
        seconds=time.perf_counter() - started,
    )


def _every(every: int | None) -> str:
    return "default" if every is None else str(every)


def table(results: list[RunResult]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| # | pattern | sharding | every | verdict | what the report named first | origin (stage at where) | cause named? |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        j = result.judgement
        lead = f"{j.lead_check}: {j.lead}" if j.lead_check else "(nothing)"
        named = "yes" if j.named else "**no**"
        lines.append(
            f"| {result['number']} | {result['pattern']} | {result['kind']} | {_every(result['every'])} | {j.verdict} "
            f"| {lead} | {j.origin or '-'} | {named} |"
        )
    return "\n".join(lines)


def _select(values: list[str] | None, controls: bool) -> list[Pattern]:
    if not values:
        return [*PATTERNS, *(CONTROLS if controls else ())]
    chosen = []
    for value in values:
        found = [p for p in (*PATTERNS, *CONTROLS) if value in (p.name, p.number)]
        if not found:
            names = ", ".join(f"{p.number} ({p.name})" for p in (*PATTERNS, *CONTROLS))
            raise SystemExit(f"python -m benchmarks.bug_patterns: unknown pattern {value!r}; expected one of {names}")
        chosen.extend(found)
    return chosen


def document(results: list[RunResult]) -> dict[str, Any]:
    return {
        "benchmark": "bug_patterns",
        "device": device_name("cpu"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "world_size": WORLD_SIZE,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "patterns": {
            p.name: {
                "number": p.number,
                "title": p.title,
                "sources": list(p.sources),
                "plants": p.plants,
                "settings": asdict(p.settings),
                "settings_text": p.settings.describe(),
                "expect": asdict(p.expect),
            }
            for p in (*PATTERNS, *CONTROLS)
        },
        "runs": list(results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bug_patterns", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pattern", action="append", help="a pattern or control by name or number (repeatable)")
    parser.add_argument("--kind", action="append", choices=KINDS, help="a sharding (repeatable; default: both)")
    parser.add_argument("--no-controls", action="store_true", help="leave the healthy controls out")
    parser.add_argument(
        "--json", default=None, help="where to write the results (default: benchmarks/results/bug-patterns-DEVICE.json)"
    )
    args = parser.parse_args(argv)
    patterns = _select(args.pattern, not args.no_controls)
    kinds = args.kind or list(KINDS)
    results: list[RunResult] = []
    for pattern in patterns:
        for kind in kinds:
            for every in pattern.every:
                result = run_pattern(pattern, kind, every)
                results.append(result)
                print(table([result]).splitlines()[-1], f"({result['seconds']:.0f} s)", flush=True)
    print(f"\nbug patterns on {WORLD_SIZE} gloo CPU ranks, torch {torch.__version__}:\n")
    print(table(results))
    named = sum(r.judgement.named for r in results)
    print(f"\ncause named in {named} of {len(results)} runs")
    path = Path(args.json) if args.json else RESULTS / f"bug-patterns-{device_slug('cpu')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document(results), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0
