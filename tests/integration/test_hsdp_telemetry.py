"""Telemetry on HSDP, on 4 gloo ranks: a 2 x 2 mesh (replicate, shard) against a 1-D mesh of 4.

The precision diagnostics gather over the ranks that shard a parameter, so each replica counts
the model's elements once: every count of a step equals the 1-D mesh's, and ratios agree to the
rounding by which averaging over 2 x 2 ranks differs from averaging over 4. Both ``fully_shard``
and torch's FSDP2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_patch.telemetry.offline import precision_report
from fsdp_patch.telemetry.offline.trace_reading import iter_events, rank_segments
from torch.distributed.device_mesh import init_device_mesh

from tests import models
from tests.integration.otel_training import environment, in_memory_otel, metric_values, reset_otel
from tests.integration.report_json import report_json

WORLD_SIZE = 4
PLANTED_STEP = 2


def _plant(model: torch.nn.Module, plant: str) -> None:
    """Write the head's main weight, element [0, 0] (held by each replica's first shard rank):
    ``both``: a NaN on every replica; ``one``: a NaN on the second replica only; ``drift``: +1 on
    the second replica only (finite, and the replicas no longer hold the same weights)."""
    weight = model.head.weight
    mesh = weight.device_mesh
    if mesh.get_local_rank(mesh.ndim - 1) != 0 or plant == "none":
        return
    if plant != "both" and (mesh.ndim < 2 or mesh.get_local_rank(0) != 1):
        return
    with torch.no_grad():
        local = weight.to_local()
        local[0, 0] = float("nan") if plant in ("both", "one") else local[0, 0] + 1.0


def _shard(model: torch.nn.Module, impl: str, mesh: Any) -> torch.nn.Module:
    """``model`` sharded on ``mesh`` by ``fully_shard`` (``"ours"``) or torch's FSDP2, bf16 compute
    (FSDP2 reduces in bf16, its default for it)."""
    if impl == "ours":
        from fsdp_patch import MixedPrecisionPolicy

        return models.shard_model(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    return models.fsdp2_shard_model(
        model, mesh=mesh, mp_policy=TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    )


def _events(spans: Any, name: str) -> list[dict[str, Any]]:
    return [dict(e.attributes) for s in spans.get_finished_spans() for e in s.events if e.name == name]


def hsdp_telemetry_run(
    impl: str, shape: tuple[int, ...], plant: str = "both", every: str = "1", steps: int = PLANTED_STEP
) -> dict[str, Any]:
    """Adapted AdamW, bf16 compute, diagnostics every ``every`` steps, the head's main weight
    written as ``plant`` says (:func:`_plant`) before the step of ``PLANTED_STEP``, ``steps``
    steps: this rank's precision metric points, its replica-divergence and first-NaN/Inf events,
    and the steps its diagnostics ran on."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY=every), in_memory_otel() as (spans, reader):
        model = models.make_model(0)
        model = _shard(model, impl, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fully_shard_optimizer(optimizer)
        for step, tokens in enumerate(models.make_batches(steps), start=1):
            models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
            if step == PLANTED_STEP:
                _plant(model, plant)
            optimizer.step()
            optimizer.zero_grad()
        points = metric_values(reader)
        divergence = _events(spans, "fsdp.precision.replica_divergence")
        first = _events(spans, "fsdp.precision.first_nonfinite")
        finished = spans.get_finished_spans()
        step_of = {s.context.span_id: s.attributes["fsdp.step"] for s in finished if s.name == "fsdp.optimizer.step"}
        diagnosed = sorted(step_of[s.parent.span_id] for s in finished if s.name == "fsdp.optimizer.precision")
    metrics = {
        name: sorted(
            (tuple(sorted((k, v) for k, v in attrs.items() if k != "fsdp.rank")), value) for attrs, value in values
        )
        for name, values in points.items()
        if name.startswith("fsdp.precision")
    }
    return {"metrics": metrics, "divergence": divergence, "first_nonfinite": first, "diagnosed": diagnosed}


@pytest.mark.parametrize("impl", ["ours", "fsdp2"])
def test_hsdp_counts_each_model_element_once(dist_pool, impl) -> None:
    pool = dist_pool(WORLD_SIZE)
    hsdp_ranks = pool.run(hsdp_telemetry_run, impl, (2, 2))
    hsdp, flat = hsdp_ranks[0]["metrics"], pool.run(hsdp_telemetry_run, impl, (WORLD_SIZE,))[0]["metrics"]
    assert sorted(hsdp) == sorted(flat), f"metrics on HSDP {sorted(hsdp)}, on a 1-D mesh {sorted(flat)}"
    counts = (
        "fsdp.precision.nonfinite",
        "fsdp.precision.steps",
        "fsdp.precision.nonfinite.steps",
        "fsdp.precision.refresh.overflow",
        "fsdp.precision.refresh.underflow",
    )
    for name in counts:
        assert hsdp[name] == flat[name], f"{impl}: {name} on HSDP {hsdp[name]}, on a 1-D mesh {flat[name]}"
    planted = dict(hsdp["fsdp.precision.nonfinite"])
    key = (("fsdp.nonfinite.kind", "nan"), ("fsdp.tensor", "main_weight"))
    assert planted[key] == 1, f"{impl}: the one NaN planted on both replicas counted {planted[key]} times: {planted}"
    for name in ("fsdp.precision.grad.amax", "fsdp.precision.update.lost_ratio", "fsdp.precision.refresh.error"):
        (_, got), (_, want) = hsdp[name][0], flat[name][0]
        # Averaging over 2 x 2 ranks rounds (in bf16) otherwise than over 4.
        assert abs(got - want) <= 0.05 * abs(want), f"{impl}: {name} on HSDP {got}, on a 1-D mesh {want}"
    got_divergence = [run["divergence"] for run in hsdp_ranks]
    assert got_divergence == [[]] * WORLD_SIZE, f"{impl}: replicas that agree reported diverging: {got_divergence}"


# The mesh [[0, 1], [2, 3]]: replica 0 is ranks 0 and 1, replica 1 ranks 2 and 3; each rank's
# peers (the ranks holding its shard on each replica) are its replicate group.
PEERS = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}


