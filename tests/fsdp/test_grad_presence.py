"""Grad presence per parameter: a grad set to ``None`` while others of its unit keep theirs is
never resurrected, and a parameter that got no gradient keeps ``None``, as in the unsharded
model and under torch FSDP2.

Each pattern trains 4 AdamW steps (weight decay and moments move any parameter that has a grad,
even a zero one) on 2 gloo ranks, and on 4, where the head's 5 rows split (2, 2, 1, 0) and the
last rank's shard of it (and its presence flags) is empty: fp32 within 1e-5 of the unsharded model, FSDP2 alongside as
the control; bf16 compute bitwise equal to FSDP2 with the same dtypes, both compute-copy
lifetimes, fp32 main grads (FSDP2: fp32 reduce), since grads accumulate across backwards.
Which grads are ``None`` at the end must match too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.fsdp.parity import (
    NetOptions,
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

STEPS = 4


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _train(impl: str, pattern: str, precision: str) -> dict[str, Any]:
    net: NetOptions = {"spare": pattern == "unused", "aux": pattern == "rank_divergent"}
    # Grads accumulate across backwards here: in fp32 main grads, as FSDP2 adds into its fp32
    # sharded grads (with its reduce in fp32 too, the same dtypes throughout).
    model = build(impl, precision, net=net, main_grads_dtype=torch.float32 if precision == "bf16" else None)
    named = dict(model.named_parameters())
    if pattern == "unheld":
        # blocks.0.fc1.bias is in no optimizer: its grad accumulates, the others' are zeroed.
        held = [p for n, p in named.items() if n != "blocks.0.fc1.bias"]
        optimizers = [(1, adapt(_adamw(held), impl, precision))]
    elif pattern == "two_rates":
        # Weights and biases share every unit: the biases' optimizer steps every other step.
        weights = [p for n, p in named.items() if n.endswith("weight")]
        biases = [p for n, p in named.items() if not n.endswith("weight")]
        optimizers = [(1, adapt(_adamw(weights), impl, precision)), (2, adapt(_adamw(biases), impl, precision))]
    else:
        optimizers = [(1, adapt(_adamw(model.parameters()), impl, precision))]
    rank, world_size = world()
    for step, (x, y) in enumerate(batches(STEPS), start=1):
        if pattern == "rank_divergent":
            # Rank 0 uses the aux head, rank 1 does not; the reference does the same per rank's rows.
            if impl == "reference":
                per = x.shape[0] // world_size
                loss = (
                    sum(
                        loss_of(
                            model,
                            impl,
                            precision,
                            x[r * per : (r + 1) * per],
                            y[r * per : (r + 1) * per],
                            use_aux=r == 0,
                        )
                        for r in range(world_size)
                    )
                    / world_size
                )
            else:
                loss = loss_of(model, impl, precision, x, y, use_aux=rank == 0)
        else:
            loss = loss_of(model, impl, precision, x, y)
        loss.backward()  # type: ignore[union-attr]
        for every, optimizer in optimizers:
            if step % every == 0:
                optimizer.step()
                if pattern != "weights_none":
                    optimizer.zero_grad(set_to_none=True)
        if pattern == "weights_none":
            for name, p in named.items():
                if name.endswith("weight"):
                    p.grad = None  # biases keep accumulating
    grads = full_grads(model)
    return {"params": full_params(model), "grads_none": sorted(n for n, g in grads.items() if g is None)}


def presence_run(pattern: str, precision: str) -> None:
    impls = ("reference", "ours") if pattern == "rank_divergent" else None
    results = run_contenders(lambda impl: _train(impl, pattern, precision), precision, impls)
    if pattern == "rank_divergent":
        assert_close(
            results["ours"]["params"], results["reference"]["params"], f"{pattern}, ours against the unsharded model"
        )
        control = "reference"
    else:
        assert_parity(results, precision, pattern)
        control = "reference" if precision == "fp32" else "fsdp2"
    want = results[control]["grads_none"]
    for impl, got in results.items():
        assert got["grads_none"] == want, f"{pattern}/{impl}: grads left None {got['grads_none']}, {control} {want}"


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
