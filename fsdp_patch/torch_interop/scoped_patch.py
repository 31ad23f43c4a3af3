"""An attribute of torch replaced while some objects live, and restored exactly after the last.

fsdp_patch changes torch's behaviour in two places, both only where its own parameter groups
need it (an error that points nowhere useful, a path torch takes that cannot work on them).
A :class:`ScopedPatch` installs its replacement when the first object that needs it is held and
puts the original back, the very same object, once the last such object is garbage collected.
If someone replaced the attribute since, theirs is left in place (and ours, which it may call,
keeps passing calls through to the original).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["ScopedPatch"]


class ScopedPatch:
    """Replaces ``owner().<name>`` by ``make_replacement(original)`` while held objects live.

    Args:
        owner: Returns the object (class or module) whose attribute is replaced; called at
            install, so that importing this module imports nothing of torch's.
        name: The attribute.
        make_replacement: Builds the replacement from the original.
    """

    def __init__(self, owner: Callable[[], Any], name: str, make_replacement: Callable[[Any], Any]) -> None:
        self._owner = owner
        self._name = name
        self._make_replacement = make_replacement
        self._lock = threading.Lock()
        self._live = 0
        self._installed: tuple[Any, Any, Any] | None = None  # (owner, original, replacement)

    @property
    def installed(self) -> bool:
        return self._installed is not None

    @property
    def live(self) -> int:
        """How many held objects are alive."""
        return self._live

    def hold(self, obj: object) -> None:
        """Keeps the replacement installed for as long as ``obj`` lives.

        If installing raises, or ``obj`` cannot be weakly referenced, nothing is held and the
        attribute is as it was."""
        with self._lock:
            if self._live == 0:
                self._install()
            self._live += 1
        try:
            weakref.finalize(obj, self._release)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        with self._lock:
            self._live -= 1
            if self._live == 0:
                self._uninstall()

    def _install(self) -> None:
        owner = self._owner()
        if self._name not in owner.__dict__:
            return  # a torch without the attribute: nothing of it to change
        original = owner.__dict__[self._name]
        replacement = self._make_replacement(original)
        setattr(owner, self._name, replacement)
        self._installed = (owner, original, replacement)

    def _uninstall(self) -> None:
        if self._installed is None:
            return
        owner, original, replacement = self._installed
        if owner.__dict__.get(self._name) is replacement:
            setattr(owner, self._name, original)
        self._installed = None