@pytest.mark.parametrize("impl", ["ours", "fsdp2"])
def test_a_nan_on_one_replica_is_named_on_every_rank(dist_pool, impl) -> None:
    runs = dist_pool(WORLD_SIZE).run(hsdp_telemetry_run, impl, (2, 2), "one")
    for rank, run in enumerate(runs):
        planted = dict(run["metrics"]["fsdp.precision.nonfinite"])
        key = (("fsdp.nonfinite.kind", "nan"), ("fsdp.tensor", "main_weight"))
        assert planted[key] == 1, f"{impl} rank {rank}: want the NaN of replica 1 counted once, got {planted}"
        events = run["divergence"]
        assert len(events) == 1, f"{impl} rank {rank}: want one divergence event (step {PLANTED_STEP}), got {events}"
        got = {k: (list(v) if isinstance(v, tuple) else v) for k, v in events[0].items()}
        want = {
            "fsdp.step": PLANTED_STEP,
            "fsdp.replica.diff": "nonfinite",
            "fsdp.ranks": PEERS[rank],
            "fsdp.precision.params": ["head.weight"],
            "fsdp.precision.params.count": 1,
        }
        assert {k: got.get(k) for k in want} == want, f"{impl} rank {rank}: want {want}, got {got}"
        per_replica = list(got["fsdp.replica.nonfinite"])
        assert per_replica[0] == 0 and per_replica[1] >= 1, (
            f"{impl} rank {rank}: want NaN/Inf on replica 1 only, got per replica {per_replica}"
        )
        firsts = [(e["fsdp.param"], list(e["fsdp.ranks"])) for e in run["first_nonfinite"]]
        assert firsts == [("head.weight", [2])], (
            f"{impl} rank {rank}: want the first NaN named where it is (rank 2, replica 1), got {firsts}"
        )


