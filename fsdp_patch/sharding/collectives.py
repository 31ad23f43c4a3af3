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

__all__ = ["AllGather", "ReduceScatter", "Reduction"]


class _Completed:
    """A work that has finished: what a custom comm called with ``async_op=True`` may return
    instead of a work (FSDP2's interface allows ``None``)."""

    @staticmethod
    def of(work: Any) -> Any:
        return _Completed() if work is None else work

    def wait(self) -> bool:
        return True


class AllGather:
    """An all-gather in flight into its own output buffer.

    Attributes:
        output: Every rank's shard, rank-major (valid once :meth:`wait` returned).
        tag: What the caller gathered (the group's refresh count): a gather issued before the
            source changed is recognizably out of date.
        metadata: What the caller keeps beside the gathered data (float8 scales), or ``None``.
    """

    def __init__(self, work: Any, output: torch.Tensor, tag: int, metadata: Any = None) -> None:
        self._work = work
        self.output = output
        self.tag = tag
        self.metadata = metadata

    @staticmethod
    def allocate_output(numel: int, dtype: torch.dtype, device: torch.device, comm: Any = None) -> torch.Tensor:
        """The output buffer; ``comm`` (FSDP2's ``AllGather`` interface, from
        ``set_custom_all_gather``) allocates it where one is set."""
        if comm is not None:
            return comm.allocate((numel,), dtype=dtype, device=device)
        return torch.empty(numel, dtype=dtype, device=device)

    @classmethod
    def issue(
        cls,
        output: torch.Tensor,
        shard: torch.Tensor,
        process_group: Any,
        tag: int,
        comm: Any = None,
        metadata: Any = None,
    ) -> AllGather:
        """Starts gathering every rank's ``shard`` into ``output`` (``shard`` may be a slice of
        ``output``: this rank's slot, gathered in place), through ``comm`` where one is set."""
        if comm is not None:
            return cls(_Completed.of(comm(output, shard, process_group, async_op=True)), output, tag, metadata)
        return cls(all_gather_flat(output, shard, group=process_group, async_op=True), output, tag, metadata)

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


class Reduction:
    """How a group's grads are reduced over its ranks: FSDP2's gradient-reduction settings.

    Attributes:
        divide_factor: The sum over ranks is divided by it (``set_gradient_divide_factor``);
            ``None``: the mean over ranks.
        force_sum: The collective itself only sums; the division is a separate step
            (``set_force_sum_reduction_for_comms``).
        comm: FSDP2's ``ReduceScatter`` interface (``set_custom_reduce_scatter``), or ``None``.
        process_group: A group of the reduce-scatter's own over the same ranks
            (``set_separate_reduce_scatter_group``), or ``None``: the group's.
    """

    __slots__ = ("divide_factor", "force_sum", "comm", "process_group")

    def __init__(self) -> None:
        self.divide_factor: float | None = None
        self.force_sum = False
        self.comm: Any = None
        self.process_group: Any = None

    def op_and_divisor(self, world_size: int) -> tuple[Any, float | None]:
        """The collectives' op and what their result is divided by afterwards (``None``:
        nothing); ``world_size`` counts every rank the grads are reduced over (shard and, for
        HSDP, replicate dimension), the division being linear whichever collective it follows."""
        if self.divide_factor is not None:
            return dist.ReduceOp.SUM, self.divide_factor
        if self.force_sum or self.comm is not None:
            return dist.ReduceOp.SUM, float(world_size)
        return dist.ReduceOp.AVG, None


class ReduceScatter:
    """A reduce-scatter (average over ranks, or as a :class:`Reduction` says) in flight; with
    one rank, the input is the result.

    Attributes:
        overwrite: Whether the result replaces what it is applied to instead of adding to it
            (decided when it was issued; see :class:`~.main_grads.MainGrads`).
    """

    def __init__(
        self,
        work: Any,
        packed: torch.Tensor,
        output: torch.Tensor,
        overwrite: bool,
        op: Any = dist.ReduceOp.AVG,
        divisor: float | None = None,
    ) -> None:
        self._work = work
        self._packed = packed
        self.output = output
        self.overwrite = overwrite
        self._op = op  # the reduce-scatter's, which an HSDP all-reduce repeats
        self._divisor = divisor
        self._all_reduce_work: Any = None
        self.all_reducing = False

    @classmethod
    def issue(
        cls,
        packed: torch.Tensor,
        process_group: Any,
        world_size: int,
        overwrite: bool,
        reduction: Reduction | None = None,
        replicas: int = 1,
    ) -> ReduceScatter:
        """Starts reducing ``packed`` (``(world_size, n)``: row ``r`` is what rank ``r`` receives);
        ``replicas``: how many HSDP replicas all-reduce the result afterwards (see
        :meth:`all_reduce`)."""
        reduction = reduction or _MEAN
        op, divisor = reduction.op_and_divisor(world_size * replicas)
        process_group = reduction.process_group or process_group
        if world_size == 1:
            return cls(None, packed, packed.view(-1), overwrite, op, None if divisor == 1.0 else divisor)
        n = packed.shape[1]
        if reduction.comm is not None:
            output = reduction.comm.allocate((n,), dtype=packed.dtype, device=packed.device)
            work = _Completed.of(reduction.comm(output, packed.view(-1), process_group, op, async_op=True))
        else:
            output = torch.empty(n, dtype=packed.dtype, device=packed.device)
            work = reduce_scatter_flat(output, packed.view(-1), op=op, group=process_group, async_op=True)
        return cls(work, packed, output, overwrite, op, divisor)

    def wait(self) -> torch.Tensor:
        """Completes the collective (and the HSDP all-reduce :meth:`all_reduce` started) and
        frees its input; returns this rank's reduced row."""
        self._wait_reduce_scatter()
        if self._all_reduce_work is not None:
            self._all_reduce_work.wait()
            self._all_reduce_work = None
        return self.output

    def _wait_reduce_scatter(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            free_now(self._packed)
        if self._divisor is not None:
            # Presence flags (the row's tail) are divided too: only their sign is read.
            with torch.no_grad():
                self.output.div_(self._divisor)
            self._divisor = None

    def all_reduce(self, replicate_group: Any, partial: torch.Tensor | None) -> None:
        """HSDP: completes the reduce-scatter, adds ``partial`` (grads reduce-scattered by
        backwards that skipped the all-reduce) to this rank's reduced row and starts
        all-reducing it over the replicas, with the op of the reduce-scatter (the mean of the
        replicas' means, or a sum divided as the reduction says); :meth:`wait` completes it, so
        that the all-reduce runs while backward goes on, as the reduce-scatter did."""
        self._wait_reduce_scatter()
        with torch.no_grad():
            if partial is not None:
                self.output.add_(partial)
            self._all_reduce_work = dist.all_reduce(self.output, op=self._op, group=replicate_group, async_op=True)
        self.all_reducing = True

    def free(self) -> None:
        free_now(self.output)
        free_now(self._packed)

    def cancel(self) -> None:
        for work in (self._work, self._all_reduce_work):
            if work is not None:
                work.wait()
        self._work = self._all_reduce_work = None
        self.free()


_MEAN = Reduction()
