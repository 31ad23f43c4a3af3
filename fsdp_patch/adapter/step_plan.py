"""What one optimizer step touches, with the part that rarely changes cached between steps.

Two levels:

- :class:`OptimizerShape`: which of the optimizer's parameters belong to which FSDP group
  (with the :class:`~.grad_cast.GroupGradCast` of each group whose grads need a cast), which
  are plain parameters, which belong to torch FSDP2 groups. Building it costs one registry
  lookup and one ``isinstance`` per parameter; it is kept while ``param_groups`` hold the same
  parameters in the same places, which :meth:`OptimizerShape.matches` checks by identity at C
  speed (``add_param_group``, a replaced or edited ``params`` list, ``param_groups.pop()`` all
  show there).
- :class:`StepPlan`: which of those parameters have grads this step. For each group that needs
  a cast, the parameters' ``.grad`` are read in one ``map`` and compared by identity with the
  group's live main-grad views: equal means every grad is the group's own view or absent, the
  common case; otherwise (grads replaced by a user, some grads set to ``None``) the plan looks
  closer at that group. Plain parameters' grads are checked one by one, as before: torch lets a
  plain parameter whose ``grad_dtype`` differs from its dtype take a grad of another dtype.

Alternatives considered:
    - Detecting grad changes without reading ``.grad``: torch has no hook on ``.grad``
      assignment (``p.grad = t``, ``zero_grad``, ``model.zero_grad``), and the main-grad views
      change whenever the buffer is freed and re-allocated; an identity comparison in C costs
      ~0.1 µs per parameter and catches every case.
    - Keying the cache on ``len(param_groups)`` and list identities only: misses an in-place
      edit of a ``params`` list (``params[i] = other``).
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain, repeat

import torch
from torch import nn

from ..sharding import ParameterGroup, parameter_group_of
from ..torch_interop.fsdp2 import FSDP2Group, fsdp2_groups
from .events import Mismatch, MismatchAction, StepPlanned
from .grad_cast import GroupGradCast

__all__ = ["GroupShare", "OptimizerShape", "StepPlan", "plan_step"]

_GRAD = operator.attrgetter("grad")
_GRAD_DTYPE = operator.attrgetter("grad_dtype")
_PARAMS = operator.itemgetter("params")


@dataclass(eq=False)
class GroupShare:
    """The parameters an optimizer holds of one FSDP group.

    Attributes:
        group: The FSDP parameter group.
        indices: Their positions in ``group.params``, sorted, each once.
        params: ``group.params[i]`` for ``i`` in ``indices``.
        cast: The cast of their grads to the main-weight dtype; ``None`` when the grads have
            that dtype already or the optimizer is precision aware.
    """

    group: ParameterGroup
    indices: tuple[int, ...]
    params: list[nn.Parameter]
    cast: GroupGradCast | None

    @property
    def mismatched(self) -> bool:
        return self.group.grads_dtype != self.group.main_dtype


class OptimizerShape:
    """The optimizer's parameters sorted by kind; see the module docstring.

    Args:
        optimizer: The adapted optimizer.
        precision_aware: Whether grads pass through uncast.
        reuse: Casts of an earlier shape, by (group, indices): kept, with their buffers, when
            the optimizer still holds the same parameters of that group.

    Raises:
        TypeError: A param group holds something that is not an ``nn.Parameter``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        precision_aware: bool,
        reuse: dict[tuple[int, tuple[int, ...]], GroupGradCast] | None = None,
    ) -> None:
        by_group: dict[int, tuple[ParameterGroup, set[int]]] = {}
        self.plain: list[tuple[int, int, nn.Parameter]] = []
        lists = [group["params"] for group in optimizer.param_groups]
        for group_index, params in enumerate(lists):
            for param_index, param in enumerate(params):
                if not isinstance(param, nn.Parameter):
                    raise TypeError(
                        f"fully_shard_optimizer expected nn.Parameter values in optimizer param groups; "
                        f"param_groups[{group_index}]['params'][{param_index}] is {type(param).__name__}"
                    )
                fsdp_group = parameter_group_of(param)
                if fsdp_group is None:
                    self.plain.append((group_index, param_index, param))
                else:
                    by_group.setdefault(id(fsdp_group), (fsdp_group, set()))[1].add(fsdp_group.index_of(param))
        self._lists = lists
        self._flat = list(chain.from_iterable(lists))
        self.params_count = len(self._flat)
        reuse = reuse or {}
        self.shares: list[GroupShare] = []
        for fsdp_group, index_set in by_group.values():
            indices = tuple(sorted(index_set))
            cast = None
            if fsdp_group.grads_dtype != fsdp_group.main_dtype and not precision_aware:
                cast = reuse.get((id(fsdp_group), indices)) or GroupGradCast(fsdp_group, indices)
            self.shares.append(GroupShare(fsdp_group, indices, [fsdp_group.params[i] for i in indices], cast))
        self.groups: list[ParameterGroup] = [share.group for share in self.shares]
        self.fsdp2: list[FSDP2Group] = fsdp2_groups(param for _, _, param in self.plain)
        self._plain_params = [param for _, _, param in self.plain]
        self._plain_dtypes = [param.dtype for param in self._plain_params]
        self.casts: list[GroupGradCast] = [share.cast for share in self.shares if share.cast is not None]

    def matches(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer.param_groups`` still hold exactly the parameters this shape sorted."""
        param_groups = optimizer.param_groups
        if len(param_groups) != len(self._lists):
            return False
        flat = list(chain.from_iterable(map(_PARAMS, param_groups)))
        return len(flat) == len(self._flat) and all(map(operator.is_, flat, self._flat))

    def plain_grads_may_differ(self) -> bool:
        """Whether a plain parameter may hold a grad of another dtype than its own.

        Torch refuses such a grad (assigned or accumulated) unless the parameter's
        ``grad_dtype`` differs from its dtype, which one ``map`` over the plain parameters
        tells; only then are their grads read one by one.
        """
        return list(map(_GRAD_DTYPE, self._plain_params)) != self._plain_dtypes

    def casts_by_key(self) -> dict[tuple[int, tuple[int, ...]], GroupGradCast]:
        return {(id(cast.group), cast.indices): cast for cast in self.casts}


@dataclass(eq=False)
class CastTask:
    """One group's cast this step.

    Attributes:
        share: What the optimizer holds of the group.
        originals: Each parameter's current grad (the group's main-grad view, or ``None``);
            ``None`` when some grad is a tensor a user assigned, which the cast first copies
            into the main grads (see :meth:`ParameterGroup.adopt_foreign_grads`).
        all_present: Every parameter has a grad.
    """

    share: GroupShare
    originals: list | None
    all_present: bool


@dataclass(eq=False)
class StepPlan:
    """What one step does: the casts, the groups to refresh, what telemetry is told.

    Attributes:
        shape: The optimizer's shape the plan was made from.
        casts: The casts to do, one per group with grads to cast.
        planned: The event the observer receives.
        rejection: Why the step must not run (a plain parameter's grad dtype), or ``None``.
    """

    shape: OptimizerShape
    casts: list[CastTask] = field(default_factory=list)
    planned: StepPlanned | None = None
    rejection: str | None = None


def plan_step(shape: OptimizerShape, precision_aware: bool) -> StepPlan:
    """Reads this step's grads against ``shape``; changes nothing."""
    plan = StepPlan(shape)
    mismatches: Counter[tuple[torch.dtype, torch.dtype, MismatchAction]] = Counter()
    rejected: list[str] = []
    for group_index, param_index, param in shape.plain if shape.plain_grads_may_differ() else ():
        grad = param.grad
        if grad is not None and grad.dtype != param.dtype:
            if precision_aware:
                mismatches[(param.dtype, grad.dtype, MismatchAction.PASSTHROUGH)] += 1
            else:
                mismatches[(param.dtype, grad.dtype, MismatchAction.REJECTED)] += 1
                rejected.append(
                    f"param_groups[{group_index}]['params'][{param_index}] "
                    f"(shape {tuple(param.shape)}): dtype {param.dtype}, grad dtype {grad.dtype}"
                )
    action = MismatchAction.PASSTHROUGH if precision_aware else MismatchAction.CAST
    for share in shape.shares:
        if not share.mismatched:
            continue
        grads = list(map(_GRAD, share.params))
        # Each grad the group's own main-grad view, or absent: the cast replaces them as they
        # are. Otherwise some grad is a tensor a user assigned (see CastTask.originals).
        own = all(map(operator.is_, grads, share.group.grad_views(share.indices)))
        absent = sum(map(operator.is_, grads, repeat(None)))
        originals: list | None = grads if own else None
        present = len(grads) - absent
        if not present:
            continue
        group = share.group
        mismatches[(group.main_dtype, group.grads_dtype, action)] += present
        if share.cast is not None:
            plan.casts.append(CastTask(share, originals, absent == 0))
    plan.planned = StepPlanned(
        shape.params_count,
        len(shape.groups) + len(shape.fsdp2),
        tuple(Mismatch(param, grad, act, count) for (param, grad, act), count in mismatches.items()),
    )
    if rejected:
        plan.rejection = (
            "fully_shard_optimizer: a parameter not managed by fully_shard has a grad whose dtype differs "
            "from its own, which the optimizer cannot update safely; expected equal dtypes or "
            f"precision_aware=True. Offending: {'; '.join(rejected[:5])}"
            + (f" (and {len(rejected) - 5} more)" if len(rejected) > 5 else "")
        )
    return plan
