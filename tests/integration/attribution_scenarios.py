"""What the attribution tests on gloo ranks share (``test_attribution.py``,
``test_attribution_export.py``): the small transformer at a width that shards unevenly, sharded by
``fully_shard`` or torch FSDP2; a reference of each parameter's diagnostics from its full tensors;
the span findings of a run; the scenarios (what each plants in which parameter, and what the
report must say of it); and the training run that plants one and records all of that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from fsdp_patch.telemetry import semconv

from tests import models
from tests.integration.otel_training import environment, in_memory_otel, metric_values

KINDS = ("fully_shard", "fsdp2")
WORLDS = (2, 4)
STEPS = 3  # the default window: a stuck or unstepped weight is named at step 3
NAN_STEP = 2
UNITS = {"", "blocks.0", "blocks.1"}
# Width 25 (one head): every target's rows split unevenly over 2 and 4 ranks under FSDP2's dim-0
# sharding (25 -> 13/12, 7/7/7/4; 75 -> 38/37, 19/19/19/18; 37 -> 19/18, 10/10/10/7), and every
# flat buffer of fully_shard ends in a shorter last shard.
WIDTH = {"dim": 25, "heads": 1}
BF16_UNIT_ROUNDOFF = 2.0**-8


# -- on the ranks --------------------------------------------------------------------------------


def attribution_model(kind: str, mesh: Any = None) -> torch.nn.Module:
    """The model sharded by ``kind`` over ``mesh`` (``None``: every rank)."""
    model = models.make_model(0, **WIDTH)
    if kind == "fully_shard":
        # fp32 main weights, bf16 compute weights and grads
        return models.shard_model(model.bfloat16(), mesh=mesh)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _reference(before: torch.Tensor, after: torch.Tensor, grad: torch.Tensor | None) -> dict[str, float]:
    """The conventions page's diagnostics of one full parameter, from its full tensors: the compute
    weight is the bf16 cast of the main weight (what the refresh, or FSDP2's all-gather, makes)."""
    changed = _bits(after) != _bits(before)
    kept = _bits(after.bfloat16()) == _bits(before.bfloat16())
    lost, moved = int((changed & kept).sum()), int(changed.sum())
    main = after.double()
    norm = float(main.norm())
    return {
        semconv.METRIC_LOST_RATIO: lost / moved if moved else 0.0,
        semconv.METRIC_REFRESH_ERROR: float((after.bfloat16().double() - main).norm()) / norm if norm else 0.0,
        semconv.METRIC_GRAD_AMAX: 0.0 if grad is None else float(grad.abs().max()),
        semconv.DIAGNOSTIC_UPDATE_RESOLUTION: float((main - before.double()).norm()) / (BF16_UNIT_ROUNDOFF * norm),
    }


def span_findings(spans: list[Any]) -> dict[str, Any]:
    """Offender values by step, diagnostic and parameter; first-NaN and dtype-contract events; span attributes."""
    step_of = {s.context.span_id: s.attributes[semconv.ATTR_STEP] for s in spans if s.name == semconv.SPAN_STEP}
    offenders: dict[int, dict[str, dict[str, float]]] = {}
    firsts, contracts, attributes = [], [], {}
    causes: dict[int, dict[str, str]] = {}
    for span in spans:
        if span.name == semconv.SPAN_PRECISION:
            step = step_of[span.parent.span_id]
            attributes[step] = dict(span.attributes)
            for event in span.events:
                a = dict(event.attributes)
                if event.name == semconv.EVENT_OFFENDER:
                    key = a[semconv.ATTR_PARAM]
                    if semconv.ATTR_OPTIMIZER_STATE in a:
                        key = f"{key}:{a[semconv.ATTR_OPTIMIZER_STATE]}"
                    offenders.setdefault(step, {}).setdefault(a[semconv.ATTR_DIAGNOSTIC], {})[key] = a[
                        semconv.ATTR_VALUE
                    ]
                    if semconv.ATTR_CAUSE in a:
                        causes.setdefault(step, {})[key] = a[semconv.ATTR_CAUSE]
                elif event.name == semconv.EVENT_FIRST_NONFINITE:
                    firsts.append(a)
        elif span.name == semconv.SPAN_STEP:
            contracts += [dict(e.attributes) for e in span.events if e.name == semconv.EVENT_DTYPE_CONTRACT]
    return {
        "offenders": offenders,
        "firsts": firsts,
        "contracts": contracts,
        "attributes": attributes,
        "causes": causes,
    }


def close_to(got: float, want: float, rel: float) -> bool:
    return got == want or abs(got - want) <= rel * max(abs(want), 1e-300)


# -- the scenarios: what each plants and what the report must say of it ---------------------------


@dataclass(frozen=True)
class Found:
    """What a scenario's check reads: the run's findings, offenders by step and diagnostic, its target."""

    run: dict[str, Any]
    named: Callable[[int, str], dict[str, float]]
    target: str
    where: str


def _adam(named: dict[str, torch.nn.Parameter], target: str) -> torch.optim.Optimizer:
    return torch.optim.Adam(list(named.values()), lr=1e-2)


def _adam_tiny_lr_for_target(named: dict[str, torch.nn.Parameter], target: str) -> torch.optim.Optimizer:
    rest = [p for n, p in named.items() if n != target]
    return torch.optim.Adam([{"params": rest}, {"params": [named[target]], "lr": 1e-10}], lr=1e-2)


def _adam_without_target(named: dict[str, torch.nn.Parameter], target: str) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for n, p in named.items() if n != target], lr=1e-2)


