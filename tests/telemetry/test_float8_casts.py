"""What torchao's float8 casts keep, as the float8 watch measures them (``diagnostics.float8_casts``),
and which checks (``float8_thresholds``) the values fire, on planted tensors and a torchao
``Float8Linear`` (fp8 emulated on the CPU): Gaussian values keep about 31 dB in e4m3 and 25 dB in
e5m2; an outlier feature (a column) flushes most elements under a scale per tensor and per row
alike, an outlier token (a row) only under the scale per tensor; an all-zero weight casts to zeros
with torchao's amax floor and to NaN without it; a gathered weight cast with a scale from an older,
smaller amax is clamped, a fresh one is not.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from fsdp_patch.telemetry import float8_thresholds, semconv
from fsdp_patch.telemetry.diagnostics.float8_casts import VALUES, cast_kind, measure, measure_gathered
from torch import nn

from tests.fsdp.float8_models import require_torchao

ROWS, COLUMNS = 256, 64
INPUT, WEIGHT, GRAD_OUTPUT = semconv.FLOAT8_ROLES


def float8_linear(recipe: str = "tensorwise") -> nn.Module:
    """A torchao ``Float8Linear`` of COLUMNS inputs and 48 outputs, in bf16, emulated."""
    require_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)  # no fp8 matmul here
    torch.manual_seed(0)
    return convert_to_float8_training(nn.Sequential(nn.Linear(COLUMNS, 48)).to(torch.bfloat16), config=config)[0]


def gaussian(seed: int = 0) -> torch.Tensor:
    return torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def values_of(module: nn.Module, role: str, tensor: torch.Tensor) -> dict[str, float]:
    got = measure(module, role, tensor)
    assert got is not None, f"{role}: measure returned None for a cast the module makes"
    return dict(zip(VALUES, got.tolist(), strict=True))


def checks(role: str, values: dict[str, float]) -> list[str]:
    return [t.check for t in float8_thresholds.fired(role, values)]


@pytest.mark.parametrize(
    ("role", "want_dtype", "want_db"), [(INPUT, "float8_e4m3fn", 31.0), (GRAD_OUTPUT, "float8_e5m2", 25.0)]
)
def test_gaussian_values_keep_the_dtype_s_sqnr_and_flush_nothing(role: str, want_dtype: str, want_db: float) -> None:
    module = float8_linear()
    kind = cast_kind(module, role)
    assert kind is not None and str(kind.dtype) == f"torch.{want_dtype}", f"{role}: want {want_dtype}, got {kind}"
    got = values_of(module, role, gaussian())
    assert abs(got["sqnr"] - want_db) < 1.5, f"{role}: want about {want_db} dB, got {got['sqnr']:.2f}"
    shares = {k: got[k] for k in ("flushed", "subnormal", "saturated", "nonfinite")}
    assert shares == dict.fromkeys(shares, 0.0), f"{role}: a Gaussian tensor lost nothing to range, got {shares}"
    assert checks(role, got) == [], f"{role}: want no check fired, got {checks(role, got)} for {got}"


def test_an_outlier_feature_flushes_most_elements_under_a_scale_per_tensor_and_per_row() -> None:
    planted = gaussian()
    planted[:, 3] = 1e6  # one feature, in every row
    got = values_of(float8_linear(), INPUT, planted)
    assert got["flushed"] > 0.9, f"want most of the elements flushed, got {got['flushed']:.3f}"
    assert abs(got["rowwise_flushed"] - got["flushed"]) < 0.02, (
        f"a scale per row meets the outlier in every row: want rowwise_flushed near flushed {got['flushed']:.3f}, "
        f"got {got['rowwise_flushed']:.3f}"
    )
    assert got["amax_ratio"] > 1e5, f"want the outlier far above the median, got amax_ratio {got['amax_ratio']:.3g}"
    assert checks(INPUT, got) == ["float8_flush"], f"want float8_flush alone, got {checks(INPUT, got)}"


def test_an_outlier_token_flushes_most_elements_under_a_scale_per_tensor_only() -> None:
    planted = gaussian()
    planted[7, :] = 1e6  # one row
    got = values_of(float8_linear(), INPUT, planted)
    assert got["flushed"] > 0.9, f"want most of the elements flushed, got {got['flushed']:.3f}"
    assert got["rowwise_flushed"] < 0.01, f"a scale per row keeps the other rows: got {got['rowwise_flushed']:.3f}"
    planted[7, :] = 1e12  # e5m2 reaches 2^-16 of its largest value, e4m3 2^-17.8 (with subnormals)
    grad = values_of(float8_linear(), GRAD_OUTPUT, planted)
    assert checks(GRAD_OUTPUT, grad) == ["float8_grad_underflow"], (
        f"a grad output with an outlier row: want float8_grad_underflow, got {checks(GRAD_OUTPUT, grad)} for {grad}"
    )


def test_an_all_zero_weight_casts_to_zeros_with_torchao_s_amax_floor() -> None:
    module = float8_linear()
    with torch.no_grad():
        module.weight.zero_()
    got = values_of(module, WEIGHT, module.weight)
    assert math.isfinite(got["scale"]), f"torchao's EPS floors the amax: want a finite scale, got {got['scale']}"
    assert (got["amax"], got["nonfinite"], got["sqnr"]) == (0.0, 0.0, math.inf), (
        f"want amax 0, no NaN/Inf made and nothing lost (SQNR inf), got {got}"
    )
    assert checks(WEIGHT, got) == [], f"want no check fired, got {checks(WEIGHT, got)}"


def test_an_all_zero_weight_casts_to_nan_without_an_amax_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    module = float8_linear()
    with torch.no_grad():
        module.weight.zero_()
    import torchao.float8.float8_utils

    monkeypatch.setattr(torchao.float8.float8_utils, "EPS", 0.0)
    got = values_of(module, WEIGHT, module.weight)
    assert got["scale"] == math.inf, f"448 / 0: want an infinite scale, got {got['scale']}"
    assert got["nonfinite"] == module.weight.numel(), (
        f"0 x inf is NaN: want all {module.weight.numel()} elements made NaN, got {got['nonfinite']}"
    )
    assert checks(WEIGHT, got) == ["float8_nonfinite"], f"want float8_nonfinite, got {checks(WEIGHT, got)}"


def test_a_tensor_already_holding_nan_is_not_the_cast_s_nan() -> None:
    planted = gaussian()
    planted[0, 0] = float("nan")
    got = values_of(float8_linear(), INPUT, planted)
    assert math.isnan(got["amax"]) and got["nonfinite"] == 0.0, (
        f"want a NaN amax and no NaN counted as the cast's, got amax {got['amax']}, nonfinite {got['nonfinite']}"
    )
    assert checks(INPUT, got) == [], f"the NaN came from elsewhere: want no float8 check, got {checks(INPUT, got)}"


def test_the_amax_ratio_of_a_relu_output_is_over_its_non_zero_elements() -> None:
    """The median is estimated on an evenly strided sample of at most 4096 elements: within a few
    percent of the exact one on a Gaussian's half."""
    relu = torch.relu(gaussian().float()).to(torch.bfloat16)  # half the elements 0: the median of all is 0
    got = values_of(float8_linear(), INPUT, relu)
    nonzero = relu.float()[relu != 0].abs()
    want = (nonzero.max() / nonzero.sort().values[(nonzero.numel() - 1) // 2]).item()
    assert got["amax_ratio"] == pytest.approx(want, rel=0.05), f"want {want:.4g} within 5%, got {got['amax_ratio']}"


def gathered_weight(module: nn.Module, amax: float) -> Any:
    """``module``'s weight as a float8 all-gather delivers it: cast with the scale of ``amax``."""
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig, hp_tensor_and_scale_to_float8

    scale = torch.tensor(torch.finfo(torch.float8_e4m3fn).max / amax)
    weight = module.weight.detach().float()
    return hp_tensor_and_scale_to_float8(weight, scale, torch.float8_e4m3fn, LinearMMConfig(), GemmInputRole.WEIGHT)


def test_a_gathered_weight_cast_with_an_older_smaller_amax_is_clamped() -> None:
    module = float8_linear()
    weight = module.weight.detach().float()
    amax = weight.abs().max().item()
    fresh = dict(zip(VALUES, measure_gathered(gathered_weight(module, amax)).tolist(), strict=True))
    assert fresh["saturated"] == 0.0, f"a scale from the weight's own amax clamps nothing, got {fresh['saturated']}"
    assert checks(WEIGHT, fresh) == [], f"want no check fired on a fresh scale, got {checks(WEIGHT, fresh)}"
    stale = dict(zip(VALUES, measure_gathered(gathered_weight(module, amax / 1.5)).tolist(), strict=True))
    # Clamped: beyond 448 plus half a unit (16) of the scale from amax / 1.5.
    clamped = (weight.abs() * 448 * 1.5 / amax > 464).float().mean().item()
    assert stale["saturated"] == pytest.approx(clamped, rel=0.1), (
        f"want about the {clamped:.4f} beyond the largest value, got {stale['saturated']:.4f}"
    )
    assert checks(WEIGHT, stale) == ["float8_saturation"], f"want float8_saturation, got {checks(WEIGHT, stale)}"
    assert stale["sqnr"] == math.inf, f"no high-precision weight to compare with: want inf, got {stale['sqnr']}"


def test_a_rowwise_module_casts_with_a_scale_per_row() -> None:
    module = float8_linear("rowwise")
    kinds = {role: cast_kind(module, role) for role in semconv.FLOAT8_ROLES}
    got = {role: kind.granularity if kind is not None else None for role, kind in kinds.items()}
    assert got == dict.fromkeys(semconv.FLOAT8_ROLES, "axiswise"), f"want axiswise for every role, got {got}"
    values = values_of(module, INPUT, gaussian())
    assert values["scale"] < values["scale_max"], f"a scale per row: want several scales, got {values}"
    assert math.isnan(values["rowwise_flushed"]), f"already per row: want no rowwise estimate, got {values}"
    assert abs(values["sqnr"] - 31.0) < 1.5, f"want about 31 dB, got {values['sqnr']:.2f}"


@pytest.mark.parametrize(
    ("role", "values", "position", "want"),
    [
        (INPUT, {"subnormal": 0.6}, semconv.FLOAT8_POSITION_MIDDLE, [("float8_flush", "warning")]),
        (GRAD_OUTPUT, {"flushed": 0.3}, semconv.FLOAT8_POSITION_MIDDLE, [("float8_grad_underflow", "problem")]),
        (WEIGHT, {"saturated": 0.002}, semconv.FLOAT8_POSITION_MIDDLE, [("float8_saturation", "problem")]),
        (WEIGHT, {"amax": math.nan, "scale": math.nan}, semconv.FLOAT8_POSITION_MIDDLE, []),
        (INPUT, {}, semconv.FLOAT8_POSITION_FIRST, [("float8_sensitive_layer", "warning")]),
        (INPUT, {}, semconv.FLOAT8_POSITION_MIDDLE, []),
    ],
    ids=["subnormal", "grad-flushed", "saturated", "nan-tensor", "first", "healthy"],
)
def test_the_checks_fired_and_their_severity(role: str, values: dict[str, float], position: str, want: list) -> None:
    healthy = {"amax": 1.0, "scale": 448.0, "flushed": 0.0, "subnormal": 0.0, "saturated": 0.0, "nonfinite": 0.0}
    got = [(t.check, t.severity) for t in float8_thresholds.fired(role, {**healthy, **values}, position)]
    assert got == want, f"{role} {values} at {position}: want {want}, got {got}"
