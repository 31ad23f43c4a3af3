"""Memory of a stretch of training on the CPU: live tensor bytes (from storages) and the RSS peak.

:class:`StorageMeter` counts the bytes of every storage created while it is active: a
``TorchDispatchMode`` sees each op's outputs (a wrapper subclass such as DTensor through its
inner tensors), a storage is counted once and uncounted when torch frees it (its Python object
lives exactly as long as the storage), and ``UntypedStorage.resize_`` (how FSDP2 and
``fully_shard`` free and re-materialize unsharded parameters) is followed while the meter runs.
Start it before the model is built: everything the training allocates is then counted. Ops run
inside a subclass's own dispatch (DTensor's redistribution temporaries) are not seen.

The RSS high-water mark comes from ``/proc/self/status`` (``VmHWM``), reset through
``/proc/self/clear_refs`` after ``malloc_trim`` has returned freed heap memory to the system, so
that one process can measure several stretches one after the other.
"""

from __future__ import annotations

import ctypes
import gc
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["StorageMeter", "reset_rss_peak", "rss_peak_bytes"]


class StorageMeter(TorchDispatchMode):
    """Live and peak bytes of the storages created while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._original_resize: Any = None

    def reset_peak(self) -> None:
        self.peak = self.live

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes:
            return
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self._grow(nbytes)
        weakref.finalize(storage, self._freed, key)

    def _grow(self, nbytes: int) -> None:
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _count_tensor(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
            for name in names:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self._count_tensor(inner)
            return
        self._count(tensor.untyped_storage())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                self._count_tensor(leaf)
        return out

    def __enter__(self) -> StorageMeter:
        meter = self
        original = self._original_resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            before = storage.nbytes()
            result = original(storage, size)
            key = id(storage)
            if key in meter._sizes:
                meter._sizes[key] = storage.nbytes()
                meter._grow(storage.nbytes() - before)
            else:
                meter._count(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_rss_peak() -> int:
    """Returns freed heap memory to the system and restarts the RSS peak; returns the RSS in bytes."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the peak then also holds freed heap memory
        pass
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
        clear.write("5")
    return _status_kib("VmRSS") * 1024


def rss_peak_bytes() -> int:
    """The RSS high-water mark since the last :func:`reset_rss_peak`, in bytes."""
    return _status_kib("VmHWM") * 1024
