"""The operation audit on one process: what it names for each kind of finding, where (the source
line, its caller, the module, the phase), that healthy low-precision code is not named, and that
the audited computation is exactly the unaudited one."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from fsdp_patch.telemetry.diagnostics.op_audit import OpAudit
from fsdp_patch.telemetry.diagnostics.op_judgement import OpFinding
from torch import nn
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

HERE = "tests/telemetry/test_op_audit.py"


def _line(offset: int = 0) -> int:
    """The caller's line number plus ``offset``."""
    return sys._getframe(1).f_lineno + offset


def _audit(run: object, names: dict[int, str] | None = None) -> list[OpFinding]:
    audit = OpAudit(names or {})
    audit.start()
    try:
        run()  # type: ignore[operator]
    finally:
        findings = audit.finish(top_k=5)
    return findings


def _kinds(findings: list[OpFinding]) -> list[tuple[str, str]]:
    return [(f.kind, f.op) for f in findings]


# -- each kind of finding, named at its line -----------------------------------------------------------


def test_an_fp16_overflow_is_named_at_its_line_as_a_precision_problem() -> None:
    x = torch.tensor([1.0, 10.0, 12.0], dtype=torch.float16)
    line = _line(1)
    findings = _audit(lambda: torch.exp(x))
    got = [(f.kind, f.op, f.dtype, f.site.file, f.site.line, f.fp32_finite) for f in findings]
    want = [("nonfinite", "aten.exp", "float16", HERE, line, True)]
    assert got == want, f"got {got}, want {want}"
    assert "float32 on the same inputs stays finite" in findings[0].detail, findings[0].detail


def test_a_nan_float32_makes_too_is_not_called_a_precision_problem() -> None:
    x = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    findings = _audit(lambda: torch.log(x) * 0 + torch.rsqrt(x))
    first = findings[0]
    got = (first.kind, first.op, first.fp32_finite, "not the dtype" in first.fix)
    assert got == ("nonfinite", "aten.log", False, True), f"got {got}: {first.detail} / {first.fix}"


def _focal(logit: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logit)
    complement = 1 - p  # cancels: sigmoid(9.39) is 1.0 in float16
    return torch.log(complement)


def test_a_nan_is_traced_back_to_the_cancellation_that_lost_precision() -> None:
    """open-mmlab/mmcv#1488's focal loss: log(1 - sigmoid(9.39)) in float16 is log(0); float32
    throughout stays finite, and the operation that lost the digits is the subtraction."""
    logit = torch.tensor([9.3906, -4.2344], dtype=torch.float16)
    findings = _audit(lambda: _focal(logit))
    first = findings[0]
    got = (first.kind, first.op, first.fp32_finite)
    assert got == ("nonfinite", "aten.log", True), f"got {got}"
    cancel_line = _focal.__code__.co_firstlineno + 2
    want = f"Precision was lost upstream, at aten.rsub in float16 at {HERE}:{cancel_line} in _focal"
    assert want in first.detail, f"got {first.detail!r}, want it to hold {want!r}"


def test_an_underflow_that_makes_a_later_nan_is_named_where_it_flushed() -> None:
    """facebookresearch/xformers#96's normalizer: exp underflows in float16, 0/0 is NaN."""
    x = torch.full((4, 8), 20.0, dtype=torch.float16)
    line = _line(1)
    findings = _audit(lambda: torch.exp(-x) / torch.exp(-x).sum(-1, keepdim=True))
    assert _kinds(findings)[:2] == [("precision_loss", "aten.exp"), ("nonfinite", "aten.div")], _kinds(findings)
    assert "100% of the non-zero ones flushed to 0" in findings[0].detail, findings[0].detail
    first = findings[1]
    assert first.fp32_finite, first.detail
    want = f"at aten.exp in float16 at {HERE}:{line} in"
    assert want in first.detail and "flushed to 0" in first.detail, f"got {first.detail!r}, want {want!r}"


