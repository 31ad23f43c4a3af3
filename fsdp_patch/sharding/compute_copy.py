"""The compute copy: the sharded compute-dtype weights that forward's and backward's all-gathers read.

One of two lifetimes (``MixedPrecisionPolicy.compute_copy``), when the compute dtype differs
from the main weights' (otherwise the main weights themselves are gathered):

- ``"persistent"``: a buffer kept as long as the model, cast from the main weights by
  :meth:`ComputeCopy.refresh` and gathered without a cast;
- ``"per_gather"``: none is kept (its storage is 0 bytes; only its dtype and layout remain):
  each all-gather casts the main weights into this rank's slot of its own output, as FSDP2
  casts into its all-gather input, so the copy needs no memory of its own.

When it is refreshed is the parameter group's policy; this class counts the refreshes, so
that a gather can say which one it read. A third kind, torchao's float8 weights kept in float8
with their scales, is :class:`~.float8_copy.Float8ComputeCopy`; what the gathers ask of a copy
beyond its buffer (the dtype the all-gather moves, what travels beside a gather, what the
unsharded parameters are over their views) is asked here, so that they need not know which.
"""

from __future__ import annotations

from typing import Any

import torch

from .flat_buffer import ShardedBuffer

__all__ = ["ComputeCopy"]


class ComputeCopy:
    """The compute-dtype copy of a group's main weights.

    Args:
        main: The main weights.
        dtype: The compute dtype.
        lifetime: ``"persistent"`` or ``"per_gather"``.

    Attributes:
        stale: Whether the copy may lag the main weights (the next gather refreshes first).
        refreshes: How many refreshes it has had.
    """

    def __init__(self, main: ShardedBuffer, dtype: torch.dtype, lifetime: str) -> None:
        self.main = main
        self.lifetime = lifetime
        if dtype == main.dtype:
            self.buffer = main
        else:
            self.buffer = ShardedBuffer(main.tensor.to(dtype), main.layout, main._specs)
            if self.per_gather:
                self.buffer.free()
        self.stale = False
        self.refreshes = 0

    def invalidate(self) -> None:
        """Anything may have written the main weights since the last refresh (a root forward):
        the next gather casts again."""
        self.stale = True

    def weights_changed(self) -> None:
        """The main weights were written (a load, an adopted replacement): the next gather casts again."""
        self.stale = True

    @property
    def aliases_main(self) -> bool:
        return self.buffer is self.main

    @property
    def per_gather(self) -> bool:
        """Whether no copy is kept: each all-gather casts the main weights itself."""
        return self.lifetime == "per_gather" and not self.aliases_main

    @property
    def storage_bytes(self) -> int:
        """Bytes the copy holds now (0 when it is the main weights, or none is kept)."""
        return 0 if self.aliases_main else self.buffer.storage_bytes

    def refresh(self, after_step: bool = False) -> int:
        """Casts the main weights into the persistent copy (one cast for the whole group) and
        counts the refresh; returns the bytes written (0 when nothing is kept or cast).
        ``after_step``: the optimizer adapter's refresh after a step (not a gather's)."""
        written = 0
        if not self.aliases_main and not self.per_gather:
            compute = self.buffer.tensor
            with torch.no_grad():
                compute.copy_(self.main.tensor)
            written = compute.numel() * compute.element_size()
        self.stale = False
        self.refreshes += 1
        return written

    def gather_input(self, output: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
        """What this rank contributes to an all-gather into ``output``: the copy, or, per
        gather, this rank's slot of ``output`` with the main weights cast into it."""
        if not self.per_gather:
            return self.buffer.tensor
        slot = output.view(world_size, -1)[rank]
        with torch.no_grad():
            slot.copy_(self.main.tensor)
        return slot

    @property
    def gather_dtype(self) -> torch.dtype:
        """The dtype the all-gathers move (the buffer's, or bytes of the same size)."""
        return self.buffer.dtype

    def to_gathered(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, in the buffer's dtype, as the all-gather moves it (a view)."""
        return tensor if tensor.dtype == self.gather_dtype else tensor.view(self.gather_dtype)

    def from_gathered(self, tensor: torch.Tensor) -> torch.Tensor:
        """An all-gather's output read back in the buffer's dtype (a view)."""
        return tensor if tensor.dtype == self.buffer.dtype else tensor.view(self.buffer.dtype)

    def gather_metadata(self) -> Any:
        """What a gather issued now carries beside the data, for :meth:`post_gather` (none)."""
        return None

    def post_gather(self, metadata: Any) -> None:
        """Called when a gather carrying ``metadata`` completed into the unsharded parameters."""

    def unsharded_data(self, index: int, view: torch.Tensor) -> torch.Tensor:
        """What parameter ``index``'s unsharded parameter is over its ``view`` of the unsharded
        buffer: the view itself."""
        return view

    @property
    def single_rank_source(self) -> torch.Tensor:
        """With one rank, the tensor the unsharded parameters are copied (or cast) from."""
        return self.main.tensor if self.per_gather else self.buffer.tensor