def _nothing(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: str, step: int) -> None:
    pass


def _nan_grad_on_last_rank(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: str, step: int) -> None:
    if step == NAN_STEP and dist.get_rank() == dist.get_world_size() - 1:
        dict(model.named_parameters())[target].grad.to_local().view(-1)[5] = float("nan")


def _tiny_grads(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: str, step: int) -> None:
    # Grads of ~1e-32: their squares underflow fp32, exp_avg_sq stays 0 where the grad is not.
    dict(model.named_parameters())[target].grad.to_local().mul_(1e-30)


def _bf16_exp_avg_sq(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: str, step: int) -> None:
    if step == 2:
        state = optimizer.state[dict(model.named_parameters())[target]]
        state["exp_avg_sq"] = state["exp_avg_sq"].to(torch.bfloat16)  # AdamW keeps stepping, silently


def _check_nan(found: Found) -> str:
    run, named, target, where = found.run, found.named, found.target, found.where
    world = dist.get_world_size()
    got = [
        (
            f[semconv.ATTR_STEP],
            f[semconv.ATTR_PARAM],
            f[semconv.ATTR_TENSOR],
            tuple(f[semconv.ATTR_RANKS]),
            f[semconv.ATTR_NONFINITE_KIND],
            f[semconv.ATTR_PRECISION_ELEMENTS],
            f[semconv.ATTR_UNIT],
        )
        for f in run["firsts"]
    ]
    want = [(NAN_STEP, target, semconv.TENSOR_MAIN_GRAD, (world - 1,), semconv.NONFINITE_NAN, 1, "blocks.1")]
    assert got == want, f"{where}: first NaN/Inf events: want {want}, got {got}"
    nonfinite = named(NAN_STEP, semconv.METRIC_NONFINITE)
    # the NaN grad element, the main weight Adam wrote from it, and its bf16 compute weight
    assert nonfinite == {target: 3}, f"{where}: non-finite offenders at step {NAN_STEP}: {nonfinite}"
    state = named(NAN_STEP, semconv.DIAGNOSTIC_STATE_NONFINITE)
    want_state = {f"{target}:exp_avg": 1, f"{target}:exp_avg_sq": 1}
    assert state == want_state, f"{where}: state offenders at step {NAN_STEP}: want {want_state}, got {state}"
    assert named(1, semconv.METRIC_NONFINITE) == {}, f"{where}: step 1 blamed {named(1, semconv.METRIC_NONFINITE)}"
    return "done"  # after a NaN the values differ from the finite reference by design


def _check_tiny_lr(found: Found) -> None:
    run, named, target, where = found.run, found.named, found.target, found.where
    for step in range(1, STEPS + 1):
        below = named(step, semconv.DIAGNOSTIC_UPDATE_RESOLUTION)
        assert list(below) == [target], f"{where}: step {step}: updates below bf16's resolution: {below}"
        want = run["references"][step][target][semconv.DIAGNOSTIC_UPDATE_RESOLUTION]
        assert close_to(below[target], want, 1e-5), (
            f"{where}: step {step}: resolution {below[target]}, reference {want}"
        )
        assert below[target] < 1e-4, f"{where}: lr 1e-10 moves {target} by {below[target]} of a bf16 step"
        lost = named(step, semconv.METRIC_LOST_RATIO)
        assert lost.get(target) == 1.0, f"{where}: step {step}: lost ratio of {target}: {lost.get(target)}"
    stuck = named(STEPS, semconv.DIAGNOSTIC_STUCK)
    assert stuck == {target: STEPS}, f"{where}: stuck at step {STEPS}: want {{{target}: {STEPS}}}, got {stuck}"


def _check_left_out(found: Found) -> None:
    run, named, target, where = found.run, found.named, found.target, found.where
    unstepped = named(STEPS, semconv.DIAGNOSTIC_UNSTEPPED)
    assert unstepped == {target: STEPS}, f"{where}: unstepped at step {STEPS}: {unstepped}"
    cause = run["causes"].get(STEPS, {}).get(target)
    assert cause == semconv.UNSTEPPED_NOT_IN_OPTIMIZER, f"{where}: {target} unstepped because {cause!r}"
    for step in range(1, STEPS):
        assert named(step, semconv.DIAGNOSTIC_UNSTEPPED) == {}, f"{where}: named before the window, at step {step}"
    assert run["attributes"][STEPS][semconv.ATTR_UNSTEPPED_PARAMS] == 1


