"""The CUDA/NCCL path, at world size 1 on one GPU: skipped, saying why, without CUDA.

- ``fully_shard`` trains like torch's FSDP2 on CUDA (fp32, AdamW; losses and weights within 1e-6).
- The adapter on CUDA tensors equals the hand-cast reference bit for bit (bf16 compute, fp32 main,
  bf16 grads), and the compute copy is the main weights cast.
- Telemetry's step durations on CUDA come from CUDA events: non-zero, and close to (never above) a
  measurement of the same steps between ``torch.cuda.synchronize()`` calls.
"""

from __future__ import annotations

import pytest

from tests.cuda import cuda_fns

pytestmark = pytest.mark.cuda
TOL = 1e-6


def test_fully_shard_matches_fsdp2_on_cuda(on_cuda) -> None:
    result = on_cuda(cuda_fns.fsdp2_parity, "cuda")
    ours, theirs = result["ours"], result["fsdp2"]
    assert ours["devices"] == theirs["devices"] == ["cuda"], f"shards on {ours['devices']} / {theirs['devices']}"
    for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"], strict=True), start=1):
        assert abs(a - b) <= TOL, f"step {step}: loss {a} (fully_shard) vs {b} (FSDP2)"
    for name, want in theirs["params"].items():
        diff = (ours["params"][name] - want).abs().max().item()
        assert diff <= TOL, f"{name}: max |fully_shard - FSDP2| = {diff}, want <= {TOL}"


def test_adapter_equals_hand_cast_reference_bitwise_on_cuda(on_cuda) -> None:
    result = on_cuda(cuda_fns.adapter_vs_hand_cast, "cuda")
    assert result["devices"] == ["cuda"], f"main weights on {result['devices']}"
    assert result["dtypes"] == ["torch.float32/torch.bfloat16"], result["dtypes"]
    assert result["mismatches"] == [], f"adapted != hand-cast reference: {result['mismatches']}"
    assert result["compute_is_cast_of_main"], "the compute copy is not the main weights cast to bf16"


def test_step_durations_are_cuda_event_times_close_to_a_synchronized_measurement(on_cuda) -> None:
    result = on_cuda(cuda_fns.event_timings, "cuda")
    assert result["event_recorder"], "CUDA parameters did not get the CUDA-event duration recorder"
    assert result["count"] == 8 and result["refresh_count"] == 8, result
    assert result["device_min"] > 0 and result["refresh_min"] > 0, f"a zero duration was recorded: {result}"
    device, host = result["device_sum"], result["host_sum"]
    # The events bracket the step on the stream, so they see the host's issuing time as well as
    # the kernels: close to the synchronized host time, and not above it (beyond timer resolution).
    assert 0.5 * host <= device <= 1.02 * host + 1e-3, f"CUDA events {device:.6f} s vs synchronized host {host:.6f} s"
