"""Bug patterns that live in one line of a user's code, and each one's fix as a healthy control.

None of these is of a kind the rest of the catalogue holds: custom operations and activations in the
forward, a loss's own terms, and what a script keeps beside the model between steps. Each plant is
in :mod:`.op_plants`; each expectation names the operation, the line (that file and function) and
the module where the report must find it (:class:`~.expectations.OpWant`). Each control trains the
same code with the fix the public thread settled on.
"""

from __future__ import annotations

from . import op_plants
from .expectations import HEALTHY, PROBLEM, WARNING, Expect, OpWant, OriginWant, Pattern
from .tiny_lm import Settings

__all__ = ["OP_CONTROLS", "OP_PATTERNS"]

_FP16_SCALED = {"compute": "fp16", "grads": "fp32", "scaler": True}
_HERE = "op_plants.py:"
_FORWARD = (_HERE, "in forward")
_LOST = "Precision was lost upstream"
_LOADED = (_HERE, "in between_steps")


def _act(kind: str, op: str, detail: str | None = None, fp32_finite: bool | None = None) -> OpWant:
    return OpWant(kind, op, _FORWARD, module="blocks.0.act", phase="forward", detail=detail, fp32_finite=fp32_finite)


OP_PATTERNS: tuple[Pattern, ...] = (
    Pattern(
        name="moe_router_ties_bf16",
        number="17",
        title="a mixture-of-experts router's top-k taken from bf16 probabilities",
        sources=(
            "vllm-project/vllm#14027 (PR) — [Bugfix] Fix Precision Mismatch in MoE Router of DeepSeek V2/V3 Models "
            "and Fused Kernels (BF16 -> FP32)",
            "ViperEkura/AstrAI#57 (PR) — fix: keep MoE expert routing consistent",
        ),
        plants="each block's activation gated by a top-2-of-8 router whose softmax runs in bf16: close "
        "probabilities tie, and topk picks the lower index",
        settings=Settings(steps=6),
        plant=op_plants.Activation(op_plants.TopKRouterAct),
        expect=Expect(
            WARNING,
            ("op_ties",),
            "topk over bf16 router probabilities decided by ties: the router in float32",
            op=_act("ties", "aten.topk"),
        ),
    ),
    Pattern(
        name="attention_mask_twice_fp16",
        number="18",
        title="a padding and a causal mask of finfo(float16).min added together",
        sources=(
            "huggingface/transformers#17306 (PR) — Fix -1e4 as attn mask",
            "huggingface/transformers#17437 (PR) — OPT - Fix Softmax NaN in half precision mode",
        ),
        plants="attention over slots of each block's hidden units, masked by padding + causal masks each of "
        "torch.finfo(float16).min: their sum is -inf, a fully masked row's softmax NaN",
        settings=Settings(**_FP16_SCALED, steps=6),  # type: ignore[arg-type]
        plant=op_plants.Activation(op_plants.MaskedSlotsAct),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "the masks' sum overflows float16 at the add: one mask value, and the masked softmax in float32",
            OriginWant("forward"),
            op=_act("nonfinite", "aten.add", "float32 on the same inputs stays finite"),
        ),
    ),
    Pattern(
        name="softplus_small_beta_fp16",
        number="19",
        title="F.softplus with a small beta in float16",
        sources=(
            "pytorch/pytorch#187180 — torch.nn.functional.softplus returns +Inf for finite float16 input when "
            "beta is very small",
        ),
        plants="each block's activation F.softplus(x, beta=1e-5) * 1e-5 in fp16: softplus is about 69315 there",
        settings=Settings(**_FP16_SCALED, steps=6),  # type: ignore[arg-type]
        plant=op_plants.Activation(op_plants.SmallBetaSoftplusAct),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "softplus's result passes 65504: compute it in float32",
            OriginWant("forward"),
            op=_act("nonfinite", "aten.softplus", "float32 on the same inputs stays finite"),
        ),
    ),
    Pattern(
        name="random_features_underflow_fp16",
        number="20",
        title="FAVOR+ random features and their normalizer in float16",
        sources=(
            "facebookresearch/xformers#96 — Favor breaks with fp16",
            "facebookresearch/xformers#98 (PR) — [bugfix] Favor + fp16",
        ),
        plants="each block's activation a random-feature attention: exp(w.x - |x|^2/2), the normalizer and the "
        "numerator in fp16 leave its range (the normalizer flushes to 0, the numerator overflows): NaN",
        settings=Settings(**_FP16_SCALED, steps=6),  # type: ignore[arg-type]
        plant=op_plants.Activation(op_plants.RandomFeatureAct),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "the features and their products leave fp16's range (the normalizer flushes to 0, the numerator "
            "overflows): compute them in float32",
            OriginWant("forward"),
            op=OpWant("nonfinite", "aten.div|aten.bmm", (_HERE, "in _attend"), module="blocks.0.act", fp32_finite=True),
        ),
    ),
    Pattern(
        name="naive_softmax_fp16",
        number="21",
        title="a softmax written out as exp(s) / exp(s).sum() in float16",
        sources=(
            "NVIDIA/FasterTransformer#43 — fastertransformer nan error",
            "mila-iqia/blocks#727 (PR) — Stabilize attention energies",
            "ggml-org/llama.cpp#2665 (PR) — Fix CUDA softmax by subtracting max value before exp",
        ),
        plants="each block's activation mixes slots by exp(s) / exp(s).sum() without subtracting the maximum: "
        "exp of a score over 11.1 is Inf in fp16, Inf/Inf NaN",
        settings=Settings(**_FP16_SCALED, steps=6),  # type: ignore[arg-type]
        plant=op_plants.Activation(op_plants.NaiveSoftmaxAct),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "exp overflows fp16: subtract the row's maximum first",
            OriginWant("forward"),
            op=_act("nonfinite", "aten.exp", "float32 on the same inputs stays finite"),
        ),
    ),
    Pattern(
        name="focal_loss_fp16",
        number="22",
        title="a sigmoid focal loss on float16 logits, guarded by float32's smallest normal value",
        sources=("open-mmlab/mmcv#1488 — SigmodFocalLoss return NAN",),
        plants="the loss gains 0.1 x a sigmoid focal loss of the fp16 logits / 0.15: sigmoid flushes to 0 or "
        "rounds to 1, the guard torch.finfo(float32).tiny is 0 in fp16, and log(0) is -Inf",
        settings=Settings(**_FP16_SCALED, steps=6),  # type: ignore[arg-type]
        plant=op_plants.FocalLoss(),
        expect=Expect(
            PROBLEM,
            ("origin",),
            "log of a probability fp16 flushed: the loss in float32 (or in log space)",
            OriginWant("loss"),
            op=OpWant("nonfinite", "aten.log", (_HERE, "in term"), phase="loss", detail=_LOST),
        ),
    ),
    Pattern(
        name="distillation_kl_bf16",
        number="23",
        title="a distillation KL term between close distributions, in bfloat16",
        sources=(
            "vllm-project/speculators#788 (PR) — fix(loss): compute divergence losses in float32 under bf16 training",
        ),
        plants="the loss gains 0.1 x KL(teacher || model) on bf16 log-softmaxes, the teacher's logits 0.01 "
        "from the model's: the difference of near-equal log-probabilities has no correct digit",
        settings=Settings(steps=6),
        plant=op_plants.DistillationKL(),
        expect=Expect(
            WARNING,
            ("op_ill_conditioned",),
            "the KL's difference of bf16 log-probabilities cancels: both log-softmaxes in float32",
            op=OpWant("ill_conditioned", "aten.sub", (_HERE, "in term"), phase="loss"),
        ),
    ),
    Pattern(
        name="bf16_loss_total",
        number="24",
        title="a running loss total kept in bfloat16 and never reset",
        sources=(
            "huggingface/transformers#8561 (PR) — Reset loss to zero on logging in Trainer to avoid bfloat16 issues",
            "pytorch/xla#2425 (PR) — Add warning on loss values when using XLA_USE_BF16",
        ),
        plants="after each step the loss is added to a bf16 total resumed at 4600: bf16's spacing there is 32, "
        "and the total no longer moves",
        settings=Settings(steps=6),
        plant=op_plants.BF16LossTotal(),
        expect=Expect(
            PROBLEM,
            ("op_lost_update",),
            "the total's updates are below half its bf16 spacing: keep it in float32",
            op=OpWant("lost_update", "aten.add_", (_HERE, "in between_steps"), phase="between_steps"),
        ),
    ),
    Pattern(
        name="bf16_ema",
        number="25",
        title="an exponential moving average of the weights kept in bfloat16",
        sources=(
            "d8ahazard/sd_dreambooth_extension#1417 (PR) — Ema fp32",
            "d8ahazard/sd_dreambooth_extension#1415 (PR) — Use float32 for EMA model",
            "AndreasBergmeister/ram#6 — Inactive old/evaluation LoRA adapters are cast to fp16, quantizing EMA updates",
        ),
        plants="after each step a bf16 copy of the weights is updated by ema.mul_(0.999).add_(w, alpha=0.001): "
        "0.999 is 1.0 in bf16 and the updates are below its spacing",
        settings=Settings(steps=6),
        plant=op_plants.BF16Ema(),
        expect=Expect(
            PROBLEM,
            ("op_lost_update",),
            "the average never moves in bf16: keep it in float32",
            op=OpWant("lost_update", "aten.mul_", (_HERE, "in between_steps"), phase="between_steps"),
        ),
    ),
    Pattern(
        name="bf16_packed_positions",
        number="26",
        title="position ids of a packed document made by torch.arange in bfloat16",
        sources=(
            "pytorch/pytorch#137774 — torch.arange bf16 results are not accurate",
            "pytorch/pytorch#81926 — A bug of torch.arange for long sequence with fp16 data type",
        ),
        plants="the embedding adds learned position embeddings at positions 1000.. made by torch.arange in the "
        "embedding's bf16: bf16 holds integers only up to 256, so positions repeat",
        settings=Settings(steps=6),
        plant=op_plants.PackedPositions(),
        expect=Expect(
            WARNING,
            ("op_precision_loss",),
            "bf16 positions repeat: torch.arange without dtype (integers)",
            op=OpWant("precision_loss", "aten.arange", _FORWARD, module="embed", phase="forward"),
        ),
    ),
)


