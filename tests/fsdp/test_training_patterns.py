"""``fully_shard`` trains like the unsharded model on the patterns real training scripts use,
with torch's FSDP2 as the control in every test.

Each pattern runs on 2 gloo ranks with ``fully_shard`` and with FSDP2, and in one process
unsharded; fp32, SGD with momentum. Tolerance: fp32 sums over differently split batches. The same
patterns in mixed precision: ``test_training_patterns_mixed.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from tests.comparison import max_abs_difference
from tests.fsdp.pattern_models import IMPLS, STEPS, NetOptions, build, data, mse, rows, sgd
from tests.fsdp.pattern_training import (
    WORLD_SIZE,
    backward_once,
    backward_twice,
    fsdp2_limitation,
    sgd_all,
    sgd_and_head_bias_apart,
)
from tests.fsdp.sharded_views import difference, full, full_params, rank0, world

TOL = 1e-5


def _convert_without_change(model: nn.Module) -> None:
    """Conversions that change nothing, and meta-device style initialization: empty storage, then the values loaded."""
    model.float()
    model.to(torch.float32)
    model.cpu()
    model.to("cpu")
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.to_empty(device="cpu")
    model.load_state_dict(saved)


def _freeze_head(model: nn.Module, facts: dict[str, Any], optimizers: list[torch.optim.Optimizer]) -> None:
    model.head.requires_grad_(False)


def _unfreeze_head(model: nn.Module, facts: dict[str, Any], optimizers: list[torch.optim.Optimizer]) -> None:
    model.head.requires_grad_(True)


def _load(assign: bool) -> Callable[[nn.Module, dict[str, Any], list[torch.optim.Optimizer]], None]:
    def load(model: nn.Module, facts: dict[str, Any], optimizers: list[torch.optim.Optimizer]) -> None:
        loaded = {k: v.detach() * 0.5 + 0.01 for k, v in model.state_dict().items()}
        model.load_state_dict(loaded, assign=assign)
        facts["loaded_values_not_in_use"] = {
            k: diff
            for k, v in loaded.items()
            if (diff := difference(full(model.get_parameter(k)), full(v))) is not None
        }
        if assign:
            # assign=True registers new tensors: an optimizer must be built over them.
            optimizers[:] = [sgd(model.parameters())]

    return load


def _input_grad_first(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, facts: dict[str, Any], world_size: int
) -> None:
    """``torch.autograd.grad`` of the loss for the input, before the training forward."""
    xi = x.clone().requires_grad_()
    (input_grad,) = torch.autograd.grad(mse(model(xi), y), xi)
    facts.setdefault("grads_after_autograd_grad", []).append(
        [n for n, p in model.named_parameters() if p.grad is not None]
    )
    facts.setdefault("input_grad_norm", []).append(input_grad.norm().item() * world_size)


def _halve_grads_by_assignment(model: nn.Module) -> None:
    # A grad assigned by the user (a new tensor, not fully_shard's view) is what the next
    # backward accumulates onto, as in an unsharded model.
    for p in model.parameters():
        p.grad = p.grad * 0.5


@dataclass(frozen=True)
class Pattern:
    """An fp32 pattern of :func:`train`: what the script does at each point of its loop.

    Attributes:
        net: The model's options.
        frozen_head: The head is frozen before sharding.
        prepare: Runs on the sharded model before training.
        optimizers: Builds the optimizers over the model.
        at_step_1: Runs before the second step's forward (may replace the optimizers, in place).
        before_forward: Runs before each training forward (with the rank's rows and the facts).
        backward: Runs the backward of the loss; returns the loss it reports.
        zero_grad_after_step: Whether ``optimizer.zero_grad()`` follows each step.
        after_step: Runs after each step.
    """

    net: NetOptions | None = None
    frozen_head: bool = False
    prepare: Callable[[nn.Module], None] | None = None
    optimizers: Callable[[nn.Module], list[torch.optim.Optimizer]] = sgd_all
    at_step_1: Callable[[nn.Module, dict[str, Any], list[torch.optim.Optimizer]], None] | None = None
    before_forward: Callable[[nn.Module, torch.Tensor, torch.Tensor, dict[str, Any], int], None] | None = None
    backward: Callable[[Any, torch.Tensor], torch.Tensor] = backward_once
    zero_grad_after_step: bool = True
    after_step: Callable[[nn.Module], None] | None = None


PATTERNS = {
    "ckpt_inside_nonreentrant": Pattern(net={"inner": "nonreentrant"}),
    "ckpt_inside_reentrant": Pattern(net={"inner": "reentrant"}),
    "ckpt_around_nonreentrant": Pattern(net={"outer": "nonreentrant"}),
    "ckpt_around_reentrant": Pattern(net={"outer": "reentrant"}),
    "multi_backward": Pattern(net={"output": "dataclass"}, backward=backward_twice),
    "output_dataclass": Pattern(net={"output": "dataclass"}),
    "output_object": Pattern(net={"output": "object"}),
    "output_nested": Pattern(net={"output": "nested"}),
    "zero_size": Pattern(net={"zero_size": True}),
    "convert_noop": Pattern(prepare=_convert_without_change),
    "two_optimizers": Pattern(optimizers=sgd_and_head_bias_apart),
    "late_freeze": Pattern(at_step_1=_freeze_head),
    "late_unfreeze": Pattern(frozen_head=True, at_step_1=_unfreeze_head),
    "load_assign": Pattern(at_step_1=_load(assign=True)),
    "load_copy": Pattern(at_step_1=_load(assign=False)),
    "autograd_grad": Pattern(before_forward=_input_grad_first),
    "user_grad": Pattern(zero_grad_after_step=False, after_step=_halve_grads_by_assignment),
}


def train(impl: str, name: str, reshard_after_forward: bool = True) -> dict[str, Any]:
    """Trains pattern ``name`` STEPS steps with ``impl``; returns losses, final params and facts."""
    pattern = PATTERNS[name]
    rank, world_size = world()
    if impl == "reference":
        rank, world_size = 0, 1
    model = build(impl, pattern.net, frozen_head=pattern.frozen_head, reshard_after_forward=reshard_after_forward)
    if pattern.prepare is not None:
        pattern.prepare(model)
    optimizers = pattern.optimizers(model)
    facts: dict[str, Any] = {"losses": []}
    for step, (x, y) in enumerate(data()):
        x, y = rows(x, rank, world_size), rows(y, rank, world_size)
        if step == 1 and pattern.at_step_1 is not None:
            pattern.at_step_1(model, facts, optimizers)
        if pattern.before_forward is not None:
            pattern.before_forward(model, x, y, facts, world_size)
        output = model(x)
        loss = pattern.backward(output, mse(output, y))
        facts["losses"].append(loss.item())
        if step == STEPS - 1:
            facts["grads"] = {n: full(p.grad) for n, p in model.named_parameters()}
        for optimizer in optimizers:
            optimizer.step()
            if pattern.zero_grad_after_step:
                optimizer.zero_grad()
        if pattern.after_step is not None:
            pattern.after_step(model)
    facts["params"] = full_params(model)
    return facts


def global_losses(run: dict[str, Any], impl: str) -> list[float]:
    per_rank = [r[impl] for r in run["losses"]]
    return [sum(step) / len(per_rank) for step in zip(*per_rank, strict=True)]


def pattern_run(pattern: str, reshard_after_forward: bool = True, impls: tuple[str, ...] = IMPLS) -> dict[str, Any]:
    """``train`` for each implementation; an implementation that raises is reported, not fatal."""
    out: dict[str, Any] = {}
    for impl in impls:
        try:
            out[impl] = train(impl, pattern, reshard_after_forward)
        except Exception as exc:
            out[impl] = {"error": f"{type(exc).__name__}: {exc}"}
    losses = {impl: r.get("losses") for impl, r in out.items()}
    return {"results": rank0(out), "losses": losses}


def assert_trains_like_reference(
    run_once: Any, pattern: str, reshard_after_forward: bool = True, fsdp2_fails: bool = False
) -> dict[str, Any]:
    """Asserts ``fully_shard`` (and FSDP2, unless ``fsdp2_fails``: then FSDP2 must raise) train
    ``pattern`` like the unsharded reference; returns rank 0's results."""
    per_rank = run_once(WORLD_SIZE, pattern_run, pattern, reshard_after_forward)
    results = per_rank[0]["results"]
    limitation = fsdp2_limitation(pattern, results)
    if limitation is not None:
        # Said, and the check goes on against the unsharded reference alone.
        warnings.warn(
            f"FSDP2 control left out: {limitation}; fully_shard is checked against the unsharded model", stacklevel=2
        )
        fsdp2_fails = True
    impls = ("ours",) if fsdp2_fails else ("fsdp2", "ours")  # the control first: if it fails, the test is wrong
    if fsdp2_fails:
        assert "error" in results["fsdp2"], f"FSDP2 trained {pattern}; this test's premise changed"
    for impl in impls:
        assert "error" not in results[impl], f"{pattern} under {impl} raised: {results[impl]['error']}"
    want = results["reference"]
    for impl in impls:
        got_losses, want_losses = global_losses({"losses": [r["losses"] for r in per_rank]}, impl), want["losses"]
        loss_err = max(abs(a - b) for a, b in zip(got_losses, want_losses, strict=True))
        assert loss_err <= TOL, f"{pattern}/{impl}: losses {got_losses}, reference {want_losses}"
        err, _ = max_abs_difference(results[impl]["params"], want["params"])
        assert err <= TOL, f"{pattern}/{impl}: final params differ from the reference by {err}"
    return results


@pytest.mark.parametrize("reshard_after_forward", (True, False))
@pytest.mark.parametrize(
    "pattern",
    ("ckpt_inside_nonreentrant", "ckpt_inside_reentrant", "ckpt_around_nonreentrant", "ckpt_around_reentrant"),
)
def test_activation_checkpointing(run_once: Any, pattern: str, reshard_after_forward: bool) -> None:
    """``torch.utils.checkpoint`` inside a unit's forward (the recompute must see gathered
    parameters) and around a unit (the recompute must not free what backward needs)."""
    assert_trains_like_reference(run_once, pattern, reshard_after_forward)


def test_two_backwards_per_step_both_reduced(run_once: Any) -> None:
    """``loss.backward(retain_graph=True); aux.backward()``: the second backward's grads (aux
    reaches only the first block and the input layer) are reduced and added, not left behind."""
    results = assert_trains_like_reference(run_once, "multi_backward")
    grads, want = results["ours"]["grads"], results["reference"]["grads"]
    err, _ = max_abs_difference(grads, want)
    assert err <= TOL, f"last step's grads differ from the reference by {err}"


def test_autograd_grad_leaves_parameter_grads_alone(run_once: Any) -> None:
    """``torch.autograd.grad`` through the sharded model fills no ``.grad`` and reduces nothing."""
    results = assert_trains_like_reference(run_once, "autograd_grad")
    got, want = results["ours"], results["reference"]
    written = got["grads_after_autograd_grad"]
    assert written == [[]] * STEPS, f"per step, parameters whose .grad torch.autograd.grad wrote: {written}"
    # The input grad itself: each rank's is that of its own rows (averaged loss over fewer rows).
    assert len(got["input_grad_norm"]) == len(want["input_grad_norm"]) == STEPS


@pytest.mark.parametrize("output", ("output_dataclass", "output_object", "output_nested"))
def test_any_forward_output_structure(run_once: Any, output: str) -> None:
    """The root returns a dataclass, a plain object holding the logits, or nested containers.

    FSDP2 finds no tensor in a plain object, so its backward finds the root's weights freed.
    """
    assert_trains_like_reference(run_once, output, fsdp2_fails=output == "output_object")


@pytest.mark.parametrize("pattern", ("load_assign", "load_copy"))
def test_load_state_dict_then_train(run_once: Any, pattern: str) -> None:
    """``load_state_dict`` with ``assign=True`` (new tensors registered in the module) and
    ``assign=False``: the loaded values are the ones the next forward uses and the optimizer steps."""
    results = assert_trains_like_reference(run_once, pattern)
    diffs = results["ours"]["loaded_values_not_in_use"]
    assert diffs == {}, f"after load_state_dict the parameters do not hold the loaded values: {diffs}"


@pytest.mark.parametrize("pattern", ("late_freeze", "late_unfreeze"))
def test_requires_grad_toggled_after_sharding(run_once: Any, pattern: str) -> None:
    """``head.requires_grad_(False)`` after ``fully_shard``: no grad, no move; ``True`` for a head
    frozen before: it trains from that step on."""
    results = assert_trains_like_reference(run_once, pattern)
    grads = results["ours"]["grads"]
    if pattern == "late_freeze":
        assert grads["head.weight"] is None and grads["head.bias"] is None, "a frozen head got grads"
    else:
        assert grads["head.weight"] is not None, "the unfrozen head got no grad"


def test_two_optimizers_over_one_group(run_once: Any) -> None:
    """Two optimizers split one unit's parameters (``head.bias`` alone in the second); each
    steps and zeroes its own in turn."""
    assert_trains_like_reference(run_once, "two_optimizers")


def test_noop_conversions_and_to_empty_keep_training_right(run_once: Any) -> None:
    """``.float()``, ``.to(float32)``, ``.cpu()``, ``.to('cpu')``, then ``to_empty`` and a load."""
    assert_trains_like_reference(run_once, "convert_noop")


def test_user_assigned_grads_are_accumulated_onto(run_once: Any) -> None:
    """A grad the user assigns (a new tensor) is what the next backward adds to."""
    assert_trains_like_reference(run_once, "user_grad")


def test_zero_size_parameter_trains(run_once: Any) -> None:
    """A parameter of shape (0, 3): FSDP2 fails at the first backward; ``fully_shard`` trains."""
    results = assert_trains_like_reference(run_once, "zero_size", fsdp2_fails=True)
    shape = tuple(results["ours"]["params"]["empty"].shape)
    assert shape == (0, 3), f"zero-size parameter's global shape: got {shape}, want (0, 3)"
