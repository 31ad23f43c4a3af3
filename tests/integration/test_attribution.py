"""Precision attribution on 2 and 4 gloo ranks (uneven shards), for ``fully_shard`` and torch FSDP2:
the planted problems.

Each scenario plants one problem in one named parameter of the small transformer and checks that
the precision span names exactly that parameter, step, rank and kind, and no other parameter;
per-parameter values are checked against a reference computed with plain torch from the full
tensors (``DTensor.full_tensor()``) before and after each step. The rank functions sit
beside their tests and assert on the ranks, with the values in the message; the scenarios and the
training run are in ``attribution_scenarios``. The export's bounds: ``test_attribution_export.py``.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from fsdp_patch.telemetry import semconv

from tests.integration.attribution_scenarios import (
    ALL,
    KINDS,
    SCENARIOS,
    STEPS,
    WORLDS,
    Found,
    attributed_training,
    close_to,
)


def check_scenario(kind: str, name: str) -> None:
    """On every rank: the planted problem is named with exactly its parameter, step, rank and
    kind, no other parameter is blamed, and the per-parameter values equal the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    scenario = SCENARIOS[name]
    run = attributed_training(kind, name, ALL)
    offenders, target = run["offenders"], scenario.target
    where = f"{kind}, {world} ranks, rank {rank}, {name}"

    def named(step: int, diagnostic: str) -> dict[str, float]:
        return offenders.get(step, {}).get(diagnostic, {})

    sizes = [0] * world
    dist.all_gather_object(sizes, run["local_numel"][target])
    assert len(set(sizes)) > 1, f"{where}: {target}'s shards hold {sizes} elements, want them uneven"
    if scenario.check(Found(run, named, target, where)) == "done":
        return
    # Nothing else blamed by the diagnostics the scenarios plant.
    for step in range(1, STEPS + 1):
        for diagnostic in (
            semconv.DIAGNOSTIC_STUCK,
            semconv.DIAGNOSTIC_UNSTEPPED,
            semconv.DIAGNOSTIC_STATE_FLUSHED,
            semconv.DIAGNOSTIC_STATE_NONFINITE,
            semconv.METRIC_NONFINITE,
        ):
            blamed = {key.split(":")[0] for key in named(step, diagnostic)} - {target}
            assert not blamed, f"{where}: step {step}: {diagnostic} blames {blamed}"
        if not scenario.tiny_updates:
            below = named(step, semconv.DIAGNOSTIC_UPDATE_RESOLUTION)
            assert not below, f"{where}: step {step}: updates below resolution without a tiny lr: {below}"
    if not scenario.dtype_contract:
        assert run["contracts"] == [], f"{where}: dtype-contract events: {run['contracts']}"
    # Per-parameter values equal the reference from the full tensors.
    for step, reference in run["references"].items():
        for diagnostic, rel in (
            (semconv.METRIC_LOST_RATIO, 1e-12),
            (semconv.METRIC_GRAD_AMAX, 0.0),
            (semconv.METRIC_REFRESH_ERROR, 1e-5),
        ):
            got = named(step, diagnostic)
            want = {n: r[diagnostic] for n, r in reference.items() if r[diagnostic] > 0}
            assert set(got) == set(want), (
                f"{where}: step {step} {diagnostic}: parameters {sorted(got)} vs {sorted(want)}"
            )
            bad = {n: (got[n], want[n]) for n in want if not close_to(got[n], want[n], rel)}
            assert not bad, f"{where}: step {step} {diagnostic}: (got, reference) {bad}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_planted_problem_is_named_exactly(dist_pool, world: int, kind: str, scenario: str) -> None:
    dist_pool(world).run(check_scenario, kind, scenario)
