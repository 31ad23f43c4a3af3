"""``ScopedPatch``: installed with the first held object, the very original restored after the
last one is collected, someone else's later replacement left alone; an attribute this torch
lacks is nothing to patch."""

from __future__ import annotations

import gc
from typing import Any

from fsdp_patch.scoped_patch import ScopedPatch


class Owner:
    @staticmethod
    def method(x: int) -> int:
        return x + 1


class Held:
    """An object whose lifetime keeps the patch installed."""


def _twice(original: Any) -> Any:
    def replacement(x: int) -> int:
        return 2 * original(x)

    return replacement


def test_installed_while_held_and_restored_exactly() -> None:
    original = Owner.__dict__["method"]
    patch = ScopedPatch(lambda: Owner, "method", _twice)
    first, second = Held(), Held()
    patch.hold(first)
    got = Owner.method(1)
    assert got == 4, f"patched call gave {got}, want 4"
    patch.hold(second)
    del first
    gc.collect()
    assert patch.installed and patch.live == 1, f"installed {patch.installed}, live {patch.live} with one object left"
    del second
    gc.collect()
    restored = Owner.__dict__["method"]
    assert restored is original, f"after the last object: {restored!r}, want the original {original!r}"
    assert not patch.installed and patch.live == 0, f"installed {patch.installed}, live {patch.live}"


def test_a_later_replacement_is_left_in_place() -> None:
    original = Owner.__dict__["method"]
    patch = ScopedPatch(lambda: Owner, "method", _twice)
    held = Held()
    patch.hold(held)

    def theirs(x: int) -> int:
        return -x

    Owner.method = staticmethod(theirs)  # type: ignore[method-assign]
    try:
        del held
        gc.collect()
        kept = Owner.__dict__["method"].__func__
        assert kept is theirs, f"someone else's replacement was undone: {kept!r}"
    finally:
        Owner.method = original  # type: ignore[method-assign]


def test_a_missing_attribute_is_nothing_to_patch() -> None:
    patch = ScopedPatch(lambda: Owner, "absent", _twice)
    held = Held()
    patch.hold(held)
    assert not patch.installed and not hasattr(Owner, "absent"), "patched an attribute the owner does not have"
    del held
    gc.collect()
    assert patch.live == 0, f"live {patch.live} after the object was collected"
