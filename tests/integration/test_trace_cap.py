"""A long 2-rank run on the embedded trace files under a small cap.

Real training through the public API with telemetry on and diagnostics every step: each rank's
files, the Jaeger file written at exit included, stay under ``FSDP_PATCH_TRACE_MAX_BYTES``, every
file is valid JSON, the newest steps are kept, and the precision report reads the rotated files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_patch.telemetry.offline import precision_report

from tests import models
from tests.integration.otel_training import environment, reset_otel

pytestmark = pytest.mark.slow
STEPS = 120
CAP = 64 << 10


def capped_trace_files(directory: str, steps: int, max_bytes: str) -> dict[str, Any]:
    """Trains ``steps`` steps on the embedded default trace files under a size cap; returns this rank's files."""
    import fsdp_patch.telemetry as telemetry

    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    reset_otel()
    settings = dict(
        FSDP_PATCH_TELEMETRY="1",
        FSDP_PATCH_PRECISION_EVERY="1",
        FSDP_PATCH_TRACE_DIR=directory,
        FSDP_PATCH_TRACE_MAX_BYTES=max_bytes,
        FSDP_PATCH_SUMMARY="none",
        OTEL_TRACES_EXPORTER=None,
        OTEL_METRICS_EXPORTER=None,
    )
    try:
        with environment(**settings):
            model = models.sharded_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            fully_shard_optimizer(optimizer)
            batches = models.make_batches(4)
            for step in range(steps):
                tokens = batches[step % len(batches)]
                models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
                optimizer.step()
                optimizer.zero_grad()
            telemetry.shutdown()
    finally:
        reset_otel()
    names = sorted(n for n in os.listdir(directory) if n.startswith(f"rank{rank}."))
    return {"files": {n: os.path.getsize(os.path.join(directory, n)) for n in names}}


def _step_numbers(path: Path) -> list[int]:
    events = json.loads(path.read_text())["traceEvents"]  # raises if not valid JSON
    return [e["args"]["fsdp.step"] for e in events if e.get("name") == "fsdp.optimizer.step"]


def test_long_run_stays_under_the_cap_keeping_the_newest_steps(dist_pool, tmp_path: Path) -> None:
    results = dist_pool(2).run(capped_trace_files, str(tmp_path), STEPS, "64K")
    for rank, result in enumerate(results):
        files = result["files"]
        want = {f"rank{rank}.1.trace.json", f"rank{rank}.trace.json", f"rank{rank}.jaeger.json"}
        assert set(files) == want, f"rank {rank}: files {sorted(files)}, want {sorted(want)}"
        total = sum(files.values())
        assert total <= CAP, f"rank {rank}: {total} bytes of trace files, cap {CAP}"
        kept = _step_numbers(tmp_path / f"rank{rank}.1.trace.json") + _step_numbers(tmp_path / f"rank{rank}.trace.json")
        assert kept and kept[-1] == STEPS, f"rank {rank}: newest kept step {kept[-1:]}, want {STEPS}"
        assert kept == list(range(kept[0], STEPS + 1)), f"rank {rank}: kept steps {kept} are not the newest in a row"
        jaeger = json.loads((tmp_path / f"rank{rank}.jaeger.json").read_text())
        assert jaeger["data"], f"rank {rank}: an empty Jaeger file"

    run = precision_report.read_run(str(tmp_path))
    assert run.ranks == {0, 1} and run.last_step == STEPS, f"report read ranks {run.ranks} up to step {run.last_step}"
    assert max(run.samples) == STEPS, f"newest diagnosed step in the report: {max(run.samples)}, want {STEPS}"
    lines = precision_report.range_lines(run)
    assert [line.verdict for line in lines] == ["healthy"] * len(lines), precision_report.render(run, lines, "t")
