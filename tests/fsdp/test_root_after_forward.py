"""The root keeps its unsharded parameters after forward, as FSDP2's does, and reshards at the
end of backward: code between forward and backward uses the root's weights as plain tensors (a
penalty on ``model.head.weight``, logits tied to the input embedding computed after forward).

Each pattern trains a 2-block model with ``fully_shard``, with torch's FSDP2 (the control) and
unsharded in one process (the reference): fp32 to 1e-5 of the reference, bf16 compute (with the
optimizer adapter, both compute-copy lifetimes) bitwise equal to FSDP2 with ``param_dtype=bf16``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tests.comparison import max_abs_difference
from tests.fsdp import pattern_models
from tests.fsdp.sharded_views import count_collectives, full, full_params, unsharded_bytes, world
from tests.fsdp.training_runs import Run, assert_same_training

TOL = 1e-5
VOCAB, SEQ = 13, 5  # the embedding's 13 rows split unevenly over 2 and 4 ranks
BF16 = torch.bfloat16


class TiedLM(nn.Module):
    """Embedding, two blocks and a norm in the root; returns hidden states, whose logits the
    training script computes after forward with the embedding's weight (tied output layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, pattern_models.DIM)
        self.blocks = nn.ModuleList(pattern_models.Block("none") for _ in range(2))
        self.norm = nn.LayerNorm(pattern_models.DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


def _tied_batches() -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randint(0, VOCAB, (pattern_models.BATCH, SEQ + 1), generator=gen),) for _ in range(pattern_models.STEPS)
    ]


def _pattern_batches() -> list[tuple[torch.Tensor, ...]]:
    return list(pattern_models.data())


