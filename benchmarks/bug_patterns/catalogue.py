"""The bug-pattern catalogue: mixed-precision bugs from public issue trackers, and healthy controls.

Each :class:`Pattern` names its public sources (``owner/repo#N`` and the thread's title; ``(PR)``
marks a pull request), what it plants and where, the settings it trains
with (the same under ``fully_shard`` and torch FSDP2) and what the precision report
(``fsdp_patch.telemetry.offline.precision_report.report_json``) must say about it
(:class:`Expect`). :func:`judge` compares a report with that expectation.

An expectation is the diagnosis a correct report gives, whether or not the report gives it; each
``Expect.lead`` is a check of ``telemetry/precision_thresholds.py``. The benchmark
(``python -m benchmarks.bug_patterns``) shows, per pattern and sharding, whether the report does.
"""

from __future__ import annotations

import torch

from . import op_catalogue, plants
from .expectations import HEALTHY, PROBLEM, WARNING, Expect, Judgement, OpWant, OriginWant, Pattern, judge
from .training import Settings

__all__ = [
    "CATALOGUE",
    "CONTROLS",
    "PATTERNS",
    "Expect",
    "Judgement",
    "OpWant",
    "OriginWant",
    "Pattern",
    "judge",
]

W = plants.When
FP16_SCALED = {"compute": "fp16", "grads": "fp32", "scaler": True}

