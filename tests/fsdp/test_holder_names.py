"""``holder_prefix``: where a sharded root sits in the module the user holds, the prefix of every name telemetry gives."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_patch.module.model_units import holder_prefix, user_name


class Holder(nn.Module):
    def __init__(self, inner: nn.Module, attribute: str = "model") -> None:
        super().__init__()
        setattr(self, attribute, inner)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))


def test_a_model_nobody_holds_keeps_its_own_names() -> None:
    model = _model()
    assert holder_prefix(model) == "", f"want no prefix, got {holder_prefix(model)!r}"


def test_a_held_model_is_named_as_its_holders_name_it() -> None:
    model = _model()
    outer = Holder(Holder(model), "wrapped")
    got = holder_prefix(model)
    assert got == "wrapped.model.", f"want 'wrapped.model.', got {got!r}"
    names = dict(outer.named_parameters())
    assert user_name(got, "0.weight") in names, f"{user_name(got, '0.weight')!r} is not among {sorted(names)}"
    assert user_name(got, "") == "wrapped.model" and user_name("", "0") == "0"
    del outer


def test_a_module_held_by_two_parents_ends_the_walk() -> None:
    model = _model()
    shared = Holder(model)
    first, second = Holder(shared, "a"), Holder(shared, "b")
    got = holder_prefix(model)
    assert got == "model.", f"want the walk to stop below the shared holder ('model.'), got {got!r}"
    del first, second


def test_torch_compile_wrapper_adds_nothing() -> None:
    model = _model()
    holder = Holder(model)
    compiled = torch.compile(holder)
    outer = Holder(compiled, "net")
    got = holder_prefix(model)
    assert got == "net.model.", f"want 'net.model.' (no _orig_mod.), got {got!r}"
    del outer
