"""Update jumps: each parameter's update against its own history and against Adam's bound, with
what changed at that step (telemetry/diagnostics/update_jumps.py ``UpdateHistory``)."""

from __future__ import annotations

import math

import pytest
import torch
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.diagnostics import rows as row_spec
from fsdp_patch.telemetry.diagnostics.optimizer_state import ParamContext, adam_update_bound, contexts_for
from fsdp_patch.telemetry.diagnostics.rows import ParamSlot
from fsdp_patch.telemetry.diagnostics.update_jumps import UpdateHistory


def _row(before: torch.Tensor, after: torch.Tensor, grad: torch.Tensor) -> list[float]:
    row = [0.0] * row_spec.ROW
    row[row_spec.NUMEL] = float(after.numel())
    row[row_spec.UPDATE_SQ] = float(((after - before) ** 2).sum())
    row[row_spec.MAIN_SQ] = float((after**2).sum())
    row[row_spec.GRAD_AMAX] = float(grad.abs().max())
    return row


def _adam_bound_brute(beta1: float, beta2: float, steps: int) -> float:
    """``sqrt(sum a_i² / b_i)`` at step ``steps``, summed term by term."""
    total = 0.0
    for i in range(1, steps + 1):
        a = (1 - beta1) * beta1 ** (steps - i) / (1 - beta1**steps)
        b = (1 - beta2) * beta2 ** (steps - i) / (1 - beta2**steps)
        total += a * a / b
    return math.sqrt(total)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95), (0.0, 0.99)])
def test_adams_bound_is_the_limit_of_the_weighted_sums_and_no_update_exceeds_it(betas) -> None:
    bound = adam_update_bound(*betas)
    assert bound is not None
    brute = [_adam_bound_brute(*betas, steps) for steps in (1, 10, 100, 10000)]
    assert brute[0] == pytest.approx(1.0), f"at the first step Adam's update is the grad's sign: got {brute[0]}"
    assert all(b <= bound * (1 + 1e-9) for b in brute), f"every step's sum stays below the limit {bound}: {brute}"
    assert brute[-1] == pytest.approx(bound, rel=1e-3), f"and reaches it: want {bound}, got {brute[-1]}"
    # A real Adam on the grads that attain the bound (Cauchy-Schwarz's equality case) and on random ones.
    steps = 400
    weights = [
        ((1 - betas[0]) * betas[0] ** (steps - i)) / ((1 - betas[1]) * betas[1] ** (steps - i))
        for i in range(1, steps + 1)
    ]
    for grads in (torch.tensor(weights), torch.randn(steps, generator=torch.Generator().manual_seed(0))):
        p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        opt = torch.optim.Adam([p], lr=1.0, betas=betas, eps=0.0)
        largest = 0.0
        for g in grads:
            before = p.detach().clone()
            p.grad = g.reshape(1).to(torch.float64)
            opt.step()
            largest = max(largest, float((p.detach() - before).abs()))
        assert largest <= bound * (1 + 1e-9), f"Adam moved an element by {largest}, beyond the bound {bound}"
    assert largest > 0, "the random grads moved the parameter"


def test_no_finite_bound_where_beta1_squared_reaches_beta2() -> None:
    got = (adam_update_bound(0.99, 0.9), adam_update_bound(0.9, 0.81))
    assert got == (None, None), f"want no bound where β1² >= β2, got {got}"


def _train(
    optimizer_kind: str,
    steps: int,
    lr_at=lambda step: 1e-3,
    grad_scale_at=lambda step: 1.0,
    load_at=None,
    load_dtype=torch.float16,
    keep_second_moment=False,
) -> list[tuple[int, tuple[float, str] | None]]:
    """A real optimizer on one parameter whose first half gets grads only every other step (an
    embedding's rows a batch does not reach), judged at every step."""
    gen = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(64, 8, generator=gen))
    # Adam's weight decay would add 0.01 * p to every grad, and no row would go without one.
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01) if optimizer_kind == "adamw" else torch.optim.Adam([p])
    slot = ParamSlot(
        name="embed.weight",
        unit="",
        group=0,
        tensor=0,
        start=0,
        length=p.numel(),
        param=p,
        main_dtype=torch.float32,
        compute_dtype=None,
    )
    history = UpdateHistory()
    judged = []
    for step in range(1, steps + 1):
        loaded = False
        if load_at is not None and step == load_at:
            saved = opt.state_dict()
            for state in saved["state"].values():
                for key, value in state.items():
                    if key == "step" or (keep_second_moment and key == "exp_avg_sq"):
                        continue
                    state[key] = value.to(load_dtype).to(torch.float32)
            opt.load_state_dict(saved)
            loaded = True
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        grad = torch.randn(64, 8, generator=gen) * 1e-3 * grad_scale_at(step)
        if step % 2 == 0:
            grad[:32] = 0
        p.grad = grad
        before = p.detach().clone()
        opt.step()
        (context,) = contexts_for(opt, [slot], [()])
        judged.append((step, history.judge(slot.name, _row(before, p.detach(), grad), context, loaded)))
    return judged