PATTERNS: tuple[Pattern, ...] = (
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
    Pattern(
        name="fp16_grad_underflow",
        number="8",
        title="fp16 gradients underflow to zero without loss scaling",
        sources=(
            "engichang1467/Open-Rig3R#35 — autocast defaults to fp16 with no GradScaler — gradients can silently "
            "underflow to zero",
        ),
        plants="fp16 compute, fp32 reduce, no GradScaler; the loss x1e-6 from step 1, so most fp16 grads flush to 0",
        settings=Settings(compute="fp16", steps=8),
        plant=plants.ScaleLoss(W(1), 1e-6),
        expect=Expect(
            PROBLEM,
            ("grad_underflow",),
            "fp16 grads flushed to zero in the backward (no loss scaling): use a GradScaler or bf16",
        ),
    ),
    Pattern(
        name="main_weights_from_bf16",
        number="9",
        title="fp32 main weights rebuilt from the bf16 copy (a resume from a bf16 checkpoint)",
        sources=(
            "TensorAuto/OpenTau#185 — MasterWeightOptimizer: per-resume precision drift from bf16 master rebuild",
            "NVIDIA/Megatron-LM#1359 — [BUG] state[p]['master_weight'] become bf16",
            "NVIDIA/apex#42 (PR) — load mode before creating master_params when fp16",
        ),
        plants="after step 3's update, every rank: each main weight replaced by its bf16 rounding",
        settings=Settings(steps=8),
        plant=plants.MainWeightsFromCompute(W(3)),
        expect=Expect(
            WARNING,
            ("dtype_contract",),
            "every main weight exactly bf16-representable from step 4: rebuilt from the compute copy; checkpoint "
            "the fp32 main weights",
            contract="main_weight",
        ),
    ),
    Pattern(
        name="pure_bf16_no_master_weights",
        number="10",
        title="pure bf16 training without fp32 main weights: norm scales never move",
        sources=(
            "vllm-project/speculators#765 (PR) — Fix numerical issues by holding params in fp32",
            "workofart/ml-by-hand#85 (PR) — Create FP32 master copy of weights for mixed-precision training",
            "NVIDIA/apex#1728 — FusedAdam doesn't allocate master weights for bfloat16",
        ),
        plants="main weights bf16 (fully_shard main_params_dtype bf16; FSDP2 over a bf16 module, no policy); "
        "AdamW lr 1e-3: the norm weights at 1.0 round back every step",
        settings=Settings(main="bf16", grads="bf16", steps=8),
        plant=plants.NoPlant(),
        expect=Expect(
            PROBLEM,
            ("unstepped_weights",),
            "main weights are bf16 (no fp32 main weights): the norm weights' updates are below bf16's rounding step",
            finding="no fp32 master weights",
        ),
    ),
    Pattern(
        name="inf_grad_spread_by_clip",
        number="11b",
        title="an Inf grad element spread by clip_grad_norm_ into zeros and NaN",
        sources=("pytorch/pytorch#46849 — clip_grad_norm_ silently passes when not finite",),
        plants="step 3, rank 1, after backward: Inf into element 0 of its shard of head.weight's grad; "
        "clip_grad_norm_(1.0): the total norm is Inf, every grad x0, that element NaN",
        settings=Settings(clip=1.0, steps=6),
        plant=plants.WriteGrad(W(3, 3, ranks=(1,)), "head.weight", float("inf")),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "the grads went non-finite between backward and step (a grad hook, a clip of a non-finite norm) in "
            "the root unit, rank 1, step 3",
            OriginWant("grad_write", "clip_grad_norm_", 3),
        ),
    ),
    Pattern(
        name="clip_norm_in_fp16",
        number="11a",
        title="a grad norm summed in fp16 overflows: clipping zeroes every grad",
        sources=(
            "facebookresearch/fairscale#263 (PR) — Resolve issue where grad norms because inf with OSS / fp16",
            "facebookresearch/fairscale#1092 — clip_grad_norm_ … downcasts to bf16 before all reduce",
        ),
        plants="a clip whose sum of squares runs in fp16; step 3, rank 0: head.weight's grad element 0 +5000 "
        "(finite; its square is not): the total norm is Inf and every grad is multiplied by 0",
        settings=Settings(steps=6),
        plant=plants.ClipInLowPrecision(W(3, 3, ranks=(0,)), "head.weight", 5000.0),
        expect=Expect(
            WARNING,
            ("grads_zeroed",),
            "the clip's total norm was Inf at step 3 (summed in fp16) and zeroed every grad: compute norms in fp32",
        ),
    ),
    Pattern(
        name="bf16_grad_accumulation",
        number="12",
        title="gradient accumulation in bf16",
        sources=(
            "deepspeedai/DeepSpeed#1800 — [BUG] ZeRO/bf16 grad accumulation in bf16 needs fixing",
            "pytorch/pytorch#106395 — FP32 accumulation of bf16 gradients in FSDP",
        ),
        plants="8 microbatches per step, sync on the last; grads bf16 (fully_shard main_grads_dtype bf16; FSDP2 "
        "reduce_dtype bf16): the sum of microbatch grads is rounded to bf16 at each add",
        settings=Settings(grads="bf16", microbatches=8, steps=4),
        plant=plants.NoPlant(),
        expect=Expect(
            WARNING,
            ("dtype_contract",),
            "microbatch grads accumulated in bf16: accumulate in fp32 (main_grads_dtype / reduce_dtype float32)",
            contract="grad_accumulation",
        ),
    ),
    Pattern(
        name="rope_buffer_in_bf16",
        number="13",
        title="a RoPE inv_freq buffer rounded to bf16 by a model-wide cast",
        sources=(
            "huggingface/transformers#29285 (PR) — RoPE loses precision for Llama / Gemma + Gemma logits.float()",
            "huggingface/transformers#29496 — Precision issues in Mistral rotary embeddings",
            "EleutherAI/gpt-neox#1016 (PR) — fix rope precision bug",
        ),
        plants="the root's inv_freq buffer made in fp32 and cast to bf16 before sharding (what model.bfloat16() "
        "does to every floating buffer); sinusoidal positions built from it are added to the embedding output",
        settings=Settings(steps=6),
        plant=plants.LowPrecisionBuffer(),
        expect=Expect(
            WARNING,
            ("dtype_contract",),
            "the buffer inv_freq is bf16: keep buffers in fp32 (buffer.data = buffer.data.float() after the cast)",
            contract="buffer",
        ),
    ),
    Pattern(
        name="loss_on_bf16_logits",
        number="14",
        title="cross entropy on bf16 logits",
        sources=(
            "Modalities/modalities#464 (PR) — fix(loss): compute causal-LM cross-entropy in float32",
            "google-deepmind/optax#1020 — Precision bug in `optax.softmax_cross_entropy_with_integer_labels`",
        ),
        plants="F.cross_entropy on the bf16 logits (no .float()); head.bias +30 before sharding, so every logit "
        "sits where bf16's spacing is 0.125",
        settings=Settings(loss="ce_low", steps=6),
        plant=plants.HeadBias(30.0),
        expect=Expect(
            WARNING,
            ("dtype_contract",),
            "the loss read bf16 logits: compute it on logits.float()",
            contract="loss",
        ),
    ),
    Pattern(
        name="norm_statistics_fp16",
        number="15",
        title="RMSNorm statistics computed in fp16: variance Inf, output zeros",
        sources=(
            "meta-llama/llama#1048 — Why RMSNorm has to be performed under fp32 precision instead of fp16 precision",
            "pytorch/pytorch#66707 — `layer_norm` needs to be done in fp32 for fp16 inputs",
            "microsoft/onnxruntime#29034 — SkipSimplifiedLayerNormalization fp16 silently returns all zeros for "
            "large-magnitude inputs (variance accumulated in fp16)",
        ),
        plants="every norm an RMSNorm computed in fp16 (no upcast); step 3, rank 0: final_norm's input x300, "
        "so its mean of squares is Inf and its output exactly 0",
        settings=Settings(compute="fp16", norm="naive", steps=6),
        plant=plants.FinalGain(W(3, 3, ranks=(0,)), 300.0),
        expect=Expect(
            WARNING,
            ("dtype_contract",),
            "final_norm's statistics overflowed fp16 at step 3 on rank 0 (output all zeros): compute them in fp32",
            contract="norm_statistics",
        ),
    ),
    Pattern(
        name="lr_too_small_for_bf16_weights",
        number="16",
        title="the learning rate drops below bf16 weights' resolution",
        sources=(
            "NVIDIA/Model-Optimizer#2322 (PR) — fp32 master weights for the DFlash draft, and keep them across a "
            "resume",
            "vllm-project/speculators#765 (PR) — Fix numerical issues by holding params in fp32",
            "marin-community/marin#6486 — Agent MoE Experiment: bf16 master precision ablations",
            "kyegomez/SingLoRA#6 — [BUG] ramp up steps cause vanishing updates in bf16",
        ),
        plants="bf16 main weights; lr 1e-2 for steps 1-2, then 1e-4: the norm weights stop moving",
        settings=Settings(main="bf16", grads="bf16", lr=1e-2, steps=8),
        plant=plants.LrSchedule(W(3), lr=1e-4),
        expect=Expect(
            PROBLEM,
            ("unstepped_weights",),
            "from step 3 (the lr drop) the norm weights' updates are below bf16's rounding step: fp32 main weights",
            finding="no fp32 master weights",
        ),
    ),
)

CONTROLS: tuple[Pattern, ...] = tuple(
    Pattern(
        name=f"healthy_{compute}_lr{lr:g}",
        number=f"C{index}",
        title=f"healthy: {compute} compute, fp32 main weights, AdamW lr {lr:g}, 200 steps"
        + (", GradScaler" if compute == "fp16" else ""),
        sources=(),
        plants="nothing",
        settings=Settings(
            compute=compute,  # type: ignore[arg-type]
            scaler=compute == "fp16",
            lr=lr,
            steps=200,
        ),
        plant=plants.NoPlant(),
        expect=Expect(HEALTHY, (), "healthy: no finding"),
        every=(None, 1),
    )
    for index, (compute, lr) in enumerate((("bf16", 1e-4), ("bf16", 3e-3), ("fp16", 1e-4), ("fp16", 3e-3)), start=1)
)

PATTERNS += op_catalogue.OP_PATTERNS
CONTROLS += op_catalogue.OP_CONTROLS

CATALOGUE: dict[str, Pattern] = {p.name: p for p in (*PATTERNS, *CONTROLS)}
