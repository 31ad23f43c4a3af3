"""The model side of an adapted optimizer's telemetry: each iteration's forward, loss, backward and
reduce checked as they run, and the iteration's checks read a step later.

An optimizer observer sees the optimizer boundary only. To say where a NaN/Inf began, a
:class:`ModelWatch` checks the sharded model it steps (:mod:`fsdp_patch.module.model_units`): each
unit's output and its grad, the loss (the tensors ``torch.autograd.backward`` is called on, through
:mod:`.training_calls`), each group's grads before and after its reduce-scatter (torch FSDP2's
through :mod:`.fsdp2_reduce_checks`), and, from the observer, the main grads at the step and the
main weights before and after the update (:mod:`..diagnostics.probes`; what they say:
:mod:`..diagnostics.origin`). One ``aminmax`` per
checked tensor, kept on the device; the iteration's log is read after the next step begins (a
CUDA event, no stall), and the ranks agree on whether any of them saw a NaN/Inf through one small
all-reduce issued with it, so that they escalate together (:class:`IterationCheck`).

Escalated (after a NaN/Inf, for ``FSDP_PATCH_PRECISION_ESCALATION`` iterations), every module of
the model is checked too (:class:`~.module_checks.ModuleChecks`).

Alternatives considered:
    - Reading the checks at the step that ran them: one device sync per step; a step later the
      copy has long finished.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_patch.module.model_units import ShardedModel, user_name
from fsdp_patch.sharding.grad_reduce import REDUCE_COPIED, REDUCE_INPUT

from .. import semconv
from ..diagnostics.host_copies import HostCopy
from ..diagnostics.model_audit import ModelFinding, NormStatistics, loss_precision
from ..diagnostics.origin import Origin, find_origin, zeroed_groups
from ..diagnostics.probes import AFTER, BEFORE, INPUT, Checked, PreparedChecks, ProbeLog, floating_tensors
from .checked_grads import CheckedGrads
from .fsdp2_reduce_checks import FSDP2ReduceChecks
from .model_parameters import ModelParameters
from .module_checks import ModuleChecks

__all__ = ["IterationCheck", "ModelWatch"]


# What :func:`zeroed_groups` reads: the reduced grads and the grads at the step.
_ZEROED_STAGES = frozenset({semconv.ORIGIN_REDUCE, semconv.ORIGIN_GRAD_WRITE})


class IterationCheck:
    """What one iteration's checks found, read a step later.

    Attributes:
        origin: This rank's origin of the iteration's first NaN/Inf (``None``: all finite here).
        refined: Module-level origins of an escalated iteration (forward, backward), where found.
        anywhere: Whether any rank saw a NaN/Inf in the iteration (agreed by all ranks).
        backward_count: Backward passes the iteration ran.
        zeroed: The groups whose non-zero grads were all 0 at the step (:func:`zeroed_groups`).
    """

    def __init__(
        self,
        origin: Origin | None,
        refined: list[Origin],
        anywhere: bool,
        backward_count: int,
        zeroed: list[str],
        read: Callable[[], list[Checked]],
        checks: list[Checked] | None = None,
    ) -> None:
        self.origin = origin
        self.refined = refined
        self.anywhere = anywhere
        self.backward_count = backward_count
        self.zeroed = zeroed
        self._read = read
        self._checks = checks  # already read, where the iteration was read probe by probe

    @property
    def checks(self) -> list[Checked]:
        """Everything checked, in order (read from the host's values when first asked: an
        iteration with nothing to report is never read probe by probe)."""
        if self._checks is None:
            self._checks = self._read()
        return self._checks


class _Pending:
    """An iteration's log on its way to the host, and the ranks' flag on its way back.

    [Note: reading an iteration's checks without synchronizing]
    The probes' values and the flag are copied to the host without blocking as the iteration
    closes (:class:`.host_copies.HostCopy`) and read as the next step begins, one iteration later,
    on every rank at the same step (their escalation must agree). By then the copy is done unless
    the device runs more than an iteration behind the host; waiting for it then costs the device
    nothing, since the next iteration's work is already queued. No value of a device tensor is
    read on an undiagnosed step.
    """

    def __init__(self, log: ProbeLog, copies: HostCopy, work: Any, refined: list[Origin], backward_count: int) -> None:
        self.log = log
        self._copies = copies
        self._work = work
        self.refined = refined
        self.backward_count = backward_count

    def result(self) -> tuple[list[float], bool | None]:
        """The values on the host, and whether any rank held a NaN/Inf (``None``: no other rank agreed)."""
        if self._work is not None:
            self._work.wait()  # gloo: the host's own collective, a step old
        values, flag = self._copies.values(wait=True)
        return [] if values is None else values.tolist(), None if flag is None else not math.isfinite(flag.item())


class ModelWatch:
    """The checks of one sharded model, and its count of backward passes.

    Args:
        model: The sharded model (its root held weakly).
        process_group: Where the ranks agree on each iteration's flag (``None``: this process only).
    """

    def __init__(self, model: ShardedModel, process_group: Any) -> None:
        self._root_ref = weakref.ref(model.root)
        self.prefix = model.prefix
        self._process_group = process_group
        self._peers: bool | None = None
        self.log = ProbeLog()
        self.backward_count = 0
        # Told after each backward pass (the observer readies its providers: a run that never steps
        # still reports its backward passes at exit).
        self.backward_listeners: list[Callable[[], None]] = []
        self.modules: ModuleChecks | None = None
        # Checked once: the first training forward's normalization statistics, the first loss.
        self.norms = NormStatistics(model.root, model.prefix)
        self.loss_finding: ModelFinding | None = None
        self._loss_checked = False
        self._pending: _Pending | None = None
        # Per checked group: whether its main weights were finite after the last update checked.
        self._after_finite: dict[str, bool] = {}
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._fsdp2 = FSDP2ReduceChecks(self)
        self.checked_grads = CheckedGrads()
        # Units whose output was written in place after its hook (see [Note: a forward's checks
        # held until its backward]).
        self._checked_at_once: set[str] = set()
        self._in_backward = False
        # Whether a hook of this model ran in the backward going on, and that backward's losses,
        # checked as it first does (see [Note: whose backward]).
        self._reached = False
        self._losses: list[torch.Tensor] = []
        self._depth = 0  # backward passes running, one inside another (reentrant checkpointing)
        self._loss_finding: ModelFinding | None = None  # of the first loss, read before its backward
        self.parameters = ModelParameters(self._root_ref)  # what a clip_grad_norm_ clipped is known by
        self._handles.append(model.root.register_forward_pre_hook(self._model_input))
        units: list[tuple[str, nn.Module]] = []
        self._output_grad_hooks: dict[str, Callable[[torch.Tensor], None]] = {}
        for name, unit in model.units:
            name = user_name(model.prefix, name)
            self._output_grad_hooks[name] = functools.partial(self._unit_output_grad, name)
            self._handles.append(unit.register_forward_hook(functools.partial(self._unit_output, name)))
            units.append((name, unit))
            state = getattr(unit, "_fsdp_state", None)
            for group in getattr(state, "groups", ()) or ():
                self._handles.append(group.register_reduce_hook(functools.partial(self._reduced, name)))
        self._fsdp2.watch(model.root, units)

    @property
    def root(self) -> nn.Module | None:
        return self._root_ref()

    @property
    def pending(self) -> bool:
        """Whether a closed iteration's checks wait to be read."""
        return self._pending is not None

    # -- what the model runs ----------------------------------------------------------------

    # [Note: a forward's checks held until its backward]
    # The model's input and each unit's output are held (ProbeLog.hold) and checked together as
    # the backward begins (before the loss), or at the next forward or the step where no backward
    # came: autograd keeps those tensors until then anyway (held_checks). A unit whose output was
    # written in place after its hook saw it is checked at once from then on.

    def _model_input(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._in_backward:
            self.reached()
        if torch.is_grad_enabled():
            self._flush()  # a forward that no backward followed
            for t in floating_tensors(args):
                self.log.hold(semconv.ORIGIN_FORWARD, "", t, INPUT)

    def _unit_output(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation between steps is no part of the iteration the step ends
        if self._in_backward:
            self.reached()
        # A forward recomputed inside a backward (activation checkpointing) is checked at once:
        # held, its outputs would outlive the recomputation.
        check = self.log.check if self._in_backward or name in self._checked_at_once else self.log.hold
        for t in floating_tensors(output):
            check(semconv.ORIGIN_FORWARD, name, t)
            if t.requires_grad:
                t.register_hook(self._output_grad_hooks[name])

    def _flush(self) -> None:
        """The held checks made now (see [Note: a forward's checks held until its backward])."""
        self._checked_at_once.update(self.log.flush())

    def _unit_output_grad(self, name: str, grad: torch.Tensor) -> None:
        self.reached()
        self.log.check(semconv.ORIGIN_BACKWARD, name, grad)

    def _reduced(self, name: str, group: Any, stage: str, grads: torch.Tensor) -> None:
        self.reached()
        if stage == REDUCE_COPIED:  # main_grad now holds the shard just checked: not checked again at the step
            self.seen_grad(grads)
            return
        when = BEFORE if stage == REDUCE_INPUT else AFTER
        self.log.check(semconv.ORIGIN_REDUCE, name, grads, when)

    # [Note: whose backward]
    # torch.autograd.backward is wrapped for the whole process, and a process may train other
    # models beside this one (a GAN's discriminator, a model not adapted). A backward belongs to
    # this model's iteration only where one of its hooks ran in it: a unit's output grad, a
    # reduce (fully_shard's, torch FSDP2's post-backward), a forward recomputed; its loss is
    # checked as the first of them runs, so it comes before them in the log, and another
    # model's backward costs this watch nothing but its held checks made. A model reached only
    # by a forward method of its own (no module hook runs) in a backward without gradient sync
    # shows none of these: that backward is not counted.

    def reached(self) -> None:
        """A hook of this model runs in the backward going on: the first checks its losses (see
        [Note: whose backward])."""
        if self._reached:
            return
        self._reached = True
        losses, self._losses = self._losses, []
        for t in losses:
            self.log.check(semconv.ORIGIN_LOSS, "loss", t)
        if losses and not self._loss_checked:
            self._loss_checked = True
            self.loss_finding = self._loss_finding

    def before_backward(self, tensors: Any) -> None:
        """``torch.autograd.backward(tensors)`` is about to run: the forward's held checks made;
        the loss is checked where the backward proves this model's (:meth:`reached`). A backward
        inside a backward (reentrant checkpointing's recomputation) is part of the outer one."""
        self._depth += 1
        if self._depth > 1:
            return
        self._flush()
        self._in_backward = True
        self._reached = False
        self._losses = list(floating_tensors(tensors))
        if self._losses and not self._loss_checked:
            # Read from the graph behind the loss, which the backward frees as it goes.
            self._loss_finding = loss_precision(self._losses[0])

    def after_backward(self) -> None:
        """A backward pass ended (also by an exception): what follows belongs to the next
        microbatch, where the backward was this model's."""
        self._depth -= 1
        if self._depth > 0:
            return
        self._in_backward = False
        self._losses = []
        if not self._reached:
            return
        self.backward_count += 1
        self.log.microbatch += 1
        self.checked_grads.snapshot(self.parameters.listed())
        for listener in self.backward_listeners:
            listener()

    # -- the step -----------------------------------------------------------------------------

    def check_step_begin(
        self,
        grads: Sequence[tuple[str, torch.Tensor]],
        weights: PreparedChecks,
        replaced: Callable[[], list[tuple[str, torch.Tensor]]] | None = None,
    ) -> None:
        """At the step, before the update: the main grads written since their reduce, and the
        main weights.

        Args:
            grads: ``(group name, main grad)`` of every group the optimizer steps.
            weights: Each parameter's main weight (a write between steps spreads through this
                step's update, so the parameter written is known only now). Checked every step:
                writes through ``.data`` (a load, an EMA, a manual edit) move no version counter.
            replaced: ``(group name, grad)`` of the parameters' grads that are no main grad of
                their group (replaced by a script), read where the parameters' grads moved.
        """
        self._flush()
        if self.checked_grads.moved(self.parameters.listed()):  # [Note: a grad written through its DTensor]
            items = [(name, grad, "", "") for name, grad in grads]
            items += [(name, grad, "", "") for name, grad in (replaced() if replaced is not None else [])]
        else:
            written = self.checked_grads.written([grad for _, grad in grads])
            items = [(grads[i][0], grads[i][1], "", "") for i in written]
        if items:
            self.log.check_all(semconv.ORIGIN_GRAD_WRITE, items)
        self.log.check_prepared(weights)

    def check_step_end(self, weights: PreparedChecks) -> None:
        """After the update: each group's main weights."""
        self.log.check_prepared(weights)

    def seen_grad(self, tensor: torch.Tensor) -> None:
        """Record ``tensor`` (a grad) as checked now (:mod:`.checked_grads`)."""
        self.checked_grads.record([getattr(tensor, "_local_tensor", tensor)])

    def seen_grads(self, tensors: Sequence[torch.Tensor]) -> None:
        """Record ``tensors`` (plain grads: local shards) as checked now."""
        self.checked_grads.record(tensors)

    def close_iteration(self, agree: bool = True) -> IterationCheck | None:
        """End the iteration: its log goes on its way (with the ranks' flag when ``agree``, a
        collective); returns the previous iteration's result."""
        with self._lock:
            previous = self._resolve()
            self._pending = self._close(agree)
        return previous

    def resolve(self) -> IterationCheck | None:
        """The result of the iteration closed last, if not yet taken (at a flush or exit)."""
        with self._lock:
            return self._resolve()

    def _close(self, agree: bool) -> _Pending:
        refined: list[Origin] = []
        if self.modules is not None:
            refined = [o for o in self.modules.reset() if o is not None]
        count, self.backward_count = self.backward_count, 0
        self._flush()
        log, self.log = self.log, ProbeLog(self.log.held_plans)
        self.checked_grads.clear()
        values = log.stacked()
        work = flag = None
        device = values.device if values is not None else torch.device("cpu")
        if agree and self._has_peers():
            # 0 where every value is finite, NaN where any is not (0 x Inf is NaN); summed over
            # the ranks it stays NaN. A sum of the values themselves could overflow float64.
            if values is not None:
                flag = (values * 0.0).sum(0, keepdim=True)
            else:
                flag = torch.zeros(1, dtype=torch.float64, device=device)
            if device.type == "cpu" and _backend(self._process_group) == "nccl":
                flag = flag.cuda()
            work = dist.all_reduce(flag, group=self._process_group, async_op=True)
        if work is not None and ((flag is not None and flag.device.type == "cuda") or device.type == "cuda"):
            work.wait()  # on the stream, not the host: the copy below is ordered after the collective
            work = None
        return _Pending(log, HostCopy([values, flag]), work, refined, count)

    def _has_peers(self) -> bool:
        """Whether other ranks agree on each iteration's flag (a group of this rank alone needs no collective)."""
        if self._peers is None:
            group = self._process_group
            self._peers = (
                group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
            )
        return self._peers

    def _resolve(self) -> IterationCheck | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        values, agreed = pending.result()
        log = pending.log
        here = all(map(math.isfinite, values))
        anywhere = not here if agreed is None else agreed
        checks: list[Checked] | None = None
        if here and all(self._after_finite.values()):
            # Nothing to report from this rank (and no earlier NaN/Inf to follow): the probes are
            # read only where the zeroed-grads finding needs them.
            origin = None
            zeroed = zeroed_groups(log.read(values, _ZEROED_STAGES)) if log.grads_at_step else []
            log.release()
        else:
            checks = log.read(values)
            origin = find_origin(checks, self._after_finite)
            after: dict[str, bool] = {}
            for c in checks:
                if c.probe.stage == semconv.ORIGIN_WEIGHT_WRITE and c.probe.when == AFTER:
                    after[c.probe.where] = after.get(c.probe.where, True) and c.finite
            self._after_finite.update(after)
            zeroed = zeroed_groups(checks)
        return IterationCheck(
            origin,
            pending.refined,
            anywhere,
            pending.backward_count,
            zeroed,
            functools.partial(log.read, values),
            checks,
        )

    # -- escalation ---------------------------------------------------------------------------

    def escalate(self) -> None:
        """Module-level checks from the next forward on."""
        root = self.root
        if self.modules is None and root is not None:
            self.modules = ModuleChecks(root, self.prefix)

    def de_escalate(self) -> None:
        if self.modules is not None:
            self.modules.remove()
            self.modules = None

    def remove(self) -> None:
        """Remove every hook and patch this watch installed."""
        self.de_escalate()
        self.norms.remove()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._fsdp2.remove()


def _backend(group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:  # pragma: no cover - a group torch no longer knows
        return ""
