"""The precision report on float8 bugs from public threads (:mod:`benchmarks.bug_patterns.float8_catalogue`),
each planted in the tiny model whose linear layers are torchao ``Float8Linear`` s, trained on 2
gloo ranks with telemetry on (fp8 matmuls emulated), and each one's fix as a healthy control.

Each pattern runs under one sharding here and under the other in ``make test-long``; the report must
lead with the catalogue's check and name the module and cast where the bug is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.bug_patterns.catalogue import CATALOGUE, judge
from benchmarks.bug_patterns.float8_catalogue import FLOAT8_CONTROLS, FLOAT8_PATTERNS
from benchmarks.bug_patterns.training import FSDP2, FULLY_SHARD
from tests.bug_patterns.test_bug_patterns import _report
from tests.fsdp.float8_models import require_torchao

# Each pattern's sharding in the default run; the other one is `long`.
_FIRST_KIND = {
    "float8_outlier_feature": FULLY_SHARD,
    "float8_outlier_token": FSDP2,
    "float8_zero_layer_no_amax_floor": FULLY_SHARD,
    "float8_output_layer": FSDP2,
    "float8_e4m3_grads": FULLY_SHARD,
}
_OTHER = {FULLY_SHARD: FSDP2, FSDP2: FULLY_SHARD}


def _runs() -> list[Any]:
    runs = []
    for pattern in FLOAT8_PATTERNS:
        first = _FIRST_KIND[pattern.name]
        runs.append(pytest.param(pattern.name, first, id=f"{pattern.name}-{first}"))
        runs.append(
            pytest.param(pattern.name, _OTHER[first], id=f"{pattern.name}-{_OTHER[first]}", marks=pytest.mark.long)
        )
    return runs


def test_every_float8_pattern_has_a_sharding_here() -> None:
    got = sorted(_FIRST_KIND)
    want = sorted(p.name for p in FLOAT8_PATTERNS)
    assert got == want and len(want) >= 5, f"patterns run here {got}, catalogue {want}"


@pytest.mark.parametrize(("name", "kind"), _runs())
def test_a_float8_pattern_is_named_with_its_module_and_cast(
    dist_pool: Any, tmp_path: Path, name: str, kind: str
) -> None:
    """The report leads with the catalogue's check, naming the module and the cast (the
    expectation's ``finding`` words), with the verdict the catalogue gives."""
    require_torchao()
    pattern = CATALOGUE[name]
    report = _report(dist_pool, tmp_path, name, kind)
    got = judge(pattern, report)
    lead = report["findings"][:1]
    assert got.named, f"{name} ({'; '.join(pattern.sources)}), {kind}: {list(got.mismatches)}; leads with {lead}"


def test_the_float8_fixes_are_named_by_the_advice(dist_pool: Any, tmp_path: Path) -> None:
    """The fix the report gives is the one the public thread settled on, chosen from what was
    measured: for a feature outlier, the layer in bf16 (a scale per row flushes as much); for a
    token outlier, rowwise scaling; for e4m3 grads, e5m2."""
    require_torchao()
    advice = {}
    for name, kind in (
        ("float8_outlier_feature", FULLY_SHARD),
        ("float8_outlier_token", FULLY_SHARD),
        ("float8_e4m3_grads", FULLY_SHARD),
    ):
        report = _report(dist_pool, tmp_path / name, name, kind)
        advice[name] = report["findings"][0]["advice"]
    wants = {
        "float8_outlier_feature": "module_filter_fn=lambda module, fqn: fqn != 'blocks.0.fc1'",
        "float8_outlier_token": "from_recipe_name('rowwise')",
        "float8_e4m3_grads": "float8_e5m2",
    }
    missing = {name: advice[name] for name, want in wants.items() if want not in advice[name]}
    assert not missing, f"advice not naming the fix ({wants}): {missing}"
    assert "rowwise" not in advice["float8_outlier_feature"].split("Keep")[1], advice["float8_outlier_feature"]


@pytest.mark.parametrize(
    ("name", "kind", "every"),
    [
        *(pytest.param(c.name, FULLY_SHARD, 1, id=c.name) for c in FLOAT8_CONTROLS if c.every == (1,)),
        *(pytest.param(c.name, FULLY_SHARD, None, id=f"{c.name}-default") for c in FLOAT8_CONTROLS if c.every != (1,)),
        *(
            pytest.param(
                c.name, kind, 1 if kind == FULLY_SHARD else None, id=f"{c.name}-{kind}", marks=pytest.mark.long
            )
            for c in FLOAT8_CONTROLS
            if c.every != (1,)
            for kind in (FULLY_SHARD, FSDP2)
        ),
    ],
)
def test_a_float8_control_is_healthy(dist_pool: Any, tmp_path: Path, name: str, kind: str, every: int | None) -> None:
    """Each fix (rowwise for the massive token, torchao's amax floor for the zero layer, e5m2 grads)
    and the healthy float8 model (200 steps, on the default schedule and diagnosed every step): no
    finding at all."""
    require_torchao()
    report = _report(dist_pool, tmp_path, name, kind, every)
    got = (report["verdict"], [f["finding"] for f in report["findings"]])
    assert got == ("healthy", []), f"{name}, {kind}, every {every}: {got}"