def test_updates_below_half_a_unit_of_a_bf16_destination_are_lost_updates() -> None:
    """An EMA of weights kept in bfloat16 (d8ahazard/sd_dreambooth_extension#1417)."""
    torch.manual_seed(0)
    ema, weights = torch.randn(256).bfloat16(), torch.randn(256).bfloat16()
    line = _line(1)
    findings = _audit(lambda: ema.mul_(0.999).add_(weights, alpha=0.001))
    got = sorted((f.kind, f.op, f.site.line) for f in findings)
    want = sorted(
        [("lost_update", "aten.mul_", line), ("lost_update", "aten.add_", line), ("constant", "aten.mul_", line)]
    )
    assert got == want, f"got {got}, want {want}"
    lost = next(f for f in findings if f.op == "aten.add_" and f.kind == "lost_update")
    assert lost.share > 0.5, f"share of lost updates {lost.share}"


def test_constants_that_round_to_zero_or_infinity_are_named() -> None:
    x = torch.ones(4, dtype=torch.float16)
    findings = _audit(lambda: (x + 1e-8, x * 1e5, torch.full((4,), 0.9999, dtype=torch.bfloat16)))
    got = sorted((f.op, f.detail) for f in findings if f.kind == "constant")
    want = [
        ("aten.add", "the constant other=1e-08 is 0 in float16"),
        ("aten.full", "the constant fill_value=0.9999 is 1 in bfloat16"),
        ("aten.mul", "the constant other=100000 is inf in float16"),
    ]
    assert got == want, f"got {got}, want {want}"


def test_ties_a_low_precision_selection_makes_are_counted() -> None:
    """A router's top-k over bfloat16 probabilities (vllm-project/vllm#14027)."""
    torch.manual_seed(0)
    logits = (torch.randn(512, 8) * 0.01).bfloat16()
    findings = _audit(lambda: torch.softmax(logits, -1).topk(2, dim=-1))
    ties = [f for f in findings if f.kind == "ties"]
    assert [f.op for f in ties] == ["aten.topk"] and ties[0].share > 0.05, _kinds(findings)
    healthy = _audit(lambda: torch.softmax(logits.float(), -1).topk(2, dim=-1))
    assert healthy == [], f"float32 router: {_kinds(healthy)}"


def test_a_function_of_large_bf16_arguments_is_ill_conditioned() -> None:
    """Rotary angles at positions in the thousands (EleutherAI/gpt-neox#1003)."""
    angles = torch.arange(1000, 1256).bfloat16()
    findings = _audit(lambda: torch.cos(angles))
    assert [(f.kind, f.op) for f in findings] == [("ill_conditioned", "aten.cos")], _kinds(findings)
    small = torch.arange(0, 8).bfloat16()
    assert _audit(lambda: torch.cos(small)) == []


def test_integers_past_the_dtype_s_range_are_named() -> None:
    """torch.arange in bfloat16 repeats integers past 256 (pytorch/pytorch#137774)."""
    findings = _audit(lambda: torch.arange(1000, 1016, dtype=torch.bfloat16))
    assert _kinds(findings) == [("precision_loss", "aten.arange")], _kinds(findings)
    assert "holds every integer only up to 256" in findings[0].detail, findings[0].detail
    assert _audit(lambda: torch.arange(0, 16, dtype=torch.bfloat16)) == []


def test_a_running_total_in_bf16_is_a_lost_update_even_of_one_element() -> None:
    """A loss total kept in bfloat16 (huggingface/transformers#8561)."""
    values = torch.full((8,), 1.01).bfloat16()
    findings = _audit(lambda: _bf16_running_sum(values))
    assert _kinds(findings) == [("lost_update", "aten.add_")], _kinds(findings)


def _bf16_running_sum(values: torch.Tensor) -> torch.Tensor:
    total = torch.tensor(4096.0, dtype=torch.bfloat16)
    for value in values:
        total += value
    return total


# -- where ------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.proj(x) * 1000)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_the_module_and_the_caller_of_a_forward_operation_are_named() -> None:
    torch.manual_seed(0)
    model = _Model().half()
    names = {id(m): n for n, m in model.named_modules()}
    x = torch.randn(2, 4, dtype=torch.float16)
    findings = _audit(lambda: model(x), names)
    first = findings[0]
    exp_line = _Block.forward.__code__.co_firstlineno + 1
    caller_line = _Model.forward.__code__.co_firstlineno + 1
    got = (first.kind, first.op, first.phase, first.site.where, first.site.module, first.site.caller)
    want = (
        "nonfinite",
        "aten.exp",
        "forward",
        f"{HERE}:{exp_line} in forward",
        "block",
        f"{HERE}:{caller_line} in forward",
    )
    assert got == want, f"got {got}, want {want}"


