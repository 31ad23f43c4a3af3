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
PATTERNS = (
    "data_mul",
    "data_copy",
    "hf_init",
    "state_dict_copy",
    "clamp",
    "foreach_mul",
    "foreach_ema",
    "unadapted_foreach",
)


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


def _write(model: nn.Module, pattern: str) -> None:
    """The pattern's write to the main weights, after an optimizer step."""
    params = list(model.parameters())
    with torch.no_grad():
        if pattern == "data_mul":
            for p in params:
                p.data.mul_(0.9)
        elif pattern == "data_copy":
            for p in params:
                p.data.copy_(p.data * 0.5 + 0.01)
        elif pattern == "state_dict_copy":
            for value in model.state_dict().values():
                value.copy_(value * 0.8)
        elif pattern == "clamp":
            for p in params:
                p.data.clamp_(-0.15, 0.15)
        elif pattern == "foreach_mul":
            torch._foreach_mul_(params, 0.9)


def _train(impl: str, pattern: str, precision: str, init: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    # The unadapted foreach optimizer needs grads of its parameters' dtype: fp32 main grads
    # (FSDP2: fp32 reduce).
    fp32_grads = pattern == "unadapted_foreach" and precision == "bf16"
    model = build(impl, precision, main_grads_dtype=torch.float32 if fp32_grads else None)
    if pattern == "hf_init":
        if impl == "reference":
            model.load_state_dict(init)  # type: ignore[arg-type]
        else:
            torch.manual_seed(1)
            _hf_init(model)
    ema = build(impl, precision, seed=7) if pattern == "foreach_ema" else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=pattern == "unadapted_foreach")
    if pattern != "unadapted_foreach":
        adapt(optimizer, impl, precision)
    facts: dict[str, Any] = {"losses": {}, "ema_outputs": {}}
    data = batches(STEPS)
    for step, (x, y) in enumerate(data):
        loss = loss_of(model, impl, precision, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _write(model, pattern)
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


def writes_run(pattern: str, precision: str) -> None:
    init = _fsdp2_hf_init_values(precision) if pattern == "hf_init" else None
    results = run_contenders(lambda impl: _train(impl, pattern, precision, init), precision)
    if pattern == "hf_init":
        for impl in results:
            if impl != "reference":
                model = build(impl, precision)
                torch.manual_seed(1)
                _hf_init(model)
                assert_equal(full_params(model), init, f"hf_init: {impl}'s initial weights against FSDP2's")  # type: ignore[arg-type]
    for key in ("losses", "params", "ema_outputs", "ema_params"):
        assert_parity(results, precision, f"{pattern}: {key}", key=key)


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("precision", ("bf16", "fp32"))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_writes_outside_the_adapter_reach_the_compute_weights(
    dist_pool: Any, pattern: str, precision: str, world_size: int
) -> None:
    dist_pool(world_size).run(writes_run, pattern, precision)