# An optimizer's hyperparameters whose product float32 cannot hold: named from the constant.
HYPERPARAMETER_PATTERNS: tuple[Pattern, ...] = (
    Pattern(
        name="adamw_decay_below_float32",
        number="29",
        title="AdamW's weight decay factor 1 - lr * weight_decay that float32 holds as 1",
        sources=(
            "pytorch/pytorch#64475 (PR) — [Optimizers] fix update of adamw",
            "Nerogar/OneTrainer#996 — No weight decay with Adam, bf16 and stochastic rounding",
        ),
        plants="AdamW at lr 1e-4 and weight_decay 1e-4 (DETR's): each step multiplies the fp32 main weights by "
        "1 - 1e-8, which is 1.0 in float32, so no weight ever decays",
        settings=Settings(steps=6, lr=1e-4),
        plant=op_plants.WeightDecayBelowFloat32(),
        expect=Expect(
            WARNING,
            ("op_constant",),
            "the weight decay's factor is 1 in float32: the main weights never decay",
            op=OpWant("constant", "aten.mul_", ("adam.py:", "in _single_tensor_adam"), phase="optimizer"),
        ),
    ),
)


# Optimizer state that went through a lower precision: named from its values after the load.
STATE_PATTERNS: tuple[Pattern, ...] = (
    Pattern(
        name="optimizer_state_checkpoint_bf16",
        number="27",
        title="optimizer state saved cast to bfloat16 and loaded back",
        sources=(
            "pytorch/pytorch#43706 — checkpoint restore of optimizers changes dtype of Floating-point state",
            "facebookresearch/fairscale#50 — Load state dict imprecision",
        ),
        plants="after step 3 the optimizer's state goes through bf16 and back (saved cast to halve the checkpoint, "
        "as a load into bf16 parameters casts it) into the float32 state: every moment is a bf16 value",
        settings=Settings(steps=6),
        plant=op_plants.StateThroughCheckpoint("bf16"),
        expect=Expect(
            WARNING,
            ("dtype_contract",),
            "the optimizer state went through bf16 on its way back: save it in float32",
            contract="optimizer_state",
            load_site=_LOADED,
        ),
    ),
    Pattern(
        name="optimizer_state_checkpoint_fp16",
        number="28",
        title="optimizer state saved cast to float16 and loaded back: exp_avg_sq flushed to 0",
        sources=(
            "ultralytics/ultralytics#24085 (PR) — Fix loss explosion on resume when training on small dataset",
            "ultralytics/ultralytics#24079 — loss explosion on resume",
        ),
        plants="after step 3 every floating tensor of the optimizer's state but step goes through float16 and back "
        "(a checkpoint halved): small exp_avg_sq values become 0, and the embedding's rows the next batch does "
        "not reach are updated by exp_avg / eps",
        settings=Settings(steps=6),
        plant=op_plants.StateThroughCheckpoint("fp16", fix_keeps=("exp_avg_sq",)),
        expect=Expect(
            PROBLEM,
            ("update_jump",),
            "the update jumped right after the optimizer's state was loaded: keep exp_avg_sq in float32",
            contract="optimizer_state",
            load_site=_LOADED,
            jump_cause="optimizer_state_loaded",
        ),
    ),
)


def _fixed(pattern: Pattern, index: int) -> Pattern:
    plant = pattern.plant
    fixed = type(plant)(**{**plant.__dict__, "fixed": True})  # type: ignore[arg-type]
    return Pattern(
        name=f"{pattern.name}_fixed",
        number=f"C{index}",
        title=f"healthy: {pattern.title}, fixed",
        sources=(),
        plants=f"the fix of pattern {pattern.number}",
        settings=pattern.settings,
        plant=fixed,
        expect=Expect(HEALTHY, (), "healthy: no finding"),
    )


OP_PATTERNS += STATE_PATTERNS + HYPERPARAMETER_PATTERNS
OP_CONTROLS: tuple[Pattern, ...] = tuple(_fixed(p, index) for index, p in enumerate(OP_PATTERNS, start=5))
