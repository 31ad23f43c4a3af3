"""What the fast-path tests share (``test_fast_path*.py``): an adapted model and its hand-cast
reference trained alike (:class:`Pair`), a step pre-hook that records the cast grads the update
sees (:class:`CastSpy`), and the bytes an optimizer's cast buffers should take.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_patch import parameter_group_of, parameter_groups
from tests.models import lm_loss
from tests.optimizer.support import (
    HandCast,
    O,
    adapt,
    assert_compute_fresh,
    assert_grads_original,
    assert_same,
    backward,
    build_model,
    fsdp_params,
    local,
    local_tokens,
    main_weights,
    optimizer_state,
)

FP32_BYTES = 4


def adamw(params: Any) -> torch.optim.Optimizer:
    return O.AdamW(params, lr=1e-2, weight_decay=0.1)


class CastSpy:
    """A step pre-hook registered after the adaptation: what the update sees as grads."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.seen: list[dict[int, tuple[int, int, torch.dtype]]] = []
        optimizer.register_step_pre_hook(self)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.seen.append(
            {
                id(p): (id(p.grad), local(p.grad).data_ptr(), p.grad.dtype)
                for p in fsdp_params(optimizer)
                if p.grad is not None
            }
        )

    def assert_reused(self, params: list[torch.nn.Parameter], what: str, same_memory: bool = True) -> None:
        """Asserts that the last two steps gave ``params`` the same cast views (over the same memory)."""
        assert len(self.seen) >= 2 and params, f"{what}: {len(self.seen)} steps seen, {len(params)} parameters"
        last, before = self.seen[-1], self.seen[-2]
        width = 3 if same_memory else 1
        for index, p in enumerate(params):
            got, had = last.get(id(p)), before.get(id(p))
            assert got is not None and had is not None, f"{what}: parameter {index} cast in {had} then {got}"
            assert got[:width] == had[:width], (
                f"{what}: parameter {index}'s cast view (id, data_ptr, dtype) {got[:width]}, the step before {had[:width]}"
            )


def expected_cast_bytes(params: list[torch.nn.Parameter]) -> int:
    """Bytes of the cast buffers for an optimizer holding ``params``: per group, the span of
    their slots (padding included) in fp32."""
    spans: dict[int, tuple[int, int]] = {}
    for param in params:
        group = parameter_group_of(param)
        layout = group.layout.params[group.index_of(param)]
        lo, hi = spans.get(id(group), (layout.offset, layout.offset + layout.slot_numel))
        spans[id(group)] = (min(lo, layout.offset), max(hi, layout.offset + layout.slot_numel))
    return sum(hi - lo for lo, hi in spans.values()) * FP32_BYTES


class Pair:
    """An adapted model and its hand-cast reference, trained alike."""

    def __init__(self, observer: str, params_of: Any = list) -> None:
        self.model, self.ref = build_model(), build_model()
        self.opt = adamw(params_of(list(self.model.parameters())))
        self.ref_opt = adamw(params_of(list(self.ref.parameters())))
        adapt(self.opt, observer)
        self.spy = CastSpy(self.opt)

    def both(self, fn: Any) -> None:
        """Does ``fn(model, optimizer)`` to the adapted pair and to the reference."""
        fn(self.model, self.opt)
        fn(self.ref, self.ref_opt)

    def step(self, tag: str, tokens: torch.Tensor, zero: bool | None = True, before_step: Any = None) -> None:
        """Backward on both, ``before_step`` on both, the steps, the checks, then ``zero_grad``."""
        backward(self.model, tokens)
        backward(self.ref, tokens)
        if before_step is not None:
            self.both(before_step)
        self.opt.step()
        HandCast(fsdp_params(self.ref_opt)).step(self.ref_opt)
        assert_same(main_weights(self.model), main_weights(self.ref), f"{tag}: main weights vs reference")
        assert_same(optimizer_state(self.opt), optimizer_state(self.ref_opt), f"{tag}: optimizer state vs reference")
        assert_compute_fresh(self.model, tag)
        assert_grads_original(self.opt, f"{tag}: grads are the original views")
        dtypes = [dtype for _, _, dtype in self.spy.seen[-1].values()]
        assert dtypes and set(dtypes) == {torch.float32}, f"{tag}: grad dtypes the update saw: {dtypes}"
        if zero is not None:
            self.both(lambda model, opt: opt.zero_grad(set_to_none=zero))
        if zero:
            # Nothing of the adapter holds the main grads: zero_grad(set_to_none=True) frees them.
            held = [
                g.main_grad_storage_bytes()
                for g in parameter_groups(self.model)
                if all(p.grad is None for p in g.params)
            ]
            assert held and not any(held), f"{tag}: main-grad bytes held after zero_grad(set_to_none=True): {held}"


def forward_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The loss of a forward without grad (gathers the compute copy)."""
    with torch.no_grad():
        return lm_loss(model, local_tokens(tokens))
