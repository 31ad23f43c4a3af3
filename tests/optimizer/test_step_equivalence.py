"""The adapted step is the hand-cast fp32 step, bit for bit, telemetry off or observed.

For every optimizer of the issue's list, on 2 ranks, three copies of the bf16 TinyTransformer
(fp32 main weights, bf16 main grads) train side by side from the same initialization on the
same batches:

- ``null``: adapted through the public ``fully_shard_optimizer`` (telemetry off);
- ``recording``: adapted with a recording observer where telemetry's would be;
- ``ref``: an unadapted optimizer whose grads the test casts to fp32 by hand around the step.

After every step the three have the same grads going in, the same main weights and optimizer
state coming out; each adapted model's compute copy equals its new main weights cast to bf16
before anything else touches it, and its grads are the original bf16 views again. LBFGS steps
with a closure (several backward passes per step) on the sharded parameters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.optimizer.support import (
    BF16,
    CLOSURE_OPTIMIZERS,
    EVEN,
    FP32,
    OBSERVERS,
    OPTIMIZERS,
    HandCast,
    adapt,
    assert_changed,
    assert_compute_fresh,
    assert_grads_original,
    assert_same,
    backward,
    batches,
    build_model,
    fsdp_params,
    grad_dtypes,
    grads_snapshot,
    lbfgs_state,
    main_weights,
    make_closure,
    optimizer_state,
)

STEPS = 3


def _equivalence(name: str) -> None:
    kinds = (*OBSERVERS, "ref")
    closure_mode = name in CLOSURE_OPTIMIZERS
    sizes = EVEN if closure_mode else {}
    models = {k: build_model(**sizes) for k in kinds}
    opts = {k: OPTIMIZERS[name](models[k].parameters()) for k in kinds}
    observers = {k: adapt(opts[k], k) for k in OBSERVERS}
    reference = HandCast(fsdp_params(models["ref"]))
    # A step pre-hook registered after the adaptation sees what the update sees.
    # (The reference's hook sees fp32 too, which checks the hand cast itself.)
    seen: dict[str, list[set[torch.dtype]]] = {k: [] for k in kinds}
    for k in kinds:
        if closure_mode:
            # LBFGS reads the grads produced by its closure through _gather_flat_grad.
            gather = opts[k]._gather_flat_grad

            def spy(k: str = k, gather: Any = gather) -> torch.Tensor:
                seen[k].append(grad_dtypes(opts[k]))
                return gather()

            opts[k]._gather_flat_grad = spy
        else:
            opts[k].register_step_pre_hook(lambda opt, args, kwargs, k=k: seen[k].append(grad_dtypes(opt)))
    before = main_weights(models["null"])
    for step, tokens in enumerate(batches(STEPS, **sizes)):
        if closure_mode:
            for k in OBSERVERS:
                opts[k].step(make_closure(models[k], opts[k], tokens))
            reference.step_with_closure(opts["ref"], make_closure(models["ref"], opts["ref"], tokens))
        else:
            for k in kinds:
                backward(models[k], tokens)
            ref_grads = grads_snapshot(models["ref"])
            for k in OBSERVERS:
                assert_same(grads_snapshot(models[k]), ref_grads, f"{k}: step {step}: grads going in vs reference")
            for k in OBSERVERS:
                opts[k].step()
            reference.step(opts["ref"])
        ref_main = main_weights(models["ref"])
        for k in OBSERVERS:
            tag = f"{k}: step {step}"
            assert_same(main_weights(models[k]), ref_main, f"{tag}: main weights vs hand-cast reference")
            assert_compute_fresh(models[k], tag)
            assert_grads_original(opts[k], f"{tag}: grads are the original bf16 views")
            assert seen[k] and all(s == {FP32} for s in seen[k]), f"{tag}: grad dtypes the update saw: {seen[k]}"
            seen[k].clear()
            if closure_mode:
                assert_same(lbfgs_state(opts[k]), lbfgs_state(opts["ref"]), f"{tag}: LBFGS state vs reference")
            else:
                assert_same(optimizer_state(opts[k]), optimizer_state(opts["ref"]), f"{tag}: state vs reference")
        assert seen["ref"] and all(s == {FP32} for s in seen["ref"]), (
            f"step {step}: grad dtypes the reference's update saw: {seen['ref']}"
        )
        seen["ref"].clear()
        after = grads_snapshot(models["null"])
        assert_same(grads_snapshot(models["recording"]), after, f"step {step}: grads after the step, recording vs null")
        assert_same(grads_snapshot(models["ref"]), after, f"step {step}: grads after the step, reference vs null")
        for k in kinds:
            opts[k].zero_grad()
    assert_changed(main_weights(models["null"]), before, "training")
    observer = observers["recording"]
    assert len(observer.steps) == STEPS, f"recording observer saw {len(observer.steps)} steps, want {STEPS}"
    grad_casts = [(src, dst, n) for kind, src, dst, n in observer.casts if kind == "grads_cast"]
    assert any((src, dst) == (BF16, FP32) and n > 0 for src, dst, n in grad_casts), (
        f"recording observer's grad casts {grad_casts}, want a bf16->fp32 one of some bytes"
    )
    refreshes = [c for c in observer.casts if c[0] == "weights_refreshed"]
    assert refreshes, f"recording observer recorded no refresh cast among {observer.casts}"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_adapted_step_equals_hand_cast_reference(pool2: Any, name: str) -> None:
    pool2.run(_equivalence, name)