@pytest.mark.parametrize("optimizer_kind", ["adam", "adamw"])
def test_healthy_training_with_a_warmup_and_a_noisy_loss_has_no_jump(optimizer_kind: str) -> None:
    judged = _train(
        optimizer_kind,
        60,
        lr_at=lambda step: 1e-3 * min(1.0, step / 20),
        grad_scale_at=lambda step: 1.0 + 9.0 * (step % 7 == 0),
    )
    jumps = [(step, j) for step, j in judged if j is not None]
    assert jumps == [], f"want no jump in healthy training, got {jumps}"


@pytest.mark.parametrize("optimizer_kind", ["adam", "adamw"])
def test_state_saved_in_float16_jumps_at_the_first_step_after_the_load(optimizer_kind: str) -> None:
    judged = _train(optimizer_kind, 40, load_at=30)
    jumps = {step: j for step, j in judged if j is not None}
    assert list(jumps) and min(jumps) == 30, f"want the first jump at the load's step 30, got {jumps}"
    ratio, cause = jumps[30]
    assert cause == semconv.UPDATE_JUMP_STATE_LOADED, f"want the load named, got {cause}"
    assert ratio >= 100, f"a second moment flushed to 0 divides by eps alone: want a jump of 100x or more, got {ratio}"


def test_the_fix_that_keeps_the_second_moment_in_float32_has_no_jump() -> None:
    judged = _train("adam", 40, load_at=30, keep_second_moment=True)
    jumps = [(step, j) for step, j in judged if j is not None]
    assert jumps == [], f"exp_avg_sq kept in float32 (the fix): want no jump, got {jumps}"


def test_a_resumed_run_is_judged_against_adams_bound_without_history() -> None:
    history = UpdateHistory()
    p = torch.zeros(100)
    row = _row(p, p + 0.5, torch.full((100,), 1e-3))  # an update of 500 x lr on every element
    context = ParamContext(lr=1e-3, update_bound=adam_update_bound(0.9, 0.999))
    got = history.judge("w", row, context, state_loaded=False)
    want_ratio = 500 / adam_update_bound(0.9, 0.999)
    assert got is not None and got[0] == pytest.approx(want_ratio), f"want {want_ratio}x the bound, got {got}"
    assert got[1] == semconv.UPDATE_JUMP_STATE, f"nothing else changed: want the state named, got {got[1]}"


@pytest.mark.parametrize(
    ("lr", "grad", "want"),
    [
        (5e-2, 1e-3, semconv.UPDATE_JUMP_LR),
        (1e-3, 1.0, semconv.UPDATE_JUMP_GRADS),
        (1e-3, 1e-3, semconv.UPDATE_JUMP_STATE),
    ],
)
def test_a_jump_of_an_optimizer_without_a_bound_names_what_changed(lr: float, grad: float, want: str) -> None:
    """An update 1000 times its usual size: with a learning rate 50 times larger (and still 20 times
    more per unit of it), with grads 1000 times larger, or with nothing else changed."""
    history = UpdateHistory()
    p = torch.zeros(10)
    sgd = ParamContext(lr=1e-3)
    for _ in range(3):
        assert history.judge("w", _row(p, p + 1e-3, torch.full((10,), 1e-3)), sgd, False) is None
    got = history.judge("w", _row(p, p + 1.0, torch.full((10,), grad)), ParamContext(lr=lr), False)
    assert got is not None and got[0] == pytest.approx(1000.0), f"want a 1000x jump, got {got}"
    assert got[1] == want, f"want the cause {want}, got {got[1]}"
    after = history.judge("w", _row(p, p + 1e-3, torch.full((10,), 1e-3)), sgd, False)
    assert after is None, f"the jump is not the parameter's usual size: the next usual update is no jump, got {after}"


def test_a_warm_restart_that_raises_the_learning_rate_a_thousandfold_is_no_jump() -> None:
    """SGD at the end of a cosine cycle (lr 1e-6), then restarted at 1e-3: the update grows as the
    schedule means it to; per unit of learning rate it stays the same."""
    history = UpdateHistory()
    p = torch.zeros(10)
    for _ in range(3):
        assert history.judge("w", _row(p, p + 1e-6, torch.full((10,), 1.0)), ParamContext(lr=1e-6), False) is None
    got = history.judge("w", _row(p, p + 1e-3, torch.full((10,), 1.0)), ParamContext(lr=1e-3), False)
    assert got is None, f"want no jump at a warm restart, got {got}"
