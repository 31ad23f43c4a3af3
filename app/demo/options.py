"""The demo's command line: its options, and the checks that turn them into a :class:`~.config.RunOptions`.

Every check of user input happens here, in the launching process, before any rank starts:
bad input is one :class:`DemoInputError` naming what was wrong and what is accepted, which
the command line prints as one line with exit code 2.

Options that decide the training (:class:`~.config.TrainingConfig`) are stored in every
checkpoint. On ``--resume`` the ones not given on the command line come from the checkpoint, and
one given with another value than the checkpoint's makes the checkpoint incompatible.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from fsdp_patch.mixed_precision import COMPUTE_COPY_LIFETIMES

from .config import DTYPES, RunOptions, TrainingConfig, dtype_name
from .scenarios import SCENARIOS


class DemoInputError(ValueError):
    """Bad input to the demo: a one-line message naming the value and what is expected."""


def parse_dtype(option: str, value: str) -> torch.dtype:
    """The dtype an option names.

    Raises:
        DemoInputError: Not one of :data:`DTYPES`.
    """
    dtype = DTYPES.get(value.strip().lower())
    if dtype is None:
        raise DemoInputError(f"{option} {value!r} is not a dtype; expected one of bf16, fp16, fp32")
    return dtype


EXPORTERS = ("file", "otlp", "console", "none", "prometheus")
PROGRESS_MODES = ("auto", "bar", "lines", "none")

# Training options: (flag, dest, type, help). Their default is None so that "given" is known.
_TRAINING_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--compute-dtype", "compute_dtype", str, "compute weights: bf16, fp16 or fp32 (default: the scenario's, bf16)"),
    ("--main-dtype", "main_dtype", str, "main weights the optimizer updates (default fp32)"),
    ("--grad-dtype", "grad_dtype", str, "main grads (default: the compute dtype)"),
    ("--lr", "lr", float, "peak learning rate (default: the scenario's, 3e-3)"),
    ("--min-lr", "min_lr", float, "learning rate at the end of the cosine decay (default lr/10)"),
    ("--warmup-steps", "warmup_steps", int, "linear warm-up steps (default 5)"),
    ("--decay-steps", "decay_steps", int, "step where the cosine decay reaches --min-lr (default 100)"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay (default 0)"),
    ("--batch", "batch", int, "sequences per step over all ranks (default 8)"),
    ("--microbatches", "microbatches", int, "gradient-accumulation microbatches per step (default 1)"),
    ("--seed", "seed", int, "seed of weights and data (default 0)"),
    ("--plant-step", "plant_step", int, "step where --scenario plants its bug (default: half of --steps)"),
)
DEFAULT_STEPS = 30
DEFAULT_TRACE_DIR = os.path.join("runs", "demo", "traces")
DEFAULT_PRECISION_EVERY = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options on ``parser``."""
    parser.add_argument("--scenario", default=None, help=f"planted bug: {', '.join(SCENARIOS)} (default healthy)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="train until this step (default 30)")
    parser.add_argument("--world-size", type=int, default=2, help="local CPU ranks when not under torchrun (default 2)")
    for flag, dest, kind, text in _TRAINING_FLAGS:
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=text)
    parser.add_argument("--checkpoint-dir", default=None, help="save DCP checkpoints here (and resume from here)")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        help="save every N steps, and at the end (default 10; 0: only at the end)",
    )
    parser.add_argument("--keep-checkpoints", type=int, default=2, help="checkpoints kept, newest first (default 2)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    parser.add_argument(
        "--trace-dir", default=None, help=f"trace files (default $FSDP_PATCH_TRACE_DIR, else {DEFAULT_TRACE_DIR})"
    )
    parser.add_argument(
        "--exporter",
        default=None,
        help="file (default), otlp, console, none or prometheus (a pull endpoint per rank); all but none keep the files too",
    )
    parser.add_argument(
        "--precision-every", type=int, default=None, help="precision diagnostics every N steps (default 5)"
    )
    parser.add_argument("--loss-log", default=None, help="write each step's loss and learning rate as JSON lines here")
    parser.add_argument(
        "--progress", default="auto", help="auto (a bar on a terminal, lines otherwise), bar, lines or none"
    )
    parser.add_argument("--report-lines", type=int, default=10, help="most lines of the precision report (default 10)")
    parser.add_argument(
        "--compute-copy",
        default="persistent",
        help="persistent (default: kept, refreshed after each step) or per_gather (cast at each all-gather: FSDP2's memory)",
    )


def _at_least(option: str, value: int, least: int) -> None:
    if value < least:
        raise DemoInputError(f"{option} {value} is too small; expected an integer >= {least}")


def _choice(option: str, value: str, accepted: tuple[str, ...] | list[str]) -> str:
    if value not in accepted:
        raise DemoInputError(f"{option} {value!r} is not known; expected one of {', '.join(accepted)}")
    return value


