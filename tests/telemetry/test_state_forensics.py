"""Optimizer state that went through a lower precision on its way back from a checkpoint, told from
its values: every element of the float32 state a bfloat16 (or float16) value."""

from __future__ import annotations

import torch
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.diagnostics.model_audit import STATE_EVIDENCE, state_through_low_precision


def _states(cast: torch.dtype | None) -> list[tuple[str, str, torch.Tensor]]:
    torch.manual_seed(0)
    out = []
    for name in ("fc1.weight", "fc2.weight"):
        for key, scale in (("exp_avg", 1e-3), ("exp_avg_sq", 1e-6)):
            value = torch.randn(256) * scale
            out.append((name, key, value.to(cast).float() if cast is not None else value))
    return out


def test_state_whose_every_value_is_bf16_is_named_with_its_first_tensor() -> None:
    finding = state_through_low_precision(_states(torch.bfloat16), "a resume from step 3")
    assert finding is not None
    got = (finding.tensor, finding.where, finding.expected, finding.actual)
    want = (semconv.TENSOR_OPTIMIZER_STATE, "fc1.weight exp_avg", torch.float32, torch.bfloat16)
    assert got == want, f"got {got}, want {want}"
    assert "after a resume from step 3" in finding.detail and "float32" in finding.detail, finding.detail


def test_float16_is_told_apart_and_float32_state_is_not_named() -> None:
    finding = state_through_low_precision(_states(torch.float16), "a resume from step 3")
    assert finding is not None and finding.actual == torch.float16, finding
    assert state_through_low_precision(_states(None), "a resume from step 3") is None


def test_state_with_too_few_values_to_tell_is_not_named() -> None:
    """A fresh state of zeros (or one step's few values) is on every grid."""
    zeros = [("fc1.weight", "exp_avg", torch.zeros(1024))]
    few = [("fc1.weight", "exp_avg", torch.zeros(1024).index_fill_(0, torch.arange(STATE_EVIDENCE - 1), 0.5))]
    got = (state_through_low_precision(zeros, "x"), state_through_low_precision(few, "x"))
    assert got == (None, None), f"got {got}"
