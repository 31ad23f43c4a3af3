"""The operation audit: every ATen operation of an iteration that computes in a low-precision dtype,
measured against float32 on the same inputs.

An audited iteration (forward, loss, backward, the optimizer's step, and whatever the script does
between steps) runs under :class:`OpAudit`, a ``TorchDispatchMode``. Each operation whose inputs,
outputs or destination are float16 or bfloat16 (and that is not fsdp_patch's or torch.distributed's
own, :mod:`.op_sites`) runs as it would, then on float32 values twice over:

- the **reference**: the same operation on float32 copies of the same inputs, what it makes of
  them with float32's range and resolution: whether the operation itself loses precision;
- the **shadow**: the same operation on the float32 shadows of its inputs, each shadow the result
  of the iteration's computation carried out in float32 from its start (a model's weights and
  batch, a step's grads: every value no audited operation made is its own shadow): whether the
  value is still what float32 would have computed, and where it stopped being so.

A few statistics per operation stay on the device (:data:`~.op_judgement.STATS`), and
:meth:`OpAudit.finish` reads them back with one copy and judges them (:mod:`.op_judgement`):

- **non-finite**: the result holds NaN/Inf where its inputs were finite; whether float32 keeps it
  finite, in this operation or in the shadow (a precision problem) or not (the data or the model);
  and, where the shadow stays finite, the operation upstream where precision was lost (the
  nearest producer whose result lost every correct digit against its shadow while its own inputs
  had not);
- **headroom**: the largest magnitude against the dtype's largest finite value;
- **lost precision**: the result's error against the reference, beyond what rounding the result to
  its dtype alone explains (an accumulation in low precision, cancellation inside the operation);
- **ill-conditioning** (pointwise operations): how far the result moves when an input moves by
  half a unit in the last place of its dtype, the rounding its inputs already went through: a
  function of large arguments (``sin`` of a position in bfloat16), a difference of near-equal
  values;
- **lost updates** (operations that write into their destination, ``add_``, ``mul_``, ``lerp_``,
  ``copy_``): the share of intended changes smaller than half a unit in the last place of the
  destination, which leave it as it was;
- **constants** (Python scalars, fill values) that round to 0, to infinity or to 1 in the dtype;
- **ties** (``topk``, ``max``/``argmax`` along a dimension): the share of rows whose selected value
  equals the next candidate, so that the selection follows index order, not the values.

Every finding names the operation, its dtype, the measured values, the module, the phase, and the
source line with its caller. Training is untouched: the operation runs on its own inputs exactly as
without the audit; references and shadows run on copies and draw no random numbers (a random
operation is not re-run: its shadow is its result). Shadows are carried through the forward, the
loss and whatever runs between steps (not the backward, whose saved tensors autograd unpacks
anew), and cost float32 copies of the iteration's live activations.

Alternatives considered:
    - Judging by where an operation sits (a rule per norm, loss, optimizer state): a bug in a place
      no rule names stays invisible; the reference judges every operation by what it computes.
    - Reading each operation's statistics as it runs: a device synchronization per operation; the
      statistics stay on the device until the iteration ends.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from . import op_stats
from .measured_ops import is_selection, measured
from .op_judgement import STATS, OpFinding, OpRecord, judge
from .op_sites import SITE_KEY, ModuleStack, Site, site_here
from .op_stats import LOW_PRECISION, floats, local

__all__ = ["OpAudit"]


class OpAudit(TorchDispatchMode):
    """Measures every low-precision operation of one iteration (see the module).

    Args:
        names: Qualified names of the watched models' modules, by identity.
        max_ops: Operations measured at most: the rest of the iteration passes through unmeasured.

    Attributes:
        in_optimizer: Set by the owner while the optimizer steps.
        stepped: Set by the owner once it has: what follows runs between steps.
        failed: Operations whose reference could not run, with the error (never raised).
    """

    def __init__(self, names: dict[int, str], max_ops: int = 20000) -> None:
        super().__init__()
        self.modules = ModuleStack(names)
        self.records: list[OpRecord] = []
        self._stats: list[torch.Tensor] = []
        self._pending: list[tuple[Any, Site]] = []
        self._shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._made_by: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> index of its record
        self.max_ops = max_ops
        self.exhausted = False  # measured max_ops operations
        self.failed: dict[str, str] = {}
        self.in_optimizer = False
        self.stepped = False
        self._started = False
        self._backward_seen = False
        self._passing = False  # stopped, or measured max_ops operations: every operation passes through

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Push the mode and the module hooks: from here on, every operation is measured."""
        self.modules.install()
        _push_mode(self)
        self._started = True

    def stop(self) -> None:
        """Remove the mode from this thread's mode stack (wherever it is in it: modes pushed after
        it stay, in their order) and the module hooks, exactly; drop the shadows. From here on the
        mode passes every operation through, also on a thread whose stack it is still on."""
        if not self._started:
            return
        self._started = False
        self._passing = True
        self.modules.remove()
        self._shadows = WeakIdKeyDictionary()
        self._made_by = WeakIdKeyDictionary()
        if any(mode is self for mode in _get_current_dispatch_mode_stack()):
            above = []
            while (mode := _pop_mode()) is not self:
                above.append(mode)
            for mode in reversed(above):
                _push_mode(mode)

    def finish(self, top_k: int) -> list[OpFinding]:
        """Stop, read the statistics back (one copy) and judge them: at most ``top_k`` findings
        per kind, the earliest first."""
        self.stop()
        self._tie_pending()
        if not self._stats:
            return []
        device = self._stats[0].device
        values = torch.stack([s.to(device) for s in self._stats]).cpu().tolist()
        return judge(self.records, values, top_k)

    @property
    def phase(self) -> str:
        if torch._C._current_autograd_node() is not None:
            return "backward"
        if self.in_optimizer:
            return "optimizer"
        if self.modules.in_model:
            return "forward"
        if self.stepped or not self.modules.roots_ended:
            return "between_steps"
        return "after_backward" if self._backward_seen else "loss"

    # -- the dispatch ------------------------------------------------------------------------

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._passing:
            return func(*args, **kwargs)
        if self._pending:
            self._tie_pending()
        if func.namespace != "aten" or "out" in kwargs:
            return self._unmeasured(func, args, kwargs)
        flat = tree_flatten((args, kwargs))[0]
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        low_dtype = kwargs.get("dtype") if kwargs.get("dtype") in LOW_PRECISION else None
        shadowed = any(t in self._shadows for t in tensors)
        if low_dtype is None and not shadowed and not any(t.dtype in LOW_PRECISION for t in tensors):
            out = func(*args, **kwargs)
            if any(isinstance(v, float) and op_stats.may_vanish(v) for v in flat):
                self._wide_constants(func, args, kwargs, tensors)
            return out
        node = torch._C._current_autograd_node()
        site: Site | None
        if node is not None:
            site = node.metadata.get(SITE_KEY)  # type: ignore[attr-defined]
        else:
            site = site_here(1)
            if site is not None:
                module, module_type = self.modules.current
                site = dataclasses.replace(site, module=module, module_type=module_type)
        if site is None:  # fsdp_patch's or torch.distributed's own, or a backward of one
            return self._unmeasured(func, args, kwargs)
        if node is not None:
            self._backward_seen = True
        name = func.__name__.split(".")[0]
        random = torch.Tag.nondeterministic_seeded in func.tags
        is_measured = measured(func, name)
        if len(self.records) >= self.max_ops:
            # An iteration this long (an evaluation loop between two steps, a step that never
            # comes): the rest of it passes through, shadows and all.
            self._passing = self.exhausted = True
            return func(*args, **kwargs)
        shadowing = node is None
        mutated = op_stats.mutated_arguments(func, args, kwargs)
        before = {id(t): local(t).clone() for t in mutated} if mutated and (is_measured or shadowing) else {}
        # A written tensor's shadow is written as the tensor is, in place: its views' shadows see it.
        written_shadows = {id(t): self._shadows[t] for t in mutated if t in self._shadows} if shadowing else {}
        out = func(*args, **kwargs)
        if node is None:
            self._remember(out, site)
        results = [local(t) for t in mutated] if mutated else floats(out)
        owners = mutated if mutated else [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        owners = [t for t in owners if t.is_floating_point()]
        try:
            shadows = (
                self._shadow(func, args, kwargs, out, owners, before, written_shadows, random) if shadowing else []
            )
            if is_measured:
                self._measure(func, name, args, kwargs, results, mutated, before, shadows, tensors, low_dtype, site)
            else:
                self._pass_on(tensors, owners)
        except Exception as exc:  # an operation the references cannot run: counted, never raised
            self.failed.setdefault(str(func), f"{type(exc).__name__}: {exc}"[:200])
        return out

    def _wide_constants(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor]
    ) -> None:
        """A float32 (or float64) operation given a Python constant its dtype holds as 0, infinity or
        1: nothing to recompute, only the constant to name (AdamW's ``param.mul_(1 - lr * weight_decay)``
        decays nothing once ``lr * weight_decay`` is below 2^-25)."""
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), None)
        if dtype is None or torch._C._current_autograd_node() is not None or len(self.records) >= self.max_ops:
            return
        inplace = bool(op_stats.mutated_arguments(func, args, kwargs))
        # A factor float32 holds as 1 loses what it stands for only where it is applied again and
        # again to what it writes (a decay); once (Adam's bias correction late in a run) it costs
        # what rounding the result does.
        found = tuple(c for c in op_stats.constants(func, args, kwargs, dtype) if inplace or c[2] != 1.0)
        site = site_here(2) if found else None
        if site is None:  # no such constant, or fsdp_patch's or torch.distributed's own
            return
        module, module_type = self.modules.current
        self.records.append(
            OpRecord(
                op=f"aten.{func.__name__.split('.')[0]}",
                dtype=dtype,
                elements=0,
                constants=found,
                inplace=inplace,
                site=dataclasses.replace(site, module=module, module_type=module_type),
                phase=self.phase,
            )
        )
        self._stats.append(torch.zeros(len(STATS), dtype=torch.float64))

    def _unmeasured(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Runs an operation unmeasured; what it writes (a collective, an internal copy) leaves
        its float32 shadow behind, so the shadow is dropped: from here on its value counts as exact."""
        out = func(*args, **kwargs)
        if len(self._shadows):
            if func.namespace == "aten":
                written = op_stats.mutated_arguments(func, args, kwargs)
            else:  # collectives' schemas do not always mark what they write (c10d.allreduce_)
                written = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            for t in written:
                if t in self._shadows:
                    del self._shadows[t]
        return out

    def _remember(self, out: Any, site: Site) -> None:
        # Autograd sets the outputs' grad_fn once this operation returns: the next one ties it.
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._pending.append((weakref.ref(t), site))

    def _tie_pending(self) -> None:
        pending, self._pending = self._pending, []
        for ref, site in pending:
            t = ref()
            node = t.grad_fn if t is not None else None
            if node is not None and SITE_KEY not in node.metadata:
                node.metadata[SITE_KEY] = site

    def _pass_on(self, inputs: list[torch.Tensor], results: list[torch.Tensor]) -> None:
        """A view or a move hands on the record of what made its input."""
        made = next((self._made_by[t] for t in inputs if t in self._made_by), None)
        if made is not None:
            for t in results:
                self._made_by[t] = made

    # -- shadows -----------------------------------------------------------------------------

    def _shadow(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        owners: list[torch.Tensor],
        before: dict[int, torch.Tensor],
        written_shadows: dict[int, torch.Tensor],
        random: bool,
    ) -> list[torch.Tensor | None]:
        """The float32 shadows of the operation's floating results (or the tensors it wrote), kept
        for the operations that read them; ``None`` where a result has no shadow of its own."""
        if random:
            shadows: list[torch.Tensor | None] = [None] * len(owners)
        else:

            def source(t: torch.Tensor) -> torch.Tensor | None:
                held = written_shadows.get(id(t))
                if held is not None:
                    return held
                held = self._shadows.get(t)
                if held is not None:
                    return held
                old = before.get(id(t))
                if old is not None:  # a copy: the measurement reads ``before`` as it was
                    return old.to(torch.float32) if old.dtype in LOW_PRECISION else old.clone()
                return local(t).to(torch.float32) if t.dtype in LOW_PRECISION else None

            made = op_stats.reference(func, args, kwargs, source, bool(before))
            shadows = list(made) if len(made) == len(owners) else [None] * len(owners)
        for owner, shadow in zip(owners, shadows, strict=True):
            if shadow is not None and shadow.shape == local(owner).shape:
                self._shadows[owner] = shadow
            elif owner in self._shadows:
                del self._shadows[owner]
        return shadows

    # -- measurement -------------------------------------------------------------------------

    def _measure(
        self,
        func: Any,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        results: list[torch.Tensor],
        mutated: list[torch.Tensor],
        before: dict[int, torch.Tensor],
        shadows: list[torch.Tensor | None],
        tensors: list[torch.Tensor],
        low_dtype: torch.dtype | None,
        site: Site,
    ) -> None:
        judged = [index for index, t in enumerate(results) if t.dtype in LOW_PRECISION]
        inputs = [local(t) for t in tensors if t.is_floating_point()]
        lows = [t for t in inputs if t.dtype in LOW_PRECISION]
        dtype = results[judged[0]].dtype if judged else (low_dtype or (lows[0].dtype if lows else None))
        shadowed = [i for i, s in enumerate(shadows) if s is not None and i < len(results)]
        if dtype is None and not shadowed:
            return
        device = (results or inputs)[0].device
        stats = torch.zeros(len(STATS), dtype=torch.float64, device=device)
        op_stats.input_stats(stats, inputs)
        record = OpRecord(
            op=f"aten.{name}",
            dtype=dtype or results[shadowed[0]].dtype,
            elements=sum(results[i].numel() for i in judged),
            constants=op_stats.constants(func, args, kwargs, dtype) if dtype is not None else (),
            inplace=bool(mutated),
            site=site,
            phase="backward" if torch._C._current_autograd_node() is not None else self.phase,
            made_from=tuple(sorted({self._made_by[t] for t in tensors if t in self._made_by})),
            constants_only=name.rstrip("_") in op_stats.FILLS or not inputs,
        )
        if is_selection(func, name) and lows:
            op_stats.tie_stats(stats, name, args, kwargs)
            record = dataclasses.replace(record, selection=True)
        finite: dict[int, torch.Tensor] = {}
        if judged:

            def same_inputs(t: torch.Tensor) -> torch.Tensor | None:
                old = before.get(id(t))
                value = local(t) if old is None else old.clone()
                return value.to(torch.float32) if value.dtype in LOW_PRECISION else (None if old is None else value)

            references = op_stats.reference(func, args, kwargs, same_inputs, bool(mutated))
            if len(references) == len(results):
                integers = not lows  # made from integers or float32 alone: results may be meant whole
                for index in judged:
                    old = before.get(id(mutated[index])) if mutated else None
                    finite[index] = op_stats.result_stats(stats, results[index], references[index], old, integers)
                pointwise = torch.Tag.pointwise in func.tags and len(judged) == 1
                if pointwise:
                    op_stats.sensitivity_stats(
                        stats, func, args, kwargs, same_inputs, references[judged[0]], judged[0], bool(mutated)
                    )
                record = dataclasses.replace(
                    record,
                    pointwise=pointwise,
                    accumulated=op_stats.accumulated(name, lows or inputs, [results[i] for i in judged]),
                )
        for index in shadowed:
            shadow = shadows[index]
            assert shadow is not None
            op_stats.shadow_stats(stats, results[index], shadow, finite.get(index))
        index = len(self.records)
        self.records.append(record)
        self._stats.append(stats)
        for t in mutated or []:
            self._made_by[t] = index
        if not mutated:
            for t in results:
                self._made_by[t] = index
