"""Optimizer state that went through a lower precision on its way back from a checkpoint, told from
its values: every element of the float32 state a bfloat16 (or float16) value."""

from __future__ import annotations

import torch
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.diagnostics.model_audit import (
    STATE_EVIDENCE,
    moments_inconsistent,
    state_through_low_precision,
)


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


def _adam_state(cast_keys: tuple[str, ...]) -> list[tuple[str, str, torch.Tensor]]:
    """Real Adam state after 20 steps on an embedding-like parameter whose first half gets grads
    only every other step, with the keys in ``cast_keys`` through float16 and back."""
    gen = torch.Generator().manual_seed(1)
    param = torch.nn.Parameter(torch.randn(64, 8, generator=gen))
    optimizer = torch.optim.Adam([param], lr=1e-3)
    for step in range(20):
        grad = torch.randn(64, 8, generator=gen) * 1e-3
        if step % 2:
            grad[:32] = 0
        param.grad = grad
        optimizer.step()
    state = optimizer.state[param]
    return [
        ("embed.weight", key, value.to(torch.float16).float() if key in cast_keys else value.clone())
        for key, value in state.items()
        if value.dim() > 0
    ]


def test_a_second_moment_zero_where_the_first_is_not_is_named_without_history() -> None:
    """Only exp_avg_sq saved in float16: not every value of the state is a float16 one, but its
    small values became 0 where exp_avg is not 0, which no run of grads makes."""
    states = _adam_state(("exp_avg_sq",))
    assert state_through_low_precision(states, "x") is None, "exp_avg is float32's: the state is not all float16"
    finding = moments_inconsistent(states, "a resume from step 20")
    assert finding is not None, "want the second moment's zeros named"
    got = (finding.tensor, finding.where, finding.actual)
    assert got == (semconv.TENSOR_OPTIMIZER_STATE, "embed.weight exp_avg_sq", torch.float16), got
    assert "after a resume from step 20, exp_avg_sq is exactly 0 where exp_avg is not" in finding.detail, finding.detail


def test_adam_state_that_kept_its_second_moment_is_not_named() -> None:
    """Healthy state, and the fix ultralytics/ultralytics#24085 settled on (exp_avg in float16,
    exp_avg_sq kept in float32)."""
    got = (moments_inconsistent(_adam_state(()), "x"), moments_inconsistent(_adam_state(("exp_avg",)), "x"))
    assert got == (None, None), f"want nothing named, got {got}"
