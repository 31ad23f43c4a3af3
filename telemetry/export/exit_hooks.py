"""The process-wide hooks that end a run of the embedded default: an ``atexit`` hook, and a wrapper
around ``torch.distributed.destroy_process_group`` that flushes before the default group is torn down.

They call what :mod:`~fsdp_patch.telemetry.export.providers` hands them (its shutdown, its flush
before the teardown) and import nothing of it. Each is removed by the object it was installed
with, so that removing them leaves ``atexit`` and ``torch.distributed`` as they were. The
providers install and remove them under their lock.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any

_WRAPPED_MARK = "_self_fsdp_telemetry_flush"
# The callable registered with atexit, kept because atexit.unregister removes by it.
_at_exit: Callable[[], None] | None = None


def install(at_exit: Callable[[], None], before_destroy: Callable[[], None]) -> None:
    """Register ``at_exit`` with ``atexit`` (once), and wrap ``destroy_process_group`` to call ``before_destroy``."""
    global _at_exit
    if _at_exit is None:
        _at_exit = at_exit
        atexit.register(at_exit)
    wrap_destroy_process_group(before_destroy)


def remove() -> None:
    """Unregister the ``atexit`` hook and put the original ``destroy_process_group`` back. Idempotent."""
    global _at_exit
    if _at_exit is not None:
        atexit.unregister(_at_exit)
        _at_exit = None
    unwrap_destroy_process_group()


def wrap_destroy_process_group(before_destroy: Callable[[], None]) -> None:
    """Call ``before_destroy`` before ``destroy_process_group()`` tears down the default group.

    Only the module attributes are patched, so code that imported the function by name
    before telemetry started calls the original; the atexit flush still covers it. Already
    wrapped, it is left as it is.
    """
    try:
        import torch.distributed as dist
        import wrapt
        from torch.distributed import distributed_c10d as c10d
    except ImportError:  # pragma: no cover - torch built without distributed
        return
    original = c10d.destroy_process_group
    if getattr(original, _WRAPPED_MARK, False):
        return

    def flush_first(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        group = args[0] if args else kwargs.get("group")
        if group is None or group is c10d.GroupMember.WORLD:
            before_destroy()
        return wrapped(*args, **kwargs)

    wrapper = wrapt.FunctionWrapper(original, flush_first)
    setattr(wrapper, _WRAPPED_MARK, True)
    for module in (c10d, dist):
        if getattr(module, "destroy_process_group", None) is original:
            setattr(module, "destroy_process_group", wrapper)  # noqa: B010 - a module's attribute, patched


def unwrap_destroy_process_group() -> None:
    """Put the original ``destroy_process_group`` back where our wrapper still is."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except ImportError:  # pragma: no cover
        return
    for module in (c10d, dist):
        current = getattr(module, "destroy_process_group", None)
        if current is not None and getattr(current, _WRAPPED_MARK, False):
            setattr(module, "destroy_process_group", current.__wrapped__)  # noqa: B010 - a module's attribute, patched
