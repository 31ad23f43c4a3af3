"""The bug-pattern catalogue: mixed-precision bugs from public issue trackers, and healthy controls.

Each :class:`Pattern` names its public sources (``owner/repo#N`` and the thread's title; ``(PR)``
marks a pull request), what it plants and where, the settings it trains
with (the same under ``fully_shard`` and torch FSDP2) and what the precision report
(``fsdp_patch.telemetry.offline.precision_report.report_json``) must say about it
(:class:`Expect`). :func:`judge` compares a report with that expectation.

An expectation is the diagnosis a correct report gives, whether or not the report gives it; each
``Expect.lead`` is a check of ``telemetry/precision_thresholds.py``. The benchmark
(``python -m benchmarks.bug_patterns``) shows, per pattern and sharding, whether the report does.

The catalogue is assembled here, in its numbers' order: the patterns that make NaN/Inf (1 to 7b,
:mod:`.nonfinite_catalogue`), those of gradients, master weights, clipping and dtypes (8 to 16,
here), those that live in one line of a user's code (17 to 29, :mod:`.op_catalogue`), those of
torchao's float8 casts (30 on, :mod:`.float8_catalogue`), then the healthy controls.
"""

from __future__ import annotations

from . import float8_catalogue, nonfinite_catalogue, op_catalogue, plants
from .expectations import HEALTHY, PROBLEM, WARNING, Expect, Judgement, OpWant, OriginWant, Pattern, judge
from .tiny_lm import Settings

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

PATTERNS: tuple[Pattern, ...] = (
    *nonfinite_catalogue.NONFINITE_PATTERNS,
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

PATTERNS += op_catalogue.OP_PATTERNS + float8_catalogue.FLOAT8_PATTERNS
CONTROLS += op_catalogue.OP_CONTROLS + float8_catalogue.FLOAT8_CONTROLS

CATALOGUE: dict[str, Pattern] = {p.name: p for p in (*PATTERNS, *CONTROLS)}
