"""Grad presence per parameter: a grad set to ``None`` while others of its unit keep theirs is
never resurrected, and a parameter that got no gradient keeps ``None``, as in the unsharded
model and under torch FSDP2.

Each pattern trains 4 AdamW steps (weight decay and moments move any parameter that has a grad,
even a zero one) on 2 gloo ranks, and on 4, where the head's 5 rows split (2, 2, 1, 0) and the
last rank's shard of it (and its presence flags) is empty: fp32 within 1e-5 of the unsharded model, FSDP2 alongside as
the control; bf16 compute bitwise equal to FSDP2 with the same dtypes, both compute-copy
lifetimes, fp32 main grads (FSDP2: fp32 reduce), since grads accumulate across backwards.
Which grads are ``None`` at the end must match too.

Grad objects: after a backward every grad is its group's main-grad view, also where a tensor the
user assigned was not reached by that backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.fsdp.parity import (
    adapt,
    assert_close,
    assert_parity,
    batches,
    build,
    full_grads,
    full_params,
    loss_of,
    run_contenders,
    world,
)
from tests.fsdp.pattern_models import NetOptions
from tests.fsdp.sharded_views import difference

STEPS = 4


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _one_optimizer(named: dict[str, torch.nn.Parameter]) -> list[tuple[int, Any]]:
    return [(1, list(named.values()))]


def _all_but_one_bias(named: dict[str, torch.nn.Parameter]) -> list[tuple[int, Any]]:
    # blocks.0.ff.fc1.bias is in no optimizer: its grad accumulates, the others' are zeroed.
    return [(1, [p for n, p in named.items() if n != "blocks.0.ff.fc1.bias"])]


def _weights_every_step_biases_every_other(named: dict[str, torch.nn.Parameter]) -> list[tuple[int, Any]]:
    # Weights and biases share every unit: the biases' optimizer steps every other step.
    weights = [p for n, p in named.items() if n.endswith("weight")]
    biases = [p for n, p in named.items() if not n.endswith("weight")]
    return [(1, weights), (2, biases)]


def _loss_of_all(model: torch.nn.Module, impl: str, precision: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss_of(model, impl, precision, x, y)


def _aux_head_on_rank_0(
    model: torch.nn.Module, impl: str, precision: str, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    # Rank 0 uses the aux head, the others do not; the reference does the same per rank's rows.
    rank, world_size = world()
    if impl != "reference":
        return loss_of(model, impl, precision, x, y, use_aux=rank == 0)
    per = x.shape[0] // world_size
    rows = [(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]) for r in range(world_size)]
    return sum(loss_of(model, impl, precision, xr, yr, use_aux=r == 0) for r, (xr, yr) in enumerate(rows)) / world_size


def _weights_grads_set_to_none(named: dict[str, torch.nn.Parameter]) -> None:
    for name, p in named.items():
        if name.endswith("weight"):
            p.grad = None  # biases keep accumulating


@dataclass(frozen=True)
class Pattern:
    """Whose grads a script keeps, drops or never makes.

    Attributes:
        net: The model's options.
        optimizers: The parameters of each optimizer, with the interval of its steps.
        loss: The loss of a batch on this rank.
        zero_grad: Whether each optimizer's step is followed by ``zero_grad(set_to_none=True)``.
        after_step: Runs on the named parameters after each step.
        fsdp2: Whether FSDP2 can run it (the control); else the unsharded model alone is.
    """

    net: NetOptions = field(default_factory=lambda: NetOptions())
    optimizers: Callable[[dict[str, torch.nn.Parameter]], list[tuple[int, Any]]] = _one_optimizer
    loss: Callable[..., torch.Tensor] = _loss_of_all
    zero_grad: bool = True
    after_step: Callable[[dict[str, torch.nn.Parameter]], None] | None = None
    fsdp2: bool = True


PATTERNS = {
    "unheld": Pattern(optimizers=_all_but_one_bias),
    "two_rates": Pattern(optimizers=_weights_every_step_biases_every_other),
    "weights_none": Pattern(zero_grad=False, after_step=_weights_grads_set_to_none),
    "unused": Pattern(net={"spare": True}),
    # FSDP2 cannot run this one: its reduce-scatter would cover different parameters on the ranks.
    "rank_divergent": Pattern(net={"aux": True}, loss=_aux_head_on_rank_0, fsdp2=False),
}


def _train(impl: str, name: str, precision: str) -> dict[str, Any]:
    pattern = PATTERNS[name]
    # Grads accumulate across backwards here: in fp32 main grads, as FSDP2 adds into its fp32
    # sharded grads (with its reduce in fp32 too, the same dtypes throughout).
    model = build(impl, precision, net=pattern.net, main_grads_dtype=torch.float32 if precision == "bf16" else None)
    named = dict(model.named_parameters())
    optimizers = [(every, adapt(_adamw(params), impl, precision)) for every, params in pattern.optimizers(named)]
    for step, (x, y) in enumerate(batches(STEPS), start=1):
        pattern.loss(model, impl, precision, x, y).backward()
        for every, optimizer in optimizers:
            if step % every == 0:
                optimizer.step()
                if pattern.zero_grad:
                    optimizer.zero_grad(set_to_none=True)
        if pattern.after_step is not None:
            pattern.after_step(named)
    grads = full_grads(model)
    return {"params": full_params(model), "grads_none": sorted(n for n, g in grads.items() if g is None)}


def presence_run(name: str, precision: str) -> None:
    pattern = PATTERNS[name]
    impls = None if pattern.fsdp2 else ("reference", "ours")
    results = run_contenders(lambda impl: _train(impl, name, precision), precision, impls)
    if not pattern.fsdp2:
        assert_close(
            results["ours"]["params"], results["reference"]["params"], f"{name}, ours against the unsharded model"
        )
        control = "reference"
    else:
        assert_parity(results, precision, name)
        control = "reference" if precision == "fp32" else "fsdp2"
    want = results[control]["grads_none"]
    for impl, got in results.items():
        assert got["grads_none"] == want, f"{name}/{impl}: grads left None {got['grads_none']}, {control} {want}"


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("precision", ("fp32", "bf16"))
@pytest.mark.parametrize("pattern", ("unheld", "two_rates", "weights_none", "unused"))
def test_grad_presence_per_parameter(dist_pool: Any, pattern: str, precision: str, world_size: int) -> None:
    """``unheld``: a parameter no optimizer holds keeps accumulating while the others are zeroed;
    ``two_rates``: one optimizer steps and zeroes the weights every step, another the biases
    every other step;
    ``weights_none``: ``p.grad = None`` for weights only, biases accumulate; ``unused``: a
    parameter no forward uses keeps ``None`` (AdamW would decay it on a zero grad)."""
    dist_pool(world_size).run(presence_run, pattern, precision)


@pytest.mark.parametrize("world_size", (2, 4))
def test_parameter_used_on_some_ranks_only_gets_every_ranks_gradient(dist_pool: Any, world_size: int) -> None:
    """A parameter only rank 0 uses: each rank's shard gets the averaged gradient (present on
    both ranks), as the unsharded model computes it. FSDP2 cannot run this one: its
    reduce-scatter would cover different parameters on the ranks."""
    dist_pool(world_size).run(presence_run, "rank_divergent", "fp32")


# Before the second backward of mixed_grads_run: what each parameter's grad is ("assigned": a
# tensor of the user's, "kept": the view the first backward left, "none": None), and whether
# that backward reaches the parameter (aux and spare are left out of its forward).
MIXED = {
    "blocks.0.ff.fc1.weight": ("assigned", True),
    "blocks.0.ff.fc2.weight": ("kept", True),
    "blocks.1.ff.fc1.weight": ("none", True),
    "spare": ("assigned", False),
    "aux.weight": ("kept", False),
    "aux.bias": ("none", False),
}


def mixed_grads_run() -> dict[str, Any]:
    """Two backwards over the root unit and two block units, the second one reaching only some
    parameters, with grads set in between as :data:`MIXED` says.

    Returns: the parameters whose grad after the second backward is not their group's
    main-grad view, those whose grad is ``None``, those whose value is not what the unsharded
    model's rule gives (the grad it had plus what the second backward adds), and those whose grad
    changes when the user then rescales, in place, the tensors they assigned.
    """
    from fsdp_patch import parameter_group_of

    model = build("ours", "fp32", net={"spare": True, "aux": True})
    named = dict(model.named_parameters())
    ((x, y),) = batches(1)
    loss_of(model, "ours", "fp32", x, y, use_aux=True).backward()
    assigned: list[torch.Tensor] = []
    for name, (before, _) in MIXED.items():
        param = named[name]
        if before == "assigned":
            param.grad = torch.full_like(param, 2.0).detach()
            assigned.append(param.grad)
        elif before == "none":
            param.grad = None
    had = full_grads(model)
    loss_of(model, "ours", "fp32", x, y).backward()
    got = full_grads(model)

    def is_view(param: torch.nn.Parameter) -> bool:
        group = parameter_group_of(param)
        assert group is not None, "a parameter of a fully_shard unit without its group"
        return param.grad is group.grad_views([group.index_of(param)])[0]

    not_views = sorted(n for n, p in named.items() if p.grad is not None and not is_view(p))
    with torch.no_grad():
        for tensor in assigned:
            tensor.mul_(5.0)
    rescaled = full_grads(model)
    # What the second backward alone adds: the same weights and batch, from no grads.
    model.zero_grad(set_to_none=True)
    loss_of(model, "ours", "fp32", x, y).backward()
    added = full_grads(model)
    wrong = {}
    for name, grad in got.items():
        before, now = had[name], added[name]
        want = before if now is None else now if before is None else before + now
        if (diff := difference(grad, want)) is not None:
            wrong[name] = diff
    return {
        "unreached": sorted(n for n, g in added.items() if g is None),
        "not_views": not_views,
        "none": sorted(n for n, g in got.items() if g is None),
        "wrong": wrong,
        "changed_by_rescale": {n: d for n in got if (d := difference(rescaled[n], got[n])) is not None},
    }


@pytest.mark.parametrize("world_size", (2, 4))
def test_grads_after_a_backward_are_main_grad_views_whether_or_not_it_reached_them(
    dist_pool: Any, world_size: int
) -> None:
    """After a backward, every parameter that has a grad holds its group's main-grad view: the
    tensors a user assigned were copied in, whether or not the backward added to them, so
    rescaling those tensors afterwards changes no grad. Values follow the unsharded model's rule;
    a parameter that had no grad and got none keeps ``None``."""
    unreached = sorted(n for n, (_, reached) in MIXED.items() if not reached)
    want = {"unreached": unreached, "not_views": [], "none": ["aux.bias"], "wrong": {}, "changed_by_rescale": {}}
    for rank, got in enumerate(dist_pool(world_size).run(mixed_grads_run)):
        assert got == want, f"{world_size} ranks, rank {rank}: want {want}, got {got}"
