"""The model side of an adapted optimizer's telemetry: each iteration's forward, loss, backward and
reduce checked as they run, and the iterations counted (backward passes, steps a GradScaler skipped).

An optimizer observer sees the optimizer boundary only. To say where a NaN/Inf began, a
:class:`ModelWatch` checks the sharded model it steps (:mod:`fsdp_patch.module.model_units`): each
unit's output and its grad, the loss (the tensors ``torch.autograd.backward`` is called on), each
group's grads before and after its reduce-scatter, and, from the observer, the main grads at the
step and the main weights before and after the update (:mod:`..diagnostics.origin`). One
``aminmax`` per checked tensor, kept on the device; the iteration's log is read after the next
step begins (a CUDA event, no stall), and the ranks agree on whether any of them saw a NaN/Inf
through one small all-reduce issued with it, so that they escalate together.

Escalated (after a NaN/Inf, for ``FSDP_PATCH_PRECISION_ESCALATION`` iterations), every module of
the model is checked too (:class:`ModuleChecks`): the first module whose output is not finite, with
its dtype and largest finite value, and the first module whose backward turned a finite output
grad into a non-finite input grad.

Process-wide, while any watch lives: a wrapper on ``torch.autograd.backward`` (``Tensor.backward``
calls it) and on ``torch.amp.GradScaler.step``; both are removed, exactly, with the last watch.

Alternatives considered:
    - Full backward hooks (``register_full_backward_hook``) for the module-level backward checks:
      they rewrap a module's inputs and outputs, and an in-place operation on an output then
      raises inside the user's forward; tensor hooks only read.
    - Reading the checks at the step that ran them: one device sync per step; a step later the
      copy has long finished.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import wrapt
from torch import nn

from fsdp_patch.module.model_units import ShardedModel, user_name
from fsdp_patch.sharding.parameter_group import REDUCE_COPIED, REDUCE_INPUT

from .. import semconv
from ..diagnostics.model_audit import ModelFinding, NormStatistics, loss_precision
from ..diagnostics.origin import (
    AFTER,
    BEFORE,
    CLIP,
    INPUT,
    WIDE_REDUCE_DTYPES,
    Checked,
    Origin,
    PreparedChecks,
    ProbeLog,
    dtype_name,
    find_origin,
    floating_tensors,
    zeroed_groups,
)

__all__ = ["IterationCheck", "ModelWatch", "ModuleChecks", "watch_optimizer_steps"]


# -- module-level checks while escalated ---------------------------------------------------------


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _finite_magnitude(t: torch.Tensor) -> float:
    finite = torch.isfinite(t)
    if not bool(finite.any()):
        return 0.0
    return float(t.detach()[finite].abs().max().double())


class ModuleChecks:
    """Every module of one model checked as it runs (one iteration of escalation at a time).

    Forward: the first module (children finish before their parent) whose output is not finite.
    Backward: the first module whose input grad is not finite while its output grad was.
    """

    def __init__(self, root: nn.Module, prefix: str = "") -> None:
        self.forward: Origin | None = None
        self.backward: Origin | None = None
        self._output_grad_finite: dict[str, bool] = {}
        self._handles = []
        for name, module in root.named_modules():
            name = user_name(prefix, name)
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._inputs, name)))
            self._handles.append(module.register_forward_hook(functools.partial(self._outputs, name)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> tuple[Origin | None, Origin | None]:
        """What the iteration found (forward, backward); starts the next iteration."""
        found = (self.forward, self.backward)
        self.forward, self.backward = None, None
        self._output_grad_finite.clear()
        return found

    def _inputs(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled():
            return
        for t in floating_tensors(args):
            if t.requires_grad:
                t.register_hook(functools.partial(self._input_grad, name))

    def _outputs(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.forward is None:
            for t in floating_tensors(output):
                if not _finite(t):
                    inputs = list(floating_tensors(args))
                    nan = bool(torch.isnan(t).any())
                    if not all(_finite(x) for x in inputs):
                        detail = "its input already held NaN/Inf, made by no module of the model (the batch, or code between modules in a parent's forward)"
                    else:
                        peak = max((_finite_magnitude(x) for x in inputs), default=0.0)
                        detail = (
                            f"largest finite |x| {_finite_magnitude(t):.6g} in the output, {peak:.6g} in its inputs; "
                            f"{dtype_name(t.dtype)} reaches {torch.finfo(t.dtype).max:.6g}"
                        )
                    self.forward = Origin(semconv.ORIGIN_FORWARD, name, dtype_name(t.dtype), nan, 0, detail)
                    break
        if torch.is_grad_enabled():
            for t in floating_tensors(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._output_grad, name))

    def _output_grad(self, name: str, grad: torch.Tensor) -> None:
        finite = _finite(grad)
        self._output_grad_finite[name] = self._output_grad_finite.get(name, True) and finite

    def _input_grad(self, name: str, grad: torch.Tensor) -> None:
        if _finite(grad) or not self._output_grad_finite.get(name, False):
            return
        found = self.backward
        # A parent shares its first child's input: the hooks on that tensor run parent first, so
        # a module inside the one already named is the more precise answer.
        if found is None or name.startswith(found.where + ".") or found.where == "":
            nan = bool(torch.isnan(grad).any())
            self.backward = Origin(
                semconv.ORIGIN_BACKWARD,
                name,
                dtype_name(grad.dtype),
                nan,
                0,
                "finite grad of its output, non-finite grad of its input",
            )


# -- the watch of one model ----------------------------------------------------------------------


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
    """An iteration's log on its way to the host, and the ranks' flag on its way back."""

    def __init__(
        self,
        log: ProbeLog,
        values: torch.Tensor | None,
        flag: torch.Tensor | None,
        work: Any,
        event: Any,
        refined: list[Origin],
        backward_count: int,
    ) -> None:
        self.log = log
        self._values = values
        self._flag = flag
        self._work = work
        self._event = event
        self.refined = refined
        self.backward_count = backward_count

    def result(self) -> tuple[list[float], bool | None]:
        """The values on the host, and whether any rank held a NaN/Inf (``None``: no other rank agreed)."""
        if self._work is not None:
            self._work.wait()
        if self._event is not None:
            self._event.synchronize()
        values = [] if self._values is None else self._values.tolist()
        return values, None if self._flag is None else not math.isfinite(self._flag.item())


class _ReducedGrads:
    """Torch FSDP2's grads after its reduce, one list an iteration: new tensors each time for the
    same parameters, so their probes are made again only when which parameters have grads, or
    their dtypes or sizes, change."""

    def __init__(self) -> None:
        self._key: tuple[list[str], list[torch.dtype], list[int]] | None = None
        self._prepared: PreparedChecks | None = None

    def prepared(self, wheres: list[str], grads: list[torch.Tensor]) -> PreparedChecks:
        key = (wheres, list(map(_DTYPE, grads)), list(map(torch.Tensor.numel, grads)))
        if self._prepared is not None and key == self._key:
            self._prepared.retarget(grads)
            return self._prepared
        self._key = key
        self._prepared = PreparedChecks(
            semconv.ORIGIN_REDUCE, [(where, grad, AFTER, "") for where, grad in zip(wheres, grads, strict=True)]
        )
        return self._prepared


_DTYPE = operator.attrgetter("dtype")


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
        self._patched_groups: list[Any] = []
        self._fsdp2_reduced = _ReducedGrads()
        # FSDP2 groups whose grads are reduced in a wide dtype ([Note: the reduce's input in a wide dtype]).
        self._wide_reduces: weakref.WeakSet[Any] = weakref.WeakSet()
        self._patched_states: list[Any] = []
        self._grad_versions: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._handles.append(model.root.register_forward_pre_hook(self._model_input))
        fsdp2_units: list[tuple[str, Any]] = []
        self._output_grad_hooks: dict[str, Callable[[torch.Tensor], None]] = {}
        for name, unit in model.units:
            name = user_name(model.prefix, name)
            self._output_grad_hooks[name] = functools.partial(self._unit_output_grad, name)
            self._handles.append(unit.register_forward_hook(functools.partial(self._unit_output, name)))
            state = getattr(unit, "_fsdp_state", None)
            for group in getattr(state, "groups", ()) or ():
                self._handles.append(group.register_reduce_hook(functools.partial(self._reduced, name)))
            for group in _fsdp2_param_groups(unit):
                self._patch_fsdp2_post_backward(group, name)
                fsdp2_units.append((name, group))
        if fsdp2_units:
            self._patch_fsdp2_final_callback(model.root, fsdp2_units)

    @property
    def root(self) -> nn.Module | None:
        return self._root_ref()

    @property
    def pending(self) -> bool:
        """Whether a closed iteration's checks wait to be read."""
        return self._pending is not None

    # -- what the model runs ----------------------------------------------------------------

    def _model_input(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if torch.is_grad_enabled():
            for t in floating_tensors(args):
                self.log.check(semconv.ORIGIN_FORWARD, "", t, INPUT)

    def _unit_output(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation between steps is no part of the iteration the step ends
        for t in floating_tensors(output):
            self.log.check(semconv.ORIGIN_FORWARD, name, t)
            if t.requires_grad:
                t.register_hook(self._output_grad_hooks[name])

    def _unit_output_grad(self, name: str, grad: torch.Tensor) -> None:
        self.log.check(semconv.ORIGIN_BACKWARD, name, grad)

    def _reduced(self, name: str, group: Any, stage: str, grads: torch.Tensor) -> None:
        if stage == REDUCE_COPIED:  # main_grad now holds the shard just checked: not checked again at the step
            self._seen_grad(grads)
            return
        when = BEFORE if stage == REDUCE_INPUT else AFTER
        self.log.check(semconv.ORIGIN_REDUCE, name, grads, when)

    def _patch_fsdp2_post_backward(self, group: Any, name: str) -> None:
        """FSDP2 reduces inside its group's ``post_backward``: check the unsharded grads it is about
        to reduce, in the dtype it reduces them in (an instance attribute over the class's method;
        removed by :meth:`remove`). Grads reduced in float32 or wider are not checked here: see
        [Note: the reduce's input in a wide dtype]."""
        original = type(group).post_backward
        watch_ref = weakref.ref(self)

        def post_backward(*args: Any, **kwargs: Any) -> Any:
            watch = watch_ref()
            if watch is not None:
                watch._before_fsdp2_reduce(group, name)
            return original(group, *args, **kwargs)

        group.post_backward = post_backward
        self._patched_groups.append(group)

    def _patch_fsdp2_final_callback(self, root: nn.Module, units: list[tuple[str, Any]]) -> None:
        """FSDP2 finishes its reduce-scatters in the root's final backward callback: check each
        unit's reduced grads after it (an instance attribute over the class's method, which FSDP2
        queues by attribute at each backward; removed by :meth:`remove`)."""
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
        except ImportError:  # pragma: no cover - torch built without distributed
            return
        state = _get_module_fsdp_state(root)
        original = getattr(type(state), "_root_post_backward_final_callback", None)
        if state is None or original is None:
            return
        watch_ref = weakref.ref(self)

        def final_callback(*args: Any, **kwargs: Any) -> Any:
            result = original(state, *args, **kwargs)
            watch = watch_ref()
            if watch is not None:
                watch._after_fsdp2_reduce(units)
            return result

        state.__dict__["_root_post_backward_final_callback"] = final_callback
        self._patched_states.append(state)

    def _before_fsdp2_reduce(self, group: Any, name: str) -> None:
        if group in self._wide_reduces:
            return
        dtype = getattr(group, "_reduce_dtype", None)
        grads = [g for p in group.fsdp_params if (g := _fsdp2_unsharded_grad(p)) is not None]
        narrow = [
            grad if dtype is None else grad.to(dtype)
            for grad in grads
            if (dtype or grad.dtype) not in WIDE_REDUCE_DTYPES
        ]
        if grads and not narrow:
            # Its dtypes are fixed at FSDP2's lazy initialization: never checked here.
            self._wide_reduces.add(group)
        self.log.check_all(semconv.ORIGIN_REDUCE, [(name, grad, BEFORE, "") for grad in narrow])

    def _after_fsdp2_reduce(self, units: Sequence[tuple[str, Any]]) -> None:
        wheres: list[str] = []
        grads: list[torch.Tensor] = []
        for name, group in units:
            for fsdp_param in group.fsdp_params:
                grad = fsdp_param.sharded_param.grad
                if grad is not None:
                    local = getattr(grad, "_local_tensor", grad)
                    wheres.append(name)
                    grads.append(local.detach() if local.requires_grad else local)
                    self._seen_grad(local)
        self.log.check_prepared(self._fsdp2_reduced.prepared(wheres, grads))

    def before_backward(self, tensors: Any) -> None:
        """``torch.autograd.backward(tensors)`` is about to run: the loss, checked."""
        for t in floating_tensors(tensors):
            self.log.check(semconv.ORIGIN_LOSS, "loss", t)
            if not self._loss_checked:
                self._loss_checked = True
                self.loss_finding = loss_precision(t)

    def after_backward(self) -> None:
        """A backward pass ended (also by an exception): what follows belongs to the next microbatch."""
        self.backward_count += 1
        self.log.microbatch += 1
        for listener in self.backward_listeners:
            listener()

    # -- the step -----------------------------------------------------------------------------

    def check_step_begin(self, grads: Sequence[tuple[str, torch.Tensor]], weights: PreparedChecks) -> None:
        """At the step, before the update: the main grads written since their reduce, and the
        main weights.

        Args:
            grads: ``(group name, main grad)`` of every group the optimizer steps.
            weights: Each parameter's main weight (a write between steps spreads through this
                step's update, so the parameter written is known only now). Checked every step:
                writes through ``.data`` (a load, an EMA, a manual edit) move no version counter.
        """
        changed = [(name, grad, "", "") for name, grad in grads if not self._unchanged_grad(grad)]
        if changed:
            self.log.check_all(semconv.ORIGIN_GRAD_WRITE, changed)
        self.log.check_prepared(weights)

    def check_step_end(self, weights: PreparedChecks) -> None:
        """After the update: each group's main weights."""
        self.log.check_prepared(weights)

    # A grad checked already and not written since holds what that check saw: torch FSDP2's from
    # its reduce to the step, fully_shard's main grads copied from the reduce. Not checking it
    # again saves a pass over the grads in every iteration that writes nothing between. A grad
    # is known by its tensor (a weak reference: holding it would keep alive a main-grad buffer
    # that its group frees) and "not written" by its version counter unmoved: a clip or an
    # unscale writes in place and moves it. Grads are known for one iteration only.

    def _seen_grad(self, tensor: torch.Tensor) -> None:
        local: torch.Tensor = getattr(tensor, "_local_tensor", tensor)
        self._grad_versions[id(local)] = (weakref.ref(local), local._version)

    def _unchanged_grad(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` was checked and not written since."""
        local: torch.Tensor = getattr(tensor, "_local_tensor", tensor)
        held = self._grad_versions.get(id(local))
        return held is not None and held[0]() is local and held[1] == local._version

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
        log, self.log = self.log, ProbeLog()
        self._grad_versions.clear()
        values = log.stacked()
        work = event = flag = None
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
        if (flag is not None and flag.device.type == "cuda") or device.type == "cuda":
            if work is not None:
                work.wait()  # on the stream: the copy below is ordered after the collective
                work = None
            values = None if values is None else values.to("cpu", non_blocking=True)
            flag = None if flag is None else flag.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return _Pending(log, values, flag, work, event, refined, count)

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
        for group in self._patched_groups:
            group.__dict__.pop("post_backward", None)
        self._patched_groups.clear()
        for state in self._patched_states:
            state.__dict__.pop("_root_post_backward_final_callback", None)
        self._patched_states.clear()


def _backend(group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:  # pragma: no cover - a group torch no longer knows
        return ""


def _fsdp2_param_groups(unit: nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    from fsdp_patch.torch_interop.torch_compat import fsdp2_state_param_groups

    state = _get_module_fsdp_state(unit)
    return [] if state is None else fsdp2_state_param_groups(state)


def _fsdp2_unsharded_grad(fsdp_param: Any) -> torch.Tensor | None:
    if not hasattr(fsdp_param, "_unsharded_param"):
        return None
    accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
    if accumulated is not None:
        return accumulated
    return fsdp_param._unsharded_param.grad


# -- process-wide wrappers -------------------------------------------------------------------------

_watches: weakref.WeakSet[ModelWatch] = weakref.WeakSet()
_observers: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
_installed: dict[str, tuple[Any, str, Any]] = {}
# Re-entrant: a registration allocates while holding it, and any allocation may run the garbage
# collector, whose finalizers (an optimizer collected in a reference cycle) unregister on this
# thread; a plain lock deadlocks the process there.
_install_lock = threading.RLock()
# Called before each backward, ahead of the watches (the late adaptation's pending optimizers).
_backward_listeners: list[Callable[[], None]] = []


def _on_backward(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors = args[0] if args else kwargs.get("tensors")
    for listener in list(_backward_listeners):
        listener()  # may adapt an optimizer: its watches, registered now, check this backward too
    watches = list(_watches)
    for watch in watches:
        watch.before_backward(tensors)
    try:
        return wrapped(*args, **kwargs)
    finally:
        for watch in watches:
            watch.after_backward()


def _on_scaler_step(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    optimizer = args[0] if args else kwargs.get("optimizer")
    observer = _observers.get(optimizer) if optimizer is not None else None
    if observer is None:
        return wrapped(*args, **kwargs)
    observer.loss_scaled()
    steps = observer.step_count
    result = wrapped(*args, **kwargs)
    if observer.step_count == steps:
        observer.step_skipped(_scale(instance))
    return result


def _on_clip(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    total_norm = wrapped(*args, **kwargs)
    if isinstance(total_norm, torch.Tensor):
        for watch in list(_watches):
            watch.log.check(semconv.ORIGIN_GRAD_WRITE, CLIP, total_norm)
    return total_norm


def _scale(scaler: Any) -> float:
    try:
        scale = float(scaler.get_scale())
    except Exception:  # pragma: no cover - a scaler of another shape
        return math.nan
    return scale


def _install(key: str, owner: Any, attribute: str, wrapper: Callable[..., Any]) -> None:
    original = getattr(owner, attribute)
    setattr(owner, attribute, wrapt.FunctionWrapper(original, wrapper))
    _installed[key] = (owner, attribute, original)


def _uninstall(key: str) -> None:
    owner, attribute, original = _installed.pop(key)
    current = getattr(owner, attribute)
    if getattr(current, "__wrapped__", None) is original:
        setattr(owner, attribute, original)


_registrations = 0


def _registration(add: Callable[[], None], remove: Callable[[], None]) -> Callable[[], None]:
    """Run ``add`` as one more registration (the wrappers go in with the first); returns the function
    that runs ``remove`` once and takes the registration back (the wrappers go with the last)."""
    global _registrations
    with _install_lock:
        # Counted before anything allocates: a finalizer's unregister run from in here (see
        # _install_lock) then never brings the count to 0 and takes the wrappers away.
        _registrations += 1
        try:
            if _registrations == 1:
                _install("backward", torch.autograd, "backward", _on_backward)
                _install("scaler", torch.amp.GradScaler, "step", _on_scaler_step)
                # Callers reach it through either module at call time (torch.nn.utils re-exports it).
                _install("clip", torch.nn.utils, "clip_grad_norm_", _on_clip)
                _install("clip_module", torch.nn.utils.clip_grad, "clip_grad_norm_", _on_clip)
            add()
        except BaseException:
            remove()  # whatever add() did before it raised (removing is safe where nothing was added)
            _release_one()
            raise
    done = False

    def unregister() -> None:
        nonlocal done
        with _install_lock:
            if done:
                return
            done = True
            remove()
            _release_one()

    return unregister


def _release_one() -> None:
    """One registration taken back (under ``_install_lock``); the wrappers go with the last."""
    global _registrations
    _registrations -= 1
    if _registrations == 0:
        for key in list(_installed):
            _uninstall(key)


def watch_optimizer_steps(
    watches: Sequence[ModelWatch], optimizer: torch.optim.Optimizer, observer: Any
) -> Callable[[], None]:
    """Register ``watches`` (their backward passes) and ``observer`` (its optimizer's skipped
    steps) with the process-wide wrappers, installing them for the first registration.

    Returns:
        A function that unregisters both (once) and removes the wrappers after the last
        registration.
    """
    optimizer_ref = weakref.ref(optimizer)

    def add() -> None:
        for watch in watches:
            _watches.add(watch)
        _observers[optimizer] = observer

    def remove() -> None:
        for watch in watches:
            _watches.discard(watch)
        held = optimizer_ref()
        if held is not None and _observers.get(held) is observer:
            del _observers[held]

    return _registration(add, remove)


def listen_before_backward(listener: Callable[[], None]) -> Callable[[], None]:
    """Call ``listener`` before each backward (``torch.autograd.backward``) through the same
    process-wide wrapper as the watches, installed while any registration lives: one wrapper, so
    registrations may come and go in any order and the original comes back exactly.

    Returns:
        A function that unregisters it (once; safe from inside the listener).
    """
    return _registration(lambda: _backward_listeners.append(listener), lambda: _backward_listeners.remove(listener))
