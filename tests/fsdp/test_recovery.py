"""Recovery from an exception that aborts a forward or a backward.

Autograd drops queued callbacks when a backward raises, so a failed backward would leave every
later backward without its final callback (no grads installed, the root left unsharded) and
partly reduced grads could leak into the next iteration; a failed forward would leave the
unsharded parameters registered in the modules (so ``zero_grad`` and ``state_dict`` would see the
wrong tensors). A failed forward is undone as the exception passes each unit, the root's next
forward resets an aborted backward, and ``reset_iter_state()`` resets explicitly (as FSDP2's
method of that name). The next iteration then gives the grads of a clean one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.fsdp.sharded_views import full_grads, unsharded_bytes, world
from tests.fsdp.transformer_variants import MICROBATCH, build_model
from tests.models import lm_loss, make_batches, rank_slice


def recovery_run() -> dict[str, Any]:
    """An exception aborts a backward (after some units reduced) or a forward; the next
    iteration must give the grads of a clean one and leave nothing unsharded."""
    from fsdp_patch import FSDPModule, parameter_groups
    from tests.models import shard_model

    rank, world_size = world()
    batches = make_batches(2, batch=MICROBATCH)
    reference = build_model("plain")
    for piece in range(world_size):
        (lm_loss(reference, rank_slice(batches[1], piece, world_size)) / world_size).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}

    def clean_step_error(model: nn.Module) -> float:
        lm_loss(model, rank_slice(batches[1], rank, world_size)).backward()
        grads = full_grads(model)
        if any(g is None for g in grads.values()):
            return float("inf")
        return max((grads[n] - expected[n]).abs().max().item() for n in expected)

    class Boom(RuntimeError):
        pass

    out: dict[str, Any] = {}
    for where, explicit in (("backward", False), ("backward", True), ("forward", False), ("forward", True)):
        model = shard_model(build_model("plain"))
        # A completed iteration first, so that stale grads from it could leak too.
        lm_loss(model, rank_slice(batches[0], rank, world_size)).backward()
        armed = [True]

        def fail(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            if not armed[0]:
                return output
            armed[0] = False
            if where == "forward":
                raise Boom("forward")

            def raise_in_backward(grad: torch.Tensor) -> None:
                raise Boom("backward")

            output.register_hook(raise_in_backward)
            return output

        model.blocks[0].register_forward_hook(fail)
        facts: dict[str, Any] = {}
        with pytest.raises(Boom, match=f"^{where}$"):
            lm_loss(model, rank_slice(batches[1], rank, world_size)).backward()
        if explicit:
            model.reset_iter_state()
            facts["after_reset"] = unsharded_bytes(model)
            # blocks.1 had reduced before blocks.0's backward raised: its main grads hold part
            # of the aborted iteration, so its .grad must be None (the next backward overwrites);
            # the others still hold the completed iteration's grads.
            facts["grads_none_after_reset"] = sorted(n for n, p in model.named_parameters() if p.grad is None)
            facts["unsharded_after_reset"] = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)] + [
                f"{n}.weight (module attribute)"
                for n, m in model.named_modules()
                if isinstance(m, nn.Linear) and not isinstance(m.weight, DTensor)
            ]
        model.zero_grad(set_to_none=True)
        facts["max_abs_err"] = clean_step_error(model)
        facts["after_backward"] = unsharded_bytes(model)
        facts["units"] = sum(isinstance(m, FSDPModule) for m in model.modules())
        facts["param_names"] = [n for n, _ in model.named_parameters()]
        facts["groups"] = len(parameter_groups(model))
        out[f"{where}_{'explicit' if explicit else 'auto'}"] = facts
    return out


@pytest.mark.parametrize("case", ["backward_auto", "backward_explicit", "forward_auto", "forward_explicit"])
def test_iteration_after_an_exception_matches_a_clean_one(run_once, case: str) -> None:
    for facts in run_once(2, recovery_run):
        outcome = facts[case]
        assert outcome["max_abs_err"] <= 1e-6, outcome
        assert set(outcome["after_backward"].values()) == {0}, outcome["after_backward"]
        if case.endswith("explicit"):
            assert set(outcome["after_reset"].values()) == {0}, f"unsharded bytes after reset: {outcome['after_reset']}"
            left = outcome["unsharded_after_reset"]
            assert left == [], f"unsharded parameters after reset_iter_state(): {left}"
        if case == "backward_explicit":
            got = outcome["grads_none_after_reset"]
            assert got and all(n.startswith("blocks.1.") for n in got), f"grads None after reset: {got}"
            want = sum(n.startswith("blocks.1.") for n in outcome["param_names"])
            assert len(got) == want, f"{len(got)} of blocks.1's {want} grads are None after reset: {got}"
