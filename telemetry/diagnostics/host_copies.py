"""Values telemetry reads on the host, copied there without blocking.

A value read from a device tensor (``item``, ``tolist``, ``bool``) waits for the device to finish
everything queued before it: a synchronization that stops the host from running ahead, which is
what keeps a GPU busy. So what telemetry computes on the device each iteration (its flags, its
probes) is copied with ``non_blocking=True`` into pinned host memory, with an event recorded after
the copy, and read only once the event says the copy is done: a step later, or when the script
itself synchronized (``loss.item()``), or at a flush, where waiting is the point.

On a CPU the values are on the host already: a copy is ready at once and costs nothing.

:func:`is_host_copy` lets the tests count every other read as one a GPU would synchronize on.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

# By id, each with a weak reference that drops its entry (a WeakSet would compare tensors with ==).
_COPIES: dict[int, weakref.ref[torch.Tensor]] = {}


def is_host_copy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a host copy made here (reading it never synchronizes)."""
    held = _COPIES.get(id(tensor))
    return held is not None and held() is tensor


def _remember(tensor: torch.Tensor) -> None:
    key = id(tensor)
    _COPIES[key] = weakref.ref(tensor, lambda _: _COPIES.pop(key, None))


class HostCopy:
    """Device tensors on their way to the host.

    Args:
        tensors: What to copy (``None`` entries stay ``None``).
    """

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        self._event: Any = None
        copies: list[torch.Tensor | None] = []
        for tensor in tensors:
            if tensor is not None and tensor.device.type == "cuda":
                # A device-to-host copy with non_blocking lands in pinned memory, queued on the stream.
                tensor = tensor.to("cpu", non_blocking=True)
                if self._event is None:
                    self._event = torch.cuda.Event()
            if tensor is not None:
                _remember(tensor)
            copies.append(tensor)
        if self._event is not None:
            self._event.record()
        self._copies = copies

    def ready(self) -> bool:
        """Whether the copies can be read without waiting for the device."""
        return self._event is None or bool(self._event.query())

    def values(self, wait: bool = False) -> list[torch.Tensor | None]:
        """The host copies; with ``wait``, after waiting for the device (a flush, the exit).

        Raises:
            RuntimeError: The copies are not ready and ``wait`` is false.
        """
        if not self.ready():
            if not wait:
                raise RuntimeError("the host copies are not ready: ask ready() first, or wait")
            self._event.synchronize()
        return self._copies

    def tensors(self, wait: bool = False) -> list[torch.Tensor]:
        """:meth:`values` of copies made of tensors alone (no ``None`` given)."""
        copies = self.values(wait)
        assert all(t is not None for t in copies), "tensors() of a copy that was given None"
        return [t for t in copies if t is not None]