@pytest.mark.parametrize("impl", ["ours", "fsdp2"])
def test_every_rank_escalates_together_when_one_replica_sees_a_nan(dist_pool, impl) -> None:
    """At the default interval: the NaN written on replica 1 before step 2's update is seen by
    that replica's checks alone, and read at step 3. Every rank must escalate there (the
    escalated steps' diagnostics gather over the replicas): each runs them on the same steps."""
    runs = dist_pool(WORLD_SIZE).run(hsdp_telemetry_run, impl, (2, 2), "one", "100", 7)
    got = [run["diagnosed"] for run in runs]
    # Steps 1-3 (the window), 5 (the 1-2-5 series); escalation: steps 3-5 after the NaN of step 2.
    want = [[1, 2, 3, 4, 5]] * WORLD_SIZE
    assert got == want, f"{impl}: want every rank diagnosed on {want[0]}, got per rank {got}"


@pytest.mark.parametrize("impl", ["ours", "fsdp2"])
def test_replicas_whose_weights_drift_apart_are_named(dist_pool, impl) -> None:
    runs = dist_pool(WORLD_SIZE).run(hsdp_telemetry_run, impl, (2, 2), "drift")
    for rank, run in enumerate(runs):
        nonfinite = sum(value for _, value in run["metrics"]["fsdp.precision.nonfinite"])
        assert nonfinite == 0, f"{impl} rank {rank}: a finite write counted {nonfinite} NaN/Inf elements"
        got = [
            (
                e["fsdp.step"],
                e["fsdp.replica.diff"],
                list(e["fsdp.precision.params"]),
                list(e["fsdp.replica.nonfinite"]),
            )
            for e in run["divergence"]
        ]
        want = [(PLANTED_STEP, "main_weight", ["head.weight"], [0, 0])]
        assert got == want, f"{impl} rank {rank}: want the drifted replica named {want}, got {got}"


