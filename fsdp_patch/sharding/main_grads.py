"""The main gradients of one parameter group: their buffer, who owns it, and which grads are present.

[Note: main-grad ownership]
The flat sharded main-grad buffer is held strongly by :class:`MainGrads` only while the group
writes it (from a backward's first reduce until :meth:`MainGrads.finish`); otherwise only the
DTensor views installed as the sharded parameters' ``.grad`` hold it. Once
``zero_grad(set_to_none=True)`` drops every view its memory is freed, as FSDP2's sharded grads
are, and the next backward allocates it anew. Views are cached weakly, per parameter, so that a
view dropped by the user is never handed out again.

[Note: grad presence]
Presence is decided per parameter, as the unsharded model and FSDP2 decide it:

- what a backward adds to is read from each ``.grad`` when its first reduce begins
  (:meth:`MainGrads.begin`): the parameter's own view is accumulated into in place, a tensor the
  user assigned is copied in, and ``None`` (``p.grad = None``, an optimizer's ``zero_grad`` over
  some of the group, a parameter no optimizer holds) means nothing: its region is zeroed, or,
  when every grad is ``None``, a fresh buffer is overwritten whole. A dropped view that is still
  alive elsewhere is never written: the present grads move to a fresh buffer instead.
- a parameter whose grad was ``None`` gets one only if the backward produced a grad for it on
  some rank: each reduce-scatter carries one presence flag per parameter after the grads
  (averaged, so positive where any rank had a grad), and :meth:`MainGrads.finish` installs
  views where a flag or an earlier grad says so. A parameter no rank used keeps ``None``, as in
  the unsharded model, so optimizers that skip grad-less parameters (AdamW's decay, momentum)
  skip it here too.

Alternatives considered:
    - Deciding "all grads are still ours" by identity with the cached views: a view the user
      dropped is collected, ``None is None`` reads as "ours", and the next backward would add
      onto the dropped grad's old values.
    - A zeroed grad for every trainable parameter after each backward (the collectives need
      the zeros anyway): optimizers with weight decay or momentum then move parameters that
      got no gradient.
    - Presence by local grads only (FSDP2's rule): with control flow that differs across ranks
      a rank would drop the gradient the others sent it.
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from .collectives import ReduceScatter
from .dtensors import ShardSpecs
from .flat_buffer import ShardedBuffer
from .layout import GroupLayout
from .tensor_parallel import local_grad

__all__ = ["MainGrads"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class MainGrads:
    """The sharded main grads of one group (see the notes above).

    Args:
        layout: The group's layout.
        specs: The group's cached DTensor specs.
        dtype: The main-grad dtype.
        device: This rank's device.
    """

    def __init__(self, layout: GroupLayout, specs: ShardSpecs, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.dtype = dtype
        self._specs = specs
        self._device = device
        self._count = len(layout.params)
        # The buffer's tensor, weakly (its views' bases keep it alive), and strongly while owned.
        self._ref: weakref.ref[torch.Tensor] | None = None
        self._owned: torch.Tensor | None = None
        self._view_refs: list[weakref.ref[DTensor] | None] = [None] * self._count
        # Between begin() and finish(): whether the next reduce overwrites the buffer, which
        # parameters had a grad when the accumulation began, and the reduces' presence flags.
        self._overwrite = False
        self._kept: list[bool] | None = None
        self._arrivals: torch.Tensor | None = None
        self._write_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()

    # ------------------------------------------------------------------ the buffer and its views
    @property
    def buffer(self) -> torch.Tensor | None:
        """The flat buffer, or ``None`` while no grad holds it."""
        return None if self._ref is None else self._ref()

    def storage_bytes(self) -> int:
        buffer = self.buffer
        return 0 if buffer is None else buffer.untyped_storage().nbytes()

    def _ensure(self, overwritten: bool = False) -> ShardedBuffer:
        """The buffer, held here until views are installed; allocated (zeroed unless
        ``overwritten`` next) if it was freed."""
        tensor = self.buffer
        if tensor is None:
            new = torch.empty if overwritten else torch.zeros
            tensor = new(self.layout.shard_numel, dtype=self.dtype, device=self._device)
            self._ref = weakref.ref(tensor)
            self._view_refs = [None] * self._count
        self._owned = tensor
        return ShardedBuffer(tensor, self.layout, self._specs)

    def view(self, index: int) -> DTensor | None:
        """The live DTensor view of parameter ``index``'s region (``None``: none lives)."""
        ref = self._view_refs[index]
        return None if ref is None else ref()

    def views(self, indices: Sequence[int]) -> list[DTensor | None]:
        """:meth:`view` of each of ``indices``."""
        refs = self._view_refs
        if len(indices) == len(refs):  # all of them (indices are sorted distinct positions)
            return [None if ref is None else ref() for ref in refs]
        return [None if refs[i] is None else refs[i]() for i in indices]  # type: ignore[misc]

    def _make_view(self, shards: ShardedBuffer, index: int) -> DTensor:
        view = self.view(index)
        if view is None:
            view = shards.dtensor(index)
            self._view_refs[index] = weakref.ref(view)
        return view

    def _install(self, shards: ShardedBuffer, params: Sequence[nn.Parameter], wanted: Callable[[int], bool]) -> None:
        """Makes the views the ``.grad`` of ``params[i]`` where ``wanted(i)``; from then on they,
        not this object, own the buffer."""
        for index, param in enumerate(params):
            if wanted(index):
                view = self._make_view(shards, index)
                if param.grad is not view:
                    param.grad = view
        self._owned = None

    # ------------------------------------------------------------------ grads lent out
    def register_write_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Runs ``hook()`` before the grads are next written (:meth:`before_write`), until the
        handle is removed: for whoever replaced some ``.grad`` by other tensors for a while (the
        optimizer adapter's temporary cast), to put the main-grad views back first."""
        handle = RemovableHandle(self._write_hooks)
        self._write_hooks[handle.id] = hook
        return handle

    @property
    def write_hooks(self) -> tuple[Callable[[], None], ...]:
        return tuple(self._write_hooks.values())

    def before_write(self) -> None:
        if self._write_hooks:
            for hook in list(self._write_hooks.values()):
                hook()

    # ------------------------------------------------------------------ one accumulation
    def begin(self, params: Sequence[nn.Parameter]) -> None:
        """Reads what the backward's grads add to, per parameter (see the presence note)."""
        grads = [param.grad for param in params]
        kept = [grad is not None for grad in grads]
        self._kept, self._arrivals = kept, None
        if not any(kept):
            # A fresh buffer, overwritten whole: a tensor kept from before is not written to.
            self._ref, self._owned = None, None
            self._overwrite = True
            return
        self._overwrite = False
        views = self.views(range(self._count))
        if all(kept) and all(map(operator.is_, grads, views)):
            self._ensure()
            return
        if any(view is not None and grad is not view for grad, view in zip(grads, views, strict=True)):
            self._relocate(grads, views)
            return
        shards = self._ensure()
        for index, (grad, view) in enumerate(zip(grads, views, strict=True)):
            if grad is None:
                shards.local(index).zero_()
            elif grad is not view:
                shards.local(index).copy_(_local(grad))

    def _relocate(self, grads: list[torch.Tensor | None], views: list[DTensor | None]) -> None:
        # A view no longer some parameter's grad lives on elsewhere: writing its region would
        # write into it. The present grads move to a fresh buffer; the old one stays with
        # whoever holds it.
        old = self.buffer
        self._ref = None
        shards = self._ensure()
        for index, (grad, view) in enumerate(zip(grads, views, strict=True)):
            if grad is None:
                continue
            source = self.layout.params[index].local_view(old) if grad is view and old is not None else _local(grad)
            shards.local(index).copy_(source)

    def pack(self, unsharded_params: Sequence[nn.Parameter], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A reduce-scatter's input: the unsharded grads (zeros for missing ones), then one
        presence flag per parameter, as ``(world_size, shard_numel + len(params))`` rows in the
        main-grad dtype (or ``dtype``); row ``r`` is what rank ``r`` receives (read back by
        :meth:`apply`)."""
        world_size = self.layout.params[0].world_size
        packed = torch.empty(
            world_size, self.layout.shard_numel + self._count, dtype=dtype or self.dtype, device=self._device
        )
        # Zero-size parameters own no slot (torch._chunk_cat refuses empty inputs).
        grads = [
            local_grad(param.grad, param) if param.grad is not None else torch.zeros_like(_local(param))
            for param, layout in zip(unsharded_params, self.layout.params, strict=True)
            if layout.slot_numel
        ]
        compute_dtype = unsharded_params[0].dtype
        flags = torch.tensor([param.grad is not None for param in unsharded_params], dtype=compute_dtype)
        grads.append(flags.to(self._device).expand(world_size, self._count).contiguous())
        torch._chunk_cat(grads, dim=0, num_chunks=world_size, out=packed)
        return packed

    def next_reduce_overwrites(self) -> bool:
        """Whether the reduce about to be issued overwrites the buffer (the first one after a
        :meth:`begin` that found no grad)."""
        overwrite, self._overwrite = self._overwrite, False
        return overwrite

    def apply(self, reduce: ReduceScatter) -> None:
        """Completes ``reduce`` into the buffer (overwriting or adding) and notes its flags.

        A freed buffer is allocated here, once the reduce completed (uninitialized where the
        reduce overwrites it), not when it was issued: while the reduce runs its input and
        output are held, as FSDP2 holds them, and the buffer not yet."""
        reduced = reduce.wait()
        buffer = self._ensure(overwritten=reduce.overwrite).tensor
        numel = self.layout.shard_numel
        with torch.no_grad():
            if reduce.overwrite:
                buffer.copy_(reduced[:numel])
            else:
                buffer.add_(reduced[:numel])
            flags = reduced[numel:]
            self._arrivals = flags.clone() if self._arrivals is None else self._arrivals.add_(flags)
        reduce.free()

    def finish(self, params: Sequence[nn.Parameter]) -> list[int]:
        """Ends the accumulation: installs the views as the grads of the trainable parameters
        that had a grad or got one (a frozen parameter keeps what it has).

        Returns:
            The positions of the parameters whose grad this accumulation changed.
        """
        kept = self._kept if self._kept is not None else [param.grad is not None for param in params]
        arrived = [False] * self._count if self._arrivals is None else [flag > 0 for flag in self._arrivals.tolist()]
        self._kept, self._arrivals = None, None
        shards = self._ensure()
        trainable = [param.requires_grad for param in params]
        self._install(shards, params, lambda i: trainable[i] and (kept[i] or arrived[i]))
        return [i for i in range(self._count) if trainable[i] and arrived[i]]

    def abandon(self, params: Sequence[nn.Parameter], accumulating: bool) -> None:
        """Forgets an accumulation an exception aborted; if it had begun, the buffer no longer
        holds what the grads held before, so they become ``None``."""
        if accumulating:
            for param in params:
                param.grad = None
        self._kept, self._arrivals, self._overwrite, self._owned = None, None, False, None

    # ------------------------------------------------------------------ grads set from outside a backward
    def install_zeros(self, params: Sequence[nn.Parameter]) -> None:
        """Gives trainable parameters without a grad a zeroed view as ``.grad``."""
        missing = [param.grad is None and param.requires_grad for param in params]
        shards = self._ensure()
        with torch.no_grad():
            for index, absent in enumerate(missing):
                if absent:
                    shards.local(index).zero_()
        self._install(shards, params, missing.__getitem__)

    def adopt_foreign(self, params: Sequence[nn.Parameter], indices: Sequence[int]) -> torch.Tensor:
        """Makes ``params[i].grad``, for ``i`` in ``indices`` whose grad is a tensor the user
        assigned, views holding its values; returns the buffer."""
        shards = self._ensure()
        foreign = {i for i in indices if params[i].grad is not None and params[i].grad is not self.view(i)}
        with torch.no_grad():
            for index in foreign:
                shards.local(index).copy_(_local(params[index].grad))  # type: ignore[arg-type]
        self._install(shards, params, foreign.__contains__)
        return shards.tensor
