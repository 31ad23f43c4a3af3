"""FSDP2's communication settings under ``fully_shard``: every setting that changes how grads are
reduced (or that changes nothing here) trains like FSDP2, custom all-gather and reduce-scatter
implementations are used, and a post-optimizer event is waited for once by the next forward.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest

from tests.fsdp.fsdp2_api import STEPS, Api, CountingAllGather, CountingReduceScatter, both, compare, net, train
from tests.fsdp.pattern_models import Net

# -- scripts (run on the ranks) -------------------------------------------------------------------


def _divide_by_4(unit: Any, impl: str, calls: list) -> None:
    unit.set_gradient_divide_factor(4.0)
    if impl == "fsdp2":
        # FSDP2 divides by a factor with a premultiplied sum, which gloo lacks, unless told to sum
        # and divide apart; the arithmetic is the same.
        unit.set_force_sum_reduction_for_comms(True)


def _divide_by_4_deprecated(unit: Any, impl: str, calls: list) -> None:
    unit.set_reduce_scatter_divide_factor(4.0)
    if impl == "fsdp2":
        unit.set_force_sum_reduction_for_comms(True)


def _force_sum(unit: Any, impl: str, calls: list) -> None:
    unit.set_force_sum_reduction_for_comms(True)


def _divide_by_half_force_sum(unit: Any, impl: str, calls: list) -> None:
    unit.set_gradient_divide_factor(0.5)
    unit.set_force_sum_reduction_for_comms(True)


def _divide_by_4_on_the_root(unit: Any, impl: str, calls: list) -> None:
    # Not recursive, in FSDP2 as here: set on the root, the blocks' grads stay the mean.
    if isinstance(unit, Net):
        _divide_by_4(unit, impl, calls)


def _halving_all_reduce_hook(unit: Any, impl: str, calls: list) -> None:
    unit.set_all_reduce_hook(lambda output: (calls.append(tuple(output.shape)), output.mul_(0.5)))


def _not_last_backward(unit: Any, impl: str, calls: list) -> None:
    unit.set_is_last_backward(False)


def _no_all_reduce(unit: Any, impl: str, calls: list) -> None:
    unit.set_requires_all_reduce(False)


def _where_fsdp2_has_it(unit: Any, impl: str, method: str, *args: Any, **kwargs: Any) -> None:
    """Calls a setting that leaves the arithmetic as it is; an FSDP2 control of a torch without
    it (before 2.13) trains without it, which must come out the same."""
    if impl == "ours" or hasattr(unit, method):
        getattr(unit, method)(*args, **kwargs)


def _separate_reduce_scatter_group(unit: Any, impl: str, calls: list) -> None:
    _where_fsdp2_has_it(unit, impl, "set_separate_reduce_scatter_group", True, recurse=False)


def _reduce_unused(unit: Any, impl: str, calls: list) -> None:
    _where_fsdp2_has_it(unit, impl, "set_reduce_scatter_unused_params", True, recurse=False)


def _one_reduce_buffer(unit: Any, impl: str, calls: list) -> None:
    _where_fsdp2_has_it(unit, impl, "set_reduce_scatter_max_input_buffers", 1, recurse=False)


def _default_allocation(unit: Any, impl: str, calls: list) -> None:
    unit.set_allocate_memory_from_process_group_for_comm(False)


SETTINGS: dict[str, Callable[[Any, str, list], None]] = {
    "divide_factor": _divide_by_4,
    "divide_factor_deprecated": _divide_by_4_deprecated,
    "force_sum": _force_sum,
    "divide_factor_force_sum": _divide_by_half_force_sum,
    "divide_factor_on_the_root": _divide_by_4_on_the_root,
    "all_reduce_hook": _halving_all_reduce_hook,
    "is_last_backward": _not_last_backward,
    "requires_all_reduce": _no_all_reduce,
    "separate_reduce_scatter_group": _separate_reduce_scatter_group,
    "reduce_scatter_unused_params": _reduce_unused,
    "reduce_scatter_max_input_buffers": _one_reduce_buffer,
    "allocation_from_process_group_off": _default_allocation,
}


def settings_script(impl: str, method: str) -> dict[str, Any]:
    """One of FSDP2's settings that change how grads are reduced (or nothing), set on every unit."""
    api = Api.of(impl)
    model = api.shard(net())
    calls: list[tuple[int, ...]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for unit in (model, *model.blocks):
            SETTINGS[method](unit, impl, calls)
    result = train(api, model)
    result["facts"] = {
        "hook_calls": len(calls),
        "warnings": sorted({type(w.message).__name__ for w in caught if "divide_factor" in str(w.message)}),
    }
    return result


def custom_comms_script(impl: str) -> dict[str, Any]:
    api = Api.of(impl)
    model = api.shard(net())
    gather, reduce = CountingAllGather(), CountingReduceScatter()
    for unit in (model, *model.blocks):
        unit.set_custom_all_gather(gather)
        unit.set_custom_reduce_scatter(reduce)
    result = train(api, model)
    result["facts"] = {"all_gathers": gather.calls > 0, "reduce_scatters": reduce.calls > 0}
    return result


class RecordingEvent:
    """Stands in for the ``torch.Event`` a GPU script records after its step (the CPU has none)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait(self, stream: Any = None) -> None:
        self.log.append("waited")


def post_optim_event_script(impl: str) -> dict[str, Any]:
    """``set_post_optim_event`` after each step: the next forward waits for it, once."""
    api = Api.of(impl)
    model = api.shard(net())
    log: list[str] = []

    def before(model: Net, step: int, micro: int) -> None:
        log.append(f"forward {step}")

    def after(model: Net, step: int, micro: int) -> None:
        model.set_post_optim_event(RecordingEvent(log))

    result = train(api, model, before_forward=before, after_backward=after)
    result["facts"] = {"log": log}
    return result


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", sorted(SETTINGS))
def test_reduction_settings_train_like_fsdp2(run_once, method) -> None:
    ours, fsdp2 = both(run_once, settings_script, method)
    compare(ours, fsdp2)
    if method == "all_reduce_hook":
        assert ours[0]["facts"]["hook_calls"] == 3 * STEPS, ours[0]["facts"]
    if method == "divide_factor_deprecated":
        assert ours[0]["facts"]["warnings"] == ["DeprecationWarning"], ours[0]["facts"]


def test_custom_all_gather_and_reduce_scatter_are_used(run_once) -> None:
    ours, fsdp2 = both(run_once, custom_comms_script)
    compare(ours, fsdp2)
    assert ours[0]["facts"] == {"all_gathers": True, "reduce_scatters": True}, ours[0]["facts"]


def test_post_optim_event_is_waited_for_once_by_the_next_forward(run_once) -> None:
    ours, _ = both(run_once, post_optim_event_script)
    want = ["forward 0", "forward 1", "waited", "forward 2", "waited"]
    assert ours[0]["facts"]["log"] == want, f"want each event waited by the next forward: {ours[0]['facts']}"
