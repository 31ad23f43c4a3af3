"""A ``clip_grad_norm_`` at every step, as most training scripts run one: by a positive ``max_norm``
the step checks none of the grads it wrote again (its total norm is checked; see
``checked_grads``' [Note: a clip that zeroes the grads]), a write after the clip is still named, and
a clip by ``max_norm=0`` (which zeroes every grad) is checked again and reads as grads zeroed.
Runs on ``test_origin``'s models and report.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tests import models
from tests.integration.otel_training import environment, reset_otel
from tests.integration.test_origin import KINDS, PLANT, STEPS, WANT, _local, _report, _shard


def clip_training(kind: str, max_norm: float, plant: bool, trace_dir: str, foreach: bool | None = None) -> list[int]:
    """Train STEPS steps, each clipped by ``max_norm`` (``plant``: a NaN written into blocks.0's
    grad after the clip at step PLANT; ``foreach=False``: a clip that writes grad by grad, which
    moves their version counters); returns how many grads each step checked again."""
    from fsdp_patch.telemetry import semconv, shutdown
    from fsdp_patch.telemetry.diagnostics.probes import ProbeLog

    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    rechecked: list[int] = []
    check_all = ProbeLog.check_all

    def counted(log: ProbeLog, stage: str, items: Any) -> None:
        if stage == semconv.ORIGIN_GRAD_WRITE:
            rechecked[-1] += len(items)
        check_all(log, stage, items)

    settings = {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_TRACE_DIR": trace_dir, "FSDP_PATCH_SUMMARY": "none"}
    with environment(**settings), mock.patch.object(ProbeLog, "check_all", counted):
        reset_otel()
        model = _shard(models.make_model(0), kind)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fully_shard_optimizer(optimizer)
        for step, tokens in enumerate(models.make_batches(STEPS), start=1):
            rechecked.append(0)
            models.lm_loss(model, models.rank_slice(tokens, rank, world)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=foreach)
            if plant and step == PLANT:
                with torch.no_grad():
                    _local(model.blocks[0].fc1.weight.grad).view(-1)[0] = math.nan
            optimizer.step()
            optimizer.zero_grad()
        shutdown()
        reset_otel()
    return rechecked


def _run(
    dist_pool: Any, tmp_path: Path, kind: str, max_norm: float, plant: bool, foreach: bool | None = None
) -> tuple[list[list[int]], Any]:
    trace_dir = tmp_path / f"{kind}-{max_norm}-{plant}-{foreach}"
    os.makedirs(trace_dir, exist_ok=True)
    counts = dist_pool(2).run(clip_training, kind, max_norm, plant, str(trace_dir), foreach)
    return counts, _report(trace_dir)


@pytest.mark.parametrize("foreach", [None, False], ids=["foreach", "grad-by-grad"])
@pytest.mark.parametrize("kind", KINDS)
def test_grads_clipped_by_a_positive_factor_are_not_checked_again(dist_pool, tmp_path, kind, foreach) -> None:
    counts, report = _run(dist_pool, tmp_path, kind, 1.0, False, foreach)
    want = [[0] * STEPS] * 2
    assert counts == want, f"{kind}, foreach={foreach}: grads checked again at each step, per rank: {counts}, want none"
    assert report["origin"] is None, f"{kind}: a healthy run, want no origin, got {report['origin']}"


@pytest.mark.parametrize("kind", KINDS)
def test_a_write_after_the_clip_is_checked_and_named(dist_pool, tmp_path, kind) -> None:
    counts, report = _run(dist_pool, tmp_path, kind, 1.0, True)
    origin = report["origin"]
    got = None if origin is None else (origin["step"], origin["stage"], origin["where"])
    assert got == (PLANT, *WANT["grad_write"]), f"{kind}: want the origin {(PLANT, *WANT['grad_write'])}, got {got}"
    assert all(rank[PLANT - 1] > 0 for rank in counts), (
        f"{kind}: want the written grads checked at step {PLANT}: {counts}"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_clip_by_zero_is_checked_again_and_reads_as_grads_zeroed(dist_pool, tmp_path, kind) -> None:
    counts, report = _run(dist_pool, tmp_path, kind, 0.0, False)
    assert all(all(n > 0 for n in rank) for rank in counts), f"{kind}: want the grads checked at every step: {counts}"
    checks = [finding["check"] for finding in report["findings"]]
    assert "grads_zeroed" in checks, f"{kind}: a clip by 0 zeroes every grad: want grads_zeroed, got {checks}"
