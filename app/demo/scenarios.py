"""The demo's planted-bug scenarios: what each plants, where, and what the precision report should find.

``--scenario`` picks one; the training loop (:mod:`.train`) plants it, and the dashboards' alert
check (``dashboards/demo_alerts.py``) runs each and expects its alerts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "FLOAT8_OUTLIER",
    "GROWTH_PER_STEP",
    "LAYER_LR_FACTOR",
    "ORIGIN_PLANTS",
    "SCENARIOS",
    "UNDERFLOW_SCALE",
    "Scenario",
]


@dataclass(frozen=True)
class Scenario:
    """A planted numeric bug (or none) and the settings it needs.

    Attributes:
        compute_dtype: Default compute dtype of the scenario.
        lr: Default peak learning rate.
        plant: ``None``; ``"nan"`` (a NaN in the layer's grad on rank 0 at the plant step);
            ``"overflow"`` (the layer's main weight set past fp16's range at the plant step);
            ``"layer_lr"`` (the layer in a param group of its own, at :data:`LAYER_LR_FACTOR`
            times the learning rate); ``"left_out"`` (the layer in no param group);
            ``"bf16_state"`` (the layer's ``exp_avg_sq`` turned bf16 at the plant step);
            ``"underflow"`` (the layer's grads scaled by :data:`UNDERFLOW_SCALE` from the plant
            step on, so that their squares underflow). Each of the origin scenarios plants a
            NaN/Inf in one part of an iteration, at the plant step: ``"forward_overflow"`` (the
            module's output scaled past fp16's range), ``"loss_nan"`` (the loss), ``"backward_nan"``
            (the module's backward), ``"weight_write"`` (the parameter's main weight, on rank 0,
            between the steps before the plant step), ``"reduce_overflow"`` (the module's grads
            on every rank past half of fp16's range, summed by the reduce), ``"clip_inf"`` (the
            layer's grads so large that ``clip_grad_norm_``'s total norm is Inf), ``"optimizer_nan"``
            (the layer's param group at a NaN learning rate for that step). ``"ema_bf16"``: an
            exponential moving average of the weights kept in bfloat16 and updated after every
            step from the plant step on (the operation audit names its line). ``"growth"``: the
            module's output multiplied by :data:`GROWTH_PER_STEP` once more every step from the plant
            step on (the headroom forecast names the unit before it overflows).
        description: What the precision report should find.
        layer: The parameter the bug is planted in (``None``: the whole model).
        plant_from_start: The default plant step is 1 (the bug is there from the start), not
            half of the run.
        float8: The blocks' linear layers are torchao ``Float8Linear`` s (tensorwise scaling),
            gathered in float8 by ``fully_shard``'s float8 compute copy (torchao required).
            ``"float8_outlier"``: one feature of the layer's output set far above the rest from the
            plant step on (the float8 cast of the next layer's input flushes the others to 0).
    """

    compute_dtype: torch.dtype
    lr: float
    plant: str | None
    description: str
    layer: str | None = None
    plant_from_start: bool = False
    float8: bool = False


LAYER_LR_FACTOR = 1e-3
FLOAT8_OUTLIER = 1e6
GROWTH_PER_STEP = 4.0
UNDERFLOW_SCALE = 1e-30

SCENARIOS: dict[str, Scenario] = {
    "healthy": Scenario(torch.bfloat16, 3e-3, None, "nothing planted: every verdict healthy"),
    "tiny-lr": Scenario(torch.bfloat16, 1e-7, None, "a learning rate too small for bf16 weights: lost updates"),
    "nan": Scenario(
        torch.bfloat16,
        3e-3,
        "nan",
        "one NaN in a gradient halfway: NaN/Inf in grads, then weights",
        "blocks.1.fc1.weight",
    ),
    "fp16-overflow": Scenario(
        torch.float16, 3e-3, "overflow", "fp16 compute weights, a main weight past 65504: refresh overflow", "pos"
    ),
    "layer-lr": Scenario(
        torch.bfloat16,
        3e-3,
        "layer_lr",
        "one layer's param group at 1/1000 of the lr: stuck weights",
        "blocks.1.norm2.weight",
        plant_from_start=True,
    ),
    "left-out": Scenario(
        torch.bfloat16,
        3e-3,
        "left_out",
        "one parameter in no param group: unstepped weights",
        "blocks.1.proj.weight",
        plant_from_start=True,
    ),
    "bf16-state": Scenario(
        torch.bfloat16,
        3e-3,
        "bf16_state",
        "one layer's exp_avg_sq made bf16 halfway: dtype contract",
        "blocks.0.fc2.weight",
    ),
    "state-underflow": Scenario(
        torch.bfloat16,
        3e-3,
        "underflow",
        "one layer's grads near 1e-33: exp_avg_sq flushed to zero",
        "blocks.0.fc1.weight",
        plant_from_start=True,
    ),
    "ema-bf16": Scenario(
        torch.bfloat16,
        3e-3,
        "ema_bf16",
        "an EMA of the weights kept in bf16: its updates are lost (the operation audit names the line)",
        plant_from_start=True,
    ),
    "fp16-growth": Scenario(
        torch.float16,
        3e-3,
        "growth",
        "an fp16 activation growing 4x every step: the headroom forecast names the unit before it overflows",
        "blocks.1.fc1",
        plant_from_start=True,
    ),
    # Where a NaN/Inf began: one scenario per part of an iteration.
    "forward-overflow": Scenario(
        torch.float16,
        3e-3,
        "forward_overflow",
        "an activation past fp16's range: origin in the forward",
        "blocks.1.fc1",
    ),
    "loss-nan": Scenario(torch.bfloat16, 3e-3, "loss_nan", "a log of 0 in the loss: origin in the loss", "loss"),
    "backward-nan": Scenario(
        torch.bfloat16,
        3e-3,
        "backward_nan",
        "a NaN made in a module's backward: origin in the backward",
        "blocks.1.fc1",
    ),
    "weight-write": Scenario(
        torch.bfloat16,
        3e-3,
        "weight_write",
        "a NaN written into a main weight between steps: origin weight_write",
        "blocks.1.fc2.weight",
    ),
    "reduce-overflow": Scenario(
        torch.float16,
        3e-3,
        "reduce_overflow",
        "fp16 grads whose sum over ranks overflows: origin in the reduce",
        "blocks.0.fc2",
    ),
    "clip-inf": Scenario(
        torch.bfloat16,
        3e-3,
        "clip_inf",
        "clip_grad_norm_ with an Inf total norm zeroes the grads: origin grad_write",
        "blocks.0.fc1.weight",
    ),
    "optimizer-nan": Scenario(
        torch.bfloat16,
        3e-3,
        "optimizer_nan",
        "a NaN learning rate for one param group: origin in the optimizer",
        "blocks.1.fc2.weight",
    ),
    "fp8": Scenario(
        torch.bfloat16,
        3e-3,
        None,
        "nothing planted, the blocks' linear layers in float8 (torchao, tensorwise), gathered in float8: every verdict "
        "healthy",
        float8=True,
    ),
    "fp8-outlier": Scenario(
        torch.bfloat16,
        3e-3,
        "float8_outlier",
        f"one feature of its output {FLOAT8_OUTLIER:g} from then on: the float8 cast of blocks.0.fc2's input flushes "
        "the rest to 0",
        "blocks.0.fc1",
        float8=True,
    ),
}

ORIGIN_PLANTS = frozenset(
    {"forward_overflow", "loss_nan", "backward_nan", "weight_write", "reduce_overflow", "clip_inf", "optimizer_nan"}
)
"""Plants of a NaN/Inf in one part of one iteration (the plant step's)."""
