"""FSDP2's settings that change how grads are reduced, for the parity tests of the meshes of more
than one dimension (HSDP in ``test_hsdp.py``, TP x FSDP in ``test_tensor_parallel.py``).

Each setting is applied to every unit, the same way on ``fully_shard`` ("ours") and torch FSDP2
("fsdp2"), and says by what factor it scales the grads against the mean over the data-parallel
ranks, so that the unsharded model (the reference) trains on its loss times that factor.
:class:`Seen` records what the custom reduce-scatter and the all-reduce hook were handed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tests.fsdp.fsdp2_api import CountingReduceScatter

# Neither a shard group's size (2) nor the data-parallel world's (4), nor their product: a divisor
# taken from any of those instead of the factor shows in the grads.
DIVIDE_FACTOR = 16.0


class SizeRecordingReduceScatter(CountingReduceScatter):
    """A custom reduce-scatter that also notes the size of each group it reduces over."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: set[int] = set()

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        self.sizes.add(dist.get_world_size(group))
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


@dataclass
class Seen:
    """What the settings' callables saw on this rank: the custom reduce-scatter's calls and
    groups, and per backward (:meth:`backward` opens one) the squared norm of each input the
    all-reduce hook was handed."""

    comm: SizeRecordingReduceScatter = field(default_factory=SizeRecordingReduceScatter)
    hook_inputs: list[list[float]] = field(default_factory=list)

    def backward(self) -> None:
        """Called before each backward: the hook's calls from here on are this backward's."""
        self.hook_inputs.append([])

    def facts(self) -> dict[str, Any]:
        return {
            "reduce_scatters": self.comm.calls,
            "reduce_scatter_group_sizes": sorted(self.comm.sizes),
            "hook_inputs": self.hook_inputs,
        }


def assert_hook_inputs_alike(got: list[list[float]], want: list[list[float]], what: str, per_call: bool) -> None:
    """Per backward, the hook's inputs' squared norms summed (the whole reduced shard) to float
    rounding; with ``per_call``, also call by call in order of size (the call order differs: see
    ``test_hsdp.py``)."""
    assert len(got) == len(want), f"{what}: the hook saw {len(got)} backward passes, FSDP2's {len(want)}"
    for backward, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        pairs = [(sum(mine), sum(theirs))]
        if per_call:
            assert len(mine) == len(theirs), f"{what}, backward {backward}: {len(mine)} hook calls, FSDP2 {len(theirs)}"
            pairs += list(zip(sorted(mine), sorted(theirs), strict=True))
        close = all(abs(a - b) <= 1e-6 * max(b, 1.0) for a, b in pairs)
        assert close, f"{what}, backward {backward}: the hook's inputs' squared norms {mine}, FSDP2's {theirs}"


def _force_sum(unit: Any, impl: str, seen: Seen) -> None:
    unit.set_force_sum_reduction_for_comms(True)


def _custom_reduce_scatter(unit: Any, impl: str, seen: Seen) -> None:
    unit.set_custom_reduce_scatter(seen.comm)


def _divide_factor(unit: Any, impl: str, seen: Seen) -> None:
    unit.set_gradient_divide_factor(DIVIDE_FACTOR)
    if impl == "fsdp2":
        # FSDP2 divides by a factor with a premultiplied sum, which gloo lacks, unless told to sum
        # and divide apart; the arithmetic is the same.
        unit.set_force_sum_reduction_for_comms(True)


def _divide_factor_force_sum(unit: Any, impl: str, seen: Seen) -> None:
    unit.set_gradient_divide_factor(DIVIDE_FACTOR)
    unit.set_force_sum_reduction_for_comms(True)


def _halving_all_reduce_hook(unit: Any, impl: str, seen: Seen) -> None:
    def hook(output: torch.Tensor) -> None:
        seen.hook_inputs[-1].append(float(output.double().square().sum()))
        output.mul_(0.5)

    unit.set_all_reduce_hook(hook)


def _separate_reduce_scatter_group_force_sum(unit: Any, impl: str, seen: Seen) -> None:
    unit.set_force_sum_reduction_for_comms(True)
    # FSDP2 has the method from torch 2.13; without it the control reduces on the mesh's group,
    # which must come out the same.
    if impl == "ours" or hasattr(unit, "set_separate_reduce_scatter_group"):
        unit.set_separate_reduce_scatter_group(True, recurse=False)


@dataclass(frozen=True)
class Reduction:
    """A setting: how it is applied to a unit, and the factor it scales the mean grads by on
    ``data_parallel`` ranks."""

    apply: Callable[[Any, str, Seen], None]
    scale: Callable[[int], float]


REDUCTIONS: dict[str, Reduction] = {
    "force_sum": Reduction(_force_sum, lambda data_parallel: 1.0),
    "custom_reduce_scatter": Reduction(_custom_reduce_scatter, lambda data_parallel: 1.0),
    # The sum over the data-parallel ranks divided by the factor: the mean times ranks / factor.
    "divide_factor": Reduction(_divide_factor, lambda data_parallel: data_parallel / DIVIDE_FACTOR),
    "divide_factor_force_sum": Reduction(_divide_factor_force_sum, lambda data_parallel: data_parallel / DIVIDE_FACTOR),
    "all_reduce_hook": Reduction(_halving_all_reduce_hook, lambda data_parallel: 0.5),
    "separate_reduce_scatter_group_force_sum": Reduction(
        _separate_reduce_scatter_group_force_sum, lambda data_parallel: 1.0
    ),
}


def apply_reduction(units: list[Any], impl: str, setting: str, seen: Seen) -> None:
    """Applies ``setting`` to each unit (FSDP2's divide factor and force-sum are not recursive)."""
    for unit in units:
        REDUCTIONS[setting].apply(unit, impl, seen)
