"""``torch.compile`` over ``fully_shard`` units: the whole model or each block, backends ``eager``,
``aot_eager`` and ``inductor`` on CPU.

The units' hooks run outside dynamo (a graph break at each, as FSDP2's); the compiled code sees
the unsharded parameters as ordinary inputs. Each run trains compiled with ``fully_shard`` and,
as the control, compiled the same way with FSDP2: fp32 like the uncompiled unsharded model to
1e-5, bf16 compute (optimizer adapter, both compute-copy lifetimes) bitwise like FSDP2.

Scopes: ``model`` (``torch.compile(model)``), ``blocks`` (``block.compile()`` on each sharded
block), ``blocks_wrapped`` (``model.blocks[i] = torch.compile(block)`` after sharding) and
``compile_then_shard`` (each block compiled, then the compiled blocks and the root sharded, as
torchtitan orders it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.fsdp import pattern_models
from tests.fsdp.sharded_views import full_params, world
from tests.fsdp.training_runs import Run, assert_same_training

TOL = 1e-5
BF16 = torch.bfloat16


def _compiled(
    impl: str, scope: str, backend: str | None, net: dict[str, Any], dtype: torch.dtype | None, compute_copy: str
) -> tuple[nn.Module, Any]:
    """(the model, what the training loop calls)."""
    torch.manual_seed(0)
    model = pattern_models.Net(**net)
    if backend is not None and scope == "compile_then_shard":
        for index, block in enumerate(model.blocks):
            model.blocks[index] = torch.compile(block, backend=backend)
    model = pattern_models.shard(model, impl, reshard_after_forward=None, dtype=dtype, compute_copy=compute_copy)  # type: ignore[arg-type]
    if backend is None or scope == "compile_then_shard":
        return model, model
    if scope == "model":
        return model, torch.compile(model, backend=backend)
    for index, block in enumerate(model.blocks):
        if scope == "blocks":
            block.compile(backend=backend)
        else:
            model.blocks[index] = torch.compile(block, backend=backend)
    return model, model


def train(
    impl: str,
    scope: str,
    backend: str | None,
    net: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    compute_copy: str = "persistent",
    eval_between: bool = False,
) -> Run:
    """``pattern_models.STEPS`` SGD steps; ``backend=None`` is the uncompiled run. With
    ``eval_between``, an eval forward under ``no_grad`` follows each step."""
    rank, world_size = (0, 1) if impl == "reference" else world()
    pattern_models.reset_compiler()
    model, call = _compiled(impl, scope, backend, net or {}, dtype, compute_copy)
    optimizer = pattern_models.sgd(model.parameters())
    if impl == "ours" and dtype is not None:
        from fsdp_patch.optimizer import fully_shard_optimizer

        fully_shard_optimizer(optimizer)
    losses = []
    for x, y in pattern_models.data():
        x, y = pattern_models.rows(x, rank, world_size), pattern_models.rows(y, rank, world_size)
        if impl == "ours" and dtype is not None:
            x = x.to(dtype)  # FSDP2 casts its forward inputs itself
        loss = pattern_models.mse(call(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if eval_between:
            model.eval()
            with torch.no_grad():
                call(x)
            model.train()
    # torch.compile(block) in the module tree adds "_orig_mod." to the names.
    params = {name.replace("_orig_mod.", ""): value for name, value in full_params(model).items()}
    return Run(losses, params)


def fp32_on_ranks(scope: str, backend: str, net: dict[str, Any] | None = None, eval_between: bool = False) -> None:
    reference = train("reference", scope, None, net, eval_between=eval_between)
    for impl in ("fsdp2", "ours"):
        got = train(impl, scope, backend, net, eval_between=eval_between)
        assert_same_training(got, reference, TOL, f"{impl} compiled ({scope}, {backend})", sharded_want=False)


def bf16_on_ranks(scope: str, backend: str) -> None:
    fsdp2 = train("fsdp2", scope, backend, dtype=BF16)
    for compute_copy in ("persistent", "per_gather"):
        got = train("ours", scope, backend, dtype=BF16, compute_copy=compute_copy)
        assert_same_training(got, fsdp2, 0.0, f"bf16 compiled ({scope}, {backend}, {compute_copy})")


@pytest.mark.parametrize("scope", ("model", "blocks", "blocks_wrapped", "compile_then_shard"))
@pytest.mark.parametrize("backend", ("eager", "aot_eager"))
def test_compiled_training_equals_the_uncompiled_reference(dist_pool, backend: str, scope: str) -> None:
    dist_pool(2).run(fp32_on_ranks, scope, backend)


@pytest.mark.slow
@pytest.mark.parametrize("scope", ("model", "blocks"))
def test_inductor_training_equals_the_uncompiled_reference(dist_pool, scope: str) -> None:
    dist_pool(2).run(fp32_on_ranks, scope, "inductor")


@pytest.mark.parametrize(
    ("scope", "backend"),
    (("model", "aot_eager"), ("blocks", "aot_eager"), pytest.param("model", "inductor", marks=pytest.mark.slow)),
)
def test_compiled_bf16_equals_fsdp2(dist_pool, scope: str, backend: str) -> None:
    dist_pool(2).run(bf16_on_ranks, scope, backend)


@pytest.mark.parametrize(
    "net",
    ({"inner": "nonreentrant"}, {"outer": "nonreentrant"}, {"outer": "reentrant"}),
    ids=("checkpoint_inside_blocks", "checkpoint_around_blocks", "reentrant_checkpoint_around_blocks"),
)
def test_compiled_with_activation_checkpointing_and_eval_forwards(dist_pool, net: dict[str, Any]) -> None:
    """Checkpointing inside each block's forward or around each block, the whole model compiled,
    an eval forward under ``no_grad`` after every step (dynamo compiles the no-grad graph too)."""
    dist_pool(2).run(fp32_on_ranks, "model", "aot_eager", net, True)
