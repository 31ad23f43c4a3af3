"""Every change telemetry makes beyond the objects it is given, and what takes each back.

Telemetry wraps or hooks a few things every caller in the process shares. This is the one list
of them (:data:`CHANGES`); each entry names the module that makes the change, when it is made,
and what removes it, exactly (the original object put back, the hook's handle removed).
``tests/telemetry/test_process_wide.py`` checks the list against what an instrumented run
actually changes, and against the code that makes each change.

OpenTelemetry's global tracer and meter providers are the application's: telemetry never sets
them (its own providers are kept by :mod:`.export.providers`). Per-object changes are not listed here: hooks on the watched model's modules and parameter
groups, FSDP2's per-group post-backward and root final callback, and the adapted optimizer's
``step``/``zero_grad`` wrappers and load hook. Each goes with its owner (the watch, the
adaptation, telemetry turned off for that optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CHANGES", "Change"]


@dataclass(frozen=True)
class Change:
    """One process-wide change.

    Attributes:
        target: What is changed, as a script would name it.
        kind: ``wrapper`` (the attribute replaced by a wrapt wrapper of the original), ``hook`` (a
            registration with torch or the standard library), ``filter`` or ``mode``.
        module: The module that makes and removes it (under ``fsdp_patch.telemetry``).
        installed: When it is made.
        removed: What takes it back.
    """

    target: str
    kind: str
    module: str
    installed: str
    removed: str


CHANGES: tuple[Change, ...] = (
    Change(
        "torch.optim.Optimizer.__init__",
        "wrapper",
        "instrumentation.instrumentor",
        "instrument() (opentelemetry-instrument, or FSDP_PATCH_TELEMETRY=1 at import)",
        "uninstrument(): the original put back, unless a later wrapper wraps ours (then ours passes through)",
    ),
    Change(
        "torch.optim.optimizer global step pre-hooks",
        "hook",
        "instrumentation.late_adaptation",
        "while an optimizer constructed over no sharded parameter waits for its first step",
        "that optimizer's first step, or uninstrument(): the handle removed",
    ),
    Change(
        "torch.distributed.destroy_process_group (and distributed_c10d's)",
        "wrapper",
        "export.exit_hooks",
        "the embedded default's providers built (the first telemetry step)",
        "the providers shut down (exit, uninstrument()): the originals put back",
    ),
    Change(
        "atexit",
        "hook",
        "export.exit_hooks",
        "the embedded default's providers built",
        "the providers shut down: atexit.unregister",
    ),
    Change(
        "the opentelemetry loggers' filters",
        "filter",
        "export.isolation",
        "the embedded default's providers built (telemetry's own errors logged once, not per step)",
        "the providers shut down: each filter removed",
    ),
    Change(
        "torch.autograd.backward",
        "wrapper",
        "instrumentation.training_calls",
        "the first model watch (an adapted optimizer over a sharded model, with telemetry on)",
        "the last model watch removed (telemetry off, the optimizer collected): the original put back",
    ),
    Change(
        "torch.amp.GradScaler.step",
        "wrapper",
        "instrumentation.training_calls",
        "the first model watch",
        "the last model watch removed: the original put back",
    ),
    Change(
        "torch.nn.utils.clip_grad_norm_ (and torch.nn.utils.clip_grad's)",
        "wrapper",
        "instrumentation.training_calls",
        "the first model watch",
        "the last model watch removed: the originals put back",
    ),
    Change(
        "the training thread's dispatch mode stack",
        "mode",
        "diagnostics.op_audit",
        "an audited iteration begins (the end of the step before it)",
        "the iteration's step ends, telemetry is turned off or flushed, the optimizer is collected: the mode "
        "taken out wherever it is in the stack (modes pushed after it stay)",
    ),
    Change(
        "torch.nn.modules.module global forward pre-hooks and hooks",
        "hook",
        "diagnostics.op_sites",
        "an audited iteration begins",
        "the audited iteration ends (as the mode): both handles removed",
    ),
)
