"""Collective handles: a group's all-gather and reduce-scatter, from issue to wait to free.

Each handle owns the buffers its collective reads and writes, as FSDP2's ``AllGatherResult``
and reduce-scatter states do: issuing allocates them, waiting completes the collective, freeing
releases them at once (a completed asynchronous work may still reference its buffers until the
backend's thread lets go, which would make the peak depend on timing). The flat collectives
themselves come from :mod:`fsdp_patch.torch_interop.torch_compat`.

Alternatives considered:
    - Work objects and buffers held in tuples by the parameter group: every consumer had to
      know which element to wait on and which to free; a handle says it by name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..torch_interop.torch_compat import all_gather_flat, reduce_scatter_flat
from .flat_buffer import free_now

__all__ = ["AllGather", "ReduceScatter"]


class AllGather:
    """An all-gather in flight into its own output buffer.

    Attributes:
        output: Every rank's shard, rank-major (valid once :meth:`wait` returned).
        tag: What the caller gathered (the group's refresh count): a gather issued before the
            source changed is recognizably out of date.
    """

    def __init__(self, work: Any, output: torch.Tensor, tag: int) -> None:
        self._work = work
        self.output = output
        self.tag = tag

    @staticmethod
    def allocate_output(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    @classmethod
    def issue(cls, output: torch.Tensor, shard: torch.Tensor, process_group: Any, tag: int) -> AllGather:
        """Starts gathering every rank's ``shard`` into ``output`` (``shard`` may be a slice of
        ``output``: this rank's slot, gathered in place)."""
        return cls(all_gather_flat(output, shard, group=process_group, async_op=True), output, tag)

    @property
    def nbytes(self) -> int:
        return self.output.untyped_storage().nbytes()

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self.output

    def free(self) -> None:
        free_now(self.output)

    def cancel(self) -> None:
        """A collective cannot be cancelled: waits for it, then frees its result."""
        self._work.wait()
        self.free()


class ReduceScatter:
    """A reduce-scatter (average over ranks) in flight; with one rank, the input is the result.

    Attributes:
        overwrite: Whether the result replaces what it is applied to instead of adding to it
            (decided when it was issued; see :class:`~.main_grads.MainGrads`).
    """

    def __init__(self, work: Any, packed: torch.Tensor, output: torch.Tensor, overwrite: bool) -> None:
        self._work = work
        self._packed = packed
        self.output = output
        self.overwrite = overwrite

    @classmethod
    def issue(cls, packed: torch.Tensor, process_group: Any, world_size: int, overwrite: bool) -> ReduceScatter:
        """Starts reducing ``packed`` (``(world_size, n)``: row ``r`` is what rank ``r`` receives)."""
        if world_size == 1:
            return cls(None, packed, packed.view(-1), overwrite)
        output = torch.empty(packed.shape[1], dtype=packed.dtype, device=packed.device)
        work = reduce_scatter_flat(output, packed.view(-1), op=dist.ReduceOp.AVG, group=process_group, async_op=True)
        return cls(work, packed, output, overwrite)

    def wait(self) -> torch.Tensor:
        """Completes the collective and frees its input; returns this rank's reduced row."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            free_now(self._packed)
        return self.output

    def free(self) -> None:
        free_now(self.output)
        free_now(self._packed)

    def cancel(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self.free()