def training_from_args(
    args: argparse.Namespace, saved: dict[str, Any] | None = None
) -> tuple[TrainingConfig, frozenset[str]]:
    """The training configuration: given options, else the checkpoint's (``saved``), else defaults.

    Raises:
        DemoInputError: A bad value, or (with ``saved``) a given option that differs from the checkpoint.
    """
    given = {dest: getattr(args, dest) for _, dest, _, _ in _TRAINING_FLAGS if getattr(args, dest) is not None}
    if args.scenario is not None:
        given["scenario"] = _choice("--scenario", args.scenario, list(SCENARIOS))
    for dest in ("compute_dtype", "main_dtype", "grad_dtype"):
        if dest in given:
            given[dest] = dtype_name(parse_dtype("--" + dest.replace("_", "-"), given[dest]))
    if saved is not None:
        for key, value in given.items():
            if key in saved and saved[key] != value:
                flag = "--" + key.replace("_", "-")
                raise DemoInputError(
                    f"incompatible checkpoint: it was trained with {flag} {saved[key]}, this run asks for {flag} {value} "
                    f"(leave {flag} out to continue with the checkpoint's)"
                )
        try:
            config = TrainingConfig(**{**saved, **given})
        except TypeError as exc:
            raise DemoInputError(
                f"incompatible checkpoint: its training settings do not fit this version ({exc})"
            ) from None
    else:
        scenario = SCENARIOS[given.get("scenario", "healthy")]
        compute = given.get("compute_dtype", dtype_name(scenario.compute_dtype))
        lr = given.get("lr", scenario.lr)
        config = TrainingConfig(
            scenario=given.get("scenario", "healthy"),
            compute_dtype=compute,
            main_dtype=given.get("main_dtype", "float32"),
            grad_dtype=given.get("grad_dtype", compute),
            lr=lr,
            min_lr=given.get("min_lr", lr / 10),
            warmup_steps=given.get("warmup_steps", 5),
            decay_steps=given.get("decay_steps", 100),
            weight_decay=given.get("weight_decay", 0.0),
            batch=given.get("batch", 8),
            microbatches=given.get("microbatches", 1),
            seed=given.get("seed", 0),
            plant_step=given.get(
                "plant_step", (1 if scenario.plant_from_start else max(1, args.steps // 2)) if scenario.plant else 0
            ),
        )
    _check_training(config)
    return config, frozenset(given)


def _check_training(config: TrainingConfig) -> None:
    if not config.lr > 0:
        raise DemoInputError(f"--lr {config.lr} must be a positive number")
    if not 0 <= config.min_lr <= config.lr:
        raise DemoInputError(f"--min-lr {config.min_lr} must be between 0 and --lr {config.lr}")
    if not config.weight_decay >= 0:
        raise DemoInputError(f"--weight-decay {config.weight_decay} must be >= 0")
    _at_least("--warmup-steps", config.warmup_steps, 0)
    _at_least("--decay-steps", config.decay_steps, 1)
    _at_least("--batch", config.batch, 1)
    _at_least("--microbatches", config.microbatches, 1)
    _at_least("--seed", config.seed, 0)
    _at_least("--plant-step", config.plant_step, 0)


def check_layout(config: TrainingConfig, world_size: int) -> None:
    """Whether the global batch splits evenly over microbatches and ranks.

    Raises:
        DemoInputError: It does not.
    """
    if config.batch % (config.microbatches * world_size):
        raise DemoInputError(
            f"--batch {config.batch} does not split into --microbatches {config.microbatches} x {world_size} ranks; "
            f"expected a multiple of {config.microbatches * world_size}"
        )


def run_options(
    args: argparse.Namespace, training: TrainingConfig, explicit: frozenset[str], world_size: int
) -> RunOptions:
    """The whole invocation, checked.

    Raises:
        DemoInputError: A bad value.
    """
    _at_least("--steps", args.steps, 1)
    _at_least("--world-size", world_size, 1)
    _at_least("--checkpoint-every", args.checkpoint_every, 0)
    _at_least("--keep-checkpoints", args.keep_checkpoints, 1)
    _at_least("--report-lines", args.report_lines, 1)
    if args.precision_every is not None:
        _at_least("--precision-every", args.precision_every, 0)
    if args.resume and not args.checkpoint_dir:
        raise DemoInputError("--resume needs --checkpoint-dir, the directory of the checkpoints to continue from")
    check_layout(training, world_size)
    return RunOptions(
        training=training,
        explicit=explicit,
        steps=args.steps,
        world_size=world_size,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        trace_dir=args.trace_dir or os.environ.get("FSDP_PATCH_TRACE_DIR", "").strip() or DEFAULT_TRACE_DIR,
        exporter=None if args.exporter is None else _choice("--exporter", args.exporter, EXPORTERS),
        precision_every=args.precision_every,
        loss_log=args.loss_log,
        progress=_choice("--progress", args.progress, PROGRESS_MODES),
        report_lines=args.report_lines,
        compute_copy=_choice("--compute-copy", args.compute_copy, COMPUTE_COPY_LIFETIMES),
    )
