"""Float8 bug patterns: what goes wrong when torchao's float8 training casts a layer's input, weight or
grad output, each from public threads, and each one's fix as a healthy control.

The tiny model's linear layers are torchao ``Float8Linear`` s (fp8 matmuls emulated on the CPU;
:func:`~.tiny_lm.to_float8`), the same under ``fully_shard`` and torch FSDP2. Each plant is in
:mod:`.float8_plants`; each expectation names the module and the cast (``Expect.finding``) where
the report must find it.
"""

from __future__ import annotations

from . import float8_plants
from .expectations import HEALTHY, PROBLEM, WARNING, Expect, Pattern
from .tiny_lm import Settings
from .training import Plant

__all__ = ["FLOAT8_CONTROLS", "FLOAT8_PATTERNS"]

_OUTLIER_SOURCES = (
    "pytorch/ao#1793 (PR) — [float8] add perf benchmarks for float8 training with rowwise + tensorwise scaling "
    "(review: rowwise scaling is better at handling outliers than tensorwise scaling)",
    "pytorch/FBGEMM#2886 — Why fp8 quantize need to add a min scaling factor?",
)

FLOAT8_PATTERNS: tuple[Pattern, ...] = (
    Pattern(
        name="float8_outlier_feature",
        number="30",
        title="one input feature far above the rest: tensorwise float8 flushes the layer's input to zero",
        sources=_OUTLIER_SOURCES,
        plants="float8 (tensorwise) in every block; feature 3 of every token's embedding set to 1e6 before "
        "sharding (an unnormalized value concatenated into the embedding): block 0's fc1 input has one column "
        "1e6x the others",
        settings=Settings(float8="blocks", steps=6),
        plant=float8_plants.OutlierFeature(3, 1e6),
        expect=Expect(
            PROBLEM,
            ("float8_flush",),
            "blocks.0.fc1's input flushed to zero by a scale set by feature 3 in every row: rowwise does not help; "
            "keep blocks.0.fc1 in bf16 or normalize the feature",
            finding="blocks.0.fc1's input",
        ),
    ),
    Pattern(
        name="float8_outlier_token",
        number="31",
        title="one token far above the rest (a massive activation): tensorwise float8 flushes the other tokens",
        sources=_OUTLIER_SOURCES,
        plants="float8 (tensorwise) in every block; each sequence's first token's embedding output x1e5",
        settings=Settings(float8="blocks", steps=6),
        plant=float8_plants.OutlierToken(1e5),
        expect=Expect(
            PROBLEM,
            ("float8_flush",),
            "block 0's inputs flushed to zero by a scale set by the first token: rowwise scaling keeps them",
            finding="blocks.0.",
        ),
    ),
    Pattern(
        name="float8_zero_layer_no_amax_floor",
        number="32",
        title="a zero-initialized layer cast to float8 with no floor on its amax: an infinite scale, NaN",
        sources=(
            "pytorch/ao#3356 — Float8Tensor NaN's for LoRA + FP8 training",
            "NVIDIA/Megatron-LM#7523 (PR) — Guard blockwise FP8 backward (E5M2) wgrad against all-zero gradient blocks",
        ),
        plants="blocks.1.fc2's weight and bias zeroed before sharding (a zero-initialized projection, as LoRA's B); "
        "torchao's amax floor (float8_utils.EPS) 0 for the run, as the configuration without activation_value_lb",
        settings=Settings(float8="blocks", steps=6),
        plant=float8_plants.ZeroLayer("blocks.1.fc2", 0.0),
        expect=Expect(
            PROBLEM,
            ("float8_nonfinite",),
            "blocks.1.fc2's weight is all zeros: amax 0, scale inf, 0 x inf = NaN from step 1: floor the amax",
            finding="blocks.1.fc2's weight",
        ),
    ),
    Pattern(
        name="float8_output_layer",
        number="33",
        title="the output layer silently converted to float8 (the filter names a module that does not exist)",
        sources=(
            "pytorch/torchtitan#4008 (PR) — Fix float8 filter_fqns to exclude lm_head, not output",
            "huggingface/accelerate#1188 (PR) — Only convert linear layers with weights multiple of 16",
        ),
        plants="convert_to_float8_training over every linear layer, the head included",
        settings=Settings(float8="all", steps=6),
        plant=Plant(),
        expect=Expect(
            WARNING,
            ("float8_sensitive_layer",),
            "the head (the last layer) runs in float8: keep it in bf16 with module_filter_fn",
            finding="head (last)",
        ),
    ),
    Pattern(
        name="float8_e4m3_grads",
        number="34",
        title="grads cast to e4m3 (all-E4M3 format) under a loss term weighted far above the rest",
        sources=(
            "NVIDIA/TransformerEngine#2754 — [Question] Expected behavior for blockwise FP8? Hybrid E4M3/E5M2 format "
            "& eval metrics outperforming BF16",
            "NVIDIA-NeMo/Speech#9265 (PR) — FP8 feature documentation (fp8_hybrid: gradients in E5M2 for the "
            "additional dynamic range backward tensors need)",
        ),
        plants="float8 (tensorwise) in every block with grad outputs cast to e4m3; 1e5 x the first token's "
        "logsumexp added to the loss: that token's grads are 1e6x the rest",
        settings=Settings(float8="blocks", float8_recipe="all_e4m3", steps=6),
        plant=float8_plants.GradOutlier(1e5),
        expect=Expect(
            PROBLEM,
            ("float8_grad_underflow",),
            "block grad outputs flushed to zero in e4m3: cast grads to e5m2, and find the loss term",
            finding="grad output",
        ),
    ),
)

FLOAT8_CONTROLS: tuple[Pattern, ...] = (
    Pattern(
        name="healthy_float8_blocks",
        number="C30",
        title="healthy: float8 (tensorwise) in every block, first and last layers in bf16, 200 steps",
        sources=(),
        plants="nothing",
        settings=Settings(float8="blocks", steps=200),
        plant=Plant(),
        expect=Expect(HEALTHY, (), "healthy: no finding"),
        every=(None, 1),
    ),
    Pattern(
        name="float8_outlier_token_rowwise",
        number="C31",
        title="31's fix: the same massive first token under torchao's rowwise recipe",
        sources=_OUTLIER_SOURCES,
        plants="31's plant; rowwise scaling (a scale per token)",
        settings=Settings(float8="blocks", float8_recipe="rowwise", steps=6),
        plant=float8_plants.OutlierToken(1e5),
        expect=Expect(HEALTHY, (), "healthy: each token has its own scale"),
    ),
    Pattern(
        name="float8_zero_layer_amax_floor",
        number="C32",
        title="32's fix: the zero-initialized layer under torchao's amax floor (EPS)",
        sources=("pytorch/ao#3356 — Float8Tensor NaN's for LoRA + FP8 training",),
        plants="32's zeroed blocks.1.fc2, torchao's EPS as it ships",
        settings=Settings(float8="blocks", steps=6),
        plant=float8_plants.ZeroLayer("blocks.1.fc2", None),
        expect=Expect(HEALTHY, (), "healthy: a finite scale for an all-zero weight"),
    ),
    Pattern(
        name="float8_e5m2_grads",
        number="C34",
        title="34's fix: grads cast to e5m2 (torchao's default) under the same loss term",
        sources=("NVIDIA/TransformerEngine#2754 — [Question] Expected behavior for blockwise FP8? ...",),
        plants="34's loss term; grad outputs e5m2",
        settings=Settings(float8="blocks", steps=6),
        plant=float8_plants.GradOutlier(1e5),
        expect=Expect(HEALTHY, (), "healthy: e5m2's range holds the grads"),
    ),
)
