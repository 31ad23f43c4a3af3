"""The adapter's temporary grad cast: one FSDP group's grads in its main-weight dtype.

While an adapted optimizer steps, the parameters it holds of a group whose main grads are
narrower than its main weights (bf16 grads, fp32 weights) get, as ``.grad``, DTensor views of
a buffer holding the main grads cast to the main-weight dtype; afterwards the main-grad views
are put back. A :class:`GroupGradCast` does that for one (optimizer, group) pair: one flat
``copy_`` for the cast, one attribute swap per parameter each way.

The buffer and its DTensor views are built once and reused at every step. Releasing the buffer
between steps (:meth:`GroupGradCast.release`) resizes its storage to zero bytes and keeps the
storage object, so the views stay valid and the next cast re-materializes it.

While the cast grads are attached, ``grad_dtype`` is ``None`` (any dtype); the main-grad dtype
comes back with the main-grad views.

When the buffers are not kept between steps (``keep_cast_buffers(optimizer, False)``, the CUDA
default, and the default for ``compute_copy="per_gather"`` groups), a cast that covers a whole
group also frees the group's main-grad memory while its copies stand in, and the restore casts
them back (exactly: they were widened) one group at a time, freeing each buffer as it goes. The
step then holds each grad once, in the main-weight dtype, as FSDP2's step holds its fp32 grads:
at most 16 bytes per element with AdamW instead of 18.

Alternatives considered:
    - The cast inside ``ParameterGroup``: the group would have to undo the optimizer's
      temporary state before backward and reset. Instead the group only offers a hook before it
      writes grads (``register_grad_write_hook``), registered while a cast is attached.
    - A fresh buffer and fresh DTensor views at every step: building a ``DTensor`` costs
      ~2.4 µs per parameter, and a fresh 96 MiB CPU buffer ~24,500 page faults (~38 ms).
    - ``grad_dtype`` set to the cast dtype while cast: two more attribute writes per parameter
      and step (~0.5 µs); torch's optimizers never read ``grad_dtype``.
    - Keeping the main grads through the step: 2 bytes per element more
      than FSDP2 at the step's peak. Releasing them also when the buffers are kept would buy
      that at a page-faulting re-allocation of the main grads at every CPU step.
    - One buffer per group shared by every optimizer holding part of it: optimizers usually
      step one after the other, but one can step inside another's step (from a step hook or
      a closure) while the outer cast is attached, and a shared buffer would be overwritten
      under it. Each cast covers only the span of the group's buffer its optimizer's
      parameters occupy instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ..sharding import ParameterGroup

__all__ = ["GroupGradCast", "cast_in_flight"]


class GroupGradCast:
    """Casts the grads of some parameters of one FSDP group to the main-weight dtype.

    Args:
        group: The FSDP parameter group.
        indices: Positions (in ``group.params``) of the parameters the optimizer holds, sorted.
    """

    def __init__(self, group: ParameterGroup, indices: Sequence[int]) -> None:
        self.group = group
        self.indices = tuple(indices)
        self.params: list[nn.Parameter] = [group.params[i] for i in self.indices]
        self.dtype = group.main_dtype
        layouts = [group.layout.params[i] for i in self.indices]
        self._start = min(layout.offset for layout in layouts)
        # Slots with their padding: an optimizer holding the whole group casts the whole buffer.
        self._end = max(layout.offset + layout.slot_numel for layout in layouts)
        # Whether this cast covers every parameter of the group (a span covering the whole
        # buffer is not enough: another optimizer may hold a parameter in between).
        self._whole_group = len(self.indices) == len(group.params)
        self._buffer: torch.Tensor | None = None
        self._views: list[DTensor] = []
        # While attached: the main-grad views (None: no grad, not cast) the cast views replace.
        self._originals: list[DTensor | None] | None = None
        self._hook: RemovableHandle | None = None
        # While attached with release: the main-grad buffer whose memory the cast freed.
        self._released: torch.Tensor | None = None

    # ------------------------------------------------------------------ memory
    @property
    def nbytes(self) -> int:
        """Bytes the cast buffer holds now (0 before the first cast and once released)."""
        return 0 if self._buffer is None else self._buffer.untyped_storage().nbytes()

    @property
    def in_flight(self) -> bool:
        """Whether cast grads are attached to the parameters now."""
        return self._originals is not None

    def release(self) -> None:
        """Frees the buffer's memory; the views stay valid (the next cast re-materializes it)."""
        if self._buffer is not None and not self.in_flight:
            self._buffer.untyped_storage().resize_(0)

    def _materialized(self) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None:
            buffer = torch.empty(self._end - self._start, dtype=self.dtype, device=self.group.main_weight.device)
            specs = self.group.dtensor_specs(self.dtype)
            self._views = [
                DTensor(
                    buffer[layout.offset - self._start : layout.offset - self._start + layout.local_numel].view(
                        layout.local_shape
                    ),
                    specs[index],
                    requires_grad=False,
                )
                for index, layout in ((i, self.group.layout.params[i]) for i in self.indices)
            ]
            self._buffer = buffer
            return buffer
        storage = buffer.untyped_storage()
        nbytes = buffer.numel() * buffer.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return buffer

    # ------------------------------------------------------------------ cast and restore
    def cast(
        self, main_grad: torch.Tensor, originals: list[DTensor | None], all_present: bool, release: bool = False
    ) -> int:
        """Attaches cast copies of the grads in place of ``originals``.

        Args:
            main_grad: The group's main-grad buffer.
            originals: Per parameter, its current ``.grad``: the group's main-grad view, or
                ``None`` for a parameter without a grad (left alone).
            all_present: No entry of ``originals`` is ``None`` (the loop then tests nothing).
            release: Free the main-grad buffer's memory while the cast copies stand in for it,
                when this cast covers every parameter of the group (:meth:`restore` casts them
                back): the step then holds the grads once, in the main-weight dtype, as
                FSDP2's step does.

        Returns:
            Bytes written by the cast.
        """
        buffer = self._materialized()
        with torch.no_grad():
            buffer.copy_(main_grad[self._start : self._end])
        if release and self._whole_group:
            main_grad.untyped_storage().resize_(0)
            self._released = main_grad
        self._originals = originals
        self._hook = self.group.register_grad_write_hook(self._restore_before_grad_write)
        # A parameter refuses a grad whose dtype differs from its grad_dtype; None allows any.
        if all_present:
            for param, view in zip(self.params, self._views, strict=True):
                param.grad_dtype = None
                param.grad = view
        else:
            for param, view, original in zip(self.params, self._views, originals, strict=True):
                if original is not None:
                    param.grad_dtype = None
                    param.grad = view
        return buffer.numel() * buffer.element_size()

    def restore(self, carry_back: bool) -> None:
        """Puts the main-grad views back; a no-op when nothing is attached.

        What was done to a cast grad meanwhile is kept: one set to ``None`` (``zero_grad()``
        after a failed step) stays ``None``; a tensor assigned in its place, and with
        ``carry_back`` the cast copy's own values (changed in place, e.g. by
        ``zero_grad(set_to_none=False)``), are written back into the main grads.
        ``carry_back=False`` is for the end of a step, whose update reads grads only. A main-grad
        buffer :meth:`cast` released is filled back from the cast copies first.
        """
        originals = self._originals
        if originals is None:
            return
        self._originals = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        released, self._released = self._released, None
        if released is not None:
            # The cast copies hold the grads' values (exactly: they widened them); what the
            # step did to them in place is carried back with them.
            released.untyped_storage().resize_(released.numel() * released.element_size())
            assert self._buffer is not None
            with torch.no_grad():
                released.copy_(self._buffer)
        grads_dtype = self.group.grads_dtype
        with torch.no_grad():
            for param, view, original in zip(self.params, self._views, originals, strict=True):
                if original is None:
                    continue
                current = param.grad
                if current is view and not carry_back:  # untouched: the common case
                    param.grad = original
                    param.grad_dtype = grads_dtype
                    continue
                param.grad = None
                param.grad_dtype = grads_dtype
                if current is None:
                    continue
                original._local_tensor.copy_(current._local_tensor if isinstance(current, DTensor) else current)
                param.grad = original

    def _restore_before_grad_write(self) -> None:
        self.restore(carry_back=True)

    def __repr__(self) -> str:
        return f"GroupGradCast({self.group!r}, params={len(self.indices)}, nbytes={self.nbytes})"


def cast_in_flight(group: ParameterGroup) -> bool:
    """Whether some adapted optimizer's cast grads are attached to ``group``'s parameters."""
    return any(getattr(hook, "__self__", None).__class__ is GroupGradCast for hook in group.grad_write_hooks)
