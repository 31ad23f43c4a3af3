"""The CUDA/NCCL path, at world size 1 on one GPU: skipped, saying why, without CUDA.

- ``fully_shard`` trains like torch's FSDP2 on CUDA (fp32, AdamW; losses and weights within 1e-6).
- The adapter on CUDA tensors equals the hand-cast reference bit for bit (bf16 compute, fp32 main,
  bf16 grads), and the compute copy is the main weights cast.
- The origin checks of a list, fused on CUDA, read as one check per tensor.
- Telemetry's step durations on CUDA come from CUDA events: non-zero, and close to (never above) a
  measurement of the same steps between ``torch.cuda.synchronize()`` calls.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.models import lm_loss, make_batches, make_model, shard_model

pytestmark = pytest.mark.cuda
TOL = 1e-6


# -- on the rank (device-agnostic: they also run on the CPU with gloo) ---------------------------


STEPS = 3


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu()


def fsdp2_parity(device: str) -> dict[str, Any]:
    """fp32 training of the small transformer with ``fully_shard`` and with torch's FSDP2, side by side.

    AdamW with eps=1e-4, as the CPU parity tests (torch's 1e-8 amplifies rounding of near-zero
    grads; see tests/fsdp/test_parity.py).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out: dict[str, Any] = {}
    batches = make_batches(STEPS)
    for impl in ("ours", "fsdp2"):
        model = make_model(seed=0).to(device)
        if impl == "ours":
            shard_model(model)
        else:
            mesh = init_device_mesh(device, (dist.get_world_size(),))
            for block in model.blocks:
                torch_fully_shard(block, mesh=mesh)
            torch_fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
        losses = []
        for tokens in batches:
            loss = lm_loss(model, tokens.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        out[impl] = {
            "losses": losses,
            "params": {name: _full(p) for name, p in model.named_parameters()},
            "devices": sorted({str(p.to_local().device.type) for p in model.parameters()}),
        }
    return out


def adapter_vs_hand_cast(device: str) -> dict[str, Any]:
    """bf16 compute / fp32 main / bf16 grads: the adapted AdamW against the hand-cast reference, bitwise."""
    from fsdp_patch.optimizer import fully_shard_optimizer
    from tests.optimizer.support import HandCast, env, fsdp_params, same

    models = {kind: shard_model(make_model(seed=0).to(device).bfloat16()) for kind in ("adapted", "ref")}
    optimizers = {kind: torch.optim.AdamW(models[kind].parameters(), lr=1e-3) for kind in models}
    with env(FSDP_PATCH_TELEMETRY=None):
        fully_shard_optimizer(optimizers["adapted"])
    reference = HandCast(fsdp_params(models["ref"]))
    mismatches: list[str] = []
    for step, tokens in enumerate(make_batches(STEPS)):
        for model in models.values():
            lm_loss(model, tokens.to(device)).backward()
        optimizers["adapted"].step()
        reference.step(optimizers["ref"])
        for (name, a), (_, b) in zip(
            models["adapted"].named_parameters(), models["ref"].named_parameters(), strict=True
        ):
            if not same(a, b):
                mismatches.append(f"step {step + 1}: main weight {name}")
        state_a, state_b = optimizers["adapted"].state_dict()["state"], optimizers["ref"].state_dict()["state"]
        if not same(state_a, state_b):
            mismatches.append(f"step {step + 1}: optimizer state")
        for optimizer in optimizers.values():
            optimizer.zero_grad()
    from fsdp_patch import parameter_groups

    groups = parameter_groups(models["adapted"])
    return {
        "mismatches": mismatches,
        "devices": sorted({g.main_weight.device.type for g in groups}),
        "dtypes": sorted({f"{g.main_weight.dtype}/{g.compute_weight.dtype}" for g in groups}),
        "compute_is_cast_of_main": all(
            torch.equal(g.compute_weight, g.main_weight.to(g.compute_weight.dtype)) for g in groups
        ),
    }


def event_timings(device: str, steps: int = 8) -> dict[str, Any]:
    """Step durations the telemetry records (CUDA events on CUDA) beside a synchronized host measurement.

    The model is made wide enough that a step's device work dominates its launch overhead.
    """
    from fsdp_patch.telemetry import OptimizerObserver
    from fsdp_patch.telemetry.instrumentation.timing import DeviceEventDurationRecorder, duration_recorder_for
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider

    from fsdp_patch.adapter import adapt_optimizer

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    model = shard_model(make_model(seed=0, dim=256, heads=4, vocab=4096).to(device).bfloat16())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    observer = OptimizerObserver(
        optimizer, precision_aware=False, tracer_provider=TracerProvider(), meter_provider=meter_provider
    )
    adapt_optimizer(optimizer, precision_aware=False, observer_factory=lambda: observer)
    tokens = make_batches(1, vocab=4096)[0].to(device)
    host: list[float] = []
    for _ in range(steps):
        lm_loss(model, tokens).backward()
        synchronize()
        started = time.perf_counter()
        optimizer.step()
        synchronize()
        host.append(time.perf_counter() - started)
        optimizer.zero_grad()
    observer.flush_timers()
    data = reader.get_metrics_data()
    recorded = {
        metric.name: point
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        for point in metric.data.data_points
    }
    step_point = recorded["fsdp.optimizer.step.duration"]
    return {
        "event_recorder": isinstance(
            duration_recorder_for(torch.device(device), lambda s: None), DeviceEventDurationRecorder
        ),
        "count": step_point.count,
        "device_sum": step_point.sum,
        "device_min": step_point.min,
        "host_sum": sum(host),
        "refresh_count": recorded["fsdp.optimizer.refresh.duration"].count,
        "refresh_min": recorded["fsdp.optimizer.refresh.duration"].min,
    }


# -- the tests ------------------------------------------------------------------------------------


def test_fully_shard_matches_fsdp2_on_cuda(on_cuda) -> None:
    result = on_cuda(fsdp2_parity, "cuda")
    ours, theirs = result["ours"], result["fsdp2"]
    assert ours["devices"] == theirs["devices"] == ["cuda"], f"shards on {ours['devices']} / {theirs['devices']}"
    for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"], strict=True), start=1):
        assert abs(a - b) <= TOL, f"step {step}: loss {a} (fully_shard) vs {b} (FSDP2)"
    for name, want in theirs["params"].items():
        diff = (ours["params"][name] - want).abs().max().item()
        assert diff <= TOL, f"{name}: max |fully_shard - FSDP2| = {diff}, want <= {TOL}"


def test_adapter_equals_hand_cast_reference_bitwise_on_cuda(on_cuda) -> None:
    result = on_cuda(adapter_vs_hand_cast, "cuda")
    assert result["devices"] == ["cuda"], f"main weights on {result['devices']}"
    assert result["dtypes"] == ["torch.float32/torch.bfloat16"], result["dtypes"]
    assert result["mismatches"] == [], f"adapted != hand-cast reference: {result['mismatches']}"
    assert result["compute_is_cast_of_main"], "the compute copy is not the main weights cast to bf16"


def test_step_durations_are_cuda_event_times_close_to_a_synchronized_measurement(on_cuda) -> None:
    result = on_cuda(event_timings, "cuda")
    assert result["event_recorder"], "CUDA parameters did not get the CUDA-event duration recorder"
    assert result["count"] == 8 and result["refresh_count"] == 8, result
    assert result["device_min"] > 0 and result["refresh_min"] > 0, f"a zero duration was recorded: {result}"
    device, host = result["device_sum"], result["host_sum"]
    # The events bracket the step on the stream, so they see the host's issuing time as well as
    # the kernels: close to the synchronized host time, and not above it (beyond timer resolution).
    assert 0.5 * host <= device <= 1.02 * host + 1e-3, f"CUDA events {device:.6f} s vs synchronized host {host:.6f} s"


def test_fused_checks_read_as_one_check_per_tensor_on_cuda(on_cuda: Any) -> None:
    """On CUDA the origin checks of a list are one ``torch._foreach_norm(inf)``
    ([Note: one fused reduction per list on a GPU]): they read as one ``aminmax`` per tensor."""
    from tests.telemetry.test_origin_checks import check_all_against_check

    got = on_cuda(check_all_against_check, "cuda")
    assert got["many"] == got["one"], f"fused {got['many']} != one check per tensor {got['one']}"
    assert got["mixed"] == got["one"] + got["one"][-1:], f"fused among single checks: {got['mixed']}"
    assert len(got["one"]) == 6, f"want 6 checked tensors (empty and integer skipped), got {got['one']}"


@pytest.mark.parametrize("kind", ["fully_shard", "fsdp2"])
def test_undiagnosed_steps_add_no_cuda_synchronization(on_cuda: Any, tmp_path: Any, kind: str) -> None:
    """What tests/integration/test_host_reads.py counts on the CPU, on a GPU: the reads of device
    values and the synchronizations CUDA itself reports (``torch.cuda.set_sync_debug_mode``) on
    the steps telemetry at its defaults does not diagnose, against the same steps with it off."""
    from tests.integration.test_host_reads import STEPS, added, counted_training, diagnosed_steps

    on = on_cuda(counted_training, kind, str(tmp_path / "traces"), "cuda")
    off = on_cuda(counted_training, kind, "", "cuda")
    undiagnosed = [s for s in range(1, STEPS + 1) if s not in diagnosed_steps(tmp_path / "traces") and s != 2]
    reads = {step: added(on, off, step) for step in undiagnosed}
    assert all(not r for r in reads.values()), f"{kind}: device values read on undiagnosed steps: {reads}"
    syncs = {step: on["syncs"][step] - off["syncs"][step] for step in undiagnosed}
    assert all(n <= 0 for n in syncs.values()), f"{kind}: CUDA synchronizations added per undiagnosed step: {syncs}"
