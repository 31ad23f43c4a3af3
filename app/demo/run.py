"""``fsdp-patch demo``: check the input, set telemetry's environment, start the ranks."""

from __future__ import annotations

import argparse
import os

from . import checkpoint
from .config import RunOptions
from .launch import run_ranks, under_torchrun
from .options import DEFAULT_PRECISION_EVERY, DemoInputError, run_options, training_from_args
from .train import train_rank

# Exporter choice -> OTEL_TRACES_EXPORTER, OTEL_METRICS_EXPORTER. The trace files stay on with a
# collector, since the precision report at the end reads them.
_EXPORTER_ENV = {
    "file": ("trace_file", "summary"),
    "otlp": ("otlp,trace_file", "otlp"),
    "console": ("console,trace_file", "console"),
    "none": ("none", "none"),
    "prometheus": ("trace_file", "prometheus"),
}


def _set_environment(options: RunOptions) -> None:
    """Telemetry's variables for every rank (spawned ranks inherit them; torchrun's set their own)."""
    env = os.environ
    from fsdp_patch import telemetry

    missing = telemetry.opentelemetry_missing()
    if missing is not None:
        # The job trains the same without telemetry; a machine without OpenTelemetry still runs it.
        if os.environ.get("RANK", "0") == "0":
            print(f"fsdp-patch demo: telemetry off: {missing}", flush=True)
        env["FSDP_PATCH_TELEMETRY"] = "0"
    env.setdefault("FSDP_PATCH_TELEMETRY", "1")
    env["FSDP_PATCH_TRACE_DIR"] = options.trace_dir
    if options.precision_every is not None:
        env["FSDP_PATCH_PRECISION_EVERY"] = str(options.precision_every)
    else:
        env.setdefault("FSDP_PATCH_PRECISION_EVERY", str(DEFAULT_PRECISION_EVERY))
    # The precision report replaces the raw metric summary; FSDP_PATCH_SUMMARY=rank0 brings it back.
    env.setdefault("FSDP_PATCH_SUMMARY", "none")
    if options.exporter is not None:
        env["OTEL_TRACES_EXPORTER"], env["OTEL_METRICS_EXPORTER"] = _EXPORTER_ENV[options.exporter]


def _remove_other_runs_traces(trace_dir: str, world_size: int) -> None:
    # Ranks of this run replace their own files; files of ranks an earlier, larger run had would
    # otherwise be read into this run's report.
    from fsdp_patch.telemetry.offline.trace_reading import rank_segments

    if not os.path.isdir(trace_dir):
        return
    for segment in rank_segments(trace_dir):
        if segment.rank >= world_size:
            for path in (segment.path, os.path.join(trace_dir, f"rank{segment.rank}.jaeger.json")):
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass


def _prepare_loss_log(path: str, resume: bool) -> None:
    # Opened here so that a path that cannot be written is bad input, not a crash on rank 0.
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a" if resume else "w", encoding="utf-8"):
            pass
    except OSError as exc:
        raise DemoInputError(f"--loss-log {path}: cannot write it ({exc.strerror})") from None


def main(args: argparse.Namespace) -> int:
    """Run the demo as ``args`` (from :func:`fsdp_patch.app.demo.options.add_arguments`) asks.

    Raises:
        DemoInputError: Bad input, before any rank starts.
    """
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size
    if args.resume and not args.checkpoint_dir:
        raise DemoInputError("--resume needs --checkpoint-dir, the directory of the checkpoints to continue from")
    saved = checkpoint.find_latest(args.checkpoint_dir) if args.resume else None
    training, explicit = training_from_args(args, saved.training if saved else None)
    options = run_options(args, training, explicit, world_size)
    if saved is not None and options.steps <= saved.step:
        raise DemoInputError(
            f"nothing to resume: checkpoint {saved.path} is at step {saved.step}; pass --steps greater than {saved.step}"
        )
    if options.loss_log:
        _prepare_loss_log(options.loss_log, options.resume)
    _set_environment(options)
    _remove_other_runs_traces(options.trace_dir, world_size)
    run_ranks(train_rank, world_size, options, saved)
    return 0