def _check_bf16_state(found: Found) -> None:
    run, target, where = found.run, found.target, found.where
    rank = dist.get_rank()
    got = [
        (
            c[semconv.ATTR_STEP],
            c[semconv.ATTR_RANK],
            c[semconv.ATTR_PARAM],
            c[semconv.ATTR_TENSOR],
            c.get(semconv.ATTR_OPTIMIZER_STATE),
            c[semconv.ATTR_DTYPE_EXPECTED],
            c[semconv.ATTR_DTYPE_ACTUAL],
        )
        for c in run["contracts"]
    ]
    want = [(2, rank, target, semconv.TENSOR_OPTIMIZER_STATE, "exp_avg_sq", "float32", "bfloat16")]
    assert got == want, f"{where}: dtype-contract events: want {want}, got {got}"
    points = run["points"].get(semconv.METRIC_DTYPE_CONTRACT, [])
    assert [v for _, v in points] == [1], f"{where}: dtype-contract counter: {points}"


def _check_underflow(found: Found) -> None:
    named, target, where = found.named, found.target, found.where
    for step in range(1, STEPS + 1):
        flushed = named(step, semconv.DIAGNOSTIC_STATE_FLUSHED)
        key = f"{target}:exp_avg_sq"
        assert list(flushed) == [key] and flushed[key] > 0.9, f"{where}: step {step}: flushed exp_avg_sq {flushed}"


@dataclass(frozen=True)
class Scenario:
    """One planted problem.

    Attributes:
        target: The parameter it is planted in.
        check: Asserts what the report says of it (returns ``"done"`` where the common checks after
            it do not apply).
        optimizer: Builds the optimizer from the named parameters and the target.
        plant: Called after each backward, before the step, under ``no_grad``.
        tiny_updates: Updates below bf16's resolution are expected (of the target only).
        dtype_contract: A dtype-contract event is expected.
    """

    target: str
    check: Callable[[Found], str | None]
    optimizer: Callable[[dict[str, torch.nn.Parameter], str], torch.optim.Optimizer] = _adam
    plant: Callable[[torch.nn.Module, torch.optim.Optimizer, str, int], None] = _nothing
    tiny_updates: bool = False
    dtype_contract: bool = False


SCENARIOS = {
    "nan": Scenario("blocks.1.fc2.weight", _check_nan, plant=_nan_grad_on_last_rank),
    "tiny_lr": Scenario("blocks.0.qkv.weight", _check_tiny_lr, optimizer=_adam_tiny_lr_for_target, tiny_updates=True),
    "left_out": Scenario("blocks.1.proj.weight", _check_left_out, optimizer=_adam_without_target),
    "bf16_state": Scenario("head.weight", _check_bf16_state, plant=_bf16_exp_avg_sq, dtype_contract=True),
    "underflow": Scenario("blocks.0.fc2.weight", _check_underflow, plant=_tiny_grads),
}


def _nothing_planted(found: Found) -> None:
    raise AssertionError("the healthy run plants nothing to check")


# What attributed_training runs: the scenarios, and "normal", a run with nothing planted.
TRAININGS = {"normal": Scenario("", _nothing_planted), **SCENARIOS}


def attributed_training(kind: str, name: str, settings: dict[str, str | None]) -> dict[str, Any]:
    """Trains STEPS steps of Adam with ``scenario`` planted; returns the span findings, the
    reference values per step and parameter, metric points and the final local shards."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    scenario = TRAININGS[name]
    env = {"FSDP_PATCH_PRECISION_EVERY": "1", **settings}
    with environment(**env), in_memory_otel() as (exporter, reader):
        model = attribution_model(kind)
        optimizer = scenario.optimizer(dict(model.named_parameters()), scenario.target)
        fully_shard_optimizer(optimizer)
        references: dict[int, dict[str, dict[str, float]]] = {}
        for step, tokens in enumerate(models.make_batches(STEPS), start=1):
            models.lm_loss(model, models.rank_slice(tokens, rank, world)).backward()
            with torch.no_grad():
                scenario.plant(model, optimizer, scenario.target, step)
            named = dict(model.named_parameters())
            before = {n: p.full_tensor().detach().clone() for n, p in named.items()}
            grads = {n: None if p.grad is None else p.grad.full_tensor() for n, p in named.items()}
            optimizer.step()
            after = {n: p.full_tensor().detach().clone() for n, p in named.items()}
            references[step] = {n: _reference(before[n], after[n], grads[n]) for n in named}
            optimizer.zero_grad()
        found = span_findings(list(exporter.get_finished_spans()))
        points = metric_values(reader)
    return {
        **found,
        "references": references,
        "points": points,
        "local": [p.to_local().detach().clone() for p in model.parameters()],
        "names": [n for n, _ in model.named_parameters()],
        "local_numel": {n: p.to_local().numel() for n, p in model.named_parameters()},
    }


ALL = {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_TOP_K": "100"}  # every parameter with a value shows
