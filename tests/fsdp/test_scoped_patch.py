"""``ScopedPatch``: installed with the first held object, the very original restored after the
last one is collected, someone else's later replacement left alone; an attribute this torch
lacks is nothing to patch; a failed install or hold leaves nothing held. And the two patches
``fully_shard`` installs on torch (``_init_optim_state`` of DCP's state-dict module, for groups
whose main grads differ in dtype from their main weights; ``GradScaler._unscale_grads_``, for
fp16 main grads), in fresh rank processes: the very originals are back once the last model is
gone, also after a forward, a backward and a DCP state-dict call that raised half-way.
(``compile_boundary`` installs nothing: its guard is a per-call check.)"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from fsdp_patch.torch_interop.scoped_patch import ScopedPatch
from tests.distributed_pool import DistributedPool
from tests.fsdp import pattern_models
from tests.fsdp.sharded_views import world


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


def test_a_failed_install_holds_nothing() -> None:
    original = Owner.__dict__["method"]
    calls = []

    def failing(original: Any) -> Any:
        calls.append(original)
        if len(calls) == 1:
            raise RuntimeError("replacement cannot be built")
        return _twice(original)

    patch = ScopedPatch(lambda: Owner, "method", failing)
    with pytest.raises(RuntimeError, match="cannot be built"):
        patch.hold(Held())
    assert Owner.__dict__["method"] is original and patch.live == 0, f"after a failed install: live {patch.live}"
    held = Held()
    patch.hold(held)  # the next hold installs
    got = Owner.method(1)
    assert got == 4 and patch.live == 1, f"after a later hold: Owner.method(1) = {got}, live {patch.live}"
    del held
    gc.collect()
    assert Owner.__dict__["method"] is original, "not restored after the later hold's object went"


def test_an_object_without_weak_references_holds_nothing() -> None:
    original = Owner.__dict__["method"]
    patch = ScopedPatch(lambda: Owner, "method", _twice)
    with pytest.raises(TypeError, match="weak"):
        patch.hold(3)  # an int cannot be weakly referenced: its lifetime cannot be followed
    assert Owner.__dict__["method"] is original and patch.live == 0, f"after a refused hold: live {patch.live}"


class _Raise(RuntimeError):
    """Raised on purpose half-way through a forward or a backward."""


def torch_patches_restored_on_ranks() -> None:
    from torch.distributed.checkpoint import state_dict as torch_state_dict
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from fsdp_patch.module import dcp_optimizer_state, grad_scaler_hint
    from fsdp_patch.optimizer import fully_shard_optimizer

    init_original = torch_state_dict.__dict__["_init_optim_state"]
    unscale_original = torch.amp.GradScaler.__dict__["_unscale_grads_"]
    patches = {"_init_optim_state": dcp_optimizer_state._PATCH, "_unscale_grads_": grad_scaler_hint._PATCH}
    held = {name: patch.live for name, patch in patches.items()}
    assert held == {"_init_optim_state": 0, "_unscale_grads_": 0}, f"a fresh rank process already holds {held}"

    def current() -> dict[str, Any]:
        return {
            "_init_optim_state": torch_state_dict.__dict__["_init_optim_state"],
            "_unscale_grads_": torch.amp.GradScaler.__dict__["_unscale_grads_"],
        }

    originals = {"_init_optim_state": init_original, "_unscale_grads_": unscale_original}
    x, y = (pattern_models.rows(t, *world()) for t in pattern_models.data()[0])
    torch.manual_seed(0)
    # bf16 main grads: torch's _init_optim_state wrapped; fp16 main grads: GradScaler's too.
    bf16 = pattern_models.shard(pattern_models.Net(), "ours", reshard_after_forward=None, dtype=torch.bfloat16)
    fp16 = pattern_models.shard(
        pattern_models.Net(), "ours", reshard_after_forward=None, dtype=torch.bfloat16, main_grads_dtype=torch.float16
    )
    installed = {name: fn is not originals[name] for name, fn in current().items()}
    assert installed == {"_init_optim_state": True, "_unscale_grads_": True}, (
        f"installed while the models live: {installed}"
    )
    optimizer = torch.optim.AdamW(bf16.parameters(), lr=1e-2)
    fully_shard_optimizer(optimizer)

    # A DCP state-dict call that raises inside the wrapped initialization (the optimizer also
    # holds a plain tensor, which the neutral initialization refuses); first, while no grads exist.
    stray = torch.zeros(3, requires_grad=True)
    mixed = torch.optim.AdamW([*bf16.parameters(), stray], lr=1e-2)
    with pytest.raises(TypeError, match="init_optimizer_state expected nn.Parameter"):
        get_optimizer_state_dict(bf16, mixed)
    # A forward that raises in its second block.
    handle = bf16.blocks[1].register_forward_hook(lambda *args: (_ for _ in ()).throw(_Raise("forward")))
    with pytest.raises(_Raise, match="forward"):
        bf16(x.to(torch.bfloat16))
    handle.remove()

    # A backward that raises between the blocks (a grad hook on the first block's output).
    def raise_in_backward(module: Any, args: Any, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: (_ for _ in ()).throw(_Raise("backward")))

    handle = bf16.blocks[0].register_forward_hook(raise_in_backward)
    loss = pattern_models.mse(bf16(x.to(torch.bfloat16)), y)
    handle.remove()
    with pytest.raises(_Raise, match="backward"):
        loss.backward()
    del loss
    # Still installed while the models live.
    installed = {name: fn is not originals[name] for name, fn in current().items()}
    assert installed == {"_init_optim_state": True, "_unscale_grads_": True}, f"installed after the errors: {installed}"

    del bf16, fp16, optimizer, mixed, stray, handle
    gc.collect()
    restored = {name: fn is originals[name] for name, fn in current().items()}
    live = {name: patch.live for name, patch in patches.items()}
    assert restored == {"_init_optim_state": True, "_unscale_grads_": True}, (
        f"torch's originals back after the last model went: {restored} (groups still holding: {live})"
    )


def test_torch_patches_restored_exactly_after_errors_and_the_last_model() -> None:
    """Fresh rank processes, so that no other test's models are alive in them."""
    pool = DistributedPool(2)
    try:
        pool.run(torch_patches_restored_on_ranks)
    finally:
        pool.close()