def _norm_of_rows(x: torch.Tensor) -> torch.Tensor:
    return x.square().sum(-1).sqrt()  # the backward of sqrt at 0 is infinite


def test_a_backward_operation_is_named_at_the_forward_line_that_made_it() -> None:
    x = torch.zeros(2, 4, dtype=torch.bfloat16, requires_grad=True)
    findings = _audit(lambda: _norm_of_rows(x).sum().backward())
    backward = [(f.kind, f.phase, f.site.where, f.fp32_finite) for f in findings if f.phase == "backward"]
    line = _norm_of_rows.__code__.co_firstlineno + 1
    want = ("nonfinite", "backward", f"{HERE}:{line} in _norm_of_rows", False)
    assert backward[:1] == [want], f"got {backward}, want {want} first"


def test_healthy_bf16_training_with_fp32_master_weights_is_not_named() -> None:
    torch.manual_seed(0)
    master = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16))
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16)).bfloat16()
    model.load_state_dict({k: v.bfloat16() for k, v in master.state_dict().items()})
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 16)

    def iteration() -> None:
        out = model(x.bfloat16())
        F.mse_loss(out.float(), y).backward()
        for m, p in zip(master.parameters(), model.parameters(), strict=True):
            m.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(master.parameters(), model.parameters(), strict=True):
                p.copy_(m)

    findings = _audit(iteration)
    assert findings == [], [(f.kind, f.op, f.site.where, f.detail) for f in findings]


# -- the audit leaves everything as it was ------------------------------------------------------------


def _train(audited: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.GELU(), nn.Linear(32, 8)).bfloat16()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        audit = OpAudit({}) if audited else None
        if audit is not None:
            audit.start()
        x = torch.randn(4, 8).bfloat16()
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if audit is not None:
            audit.finish(top_k=3)
    return [p.detach().clone() for p in model.parameters()], torch.get_rng_state()


def test_training_is_bitwise_the_same_audited_and_not_random_numbers_included() -> None:
    plain, plain_rng = _train(False)
    audited, audited_rng = _train(True)
    for index, (a, b) in enumerate(zip(plain, audited, strict=True)):
        assert torch.equal(a, b), f"parameter {index} differs by {(a.float() - b.float()).abs().max()}"
    assert torch.equal(plain_rng, audited_rng), "the audit drew random numbers"


def test_an_abandoned_audit_is_stopped_and_its_owner_goes_on() -> None:
    """A run that stops in the middle of an audited iteration (a test's end): the audit leaves the
    stack, and the optimizer that started it finishes nothing, then audits again when due."""
    from fsdp_patch.telemetry.instrumentation.op_audits import OperationAudits, abandon_running

    before = _get_current_dispatch_mode_stack()
    audits = OperationAudits(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), 1)
    audits.start()
    got = (abandon_running(), _get_current_dispatch_mode_stack() == before, audits.finish(2, None, 0))
    assert got == (1, True, []), f"abandoned, stack as before, findings: {got}"
    audits.start()
    assert audits.running and len(_get_current_dispatch_mode_stack()) == len(before) + 1
    audits.close()
    assert _get_current_dispatch_mode_stack() == before


def test_finish_removes_the_mode_and_the_module_hooks_exactly() -> None:
    hooks = nn.modules.module._global_forward_hooks
    pre_hooks = nn.modules.module._global_forward_pre_hooks
    before = (dict(hooks), dict(pre_hooks), _get_current_dispatch_mode())
    audit = OpAudit({})
    audit.start()
    assert _get_current_dispatch_mode() is audit and len(hooks) == len(before[0]) + 1
    audit.finish(top_k=1)
    after = (dict(hooks), dict(pre_hooks), _get_current_dispatch_mode())
    assert after == before, f"after {after}, before {before}"


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_stopping_takes_out_the_audit_alone_when_a_mode_was_pushed_after_it() -> None:
    """An optimizer collected (or telemetry turned off) while a profiler's mode runs inside the
    audit: the audit leaves the stack, the other mode stays and keeps seeing operations."""
    before = _get_current_dispatch_mode_stack()
    audit, counting = OpAudit({}), _Counting()
    audit.start()
    _push_mode(counting)
    try:
        audit.stop()
        stack = _get_current_dispatch_mode_stack()
        torch.ones(2, dtype=torch.bfloat16) * 2
    finally:
        _pop_mode()
    assert stack == [*before, counting] and counting.calls > 0, f"stack {stack}, calls {counting.calls}"
    assert _get_current_dispatch_mode_stack() == before


