"""Telemetry at its defaults reads no device value into Python on a step it does not diagnose.

Counted per step by :class:`tests.host_reads.HostReads` (``item``, ``tolist``, ``bool``,
``nonzero``, ... of any tensor but the host copies telemetry reads on purpose), on 2 gloo ranks
under ``fully_shard`` and torch FSDP2 with the origin checks on (the default), against the same
training with telemetry off: on the undiagnosed steps, zero reads added. What telemetry reads, it
reads through host copies: each iteration's checks a step late, and a diagnosed step's rows once
(one wait for the device on a healthy step). The diagnosed steps are read from the run's own trace
files. On a GPU, tests/cuda/test_host_reads_cuda.py counts the
synchronizations CUDA reports (``torch.cuda.set_sync_debug_mode``) the same way.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import models
from tests.host_reads import HostReads, by_read
from tests.integration.otel_training import environment, reset_otel

STEPS = 14
KINDS = ("fully_shard", "fsdp2")


def _shard(model: torch.nn.Module, kind: str, device: str) -> torch.nn.Module:
    if kind == "fully_shard":
        from fsdp_patch import MixedPrecisionPolicy

        return models.shard_model(model, mp_policy=MixedPrecisionPolicy())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=FSDP2Policy(param_dtype=torch.bfloat16))
    return fully_shard(model, mesh=mesh, mp_policy=FSDP2Policy(param_dtype=torch.bfloat16))


def counted_training(kind: str, trace_dir: str, device: str = "cpu") -> dict[str, Any]:
    """Train STEPS steps (telemetry on at its defaults where ``trace_dir`` is set); per step, the
    reads of device values (``[read, site]``) and, on CUDA, the synchronizations CUDA
    reported."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    settings = {"FSDP_PATCH_TELEMETRY": "1" if trace_dir else None, "FSDP_PATCH_TRACE_DIR": trace_dir or None}
    with environment(**settings, FSDP_PATCH_SUMMARY="none", OTEL_TRACES_EXPORTER=None, OTEL_METRICS_EXPORTER=None):
        reset_otel()
        model = _shard(models.make_model(0).to(device), kind, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fully_shard_optimizer(optimizer)
        reads: dict[int, list[list[str]]] = {}
        syncs: dict[int, int] = {}
        host_waits: dict[int, dict[str, int]] = {}
        for step, tokens in enumerate(models.make_batches(STEPS), start=1):
            counter = HostReads()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    with counter, _waits_counted() as waits:
                        loss = models.lm_loss(model, models.rank_slice(tokens, rank, world).to(device))
                        loss.backward()
                        optimizer.step()
                        optimizer.zero_grad()
                        loss.item()  # the script's own read, as a training loop logs its loss
                finally:
                    if device == "cuda":
                        torch.cuda.set_sync_debug_mode("default")
            reads[step] = [list(read) for read in counter.reads]
            host_waits[step] = waits
            syncs[step] = sum("synchronizing" in str(w.message) for w in caught)
        if device == "cuda":
            torch.cuda.synchronize()
        from fsdp_patch import telemetry

        telemetry.shutdown()
    return {"reads": reads, "syncs": syncs, "waits": host_waits}


@contextlib.contextmanager
def _waits_counted() -> Iterator[dict[str, int]]:
    """Each wait for host copies (:meth:`HostCopy.values` with ``wait``: on a GPU, one wait for the
    device at most), by the module that asked."""
    from fsdp_patch.telemetry.diagnostics.host_copies import HostCopy

    counts: dict[str, int] = {}
    original = HostCopy.values

    def values(self: HostCopy, wait: bool = False) -> Any:
        if wait:
            caller = sys._getframe(1).f_code.co_filename.rsplit("/", 1)[-1]
            if caller == "host_copies.py":
                caller = sys._getframe(2).f_code.co_filename.rsplit("/", 1)[-1]
            counts[caller] = counts.get(caller, 0) + 1
        return original(self, wait)

    HostCopy.values = values  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        HostCopy.values = original  # type: ignore[method-assign]


def diagnosed_steps(trace_dir: Path) -> set[int]:
    """The steps the run's trace files hold precision diagnostics for."""
    from fsdp_patch.telemetry.offline.run_trace import read_run

    return set(read_run(str(trace_dir)).samples)


def added(on: dict[str, Any], off: dict[str, Any], step: int) -> dict[str, Any]:
    """Reads at ``step`` with telemetry on beyond those with it off, by read, with the sites of the
    run with telemetry on (to say where they came from)."""
    more = collections.Counter(by_read(on["reads"][step])) - collections.Counter(by_read(off["reads"][step]))
    return {name: (n, sorted({site for r, site in on["reads"][step] if r == name})) for name, n in more.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_undiagnosed_steps_read_no_device_value(dist_pool, tmp_path: Path, kind: str) -> None:
    on = dist_pool(2).run(counted_training, kind, str(tmp_path / "traces"))
    off = dist_pool(2).run(counted_training, kind, "")
    diagnosed = diagnosed_steps(tmp_path / "traces")
    undiagnosed = [step for step in range(1, STEPS + 1) if step not in diagnosed and step != 2]  # 2: the audit's
    assert len(undiagnosed) >= 6, f"want most of {STEPS} steps undiagnosed at the defaults; diagnosed {diagnosed}"
    for rank in range(2):
        got = {step: added(on[rank], off[rank], step) for step in undiagnosed}
        assert all(not reads for reads in got.values()), (
            f"{kind}, rank {rank}: telemetry read device values on undiagnosed steps: "
            f"{ {step: reads for step, reads in got.items() if reads} }"
        )
        # The counter sees reads where they are made: the script's own loss.item(), every step.
        items = [by_read(on[rank]["reads"][step]).get("item", 0) for step in range(1, STEPS + 1)]
        assert all(n >= 1 for n in items), f"{kind}, rank {rank}: the script's loss.item() not counted: {items}"
        # What telemetry reads, it reads through host copies: the iteration's checks a step later
        # (model_watch), and a diagnosed step's reduced rows once (reduced_rows: a healthy step
        # needs no second round).
        waits = on[rank]["waits"]
        got_rows = {step: waits[step].get("reduced_rows.py", 0) for step in range(1, STEPS + 1)}
        want_rows = {step: int(step in diagnosed) for step in range(1, STEPS + 1)}
        assert got_rows == want_rows, (
            f"{kind}, rank {rank}: waits for reduced rows per step {got_rows}, want {want_rows}"
        )
        later = {step: waits[step].get("model_watch.py", 0) for step in range(2, STEPS + 1)}
        assert set(later.values()) == {1}, f"{kind}, rank {rank}: the checks read once a step, a step late: {later}"
