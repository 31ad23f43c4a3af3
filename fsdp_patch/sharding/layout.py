"""Shard geometry: where each parameter's ``Shard(0)`` piece lives in a flat group buffer.

Sharding follows ``torch.chunk`` along dim 0, as DTensor's ``Shard(0)`` does: every rank owns
``ceil(dim0 / world_size)`` rows except the last ones, which may own fewer or none. Each
parameter gets a slot of ``chunk_rows * row_numel`` elements on every rank, so that flat
buffers have the same size on all ranks (all-gather and reduce-scatter need that) and the
padding sits at the end of each slot. This is the layout FSDP2's ``_chunk_cat`` produces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["ParamLayout", "GroupLayout"]


@dataclass(frozen=True)
class ParamLayout:
    """Geometry of one parameter in a group's flat buffers.

    Attributes:
        global_shape: Shape of the unsharded parameter.
        world_size: Number of shards.
        rank: The rank this layout describes.
        offset: Start of this parameter's slot in the flat sharded buffer.
        unsharded_offset: Start of this parameter's padded region in the flat unsharded buffer.
    Geometry is derived once and cached: views of fresh buffers (a grad cast) are built on
    every optimizer step.
    """

    global_shape: torch.Size
    world_size: int
    rank: int
    offset: int
    unsharded_offset: int

    @cached_property
    def row_numel(self) -> int:
        return math.prod(self.global_shape[1:])

    @cached_property
    def chunk_rows(self) -> int:
        return -(-self.global_shape[0] // self.world_size)

    @cached_property
    def slot_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    @cached_property
    def local_rows(self) -> int:
        return max(0, min(self.chunk_rows, self.global_shape[0] - self.rank * self.chunk_rows))

    @cached_property
    def local_rows_slice(self) -> slice:
        """The rows of the unsharded parameter that this rank's shard holds."""
        start = min(self.rank * self.chunk_rows, self.global_shape[0])
        return slice(start, start + self.local_rows)

    @cached_property
    def local_shape(self) -> torch.Size:
        return torch.Size((self.local_rows, *self.global_shape[1:]))

    @cached_property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    @cached_property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    @cached_property
    def global_stride(self) -> tuple[int, ...]:
        stride, acc = [], 1
        for size in reversed(self.global_shape):
            stride.append(acc)
            acc *= size
        return tuple(reversed(stride))

    def local_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard as a view into a flat sharded buffer."""
        return flat[self.offset : self.offset + self.local_numel].view(self.local_shape)

    def unsharded_view(self, flat: torch.Tensor) -> torch.Tensor:
        """The full parameter as a view into a flat unsharded buffer."""
        start = self.unsharded_offset
        return flat[start : start + self.numel].view(self.global_shape)


@dataclass(frozen=True)
class GroupLayout:
    """Geometry of all parameters of one group.

    Attributes:
        params: Per-parameter layouts, in group order.
        shard_numel: Size of the flat sharded buffer, identical on every rank.
    """

    params: tuple[ParamLayout, ...]
    shard_numel: int

    @classmethod
    def build(cls, shapes: list[torch.Size], world_size: int, rank: int) -> GroupLayout:
        layouts, offset, unsharded_offset = [], 0, 0
        for shape in shapes:
            layout = ParamLayout(torch.Size(shape), world_size, rank, offset, unsharded_offset)
            layouts.append(layout)
            offset += layout.slot_numel
            unsharded_offset += layout.slot_numel * world_size
        return cls(tuple(layouts), offset)

    @property
    def unsharded_numel(self) -> int:
        """Size of the padded flat unsharded buffer (the all-gather output)."""
        return self.shard_numel * (self.params[0].world_size if self.params else 1)

    @property
    def slot_sizes(self) -> list[int]:
        return [p.slot_numel for p in self.params]