def test_an_iteration_past_max_ops_passes_through() -> None:
    audit = OpAudit({}, max_ops=3)
    audit.start()
    x = torch.ones(4, dtype=torch.bfloat16)
    for _ in range(10):
        x = x * 1.5
    audit.finish(top_k=1)
    assert (len(audit.records), audit.exhausted) == (3, True), (len(audit.records), audit.exhausted)


def test_an_operation_the_reference_cannot_run_is_counted_not_raised() -> None:
    x = torch.ones(4, dtype=torch.bfloat16)
    audit = OpAudit({})
    audit.start()
    with pytest.MonkeyPatch.context() as patch:
        from fsdp_patch.telemetry.diagnostics import op_stats

        def broken(*args: object, **kwargs: object) -> list[torch.Tensor]:
            raise RuntimeError("no float32 kernel")

        patch.setattr(op_stats, "reference", broken)
        y = x * 3
    findings = audit.finish(top_k=1)
    assert torch.equal(y, torch.full((4,), 3.0, dtype=torch.bfloat16)) and findings == [], findings
    assert any("no float32 kernel" in error for error in audit.failed.values()), audit.failed


def test_nothing_in_float32_is_measured() -> None:
    audit = OpAudit({})
    audit.start()
    torch.randn(64, 64) @ torch.randn(64, 64)
    audit.finish(top_k=1)
    assert audit.records == [], [r.op for r in audit.records]


def test_a_float32_constant_that_float32_holds_as_one_is_named_at_the_optimizer_line() -> None:
    """AdamW at lr 1e-4 and weight decay 1e-4 (pytorch/pytorch#64475): its ``param.mul_(1 - lr *
    weight_decay)`` multiplies the float32 weights by 1.0; at weight decay 1e-2 the factor is held."""

    def stepped(weight_decay: float) -> tuple[list[OpFinding], int]:
        param = torch.nn.Parameter(torch.randn(8, 8))
        optimizer = torch.optim.AdamW([param], lr=1e-4, weight_decay=weight_decay, foreach=False)
        param.grad = torch.randn(8, 8)
        line = _line(1)
        findings = _audit(lambda: optimizer.step())
        return [f for f in findings if f.kind == "constant"], line

    found, line = stepped(1e-4)
    got = [(f.op, f.dtype, f.phase, f.site.file.endswith("adam.py"), f.site.caller, f.detail) for f in found]
    detail = "the constant other=0.99999999 is 1 in float32"
    want = [("aten.mul_", "float32", "between_steps", True, f"{HERE}:{line} in <lambda>", detail)]
    assert got == want, f"got {got}, want {want}"
    assert "larger factor applied every k-th step" in found[0].fix, found[0].fix
    held, _ = stepped(1e-2)
    assert held == [], f"1 - 1e-6 is held in float32: want nothing named, got {held}"


def test_ordinary_float32_constants_are_not_recorded() -> None:
    x = torch.randn(16)
    audit = OpAudit({})
    audit.start()
    (x * 0.5 + 1e-8).clamp(max=1 - 1e-6).mul_(0.999)
    audit.finish(top_k=1)
    assert audit.records == [], [r.op for r in audit.records]


def test_adams_late_bias_correction_that_float32_holds_as_one_is_not_named() -> None:
    """At step 20000 Adam divides by sqrt(1 - 0.999**20000), which float32 holds as 1: applied once
    to a result, not again and again to what it writes, it costs what rounding the result does."""
    param = torch.nn.Parameter(torch.randn(8, 8))
    optimizer = torch.optim.Adam([param], lr=1e-4, foreach=False)
    param.grad = torch.randn(8, 8)
    optimizer.step()
    optimizer.state[param]["step"].fill_(20000.0)
    findings = _audit(lambda: optimizer.step())
    got = [(f.op, f.detail) for f in findings if f.kind == "constant"]
    assert got == [], f"want nothing named, got {got}"
