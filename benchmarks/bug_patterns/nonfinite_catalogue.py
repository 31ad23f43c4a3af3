"""Bug patterns whose diagnosis is where a NaN/Inf began: an overflow in the forward, a write into
the weights between steps, a loss or a backward that makes NaN, a reduce-scatter that overflows,
an optimizer's state that does, a learning-rate spike (patterns 1 to 7b).

Each expectation names the origin the per-iteration checks must find (stage, unit or parameter,
step, ranks: :class:`~.expectations.OriginWant`). :mod:`.catalogue` puts them first in the
catalogue, before the silent ones (gradients, master weights, clipping, dtypes).
"""

from __future__ import annotations

import torch

from . import plants
from .expectations import PROBLEM, Expect, OriginWant, Pattern
from .tiny_lm import Settings

__all__ = ["NONFINITE_PATTERNS"]

W = plants.When
FP16_SCALED = {"compute": "fp16", "grads": "fp32", "scaler": True}

NONFINITE_PATTERNS: tuple[Pattern, ...] = (
    Pattern(
        name="fp16_forward_overflow",
        number="1",
        title="fp16 activation overflow in the forward (T5 FFN)",
        sources=(
            "huggingface/transformers#5651 — T5 fp16 overflow in forward (T5DenseReluDense)",
            "huggingface/transformers#9295 — Good Second Issue: T5 FP16 in Pytorch",
            "huggingface/transformers#10956 (PR) — [T5/MT5] resolve inf/nan under amp",
        ),
        plants="steps 3-5, rank 0: the embedding output x1e5 (an outlier batch); blocks.0.fc1's fp16 output "
        "passes 65504; the GradScaler skips those iterations, so the next ones run escalated",
        settings=Settings(**FP16_SCALED, init_scale=2.0**10, steps=10),
        plant=plants.BatchGain(W(3, 5, ranks=(0,)), gain=1e5),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "forward overflow in fp16 at unit blocks.0, module blocks.0.fc1, rank 0, step 3",
            OriginWant("forward", "blocks.0", 3, (0,), refined="blocks.0.fc1"),
        ),
    ),
    Pattern(
        name="nan_weight_write",
        number="2",
        title="NaN written into a main weight between steps (EMA, manual edit)",
        sources=(
            "ultralytics/ultralytics#24986 (PR) — Fix sticky-NaN EMA checkpoint loss …",
            "ultralytics/ultralytics#24615 — EMEA has 0/NaN value checkpoint not being saved",
        ),
        plants="after step 2's update, rank 1: NaN into element 0 of its shard of blocks.0.fc1.weight's main weight",
        settings=Settings(steps=6),
        plant=plants.WeightWrite(W(2, 2, ranks=(1,)), "blocks.0.fc1.weight", float("nan")),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "a main weight written between steps: blocks.0.fc1.weight, rank 1, step 3",
            OriginWant("weight_write", "blocks.0.fc1.weight", 3, (1,), "nan"),
        ),
    ),
    Pattern(
        name="fp16_cast_of_live_weights",
        number="2a",
        title="live weights cast to fp16 in place between steps: a weight past 65504 becomes Inf",
        sources=("ultralytics/ultralytics#24731 (PR) — Prevent NaN/Inf EMA from discarding training checkpoints",),
        plants="after step 2's update, rank 1: element 0 of its shard of blocks.1.fc2.weight set to 7e4, then the "
        "shard cast to fp16 and back in place (a validation pass's model.half() on the live weights)",
        settings=Settings(steps=6),
        plant=plants.WeightWrite(W(2, 2, ranks=(1,)), "blocks.1.fc2.weight", 7e4, round_trip=torch.float16),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "a main weight written between steps: blocks.1.fc2.weight, rank 1, step 3, Inf",
            OriginWant("weight_write", "blocks.1.fc2.weight", 3, (1,), "inf"),
        ),
    ),
    Pattern(
        name="nan_state_dict_load",
        number="2b",
        title="a checkpoint load brings a NaN weight (uninitialized torch.empty)",
        sources=("huggingface/transformers#30953 — Why using empty tensor to initialize?",),
        plants="after step 2's update, every rank: model.load_state_dict with final_norm.weight made by "
        "torch.empty and filled with NaN",
        settings=Settings(steps=6),
        plant=plants.NanStateDictLoad(W(2, 2), "final_norm.weight"),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "a main weight written between steps: final_norm.weight, ranks 0 and 1, step 3",
            OriginWant("weight_write", "final_norm.weight", 3, (0, 1), "nan"),
        ),
    ),
    Pattern(
        name="scaler_skips_every_step",
        number="3",
        title="GradScaler skipping every step, the scale collapsing",
        sources=(
            "deepspeedai/DeepSpeed#697 — Model doesn't learn with fp16.enabled = true: [Rank 0] Overflow detected. "
            "Skipping step. Attempted loss scale: 1, reducing to 1",
            'facebookresearch/fairseq#512 — nmt_scaling training fails after "overflow detected, setting loss scale '
            'to: 0.0001220703125"',
            "facebookresearch/fairseq#2488 — loss scale going to 1e-4 and training stops",
            "fastino-ai/GLiNER2#155 (PR) — Fix NaN gradients from marginal_pair_consistency_loss in half precision",
        ),
        plants="from step 2 on, rank 1: token (0, 0) reaches the sqrt aux loss as a zero vector, so every "
        "backward makes NaN grads in the root unit; fp16 with a GradScaler starting at 64",
        settings=Settings(**FP16_SCALED, init_scale=64.0, aux_sqrt=True, steps=8),
        plant=plants.ZeroedToken(W(2, ranks=(1,))),
        expect=Expect(
            PROBLEM,
            ("origin", "scaler_skipped"),
            "the GradScaler skipped 7 of 8 iterations (scale 64 to 1) because the backward makes NaN on rank 1 "
            "from step 2, in the root unit: not a loss-scale problem",
            OriginWant("backward", "", 2, (1,), "nan"),
            skipped=7,
            scales=(64.0, 1.0),
        ),
    ),
    Pattern(
        name="log_of_softmax_fp16",
        number="4a",
        title="NaN/Inf loss from the loss itself: log(softmax(fp16 logits)) of an underflowed probability",
        sources=(
            "NVIDIA/apex#379 — Log function causes floating point underflow/ gradient overflow",
            "pytorch/pytorch#85791 — nn.CrossEntropyLoss overflow with FP16 and minibatch",
            "speechbrain/speechbrain#1803 — [Bug]: CTC and w2v2 with fp16 is going NaN",
        ),
        plants="loss = -log(softmax(logits)) in fp16; step 3, rank 0: logits x50, so a target's probability "
        "rounds to 0 and its log is -Inf",
        settings=Settings(compute="fp16", loss="log_softmax_naive", steps=6),
        plant=plants.ScaleLogits(W(3, 3, ranks=(0,)), 50.0),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "the loss went non-finite from finite logits: rank 0, step 3",
            OriginWant("loss", "loss", 3, (0,), "inf"),
        ),
    ),
    Pattern(
        name="loss_all_targets_ignored",
        number="4b",
        title="NaN loss: a batch whose every label is ignore_index (mean over zero tokens)",
        sources=(
            "meta-pytorch/torchtune#2341 — CEWithChunkedOutputLoss does not check division by zero",
            "NVIDIA-NeMo/Automodel#3796 — Fully-masked batch yields NaN loss … `NaN` propagates through `backward()` "
            "into every parameter",
        ),
        plants="step 3, rank 1: every target -100, so cross_entropy's mean divides 0 by 0",
        settings=Settings(steps=6),
        plant=plants.IgnoreAllTargets(W(3, 3, ranks=(1,))),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "the loss went non-finite from finite logits: rank 1, step 3",
            OriginWant("loss", "loss", 3, (1,), "nan"),
        ),
    ),
    Pattern(
        name="backward_sqrt_at_zero",
        number="5",
        title="NaN only in the backward: the gradient of sqrt at 0",
        sources=(
            "pytorch/pytorch#2421 — Gradient of zero norm is nan",
            "fastino-ai/GLiNER2#155 (PR) — Fix NaN gradients from marginal_pair_consistency_loss in half precision",
            "pytorch/pytorch#4320 — torch.std NaN gradient",
        ),
        plants="aux loss 1e-3 * sqrt(sum(h**2)) per token of the embedding output; step 3, rank 0: token (0, 0) "
        "is a zero vector there: forward and loss finite, the backward NaN",
        settings=Settings(aux_sqrt=True, steps=6),
        plant=plants.ZeroedToken(W(3, 3, ranks=(0,))),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "the backward made NaN in the root unit (the embedding's grads): rank 0, step 3",
            OriginWant("backward", "", 3, (0,), "nan"),
        ),
    ),
    Pattern(
        name="fp16_reduce_overflow",
        number="6",
        title="the gradient reduce in fp16 overflowing: finite local grads, an Inf sum",
        sources=(
            "pytorch/pytorch#123362 (PR) — [FSDP2] Used `ReduceOp.AVG` if bf16 reduce-scatter",
            "pytorch/pytorch#78774 — [FSDP] Customizable gradient pre-divide for mixed precision training",
            "horovod/horovod#1699 — Average gradients before allreduce",
        ),
        plants="fp16 compute and fp16 grads (fully_shard main_grads_dtype fp16; FSDP2 reduce_dtype fp16 with "
        "set_gradient_divide_factor(1.0), no pre-divide); step 3, every rank: head.weight[0, 0]'s local grad "
        "+4e4: 4e4 + 4e4 leaves fp16",
        settings=Settings(compute="fp16", grads="fp16", steps=6),
        plant=plants.GradSpike(W(3, 3), 4e4, divide_factor=1.0),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "the reduce-scatter in float16 overflowed: the root unit's grads were finite before it, step 3",
            OriginWant("reduce", "", 3, kind="inf"),
        ),
    ),
    Pattern(
        name="adam_fp16_state_eps",
        number="7",
        title="Adam makes Inf/NaN from finite grads: fp16 state, eps 1e-8 rounding to 0",
        sources=(
            "pytorch/pytorch#147437 — To avoid default eps ineffective in some precision(float16), dynamically set "
            "the default value of eps in optimizers such as Adam based on precision.",
            "google-deepmind/optax#1754 — Adam-family optimizers … produce NaN on float16 zero-gradient steps",
            "afiaka87/glide-finetune#5 — Training on half precision leads to nan values",
            "chainer/chainer#6299 — Adam optimizer's default eps is too small for FP16",
        ),
        plants="from step 2, embed.weight's exp_avg_sq kept in fp16: where a row's grad is 0 (a token absent from "
        "the batch) or below ~1e-2 it holds 0, and sqrt(0) + 1e-8 is 0 in fp16, so the update divides by 0",
        settings=Settings(optimizer="adam", steps=6),
        plant=plants.LowPrecisionOptimizerState(W(2), "embed.weight"),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "the optimizer's update made embed.weight Inf from finite grads and weights, step 2",
            OriginWant("optimizer", "embed.weight", 2, kind="inf"),
        ),
    ),
    Pattern(
        name="lr_spike_fp16",
        number="7b",
        title="a learning-rate spike: finite update, then the fp16 forward overflows",
        sources=("facebookresearch/fairseq#282 — Sometimes my loss explodes (with learning rate 0.001)",),
        plants="fp16 compute, no scaler, Adam; step 3's lr x1e5 (1e-3 to 100): every weight moves by ~100 with "
        "finite grads and weights, and step 4's fp16 forward overflows",
        settings=Settings(compute="fp16", optimizer="adam", steps=6),
        plant=plants.LrSchedule(W(3, 3), lr=100.0),
        expect=Expect(
            PROBLEM,
            ("lr_jump",),
            "the lr jump at step 3 (1e-3 to 100), ahead of step 4's forward overflow",
            OriginWant("forward", "blocks.0", 4),
            finding="jumped x1e+05 (0.001 to 100, param group 0) at step 3",
        ),
    ),
)
