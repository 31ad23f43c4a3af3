"""What one demo run is asked to do: the training configuration a checkpoint stores, and the
whole invocation around it. Built and checked from the command line by :mod:`.options`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .model import GPTConfig

__all__ = ["DTYPES", "RunOptions", "TrainingConfig", "dtype_name"]

# Accepted spellings of each dtype; the checkpoint stores the canonical (torch) name.
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TrainingConfig:
    """What decides the loss curve; saved with every checkpoint and compared on resume.

    Attributes:
        scenario: Key of :data:`~.scenarios.SCENARIOS`.
        compute_dtype: Dtype of the compute weights (the module's parameters).
        main_dtype: Dtype of the sharded main weights the optimizer updates.
        grad_dtype: Dtype of the sharded main grads.
        lr: Peak learning rate, reached after the warm-up.
        min_lr: Learning rate at the end of the cosine decay.
        warmup_steps: Linear warm-up length.
        decay_steps: Step at which the cosine decay reaches ``min_lr``. Independent of the
            number of steps run, so that a run stopped and resumed follows one curve.
        weight_decay: AdamW's decoupled weight decay.
        batch: Sequences per optimizer step, over all ranks and microbatches.
        microbatches: Gradient-accumulation microbatches per step.
        seed: Seed of the weights and the data stream.
        plant_step: Step at which the scenario plants its bug (0: none).
        model: :class:`GPTConfig` fields.
    """

    scenario: str
    compute_dtype: str
    main_dtype: str
    grad_dtype: str
    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    weight_decay: float
    batch: int
    microbatches: int
    seed: int
    plant_step: int
    model: dict[str, int] = field(default_factory=lambda: dataclasses.asdict(GPTConfig()))

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(**self.model)

    def dtype(self, name: str) -> torch.dtype:
        """The torch dtype of field ``name`` (``compute_dtype``, ``main_dtype`` or ``grad_dtype``)."""
        return DTYPES[getattr(self, name)]


@dataclass(frozen=True)
class RunOptions:
    """Everything one invocation of ``fsdp-patch demo`` was asked to do.

    Attributes:
        training: The training configuration (from the command line, or the checkpoint's).
        explicit: Names of training options given on the command line (checked on resume).
        steps: Train until this global step.
        world_size: Local ranks to spawn when not under torchrun.
        checkpoint_dir: Where checkpoints go (none when ``None``).
        checkpoint_every: Save every this many steps (0: only at the end).
        keep_checkpoints: Checkpoints kept in ``checkpoint_dir``, newest first.
        resume: Continue from the newest checkpoint in ``checkpoint_dir``.
        trace_dir: Directory of the trace files.
        exporter: One of :data:`~.options.EXPORTERS`, or ``None`` to leave ``OTEL_*`` as they are.
        precision_every: Diagnostics interval (``FSDP_PATCH_PRECISION_EVERY``), or ``None`` to keep the environment's.
        loss_log: JSON-lines file of per-step loss and learning rate, written by rank 0.
        progress: One of :data:`~.options.PROGRESS_MODES`.
        report_lines: Most lines of the precision report.
        compute_copy: ``MixedPrecisionPolicy.compute_copy``; not a training option (both
            lifetimes train bit for bit alike), so a checkpoint does not record it.
    """

    training: TrainingConfig
    explicit: frozenset[str]
    steps: int
    world_size: int
    checkpoint_dir: str | None
    checkpoint_every: int
    keep_checkpoints: int
    resume: bool
    trace_dir: str
    exporter: str | None
    precision_every: int | None
    loss_log: str | None
    progress: str
    report_lines: int
    compute_copy: str = "persistent"
