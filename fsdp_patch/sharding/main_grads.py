"""The main gradients of one parameter group: their buffer, who owns it, and which grads are present.

[Note: main-grad ownership]
The flat sharded main-grad buffer is held strongly by :class:`MainGrads` only while the group
writes it (from a backward's first reduce until :meth:`MainGrads.finish`); otherwise only the
DTensor views installed as the sharded parameters' ``.grad`` hold it. Once
``zero_grad(set_to_none=True)`` drops every view its memory is freed, as FSDP2's sharded grads
are, and the next backward allocates it anew. Views are cached weakly, per parameter, so that a
view dropped by the user is never handed out again.

Alternatives considered:
    - The buffer owned by the group for good: ``zero_grad(set_to_none=True)`` would free nothing.
"""

from __future__ import annotations

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

__all__ = ["MainGrads"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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
        # Between begin() and finish(): whether the next reduce overwrites the buffer.
        self._overwrite = False
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
        """Reads what the backward's grads add to: nothing (after ``zero_grad(set_to_none=True)``),
        the views, or tensors a user assigned."""
        if all(param.grad is None for param in params):
            # A fresh buffer: a tensor someone kept from before zero_grad is not written to.
            self._ref, self._owned = None, None
            self._overwrite = True
            return
        self._overwrite = False
        shards = self._ensure()
        if all(param.grad is self.view(i) for i, param in enumerate(params)):
            return
        for index, param in enumerate(params):
            if param.grad is None:
                shards.local(index).zero_()
            elif param.grad is not self.view(index):
                shards.local(index).copy_(_local(param.grad))

    def next_reduce_overwrites(self) -> bool:
        """Whether the reduce about to be issued overwrites the buffer (the first one after a
        :meth:`begin` that found no grad); allocates the buffer, uninitialized if so."""
        overwrite, self._overwrite = self._overwrite, False
        self._ensure(overwritten=overwrite)
        return overwrite

    def apply(self, reduce: ReduceScatter) -> None:
        """Completes ``reduce`` into the buffer (overwriting or adding) and notes its flags."""
        reduced = reduce.wait()
        buffer = self._owned
        assert buffer is not None, "a reduce completed outside an accumulation"
        with torch.no_grad():
            if reduce.overwrite:
                buffer.copy_(reduced)
            else:
                buffer.add_(reduced)
        reduce.free()

    def finish(self, params: Sequence[nn.Parameter]) -> list[int]:
        """Ends the accumulation: installs the views as the grads of every trainable parameter
        (a frozen parameter keeps what it has).

        Returns:
            The positions of the parameters whose grad this accumulation changed.
        """
        shards = self._ensure()
        self._install(shards, params, lambda i: params[i].requires_grad)
        return []

    def abandon(self, params: Sequence[nn.Parameter], accumulating: bool) -> None:
        """Forgets an accumulation an exception aborted; if it had begun, the buffer no longer
        holds what the grads held before, so they become ``None``."""
        if accumulating:
            for param in params:
                param.grad = None
        self._overwrite, self._owned = False, None

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
