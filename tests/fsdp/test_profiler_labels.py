"""Profiler labels: every phase of ``fully_shard`` and of an adapted step shows in a recorded
``torch.profiler`` trace as ``fsdp_patch::<phase>``, as FSDP2's show as ``FSDP::<phase>``; and a
step nobody profiles opens none."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_patch.torch_interop import profiling

WORLD = 2


def _labels_on_rank(hsdp: bool, telemetry_dir: str | None) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.bug_patterns.training import environment
    from fsdp_patch import MixedPrecisionPolicy, fully_shard
    from fsdp_patch.optimizer import fully_shard_optimizer
    from tests.integration.otel_training import reset_otel

    reset_otel()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    mesh = init_device_mesh("cpu", (WORLD, 1) if hsdp else (WORLD,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model[0], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = {
        "FSDP_PATCH_TELEMETRY": "1" if telemetry_dir else "0",
        "FSDP_PATCH_TRACE_DIR": telemetry_dir,
        "FSDP_PATCH_SUMMARY": "none",
        "FSDP_PATCH_PRECISION_EVERY": "1",
        "OTEL_TRACES_EXPORTER": None,
        "OTEL_METRICS_EXPORTER": None,
    }
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    with environment(settings):
        fully_shard_optimizer(optimizer)
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(2):
                    model(x).float().square().sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            # And unprofiled: nothing is labelled, nothing raises.
            model(x).float().sum().backward()
            optimizer.step()
        finally:
            with contextlib.suppress(Exception):
                from fsdp_patch.telemetry import shutdown

                shutdown()
            reset_otel()
    return sorted({e.name for e in prof.events() if e.name.startswith(profiling.PREFIX)})


def _want(*missing: str) -> list[str]:
    return sorted(profiling.PREFIX + name for name in profiling.LABELS if name not in missing)


def test_every_phase_of_fully_shard_and_the_adapted_step_is_labelled(dist_pool: Any) -> None:
    """2 ranks, bf16 compute: every label but HSDP's all-reduce and the diagnostics' (telemetry off)."""
    for rank, got in enumerate(dist_pool(WORLD).run(_labels_on_rank, False, None)):
        want = _want("all_reduce", "step.precision")
        assert got == want, f"rank {rank}: want {want}, got {got}"


def test_hsdp_s_all_reduce_and_the_diagnostics_are_labelled_too(dist_pool: Any, tmp_path: Path) -> None:
    """HSDP over 2 replicas of 1 shard, telemetry on with diagnostics every step: every label."""
    for rank, got in enumerate(dist_pool(WORLD).run(_labels_on_rank, True, str(tmp_path))):
        assert got == _want(), f"rank {rank}: want {_want()}, got {got}"


def test_no_label_is_opened_while_no_profiler_records() -> None:
    opened = []
    real = torch.profiler.record_function
    try:
        torch.profiler.record_function = lambda name: opened.append(name) or real(name)  # type: ignore[assignment]
        with profiling.label("all_gather"), profiling.around("step.refresh", contextlib.nullcontext()):
            pass
        profiling.labelled("reshard")(lambda: None)()
    finally:
        torch.profiler.record_function = real  # type: ignore[assignment]
    assert opened == [], f"want no label opened without a profiler, got {opened}"


def test_the_conventions_list_every_label() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "conventions.md").read_text(encoding="utf-8")
    missing = [name for name in profiling.LABELS if f"`{profiling.PREFIX}{name}`" not in text]
    assert missing == [], f"labels docs/conventions.md does not list: {missing}"
