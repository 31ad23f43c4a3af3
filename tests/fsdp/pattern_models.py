"""The model and data of the training-pattern tests, built three ways: under ``fully_shard``,
under torch's FSDP2 (the control), and unsharded in one process (the reference).

Each pattern (in the test files beside their tests) trains a 2-block MLP a few SGD steps the way real scripts do (activation
checkpointing, several backwards, any output structure, state loading, late freezing, several
optimizers, ...). The sharded runs see their rank's rows of each batch; the reference sees all
rows, so with equal slices its mean loss and grads are what the ranks' averaged grads give.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, TypedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

IN, DIM, HIDDEN, OUT = 6, 12, 20, 5
BATCH = 8  # rows per step, divisible by 1, 2 and 4 ranks
STEPS = 3
LR = 0.05
IMPLS = ("ours", "fsdp2", "reference")


class FeedForward(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Block(nn.Module):
    """A residual block, ``x + ff(norm(x))``: ``norm`` puts a LayerNorm in front (else none);
    ``inner`` checkpoints the feed-forward (a submodule the unit owns)."""

    def __init__(self, inner: str = "none", norm: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM) if norm else None
        self.ff = FeedForward()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) if self.norm is not None else x
        if self.inner == "none":
            return x + self.ff(h)
        return x + checkpoint(self.ff, h, use_reentrant=self.inner == "reentrant")


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class Holder:
    """An object the pytree does not know, holding the logits as an attribute."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class NetOptions(TypedDict, total=False):
    """Keyword arguments of :class:`Net`."""

    inner: str
    outer: str
    output: str
    zero_size: bool
    norm: bool
    spare: bool
    aux: bool


class Net(nn.Module):
    """Input layer, two residual blocks (each its own unit), head (in the root unit).

    Args:
        inner: Checkpoints each block's feed-forward (``"none"``, ``"reentrant"``, ``"non_reentrant"``).
        outer: Checkpoints each block, a sharded unit (the same values).
        output: What forward returns: ``"tensor"``, ``"dataclass"``, ``"object"`` (an attribute of an
            object the pytree does not know) or ``"nested"`` (dicts, lists and tuples).
        zero_size: Adds ``empty``, a root parameter with no elements.
        norm: Puts a LayerNorm in front of each block's feed-forward.
        spare: Adds ``spare``, a root parameter no forward uses.
        aux: Adds ``aux``, a second head that a forward uses only when asked to (``use_aux``).
    """

    def __init__(
        self,
        inner: str = "none",
        outer: str = "none",
        output: str = "tensor",
        zero_size: bool = False,
        norm: bool = False,
        spare: bool = False,
        aux: bool = False,
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block(inner, norm) for _ in range(2))
        self.head = nn.Linear(DIM, OUT)
        self.empty = nn.Parameter(torch.randn(0, 3)) if zero_size else None
        self.spare = nn.Parameter(torch.randn(3, DIM)) if spare else None
        self.aux = nn.Linear(DIM, OUT) if aux else None
        self.outer = outer
        self.output = output

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> Any:
        h = torch.tanh(self.inp(x))
        first = h
        for index, block in enumerate(self.blocks):
            h = block(h) if self.outer == "none" else checkpoint(block, h, use_reentrant=self.outer == "reentrant")
            if index == 0:
                first = h
        logits = self.head(h)
        if use_aux:
            assert self.aux is not None
            logits = logits + self.aux(h)
        if self.empty is not None:
            logits = logits + self.empty.sum()
        if self.output == "dataclass":
            return Output(logits, first)
        if self.output == "object":
            return Holder(logits)
        if self.output == "nested":
            return {"out": [(logits,)], "aux": None}
        return logits


def logits_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output["out"][0][0]
    return output.logits


def data(steps: int = STEPS, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)) for _ in range(steps)]


def rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = t.shape[0] // world_size
    return t[rank * per : (rank + 1) * per]


# ---------------------------------------------------------------------------- building


def shard(
    model: Net,
    impl: str,
    reshard_after_forward: bool = True,
    dtype: torch.dtype | None = None,
    main_grads_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    compute_copy: str = "persistent",
) -> Net:
    """Shards each block, then the root, with ``impl``; ``dtype`` is the compute dtype."""
    if impl == "reference":
        return model
    if impl == "ours":
        from fsdp_patch import MixedPrecisionPolicy, fully_shard

        if dtype is not None:
            model.to(dtype)
        policy = MixedPrecisionPolicy(main_grads_dtype=main_grads_dtype, compute_copy=compute_copy)  # type: ignore[arg-type]
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if dtype is not None and not any(p.is_meta for p in model.parameters()):
        # fully_shard's main weights start as the compute-dtype model's values, upcast.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype))

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # Grads reduced in the compute dtype unless told otherwise, as fully_shard's main grads are: said
    # explicitly, since from torch 2.15 FSDP2's reduce_dtype=None follows the fp32 parameters instead.
    policy = TorchPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype if reduce_dtype is not None else dtype)
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    torch_fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def build(
    impl: str, net: NetOptions | None = None, frozen_head: bool = False, seed: int = 0, **shard_kwargs: Any
) -> Net:
    """:class:`Net` with ``net``'s options, seeded with ``seed``, sharded by ``impl`` (:func:`shard`'s keywords)."""
    torch.manual_seed(seed)
    model = Net(**(net or {}))
    if frozen_head:
        model.head.requires_grad_(False)
    return shard(model, impl, **shard_kwargs)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def mse(output: Any, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(logits_of(output).float(), y)


def reset_compiler() -> None:
    """Before a run that compiles: each model compiles afresh, not against guards of the last one.

    Models of earlier runs are freed by the cyclic collector; when it runs while dynamo traces
    FSDP2's ``module in _module_state_mapping`` (a WeakKeyDictionary), the dictionary shrinks
    under the trace and dynamo raises "dictionary changed size during iteration". They are
    collected first."""
    gc.collect()
    torch._dynamo.reset()
