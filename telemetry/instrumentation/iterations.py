"""The iterations of one adapted optimizer: their checks read, where a NaN/Inf began reported,
escalation decided, and backward passes counted against steps.

:class:`~.observer.OptimizerObserver` owns one :class:`IterationWatch`. An iteration ends at the
optimizer's step (or where a GradScaler skipped it); its checks (:mod:`.model_watch`) are read at
the next one, and what they say goes on that step's span:

- event ``fsdp.precision.origin`` for the first iteration of a run of iterations holding a NaN/Inf
  (on the ranks that saw one), and again for what an escalated iteration's module-level checks
  refine;
- event ``fsdp.precision.escalation`` when any rank saw one: the next
  ``FSDP_PATCH_PRECISION_ESCALATION`` iterations check every module and run the precision
  diagnostics every step, the same on every rank (the flag was all-reduced);
- event ``fsdp.precision.grads_zeroed`` for an iteration whose grads were non-zero after the
  reduce and all 0 at the step.

The origin event's attributes are made in :mod:`.origin_events`, the tensors each step checks
kept in :mod:`.step_tensors`. Each step's span also gets event ``fsdp.optimizer.lr_jump`` where a
param group's learning rate rose ``LR_JUMP_FACTOR``-fold since the previous step
(:mod:`.learning_rates`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

from fsdp_patch.module.model_units import sharded_models, user_name
from fsdp_patch.sharding import parameter_group_of
from fsdp_patch.torch_interop.fsdp2 import fsdp2_groups

from .. import env, semconv
from ..diagnostics.groups import (
    first_process_group,
    mesh_coordinate,
    present_grads,
    replaced_grads,
    weights_of,
    widest_mesh,
)
from ..diagnostics.headroom import HeadroomTrend
from ..diagnostics.model_audit import (
    ModelFinding,
    low_precision_accumulation,
    low_precision_buffers,
    moments_inconsistent,
    rebuilt_from_compute,
    state_through_low_precision,
)
from ..diagnostics.optimizer_state import resumed_at, state_tensors
from ..diagnostics.rows import param_table
from .float8_watch import Float8Watch
from .learning_rates import LearningRateJumps
from .model_watch import IterationCheck, ModelWatch
from .module_shadows import ModuleShadows
from .op_audits import OperationAudits
from .origin_events import origin_attributes
from .step_tensors import StepTensors, group_name, tensors_key
from .training_calls import watch_optimizer_steps


class IterationWatch:
    """The checks of one optimizer's iterations (see the module).

    Args:
        optimizer: The adapted optimizer (held weakly).
        observer: Its observer: opens the spans, counts the steps, is told of skipped steps.
        sdk_disabled: ``OTEL_SDK_DISABLED``: no checks at all.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, observer: Any, *, sdk_disabled: bool) -> None:
        self._optimizer_ref = weakref.ref(optimizer)
        # The checks and escalation belong to the precision diagnostics: off with them.
        every = 0 if sdk_disabled else env.precision_every()
        self.checking = bool(every) and env.precision_origin()
        self.escalation = env.precision_escalation() if self.checking else 0
        self._groups_key: tuple[int, ...] | None = None
        self._groups: list[Any] = []
        self._table: list[Any] = []
        self._names: list[str] = []
        self._named = False
        self.escalated_until = 0
        self._step = 0
        self._closed_step = 0
        self._in_episode = False
        self._refined_named: set[tuple[str, str]] = set()
        self._observer = observer
        self._buffers_audited = False
        self._audited_state: Any = None
        self._lr_jumps = LearningRateJumps()
        self._tensors: StepTensors | None = None
        self._step_tensors: StepTensors | None = None  # the running step's, from begin_step to end_step
        self.watches: list[ModelWatch] = []
        self.audits = OperationAudits.from_environment(optimizer, bool(every))
        self.shadows = ModuleShadows.from_environment(optimizer, bool(every))
        self.float8 = Float8Watch(optimizer, bool(every))
        self._headroom = HeadroomTrend()
        if sdk_disabled:
            self._unregister = None
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        groups = self._optimizer_groups()
        process_group = _agreement_group(groups) if self.checking else None
        if self.checking:
            self.watches = [ModelWatch(model, process_group) for model in sharded_models(params)]
            for watch in self.watches:
                watch.backward_listeners.append(observer.ensure_ready)
        self._unregister = watch_optimizer_steps(self.watches, optimizer, observer)
        watches = list(self.watches)
        unregister = self._unregister
        weakref.finalize(optimizer, _release, watches, unregister, self.audits, self.shadows, self.float8)
        self.float8.start()  # the first iteration is diagnosed on every schedule

    @property
    def escalated(self) -> bool:
        """Whether the running step is one of an escalation's (diagnostics run every step)."""
        return 0 < self._step <= self.escalated_until

    # -- the groups the optimizer steps -----------------------------------------------------

    def mesh_coordinate(self) -> str | None:
        """This rank's place on the mesh of the optimizer's sharded parameters, where it has 2
        or more dimensions (:func:`~..diagnostics.groups.mesh_coordinate`)."""
        return mesh_coordinate(self._optimizer_groups())

    def _optimizer_groups(self) -> list[Any]:
        optimizer = self._optimizer_ref()
        if optimizer is None:
            return []
        params = [p for g in optimizer.param_groups for p in g["params"]]
        key = tuple(map(id, params))
        if key != self._groups_key:
            flat: dict[int, Any] = {}
            for p in params:
                group = parameter_group_of(p)
                if group is not None:
                    flat.setdefault(id(group), group)
            self._groups = [*flat.values(), *fsdp2_groups(params)]
            self._groups_key = key
            self._named = False
            self._tensors = None
        if not self._named and self._step:
            # torch FSDP2 names its parameters and units at its lazy initialization, in the first
            # forward: read the names at the first step.
            self._named = True
            self._table = [slot for slot in param_table(self._groups) if slot.length]
            self._names = [group_name(group) for group in self._groups]
            self._tensors = None
        return self._groups

    def _step_tensors_now(self) -> StepTensors:
        """The step's tensors as the groups hold them now: their buffers may have been re-made
        since the last step."""
        groups = self._optimizer_groups()
        key = tensors_key(groups)
        if self._tensors is None or self._tensors.key != key:
            self._tensors = StepTensors(key, groups, self._names, self._table)
        return self._tensors

    # -- the step -------------------------------------------------------------------------------

    def begin_step(self, step: int, span: Span | None, rank: int) -> None:
        """At the start of step ``step``: the previous iteration read and reported on ``span``; then
        this step's main grads and main weights checked before the update."""
        self._step = step
        self.audits.optimizer_step(True)
        results = [w.resolve() for w in self.watches]
        self._report(results, span, rank)
        if self._observer.precision_due(self._closed_step):
            self._forecast_headroom(results, span, rank)
        optimizer = self._optimizer_ref()
        if optimizer is not None and span is not None:
            self._lr_jumps.watch(optimizer.param_groups, step, span, rank)
        if not self.watches:
            return
        tensors = self._step_tensors = self._step_tensors_now()
        self._audit_model(step, span, tensors)
        pairs = list(zip(self._names, self._groups, strict=True))
        grads = [(name, grad) for name, group in pairs for grad in present_grads(group)]

        def replaced() -> list[tuple[str, torch.Tensor]]:
            return [(name, grad) for name, group in pairs for grad in replaced_grads(group)]

        for watch in self.watches:
            watch.check_step_begin(grads, tensors.before, replaced)

    def end_step(
        self, span: Span | None, completed: bool, note: Callable[[str, AttributeValue], None] | None = None
    ) -> None:
        """At the end of the step: the main weights after the update; the iteration closed; its
        operation audit read, and the next iteration's begun where it is due. ``note`` sets an
        attribute of the step span (as the step ends), else ``span.set_attribute``."""
        self.audits.optimizer_step(False)
        self._next_audit(span)
        if not self.watches:
            return
        tensors, self._step_tensors = self._step_tensors, None
        if completed and tensors is not None:
            # The tensors begin_step found: the update writes into them and re-makes none.
            for watch in self.watches:
                watch.check_step_end(tensors.after)
            tensors.record_versions()
            microbatches = max(w.backward_count for w in self.watches)
            for finding in low_precision_accumulation(tensors.accumulation, microbatches):
                self._name(finding, self._step, span)
        # A step that raised (a settings error on every rank, a rejected dtype) closes the
        # iteration on this rank alone: its peers may not have reached this point.
        self._close(span, self._step, agree=completed, note=note)

    def skipped(self, step: int, span: Span | None, rank: int) -> None:
        """A GradScaler skipped the iteration that step ``step`` would have ended."""
        self._step = step
        self._report([w.resolve() for w in self.watches], span, rank)
        self._next_audit(span)
        self._close(span, step)

    def _next_audit(self, span: Span | None) -> None:
        """The ending iteration's operation audit read onto ``span``; the next one's begun if due."""
        self.audits.finish(self._step, span, self._observer.rank)
        self.shadows.finish(self._step, span, self._observer.rank)
        self.float8.finish(self._step, span, self._observer.rank)
        following = self._step + 1
        if self.audits.due(following, escalated=following <= self.escalated_until):
            self.audits.start()
        if self.shadows.due(following):
            self.shadows.start()
        if self._observer.precision_due(following) or following <= self.escalated_until:
            self.float8.start()

    def _close(
        self,
        span: Span | None,
        step: int,
        agree: bool = True,
        note: Callable[[str, AttributeValue], None] | None = None,
    ) -> None:
        """Close the watches' iteration; its backward count onto ``span`` (through ``note``, where
        given: the step's attributes are set on its span at once)."""
        if span is not None:
            (note or span.set_attribute)(semconv.ATTR_BACKWARD_COUNT, sum(w.backward_count for w in self.watches))
        for watch in self.watches:
            watch.close_iteration(agree)
        self._closed_step = step

    def backward_since_step(self) -> int:
        """Backward passes since the last step or skipped step (at exit: ones no step followed)."""
        return sum(w.backward_count for w in self.watches)

    def pending(self) -> bool:
        """Whether an iteration's checks wait to be read (the float8 casts' too, or their hooks to go)."""
        return any(w.pending for w in self.watches) or self.float8.pending

    def flush(self, rank: int, span: Span | None = None) -> None:
        """Read the last iteration's checks (at a flush or exit) and report them on ``span``."""
        self._report([w.resolve() for w in self.watches], span, rank)
        self.float8.flush(span, rank)

    def close(self) -> None:
        """Remove every model check and registration (telemetry turned off for the optimizer)."""
        _release(self.watches, self._unregister, self.audits, self.shadows, self.float8)
        self.watches = []

    # -- the model audit ---------------------------------------------------------------------------

    def _name(self, finding: ModelFinding, step: int, span: Span | None) -> None:
        self._observer.name_violation(
            ("model", finding.tensor, finding.where),
            finding.where,
            "",
            finding.tensor,
            finding.expected,
            finding.actual,
            step,
            span,
            detail=finding.detail,
        )

    def _audit_model(self, step: int, span: Span | None, tensors: StepTensors) -> None:
        """Buffers at the first step; the loss and the normalization statistics once checked;
        main weights rebuilt from their compute copy at the first step and after each load of the
        optimizer's state (``load_state_dict`` replaces ``optimizer.state``)."""
        findings: list[ModelFinding] = []
        for watch in self.watches:
            if not self._buffers_audited and watch.root is not None:
                findings.extend(low_precision_buffers(watch.root, watch.prefix))
            if watch.loss_finding is not None:
                findings.append(watch.loss_finding)
            if watch.norms.done:
                findings.extend(watch.norms.findings)
                watch.norms.remove()  # its inert hooks, outside any forward
        self._buffers_audited = True
        optimizer = self._optimizer_ref()
        rebuilt = None
        if optimizer is not None and optimizer.state is not self._audited_state:
            self._audited_state = optimizer.state
            resumed = resumed_at(optimizer)
            if resumed:
                loaded_at = self._observer.state_loaded_at
                since = f"a resume from step {resumed}" + (f" (load_state_dict at {loaded_at})" if loaded_at else "")
                rebuilt = rebuilt_from_compute(self._lossy_params(), since)
                names = {
                    id(param): user_name(watch.prefix, name)
                    for watch in self.watches
                    if watch.root is not None
                    for name, param in watch.root.named_parameters()
                }
                held = state_tensors(optimizer, names)
                state = state_through_low_precision(held, since) or moments_inconsistent(held, since)
                if state is not None:
                    findings.append(state)
        written = tensors.written()
        if rebuilt is None and written:
            rebuilt = rebuilt_from_compute(self._lossy_params(written), f"a write between steps {step - 1} and {step}")
        if rebuilt is not None:
            findings.append(rebuilt)
        for finding in findings:
            self._name(finding, step, span)

    def _lossy_params(self, groups_of: Sequence[int] | None = None) -> list[tuple[str, torch.Tensor, torch.dtype]]:
        groups = self._groups
        out = []
        for slot in param_table(groups):
            if groups_of is not None and slot.group not in groups_of:
                continue
            if slot.lossy and slot.length and slot.compute_dtype is not None:
                main = weights_of(groups[slot.group], None).mains[slot.tensor]
                out.append((slot.name, main[slot.start : slot.start + slot.length], slot.compute_dtype))
        return out

    # -- what an iteration found ----------------------------------------------------------------

    def _report(self, results: Sequence[IterationCheck | None], span: Span | None, rank: int) -> None:
        found = [r for r in results if r is not None]
        if not found:
            return
        step = self._closed_step
        anywhere = any(r.anywhere for r in found)
        if anywhere and not self._in_episode:
            for r in found:
                if r.origin is not None and span is not None:
                    attributes = origin_attributes(r.origin, step, rank, False, self._optimizer_groups, r.checks)
                    span.add_event(semconv.EVENT_ORIGIN, attributes)
            if self.escalation and self._step > self.escalated_until:
                self.escalated_until = self._step + self.escalation - 1
                self._refined_named.clear()
                for watch in self.watches:
                    watch.escalate()
                if span is not None:
                    span.add_event(
                        semconv.EVENT_ESCALATION,
                        {
                            semconv.ATTR_STEP: step,
                            semconv.ATTR_RANK: rank,
                            semconv.ATTR_ESCALATION_STEPS: self.escalation,
                        },
                    )
        self._in_episode = anywhere
        zeroed = sorted({where for r in found for where in r.zeroed})
        if zeroed and span is not None:
            span.add_event(
                semconv.EVENT_GRADS_ZEROED,
                {
                    semconv.ATTR_STEP: step,
                    semconv.ATTR_RANK: rank,
                    semconv.ATTR_GRADS_ZEROED_UNITS: ", ".join(where or "(root)" for where in zeroed),
                },
            )
        for r in found:
            # Module-level checks of an iteration whose NaN/Inf began in it (a GradScaler skipping
            # overflows anew); once the weights hold NaN every module's output follows from them.
            if r.origin is None:
                continue
            for origin in r.refined:
                key = (origin.stage, origin.where)
                if key in self._refined_named or span is None:
                    continue
                self._refined_named.add(key)
                span.add_event(
                    semconv.EVENT_ORIGIN, origin_attributes(origin, step, rank, True, self._optimizer_groups)
                )
        if self._step > self.escalated_until:
            for watch in self.watches:
                watch.de_escalate()

    def _forecast_headroom(self, results: Sequence[IterationCheck | None], span: Span | None, rank: int) -> None:
        """A diagnosed iteration's unit outputs into the headroom trend; event
        ``fsdp.precision.headroom_forecast`` for each unit newly forecast to reach its dtype's largest
        value (:mod:`..diagnostics.headroom`)."""
        for result in results:
            if result is not None:
                self._headroom.feed(self._closed_step, result.checks)
        if span is None:
            return
        for forecast in self._headroom.forecasts():
            attributes: dict[str, AttributeValue] = {
                semconv.ATTR_STEP: forecast.step,
                semconv.ATTR_RANK: rank,
                semconv.ATTR_UNIT: forecast.unit,
                semconv.ATTR_HEADROOM_DTYPE: forecast.dtype,
                semconv.ATTR_HEADROOM_AMAX: forecast.amax,
                semconv.ATTR_HEADROOM_LIMIT: forecast.limit,
                semconv.ATTR_HEADROOM_STEPS_LEFT: forecast.steps_left,
                semconv.ATTR_HEADROOM_FROM_STEP: forecast.first_step,
                semconv.ATTR_HEADROOM_FROM_AMAX: forecast.first_amax,
            }
            span.add_event(semconv.EVENT_HEADROOM_FORECAST, attributes)


def _release(
    watches: Sequence[ModelWatch],
    unregister: Any,
    audits: OperationAudits,
    shadows: ModuleShadows,
    float8: Float8Watch,
) -> None:
    audits.close()
    shadows.close()
    float8.close()
    for watch in watches:
        watch.remove()
    if unregister is not None:
        unregister()


def _agreement_group(groups: Sequence[Any]) -> Any:
    """Where the ranks agree on each iteration's flag (and so on escalating): every rank whose
    diagnostics run a collective with this one's. On a 1-D mesh the ranks that shard the groups;
    on HSDP and tensor parallel x FSDP every rank of the mesh, since the diagnostics also gather
    over the replicas and the TP ranks, and a rank escalating alone would leave those collectives
    unmatched. A mesh of the whole world agrees over the default group; a smaller one (other
    ranks train something else) over a group of its own ranks, made by them alone."""
    mesh = widest_mesh(groups)
    if mesh is None or mesh.ndim < 2 or not (dist.is_available() and dist.is_initialized()):
        return first_process_group(groups)
    ranks = sorted(int(rank) for rank in mesh.mesh.flatten().tolist())
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    return dist.new_group(ranks, use_local_synchronization=True)
