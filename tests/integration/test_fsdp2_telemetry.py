"""Telemetry for an optimizer over torch FSDP2's sharded DTensor parameters, on 2 gloo ranks.

The model is sharded by ``torch.distributed.fsdp.fully_shard`` with bf16 ``param_dtype``: FSDP2
keeps fp32 shards for the optimizer and casts them to bf16 at every all-gather, so the adapter
has nothing to cast or refresh and only observes; the diagnostics read the compute dtype from
the module's ``MixedPrecisionPolicy``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_patch.telemetry import semconv

from tests import models
from tests.integration.otel_training import environment, in_memory_otel, metric_values

COMPUTE_DTYPE = torch.bfloat16
PLANTED_STEP = 2


def fsdp2_model(seed: int = 0) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = models.make_model(seed)  # fp32 parameters: FSDP2 keeps them as the optimizer's main weights
    policy = MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPE, reduce_dtype=torch.float32)
    return models.fsdp2_shard_model(model, mp_policy=policy)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _lost_counts(before: list[torch.Tensor], after: list[torch.Tensor]) -> tuple[int, int]:
    """This rank's (changed, lost) elements of one step, from the definition in docs/conventions.md: main
    weight bits changed; the bf16 cast FSDP2 gathers did not."""
    changed = lost = 0
    for b, a in zip(before, after, strict=True):
        moved = _bits(a) != _bits(b)
        kept = _bits(a.to(COMPUTE_DTYPE)) == _bits(b.to(COMPUTE_DTYPE))
        changed += int(moved.sum())
        lost += int((moved & kept).sum())
    return changed, lost


def fsdp2_training(scenario: str, telemetry_on: bool, steps: int = 3) -> dict[str, Any]:
    """Trains with Adam; ``scenario``: ``normal`` (lr 1e-2), ``tiny_lr`` (1e-7), ``nan`` (a NaN in
    rank 0's grad at step PLANTED_STEP, after which training stops)."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    lr = 1e-7 if scenario == "tiny_lr" else 1e-2
    telemetry = "1" if telemetry_on else None
    with (
        environment(FSDP_PATCH_TELEMETRY=telemetry, FSDP_PATCH_PRECISION_EVERY="1"),
        in_memory_otel() as (spans, reader),
    ):
        model = fsdp2_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        fully_shard_optimizer(optimizer)
        last: tuple[int, int] = (0, 0)
        for step, tokens in enumerate(models.make_batches(steps), start=1):
            models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
            if scenario == "nan" and step == PLANTED_STEP and rank == 0:
                with torch.no_grad():
                    _local(model.head.weight.grad).view(-1)[3] = float("nan")
            before = [_local(p).detach().clone() for p in model.parameters()]
            optimizer.step()
            last = _lost_counts(before, [_local(p).detach() for p in model.parameters()])
            optimizer.zero_grad()
            if scenario == "nan" and step == PLANTED_STEP:
                break
        finished = [
            {
                "name": s.name,
                "id": s.context.span_id,
                "parent": s.parent.span_id if s.parent else None,
                "attributes": dict(s.attributes),
            }
            for s in spans.get_finished_spans()
        ]
        points = metric_values(reader)
    return {
        "spans": finished,
        "points": points,
        "last_step_changed_lost": last,
        "main": [_local(p).detach().clone() for p in model.parameters()],
        "params": len(list(model.parameters())),
        "fsdp_groups": len(model.blocks) + 1,
    }


WORLD = 2


def _total(points: dict, name: str, **attributes: str) -> float:
    return sum(value for attrs, value in points.get(name, []) if all(attrs.get(k) == v for k, v in attributes.items()))


@pytest.fixture(scope="module")
def normal_runs(dist_pool) -> dict[bool, list[dict]]:
    pool = dist_pool(WORLD)
    return {on: pool.run(fsdp2_training, "normal", on) for on in (True, False)}


def test_span_tree_and_step_metrics(normal_runs) -> None:
    for rank, result in enumerate(normal_runs[True]):
        spans = result["spans"]
        steps = [s for s in spans if s["name"] == semconv.SPAN_STEP]
        assert [s["attributes"][semconv.ATTR_STEP] for s in steps] == [1, 2, 3]
        for step in steps:
            attrs = step["attributes"]
            got = (
                attrs[semconv.ATTR_RANK],
                attrs[semconv.ATTR_WORLD_SIZE],
                attrs[semconv.ATTR_OPTIMIZER_CLASS],
                attrs[semconv.ATTR_PARAMS_COUNT],
                attrs[semconv.ATTR_GROUPS_COUNT],
                attrs[semconv.ATTR_CAST_BYTES],
            )
            want = (rank, WORLD, "Adam", result["params"], result["fsdp_groups"], 0)
            assert got == want, (
                f"rank {rank}: want (rank, world, class, params, FSDP2 groups, cast bytes) {want}, got {got}"
            )
            children = [s["name"] for s in spans if s["parent"] == step["id"]]
            assert children == list(semconv.STEP_PHASE_SPANS), f"rank {rank}: children {children}"
        points = result["points"]
        assert _total(points, semconv.METRIC_STEP_DURATION) == 3
        # nothing to cast around FSDP2's step: no cast bytes, no mismatches
        assert semconv.METRIC_CAST_SIZE not in points and semconv.METRIC_DTYPE_MISMATCHES not in points
        nonfinite = _total(points, semconv.METRIC_NONFINITE)
        assert nonfinite == 0, f"rank {rank}: a healthy run counted {nonfinite} non-finite elements"


def test_training_is_bitwise_identical_with_telemetry_on_and_off(normal_runs) -> None:
    for rank, (on, off) in enumerate(zip(normal_runs[True], normal_runs[False], strict=True)):
        assert off["spans"] == [], f"rank {rank}: telemetry off emitted spans"
        differ = [i for i, (a, b) in enumerate(zip(on["main"], off["main"], strict=True)) if not torch.equal(a, b)]
        assert differ == [], f"rank {rank}: parameters {differ} differ between telemetry on and off"


def test_planted_nan_is_counted_exactly(dist_pool) -> None:
    for result in dist_pool(WORLD).run(fsdp2_training, "nan", True):
        points = result["points"]

        def count(tensor: str, kind: str) -> float:
            return _total(
                points, semconv.METRIC_NONFINITE, **{semconv.ATTR_TENSOR: tensor, semconv.ATTR_NONFINITE_KIND: kind}
            )

        got = {(t, k): count(t, k) for t in semconv.TENSORS for k in semconv.NONFINITE_KINDS}
        want = {(t, k): 0 for t, k in got}
        # one NaN grad element on one rank; Adam writes it into that element of the main weight,
        # which the bf16 cast of the compute weight carries
        want[(semconv.TENSOR_MAIN_GRAD, semconv.NONFINITE_NAN)] = 1
        want[(semconv.TENSOR_MAIN_WEIGHT, semconv.NONFINITE_NAN)] = 1
        want[(semconv.TENSOR_COMPUTE_WEIGHT, semconv.NONFINITE_NAN)] = 1
        assert got == want, f"want {want}, got {got}"
        ((_, amax),) = points[semconv.METRIC_GRAD_AMAX]
        assert amax > 1e38, f"grad amax with a NaN grad must read off-scale, got {amax}"


def _lost_ratio(results: list[dict]) -> tuple[float, float]:
    """(the metric, the ratio computed here from every rank's shards before and after the last step)."""
    ((_, metric),) = results[0]["points"][semconv.METRIC_LOST_RATIO]
    changed = sum(r["last_step_changed_lost"][0] for r in results)
    lost = sum(r["last_step_changed_lost"][1] for r in results)
    return metric, lost / changed


def test_lost_update_ratio_near_one_for_a_tiny_lr_and_low_for_a_normal_one(dist_pool, normal_runs) -> None:
    tiny_metric, tiny_reference = _lost_ratio(dist_pool(WORLD).run(fsdp2_training, "tiny_lr", True))
    normal_metric, normal_reference = _lost_ratio(normal_runs[True])
    assert tiny_metric == pytest.approx(tiny_reference, rel=1e-12), (tiny_metric, tiny_reference)
    assert normal_metric == pytest.approx(normal_reference, rel=1e-12), (normal_metric, normal_reference)
    assert tiny_metric > 0.95, f"lr 1e-7 on bf16 compute weights: want a ratio near 1, got {tiny_metric}"
    assert normal_metric < 0.2, f"lr 1e-2: want a low ratio, got {normal_metric}"


Audited = list[tuple[str, str, str, str | None, str, str]]


def fsdp2_dtype_audit() -> dict[str, Any]:
    """The dtype-contract audit of an Adam over FSDP2's parameters, after a step and a backward:
    ``clean``: fp32 parameters with bf16 compute, as the contract expects; ``planted``: the same
    with a bf16 grad on one parameter (its ``grad_dtype`` set, which torch then accepts) and a
    bf16 ``exp_avg_sq`` on another; ``bf16_weights``: FSDP2 over a bf16 model, every main weight
    bf16 (grads and state follow their parameters' dtype)."""
    from fsdp_patch.telemetry.diagnostics.dtype_contract import audit_dtypes

    rank, world_size = dist.get_rank(), dist.get_world_size()
    tokens = models.rank_slice(models.make_batches(1)[0], rank, world_size)

    def stepped(model: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        models.lm_loss(model, tokens).backward()
        optimizer.step()
        models.lm_loss(model, tokens).backward()
        return optimizer

    def audit(optimizer: torch.optim.Optimizer) -> Audited:
        return sorted(
            (v.param, v.unit, v.tensor, v.state_key, str(v.expected), str(v.actual)) for v in audit_dtypes(optimizer)
        )

    found: dict[str, Any] = {}
    model = fsdp2_model()
    optimizer = stepped(model)
    found["clean"] = audit(optimizer)
    named = dict(model.named_parameters())
    grad = named["blocks.0.fc1.weight"]
    held, grad.grad = grad.grad, None
    grad.grad_dtype = torch.bfloat16
    grad.grad = held.to(torch.bfloat16)
    state = optimizer.state[named["head.weight"]]
    state["exp_avg_sq"] = state["exp_avg_sq"].to(torch.bfloat16)
    found["planted"] = audit(optimizer)
    model = models.fsdp2_shard_model(models.make_model(0).bfloat16())
    found["bf16_weights"] = audit(stepped(model))
    found["names"] = [name for name, _ in model.named_parameters()]
    return found


def test_dtype_audit_names_every_fsdp2_tensor_in_another_dtype(dist_pool) -> None:
    """Each tensor kind the contract covers, on FSDP2's parameters: grads, optimizer state and
    main weights, named with their parameter and unit on every rank."""
    fp32, bf16 = str(torch.float32), str(torch.bfloat16)
    for rank, found in enumerate(dist_pool(WORLD).run(fsdp2_dtype_audit)):
        assert found["clean"] == [], f"rank {rank}: violations in a run that keeps the contract: {found['clean']}"
        want = sorted(
            [
                ("blocks.0.fc1.weight", "blocks.0", semconv.TENSOR_MAIN_GRAD, None, fp32, bf16),
                ("head.weight", "", semconv.TENSOR_OPTIMIZER_STATE, "exp_avg_sq", fp32, bf16),
            ]
        )
        assert found["planted"] == want, f"rank {rank}: want {want}, got {found['planted']}"
        want = sorted(
            (n, n.rsplit(".", 2)[0] if n.startswith("blocks.") else "", semconv.TENSOR_MAIN_WEIGHT, None, fp32, bf16)
            for n in found["names"]
        )
        got = found["bf16_weights"]
        assert got == want, (
            f"rank {rank}: bf16 main weights: missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}"
        )