def _tied_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    (tokens,) = batch
    hidden = model(tokens[:, :-1])
    logits = hidden @ model.embed.weight.t()  # the root's weight, outside forward
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _mse(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    return pattern_models.mse(model(x), y)


def _two_forwards(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    return _mse(model, batch) + pattern_models.mse(model(0.5 * x), y)  # the root's forward twice, one backward


def _head_penalty(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return _mse(model, batch) + 0.01 * model.head.weight.float().pow(2).sum()  # the root's weight, outside forward


def _forward_without_backward(model: nn.Module, impl: str, loss: Callable[..., torch.Tensor], batch: Batch) -> None:
    loss(model, batch)  # a batch the script skips: its graph is dropped


def _accumulate(model: nn.Module, impl: str, loss: Callable[..., torch.Tensor], batch: Batch) -> None:
    # Gradient accumulation: a first microbatch (the whole batch, halved) reduced with the second's
    # backward; the reference accumulates the same two backwards.
    if impl != "reference":
        model.set_requires_gradient_sync(False)
    (0.5 * loss(model, batch)).backward()
    if impl != "reference":
        model.set_requires_gradient_sync(True)


def _state_dict_is_the_main_weights(model: nn.Module, impl: str) -> None:
    if impl == "reference":
        return
    state = model.state_dict()
    params = dict(model.named_parameters())
    for name in ("inp.weight", "head.bias"):
        assert isinstance(state[name], DTensor), (
            f"{impl}: state_dict()[{name!r}] between forward and backward is a {type(state[name]).__name__}"
        )
        assert torch.equal(full(state[name]), full(params[name])), (
            f"{impl}: state_dict()[{name!r}] is not the main weight"
        )


def _module_zero_grad(model: nn.Module, impl: str) -> None:
    model.zero_grad()  # instead of optimizer.zero_grad() after the step


def _eval_forward(model: nn.Module, batch: Batch) -> None:
    model.eval()
    with torch.no_grad():
        model(batch[0])
    model.train()


Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Pattern:
    """What a training script does around the kept root, at each point of the loop.

    Attributes:
        model: Builds the unsharded model.
        batches: The batches.
        loss: The loss of one batch.
        validation: A grad-free context the first forwards run under, in eval mode, before training.
        before_loss: Runs before the batch's loss (with the loss function).
        before_backward: Runs between forward and backward.
        zero_grad_after_step: Whether ``optimizer.zero_grad()`` follows each step.
        after_step: Runs after each step (with the batch).
        fsdp2_refuses: What FSDP2, the control, raises on the pattern (a regular expression), if it refuses it.
        fsdp2_trains_wrong: Why FSDP2 trains the pattern unlike the unsharded model, if it does.
    """

    model: Callable[[], nn.Module] = pattern_models.Net
    batches: Callable[[], list[Batch]] = _pattern_batches
    loss: Callable[[nn.Module, Batch], torch.Tensor] = _mse
    validation: Callable[[], Any] | None = None
    before_loss: Callable[[nn.Module, str, Callable[..., torch.Tensor], Batch], None] | None = None
    before_backward: Callable[[nn.Module, str], None] | None = None
    zero_grad_after_step: bool = True
    after_step: Callable[[nn.Module, Batch], None] | None = None
    fsdp2_refuses: str | None = None
    fsdp2_trains_wrong: str | None = None


PATTERNS = {
    "head_penalty": Pattern(loss=_head_penalty),
    "tied_logits": Pattern(model=TiedLM, batches=_tied_batches, loss=_tied_loss),
    "two_forwards": Pattern(loss=_two_forwards),
    "state_dict_between": Pattern(before_backward=_state_dict_is_the_main_weights),
    "eval_between": Pattern(after_step=_eval_forward),
    "forward_without_backward": Pattern(before_loss=_forward_without_backward),
    "accumulate": Pattern(before_loss=_accumulate),
    "eval_first": Pattern(validation=torch.no_grad),
    "inference_mode_first": Pattern(
        validation=torch.inference_mode,
        # FSDP2 keeps the tensors it makes under inference mode and then refuses to update them.
        fsdp2_refuses="Inplace update to inference tensor",
    ),
    "zero_grad_between": Pattern(
        before_backward=_module_zero_grad,
        zero_grad_after_step=False,
        fsdp2_trains_wrong=(
            "FSDP2's module.zero_grad() reaches the root's unsharded parameters only, so the previous step's "
            "sharded grads of the root stay and the next backward adds onto them"
        ),
    ),
}


def _build(impl: str, name: str, dtype: torch.dtype | None = None, compute_copy: str = "persistent") -> nn.Module:
    torch.manual_seed(0)
    model = PATTERNS[name].model()
    # reshard_after_forward left at its default (None) for both implementations.
    return pattern_models.shard(model, impl, reshard_after_forward=None, dtype=dtype, compute_copy=compute_copy)  # type: ignore[arg-type]


def train(impl: str, name: str, dtype: torch.dtype | None = None, compute_copy: str = "persistent") -> Run:
    """Pattern ``name`` for ``pattern_models.STEPS`` SGD steps; ``dtype`` is the compute dtype."""
    pattern = PATTERNS[name]
    rank, world_size = (0, 1) if impl == "reference" else world()
    model = _build(impl, name, dtype, compute_copy)
    optimizer = pattern_models.sgd(model.parameters())
    if impl == "ours" and dtype is not None:
        from fsdp_patch.optimizer import fully_shard_optimizer

        fully_shard_optimizer(optimizer)
    losses = []
    if pattern.validation is not None:
        # Validation before training starts: the first forwards of the model are without grad.
        first = pattern_models.rows(pattern.batches()[0][0], rank, world_size)
        if impl == "ours" and dtype is not None:
            first = first.to(dtype)
        model.eval()
        with pattern.validation():
            for _ in range(2):
                losses.append(model(first).float().mean().item())
        model.train()
    for batch in pattern.batches():
        batch = tuple(pattern_models.rows(t, rank, world_size) for t in batch)
        if impl == "ours" and dtype is not None and batch[0].is_floating_point():
            batch = (batch[0].to(dtype), *batch[1:])  # FSDP2 casts its forward inputs itself
        if pattern.before_loss is not None:
            pattern.before_loss(model, impl, pattern.loss, batch)
        loss = pattern.loss(model, batch)
        if pattern.before_backward is not None:
            pattern.before_backward(model, impl)
        loss.backward()
        optimizer.step()
        if pattern.zero_grad_after_step:
            optimizer.zero_grad()
        if pattern.after_step is not None:
            pattern.after_step(model, batch)
        losses.append(loss.item())
    return Run(losses, full_params(model))


def fp32_on_ranks(pattern: str) -> None:
    control = PATTERNS[pattern]
    if control.fsdp2_refuses is not None:
        with pytest.raises(RuntimeError, match=control.fsdp2_refuses):
            train("fsdp2", pattern)
        assert_same_training(
            train("ours", pattern), train("reference", pattern), TOL, f"{pattern}/fully_shard", sharded_want=False
        )
        return
    reference, fsdp2, ours = (train(impl, pattern) for impl in ("reference", "fsdp2", "ours"))
    if control.fsdp2_trains_wrong is not None:
        err, where = max_abs_difference(fsdp2.params, reference.params)
        assert err > 1e-3, (
            f"FSDP2 now trains {pattern} right ({err:.3g} off in {where}), though {control.fsdp2_trains_wrong}: "
            "this test's premise changed"
        )
    else:
        assert_same_training(fsdp2, reference, TOL, f"{pattern}/FSDP2", sharded_want=False)
    assert_same_training(ours, reference, TOL, f"{pattern}/fully_shard", sharded_want=False)


def bf16_on_ranks(pattern: str) -> None:
    fsdp2 = train("fsdp2", pattern, BF16)
    for compute_copy in ("persistent", "per_gather"):
        assert_same_training(train("ours", pattern, BF16, compute_copy), fsdp2, 0.0, f"{pattern}/bf16/{compute_copy}")


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("pattern", ("head_penalty", "tied_logits"))
def test_root_weights_used_after_forward_train_like_the_reference(dist_pool, pattern: str, world_size: int) -> None:
    """A penalty on ``model.head.weight`` added to the loss, and logits computed after forward
    with the root's embedding: fp32 like the unsharded model, FSDP2 the same."""
    dist_pool(world_size).run(fp32_on_ranks, pattern)


@pytest.mark.parametrize("pattern", ("head_penalty", "tied_logits"))
def test_root_weights_used_after_forward_bf16_equal_fsdp2(dist_pool, pattern: str) -> None:
    dist_pool(2).run(bf16_on_ranks, pattern)


@pytest.mark.parametrize(
    "pattern", ("state_dict_between", "eval_between", "forward_without_backward", "two_forwards", "accumulate")
)
def test_patterns_around_the_kept_root_train_like_the_reference(dist_pool, pattern: str) -> None:
    """``state_dict()`` between forward and backward holds the sharded main weights; an eval
    forward under ``no_grad`` after each step; a grad-enabled forward whose graph is dropped;
    two forwards of the root before one backward; a microbatch with gradient sync off."""
    dist_pool(2).run(fp32_on_ranks, pattern)


@pytest.mark.parametrize("pattern", ("eval_first", "inference_mode_first"))
def test_evaluation_before_training_then_training_like_the_reference(dist_pool, pattern: str) -> None:
    """``model.eval()`` forwards under ``torch.no_grad()`` (FSDP2 the same) or
    ``torch.inference_mode()`` (FSDP2 refuses the training after it) before the first training
    step: the root's first forwards are without grad, and training then keeps it unsharded after
    forward as usual. bf16 (no_grad) bitwise like FSDP2."""
    dist_pool(2).run(fp32_on_ranks, pattern)
    if pattern == "eval_first":
        dist_pool(2).run(bf16_on_ranks, pattern)


def test_module_zero_grad_between_forward_and_backward_reaches_the_sharded_grads(dist_pool) -> None:
    """``loss = ...; model.zero_grad(); loss.backward()``: the root's sharded grads of the last
    step are cleared although the root's unsharded parameters are in the module (FSDP2 leaves
    them, and its next backward adds onto them)."""
    dist_pool(2).run(fp32_on_ranks, "zero_grad_between")


def kept_until_backward_on_ranks() -> None:
    """What the module holds, and what is gathered, between forward and backward."""
    from fsdp_patch import FSDPModule

    x, y = (pattern_models.rows(t, *world()) for t in pattern_models.data()[0])
    for impl in ("fsdp2", "ours"):
        model = _build(impl, "head_penalty")
        with count_collectives() as forward:
            loss = pattern_models.mse(model(x), y)
        kind = type(model.head.weight)
        assert kind is not DTensor, (
            f"{impl}: the root's head.weight after forward is a {kind.__name__}, want a plain tensor"
        )
        kind = type(model.blocks[0].ff.fc1.weight)
        assert kind is DTensor, f"{impl}: a block's weight after forward is a {kind.__name__}, want the sharded DTensor"
        if impl == "ours":
            stored = unsharded_bytes(model)
            assert stored["<root>[0]"] > 0 and stored["blocks.0[0]"] == stored["blocks.1[0]"] == 0, (
                f"after forward: {stored}"
            )
        with count_collectives() as backward:
            loss.backward()
        kind = type(model.head.weight)
        assert kind is DTensor, (
            f"{impl}: the root's head.weight after backward is a {kind.__name__}, want the sharded DTensor"
        )
        if impl == "ours":
            stored = unsharded_bytes(model)
            assert not any(stored.values()), f"after backward: {stored}"
            groups = sum(len(m.fsdp_parameter_groups) for m in model.modules() if isinstance(m, FSDPModule))
            # The root is not gathered again for backward; the blocks are.
            want_forward = {"all_gather": groups, "reduce_scatter": 0}
            want_backward = {"all_gather": groups - 1, "reduce_scatter": groups}
            assert dict(forward) == want_forward, f"forward collectives {dict(forward)}, want {want_forward}"
            assert dict(backward) == want_backward, f"backward collectives {dict(backward)}, want {want_backward}"

    # reshard_after_forward=True on the root is honoured, as by FSDP2: its weights are sharded
    # outside forward and a penalty on them fails there as it does under FSDP2.
    for impl in ("fsdp2", "ours"):
        torch.manual_seed(0)
        model = pattern_models.shard(pattern_models.Net(), impl, reshard_after_forward=True)
        loss = pattern_models.mse(model(x), y)
        kind = type(model.head.weight)
        assert kind is DTensor, (
            f"{impl} with reshard_after_forward=True: head.weight after forward is a {kind.__name__}"
        )
        loss.backward()


def test_root_keeps_its_unsharded_parameters_until_backward(dist_pool) -> None:
    """After forward the root's parameters are plain tensors in the module and stay gathered
    (its backward gathers nothing), the blocks' are sharded; after backward everything is
    sharded and freed. ``reshard_after_forward=True`` on the root reshards it, as in FSDP2."""
    dist_pool(2).run(kept_until_backward_on_ranks)
