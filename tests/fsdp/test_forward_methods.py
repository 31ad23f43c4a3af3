"""``register_fsdp_forward_method``: a method other than ``forward`` as a unit's entry point.

``model.encode(x)`` on the root, ``block.mix(h)`` on each block, a registered method that
``forward`` itself calls, and a registered method called under ``torch.no_grad()`` in the middle
of training: each trains with ``fully_shard`` like the unsharded model (fp32, 1e-5) and bitwise
like FSDP2 with torch's own ``register_fsdp_forward_method`` (bf16 compute, both compute-copy
lifetimes), FSDP2 being the control in every run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_patch import register_fsdp_forward_method
from tests.fsdp import pattern_models
from tests.fsdp.sharded_views import full_params, unsharded_bytes, world
from tests.fsdp.training_runs import Run, assert_same_training

TOL = 1e-5
BF16 = torch.bfloat16


class MixBlock(nn.Module):
    """A residual block whose computation is ``mix``; ``forward`` calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.ff = pattern_models.FeedForward()

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x)


class EncoderNet(nn.Module):
    """Input layer, two blocks and a head; ``encode`` is the whole computation. ``block_entry``
    says how ``encode`` enters each block: through ``block.mix`` or by calling the block."""

    def __init__(self, block_entry: str) -> None:
        super().__init__()
        self.inp = nn.Linear(pattern_models.IN, pattern_models.DIM)
        self.blocks = nn.ModuleList(MixBlock() for _ in range(2))
        self.head = nn.Linear(pattern_models.DIM, pattern_models.OUT)
        self.block_entry = block_entry

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block.mix(h) if self.block_entry == "mix" else block(h)
        return self.head(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode(x)


# pattern: (how encode enters the blocks, methods registered: (on the root, on each block), what the loop calls)
PATTERNS: dict[str, tuple[str, tuple[str | None, str | None], str]] = {
    "root_method": ("call", ("encode", None), "encode"),
    "block_method": ("mix", (None, "mix"), "forward"),
    # forward calls encode and each block's forward calls mix, both registered.
    "called_inside_forward": ("call", ("encode", "mix"), "forward"),
    # As root_method, and each step first calls encode under no_grad (an evaluation).
    "no_grad_method": ("call", ("encode", None), "encode"),
    # As root_method, the loop calling torch.compile(model.encode) (aot_eager).
    "compiled_root_method": ("call", ("encode", None), "compiled_encode"),
}


def _register(impl: str, how: str) -> Callable[[nn.Module, str], None]:
    if impl == "fsdp2" and how == "torch":
        from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

        return torch_register
    return register_fsdp_forward_method  # on a reference (unsharded) model: a no-op


def train(
    impl: str, pattern: str, dtype: torch.dtype | None = None, compute_copy: str = "persistent", how: str = "torch"
) -> Run:
    """``pattern`` for ``pattern_models.STEPS`` SGD steps. ``how``: the FSDP2 run registers with
    torch's function (``"torch"``) or with fsdp_patch's (``"ours"``), which hands it to torch's.

    With ``no_grad_method`` each step's ``Run.losses`` entry is followed by the mean of the
    ``no_grad`` output, so that the evaluation is compared too."""
    rank, world_size = (0, 1) if impl == "reference" else world()
    block_entry, (on_root, on_blocks), entry = PATTERNS[pattern]
    torch.manual_seed(0)
    model = pattern_models.shard(
        EncoderNet(block_entry),
        impl,
        reshard_after_forward=None,
        dtype=dtype,  # type: ignore[arg-type]
        compute_copy=compute_copy,
    )
    register = _register(impl, how)
    if on_blocks is not None:
        for block in model.blocks:
            register(block, on_blocks)
    if on_root is not None:
        register(model, on_root)
    optimizer = pattern_models.sgd(model.parameters())
    if impl == "ours" and dtype is not None:
        from fsdp_patch.optimizer import fully_shard_optimizer

        fully_shard_optimizer(optimizer)
    pattern_models.reset_compiler()
    call = {"encode": model.encode, "forward": model}.get(entry) or torch.compile(model.encode, backend="aot_eager")
    scalars: list[float] = []
    for x, y in pattern_models.data():
        x, y = pattern_models.rows(x, rank, world_size), pattern_models.rows(y, rank, world_size)
        if impl == "ours" and dtype is not None:
            x = x.to(dtype)  # FSDP2 casts its forward inputs itself
        if pattern == "no_grad_method":
            with torch.no_grad():
                evaluated = model.encode(x).float().mean().item()
            if impl == "ours":
                stored = unsharded_bytes(model)
                assert not any(stored.values()), f"gathered after a no_grad call of encode: {stored}"
        loss = pattern_models.mse(call(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scalars.append(loss.item())
        if pattern == "no_grad_method":
            scalars.append(evaluated)
    return Run(scalars, full_params(model))


def fp32_on_ranks(pattern: str) -> None:
    reference = train("reference", pattern)
    for impl, how in (("fsdp2", "torch"), ("ours", "ours")) + (
        (("fsdp2", "ours"),) if pattern == "root_method" else ()
    ):
        assert_same_training(
            train(impl, pattern, how=how),
            reference,
            TOL,
            f"{pattern}/{impl} registered with {how}'s function",
            sharded_want=False,
        )


def bf16_on_ranks(pattern: str) -> None:
    fsdp2 = train("fsdp2", pattern, BF16)
    for compute_copy in ("persistent", "per_gather"):
        assert_same_training(train("ours", pattern, BF16, compute_copy), fsdp2, 0.0, f"{pattern}/bf16/{compute_copy}")


@pytest.mark.parametrize("pattern", tuple(PATTERNS))
def test_registered_method_trains_like_the_reference(dist_pool, pattern: str) -> None:
    """fp32: ``fully_shard`` and FSDP2 (torch's function; for ``root_method`` also fsdp_patch's
    function on the FSDP2 model) against the unsharded model, where registering does nothing."""
    dist_pool(2).run(fp32_on_ranks, pattern)


@pytest.mark.parametrize("pattern", ("root_method", "block_method", "no_grad_method"))
def test_registered_method_bf16_equals_fsdp2(dist_pool, pattern: str) -> None:
    dist_pool(2).run(bf16_on_ranks, pattern)


def test_registered_root_method_with_uneven_shards(dist_pool) -> None:
    """4 ranks: the head's 5 rows and the input layer's 12 split unevenly (2, 2, 1, 0)."""
    dist_pool(4).run(fp32_on_ranks, "root_method")


def refusals_on_ranks() -> None:
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    torch.manual_seed(0)
    model = pattern_models.shard(EncoderNet("call"), "ours", reshard_after_forward=None)  # type: ignore[arg-type]
    encode = model.encode
    with pytest.raises(ValueError, match=r"FSDPEncoderNet has no method 'decode'"):
        register_fsdp_forward_method(model, "decode")
    with pytest.raises(TypeError, match=r"FSDPEncoderNet.block_entry is a str, not a method"):
        register_fsdp_forward_method(model, "block_entry")
    with pytest.raises(TypeError, match=r"FSDPEncoderNet.head is a submodule \(Linear\), not a method"):
        register_fsdp_forward_method(model, "head")
    with pytest.raises(TypeError, match=r"expected method_name to be a str, got 3"):
        register_fsdp_forward_method(model, 3)  # type: ignore[arg-type]
    got = model.encode
    assert got == encode, f"a refused registration changed encode to {got!r}"
    # torch's function acts on FSDP2's own module class only: on a fully_shard module it does nothing.
    torch_register(model, "encode")
    got = model.encode
    assert got == encode, f"torch's register_fsdp_forward_method changed encode to {got!r}"
    # Registering twice wraps once.
    register_fsdp_forward_method(model, "encode")
    first = model.encode
    register_fsdp_forward_method(model, "encode")
    assert model.encode is first, "a second registration wrapped the method again"
    assert first.__wrapped__ == encode, f"the registered method wraps {first.__wrapped__!r}, want {encode!r}"


def test_refusals_name_the_method_and_leave_the_module_alone(dist_pool) -> None:
    dist_pool(2).run(refusals_on_ranks)


def raising_method_on_ranks() -> None:
    """A registered method that raises leaves the unit sharded and nothing gathered."""
    x, y = (pattern_models.rows(t, *world()) for t in pattern_models.data()[0])
    torch.manual_seed(0)
    model = pattern_models.shard(EncoderNet("call"), "ours", reshard_after_forward=None)  # type: ignore[arg-type]

    def failing(inputs: torch.Tensor) -> Any:
        model.inp(inputs)
        raise RuntimeError("out of memory (simulated)")

    model.failing = failing
    register_fsdp_forward_method(model, "failing")
    with pytest.raises(RuntimeError, match="simulated"):
        model.failing(x)
    stored = unsharded_bytes(model)
    assert not any(stored.values()), f"gathered after the method raised: {stored}"
    kinds = {type(p).__name__ for p in model.parameters()}
    assert kinds == {"DTensor"}, f"parameters after the method raised: {kinds}"
    register_fsdp_forward_method(model, "encode")
    loss = pattern_models.mse(model.encode(x), y)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters()), "no grads after the next call"


def test_registered_method_that_raises_leaves_nothing_gathered(dist_pool) -> None:
    dist_pool(2).run(raising_method_on_ranks)
