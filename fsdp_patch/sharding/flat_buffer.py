"""Flat buffers: the storage behind a group's parameters, and the views every consumer holds.

Three kinds, one per role in an iteration:

- :class:`FlatBuffer`: one 1-D tensor whose memory can be released and re-allocated in place;
- :class:`ShardedBuffer`: a flat buffer laid out as a group's shards (see :mod:`.layout`), with
  each parameter's local view and DTensor view (the main weights, the compute copy, the main grads);
- :class:`UnshardedBuffer`: the padded flat buffer the all-gathers copy out into, whose views are
  the unsharded parameters forward and backward compute with.

[Note: freeing storage in place]
Freeing resizes a buffer's storage to 0 bytes and keeps the storage object, so every view of it
(the unsharded parameters, the tensors autograd saved in forward, DTensor local shards) stays a
valid view, and sees the memory again once the buffer is materialized. FSDP2 frees its unsharded
parameters the same way; it is what lets backward re-gather into the storage forward's saved
tensors point at.

Alternatives considered:
    - Fresh tensors per use: autograd's saved tensors and the modules' registered parameters
      would point at old tensors, and each use would rebuild every view (a ``DTensor`` costs
      ~2.4 µs per parameter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .dtensors import ShardSpecs, shard_dtensor
from .layout import GroupLayout

if TYPE_CHECKING:
    from .tensor_parallel import TensorParallel

__all__ = ["FlatBuffer", "ShardedBuffer", "UnshardedBuffer", "free_now"]


def free_now(tensor: torch.Tensor) -> None:
    """Frees a tensor's memory now, whoever else still references it (see the note above)."""
    tensor.untyped_storage().resize_(0)


class FlatBuffer:
    """One 1-D tensor whose memory can be freed and re-materialized in place."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def full_nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def storage_bytes(self) -> int:
        """Bytes held now (0 while freed)."""
        return self.tensor.untyped_storage().nbytes()

    @property
    def materialized(self) -> bool:
        return self.storage_bytes == self.full_nbytes

    def materialize(self) -> torch.Tensor:
        """The tensor, its memory allocated (uninitialized) if it was freed."""
        if not self.materialized:
            self.tensor.untyped_storage().resize_(self.full_nbytes)
        return self.tensor

    def free(self) -> None:
        free_now(self.tensor)


class ShardedBuffer(FlatBuffer):
    """A flat buffer holding this rank's shard of every parameter of a group.

    Args:
        tensor: The flat tensor, ``layout.shard_numel`` elements.
        layout: Where each parameter's shard lies in it.
        specs: The group's cached DTensor specs.
    """

    def __init__(self, tensor: torch.Tensor, layout: GroupLayout, specs: ShardSpecs) -> None:
        super().__init__(tensor)
        self.layout = layout
        self._specs = specs

    @classmethod
    def allocate(
        cls, layout: GroupLayout, specs: ShardSpecs, dtype: torch.dtype, device: torch.device, zeroed: bool
    ) -> ShardedBuffer:
        new = torch.zeros if zeroed else torch.empty
        return cls(new(layout.shard_numel, dtype=dtype, device=device), layout, specs)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def local(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s shard: a view of its rows (its slot without the padding)."""
        return self.layout.params[index].local_view(self.tensor)

    def dtensor(self, index: int, requires_grad: bool = False) -> DTensor:
        """Parameter ``index``'s shard as a ``Shard(0)`` DTensor over :meth:`local`."""
        return shard_dtensor(self.local(index), self._specs.specs(self.tensor.dtype)[index], requires_grad)


class UnshardedBuffer(FlatBuffer):
    """The padded flat all-gather target of a group; its views are the unsharded parameters.

    Rank ``r``'s shards sit at ``r * shard_numel`` after an all-gather; :meth:`copy_out` moves
    each parameter's slots to its place in the unsharded parameters (``layout.unsharded_offset``),
    so the unsharded parameters are contiguous views that outlive every free.

    Args:
        layout: The group's layout.
        dtype: The compute dtype.
        device: This rank's device.
        requires_grad: Per parameter, whether its unsharded parameter starts out trainable.
        tensor_parallel: Per parameter, how tensor parallelism placed it (``None``: a plain
            parameter); such an unsharded parameter is the DTensor on the TP mesh over its view.
        data: ``data(index, view)``: what parameter ``index``'s unsharded parameter is over its
            view (``None``: the view itself; torchao's float8 weights: a ``Float8TrainingTensor``).
    """

    def __init__(
        self,
        layout: GroupLayout,
        dtype: torch.dtype,
        device: torch.device,
        requires_grad: Sequence[bool],
        tensor_parallel: Sequence[TensorParallel | None] = (),
        data: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__(torch.empty(layout.unsharded_numel, dtype=dtype, device=device))
        self.layout = layout
        flat = self.tensor
        world_size = layout.params[0].world_size if layout.params else 1
        placed = tuple(tensor_parallel) or (None,) * len(layout.params)
        views = [
            param.unsharded_view(flat) if data is None else data(index, param.unsharded_view(flat))
            for index, param in enumerate(layout.params)
        ]
        self.params: list[nn.Parameter] = [
            nn.Parameter(view if tp is None else shard_dtensor(view, tp.spec_in(dtype)), requires_grad=trains)
            for view, trains, tp in zip(views, requires_grad, placed, strict=True)
        ]
        # Per parameter, its slots of every rank as (world_size, slot_numel): the copy-out's targets.
        self._slots = [
            flat[p.unsharded_offset : p.unsharded_offset + p.slot_numel * world_size].view(world_size, p.slot_numel)
            for p in layout.params
        ]
        self._world_size = world_size
        self.free()

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Writes an all-gather's output (rank-major shards) into the unsharded parameters."""
        flat = self.materialize()
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(flat):
            torch.split_with_sizes_copy(
                gathered.view(self._world_size, -1), self.layout.slot_sizes, dim=1, out=self._slots
            )

    def pack_rows(self, ranks: slice) -> torch.Tensor:
        """The slots of ranks ``ranks`` of every parameter, rank-major as an all-gather's output
        holds them: ``(len(ranks), shard_numel)``, a copy (the buffer must be materialized)."""
        return torch.cat([slot[ranks] for slot in self._slots], dim=1)

    def copy_single(self, shard: torch.Tensor) -> None:
        """With one rank the shard is the whole: copies it in (the layouts coincide)."""
        flat = self.materialize()
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(flat):
            flat.copy_(shard)
