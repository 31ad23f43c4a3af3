"""Writes to the main weights made outside the optimizer adapter reach the next forward's
compute weights, whichever way they are made.

With bf16 compute the persistent compute copy is a cast of the main weights; each pattern
writes the main weights another way between steps (``.data`` ops, Hugging Face-style
``_init_weights`` after sharding, state-dict values, clamping, ``torch._foreach_*_`` as EMA
code does, an unadapted ``foreach`` optimizer). 4 SGD-momentum steps on 2 gloo ranks, and on
4 (the head's 5 rows split (2, 2, 1, 0), one rank's shard empty): fp32
within 1e-5 of the unsharded model with FSDP2 as the control; bf16 bitwise equal to FSDP2 with
the same dtypes, for both compute-copy lifetimes. Losses, final weights and (for EMA) the
averaged model's eval outputs are compared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from tests.fsdp.parity import (
    BF16,
    adapt,
    assert_equal,
    assert_parity,
    batches,
    build,
    full_params,
    global_loss,
    loss_of,
    run_contenders,
)

STEPS = 4


def _hf_init(model: nn.Module) -> None:
    """``PreTrainedModel._init_weights`` as Hugging Face models write it, run after sharding."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.2)
            module.bias.data.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.data.fill_(1.5)
            module.bias.data.zero_()


def _fsdp2_hf_init_values(precision: str) -> dict[str, torch.Tensor]:
    """The weights FSDP2 holds after ``_hf_init`` under seed 1: the unsharded reference starts
    from them (DTensor's random ops on CPU draw each shard from its rank's own generator, so a
    sharded ``normal_`` is not the unsharded one; ours must draw exactly FSDP2's)."""
    model = build("fsdp2", precision)
    torch.manual_seed(1)
    _hf_init(model)
    return full_params(model)


def _scale_data(factor: float) -> Callable[[nn.Module], None]:
    def write(model: nn.Module) -> None:
        for p in model.parameters():
            p.data.mul_(factor)

    return write


def _copy_into_data(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.copy_(p.data * 0.5 + 0.01)


def _copy_into_state_dict(model: nn.Module) -> None:
    for value in model.state_dict().values():
        value.copy_(value * 0.8)


def _clamp(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.clamp_(-0.15, 0.15)


def _foreach_mul(model: nn.Module) -> None:
    torch._foreach_mul_(list(model.parameters()), 0.9)


@dataclass(frozen=True)
class Pattern:
    """What a pattern does beside adapted SGD training.

    Attributes:
        write: Writes into the main weights, under ``no_grad``, after each optimizer step.
        hf_init: Initializes the sharded weights as HF's ``_init_weights`` does, before training.
        ema: Keeps an EMA model, updated with ``_foreach_lerp_`` after each step.
        unadapted_foreach: A foreach optimizer that is not adapted (its grads are fp32 main grads).
    """

    write: Callable[[nn.Module], None] | None = None
    hf_init: bool = False
    ema: bool = False
    unadapted_foreach: bool = False


PATTERNS = {
    "data_mul": Pattern(write=_scale_data(0.9)),
    "data_copy": Pattern(write=_copy_into_data),
    "hf_init": Pattern(hf_init=True),
    "state_dict_copy": Pattern(write=_copy_into_state_dict),
    "clamp": Pattern(write=_clamp),
    "foreach_mul": Pattern(write=_foreach_mul),
    "foreach_ema": Pattern(ema=True),
    "unadapted_foreach": Pattern(unadapted_foreach=True),
}


def _train(impl: str, pattern: Pattern, precision: str, init: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    # The unadapted foreach optimizer needs grads of its parameters' dtype: fp32 main grads
    # (FSDP2: fp32 reduce).
    fp32_grads = pattern.unadapted_foreach and precision == "bf16"
    model = build(impl, precision, main_grads_dtype=torch.float32 if fp32_grads else None)
    if pattern.hf_init:
        if impl == "reference":
            model.load_state_dict(init)  # type: ignore[arg-type]
        else:
            torch.manual_seed(1)
            _hf_init(model)
    ema = build(impl, precision, seed=7) if pattern.ema else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=pattern.unadapted_foreach)
    if not pattern.unadapted_foreach:
        adapt(optimizer, impl, precision)
    facts: dict[str, Any] = {"losses": {}, "ema_outputs": {}}
    data = batches(STEPS)
    for step, (x, y) in enumerate(data):
        loss = loss_of(model, impl, precision, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if pattern.write is not None:
            with torch.no_grad():
                pattern.write(model)
        facts["losses"][f"step {step}"] = torch.tensor(global_loss(loss, impl))
        if ema is not None:
            with torch.no_grad():
                torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.5)
                inputs = data[0][0].to(BF16) if impl.startswith("ours") and precision == "bf16" else data[0][0]
                facts["ema_outputs"][f"step {step}"] = ema(inputs).float()
            if impl != "reference":
                ema.reshard()  # FSDP2 leaves a root unsharded after a forward without backward
    facts["params"] = full_params(model)
    facts["ema_params"] = {} if ema is None else full_params(ema)
    return facts


def writes_run(name: str, precision: str) -> None:
    pattern = PATTERNS[name]
    init = _fsdp2_hf_init_values(precision) if pattern.hf_init else None
    results = run_contenders(lambda impl: _train(impl, pattern, precision, init), precision)
    if pattern.hf_init:
        for impl in results:
            if impl != "reference":
                model = build(impl, precision)
                torch.manual_seed(1)
                _hf_init(model)
                assert_equal(full_params(model), init, f"hf_init: {impl}'s initial weights against FSDP2's")  # type: ignore[arg-type]
    for key in ("losses", "params", "ema_outputs", "ema_params"):
        assert_parity(results, precision, f"{name}: {key}", key=key)


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("precision", ("bf16", "fp32"))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_writes_outside_the_adapter_reach_the_compute_weights(
    dist_pool: Any, pattern: str, precision: str, world_size: int
) -> None:
    dist_pool(world_size).run(writes_run, pattern, precision)