def hsdp_traced_run(impl: str, plant: str, trace_dir: str) -> None:
    """As :func:`hsdp_telemetry_run` on the 2 x 2 mesh, with the trace files a user's run writes
    (the default exporters, into ``trace_dir``) in place of in-memory providers."""
    from fsdp_patch import telemetry
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    settings = {
        "FSDP_PATCH_TELEMETRY": "1",
        "FSDP_PATCH_TRACE_DIR": trace_dir,
        "FSDP_PATCH_PRECISION_EVERY": "1",
        "FSDP_PATCH_SUMMARY": "none",
        "OTEL_TRACES_EXPORTER": None,
        "OTEL_METRICS_EXPORTER": None,
    }
    with environment(**settings):
        reset_otel()
        model = models.make_model(0)
        model = _shard(model, impl, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fully_shard_optimizer(optimizer)
        for step, tokens in enumerate(models.make_batches(PLANTED_STEP + 1), start=1):
            models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
            if step == PLANTED_STEP:
                _plant(model, plant)
            optimizer.step()
            optimizer.zero_grad()
        telemetry.shutdown()
        del optimizer, model
        reset_otel()


@pytest.mark.parametrize("impl", ["ours", "fsdp2"])
def test_the_report_names_the_replica_that_diverged(dist_pool, tmp_path, impl) -> None:
    """The report of the run whose second replica got a NaN: the origin (a write between steps,
    on rank 2 alone), then the replicas that differ, each with its ranks and NaN/Inf count."""
    dist_pool(WORLD_SIZE).run(hsdp_traced_run, impl, "one", str(tmp_path))
    report = report_json(tmp_path)
    got = [(f["check"], f["first_step"]) for f in report["findings"]][:2]
    assert got == [("origin", PLANTED_STEP), ("replica_divergence", PLANTED_STEP)], (
        f"{impl}: want the write's origin, then the divergence, got {report['findings']}"
    )
    origin = (report["origin"]["stage"], report["origin"]["where"], report["origin"]["ranks"])
    assert origin == ("weight_write", "head.weight", [2]), f"{impl}: want the write on rank 2, got {report['origin']}"
    divergence = report["replica_divergence"]
    got_replicas = [(r["ranks"], r["nonfinite"] > 0) for r in divergence["replicas"]]
    assert (divergence["step"], divergence["params"], got_replicas) == (
        PLANTED_STEP,
        ["head.weight"],
        [([0, 1], False), ([2, 3], True)],
    ), f"{impl}: want replica 1 (ranks 2, 3) named with the NaN, got {divergence}"
    want_coordinates = {str(r): f"replicate={r // 2},shard={r % 2}" for r in range(WORLD_SIZE)}
    assert report["mesh_coordinates"] == want_coordinates, f"{impl}: got {report['mesh_coordinates']}"
    # The embedded default's providers were built at the first step, the model sharded: their
    # resource carries the coordinate too.
    resources = {
        str(segment.rank): event["args"]["otel.resource"].get("fsdp.mesh.coordinate")
        for segment in rank_segments(str(tmp_path))
        for event in iter_events(segment.path)
        if event.get("ph") == "M" and event.get("name") == "process_name"
    }
    assert resources == want_coordinates, f"{impl}: trace files' resource mesh coordinates {resources}"
    text = precision_report.report(str(tmp_path))
    assert "head.weight, float32" in text and "rank 2 (replicate=1,shard=0)" in text, (
        f"{impl}: want the origin's rank named with its mesh coordinate:\n{text}"
    )


def stage_run(impl: str) -> list[int]:
    """Two pipeline stages of 2 ranks each (a (pp, replicate, shard) = (2, 1, 2) mesh), each
    training a model of its own on its 2-D (replicate, shard) submesh, diagnostics at the default
    interval; stage 1's head gets a NaN before step 2's update. The steps this rank diagnosed."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank = dist.get_rank()
    world = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "replicate", "shard"))
    mesh = world["replicate", "shard"]
    stage = world.get_local_rank("pp")
    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY="100"), in_memory_otel() as (spans, _):
        model = models.make_model(stage)
        model = _shard(model, impl, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fully_shard_optimizer(optimizer)
        for step, tokens in enumerate(models.make_batches(7), start=1):
            models.lm_loss(model, models.rank_slice(tokens, mesh.get_local_rank("shard"), 2)).backward()
            if step == PLANTED_STEP and stage == 1 and mesh.get_local_rank("shard") == 0:
                with torch.no_grad():
                    model.head.weight.to_local()[0, 0] = float("nan")
            optimizer.step()
            optimizer.zero_grad()
        finished = spans.get_finished_spans()
        step_of = {s.context.span_id: s.attributes["fsdp.step"] for s in finished if s.name == "fsdp.optimizer.step"}
        diagnosed = sorted(step_of[s.parent.span_id] for s in finished if s.name == "fsdp.optimizer.precision")
    assert rank // 2 == stage, f"rank {rank}: stage {stage}"
    return diagnosed


@pytest.mark.parametrize("impl", ["ours", "fsdp2"])
def test_ranks_of_a_mesh_smaller_than_the_world_agree_among_themselves(dist_pool, impl) -> None:
    """Each stage's ranks agree on escalating (over a group of the stage's ranks): stage 1, whose
    rank 2 wrote the NaN, escalates at step 3 on both its ranks; stage 0 keeps the schedule."""
    got = dist_pool(WORLD_SIZE).run(stage_run, impl)
    want = [[1, 2, 3, 5]] * 2 + [[1, 2, 3, 4, 5]] * 2
    assert got == want, f"{impl}: want stage 0 on the schedule, stage 1 escalated: per rank {want}, got {got}"
