"""The instrumentor and the cross-rank settings check on 2 gloo ranks, training the small transformer
sharded by fully_shard (bf16 compute, fp32 main weights, bf16 main grads)."""

from __future__ import annotations

import pytest

from tests.integration import instrument_rank_fns

WORLD = 2


def test_instrument_uninstrument_instrument_round_trip(dist_pool, tmp_path) -> None:
    results = dist_pool(WORLD).run(instrument_rank_fns.instrument_round_trip, str(tmp_path / "traces"))
    per_phase = instrument_rank_fns.STEPS_PER_PHASE
    for rank, result in enumerate(results):
        assert result["adapted"] == "wrapt", f"rank {rank}: the instrumentor did not adapt the optimizer: {result}"
        assert result["left after uninstrument"] == {}, f"rank {rank}: {result['left after uninstrument']}"
        assert result["left at the end"] == {}, f"rank {rank}: {result['left at the end']}"
        first = list(range(1, per_phase + 1))
        assert result["first trace steps"] == first, f"rank {rank}: want steps {first}, got {result}"
        assert result["trace steps while off"] == first, f"rank {rank}: spans while uninstrumented: {result}"
        second = list(range(2 * per_phase + 1, 3 * per_phase + 1))  # numbering continued across the gap
        assert result["second trace steps"] == second, f"rank {rank}: want steps {second}, got {result}"
        assert result["bitwise equal"], f"rank {rank}: training differs from the hook attachment's"


@pytest.mark.parametrize(
    ("per_rank", "named"),
    [
        ([{"FSDP_PATCH_TELEMETRY": "1"}, {"FSDP_PATCH_TELEMETRY": None}], "rank 0 on, rank 1 off"),
        (
            [{"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "1"},
             {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "5"}],
            "rank 0 1, rank 1 5",
        ),
        (
            [{"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "1"},
             {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "1", "FSDP_PATCH_PRECISION_TOP_K": "0"}],
            "Per-parameter detail (FSDP_PATCH_PRECISION_TOP_K above 0): rank 0 on, rank 1 off",
        ),
    ],
    ids=["telemetry-on-one-rank", "diagnostics-schedules-differ", "per-parameter-detail-differs"],
)  # fmt: skip
def test_mismatched_settings_raise_the_same_error_on_every_rank(dist_pool, per_rank, named) -> None:
    results = dist_pool(WORLD).run(instrument_rank_fns.mismatched_settings, per_rank)
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1], f"want one error on both ranks, got {errors}"
    for variable in ("FSDP_PATCH_TELEMETRY", "FSDP_PATCH_PRECISION_EVERY"):
        assert variable in errors[0], f"the error does not name {variable}: {errors[0]}"
    assert named in errors[0], f"the error does not give each rank's value ({named!r}): {errors[0]}"


def test_equal_settings_pass_the_check(dist_pool) -> None:
    same = {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "3"}
    results = dist_pool(WORLD).run(instrument_rank_fns.mismatched_settings, [same, same])
    assert [r["error"] for r in results] == [None, None]


def test_lbfgs_refreshes_between_closure_calls(dist_pool) -> None:
    for rank, result in enumerate(dist_pool(WORLD).run(instrument_rank_fns.lbfgs_refreshes)):
        calls = result["closure calls"]
        assert calls >= 2, f"rank {rank}: LBFGS called the closure {calls} times; the test needs several"
        # one refresh before each later closure call (forward must see the weights being evaluated),
        # and one after the step
        want = calls * result["bytes per refresh"]
        got = result["refresh bytes"]
        assert got == want, f"rank {rank}: want {calls} refreshes ({want} bytes), got {got} bytes"
