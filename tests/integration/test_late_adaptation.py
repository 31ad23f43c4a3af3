"""Optimizers whose parameters become FSDP-managed after construction, on 2 gloo ranks, ``fully_shard``
and torch FSDP2, under the instrumentor with in-memory providers.

- HF Accelerate's FSDP2 preparation swaps the sharded parameters into an optimizer built before
  sharding (done here by hand, as ``fsdp2_switch_optimizer_parameters`` does: by name, in place);
  ``add_param_group`` after sharding adds them. Either is adapted before its first step: step
  spans from step 1, and the model trains exactly as one whose optimizer was built after sharding.
- An optimizer built before sharding and never given the sharded parameters steps nothing: its
  first step warns once on every rank, naming the fix; ``fully_shard_optimizer`` refuses it.
- The watch's process-wide pieces (a wrapper on ``torch.autograd.backward``, a global step
  pre-hook) are gone once nothing is watched, and after ``uninstrument()``.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import models
from tests.integration.otel_training import environment, in_memory_otel, main_weights
from tests.telemetry.telemetry_testing import global_state

KINDS = ("fully_shard", "fsdp2")
STEPS = 3
WATCH_LOGGER = "fsdp_patch.telemetry.instrumentation.late_adaptation"


def _shard(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    if kind == "fully_shard":
        return models.shard_model(model)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return models.fsdp2_shard_model(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))


def _unsharded(kind: str) -> torch.nn.Module:
    model = models.make_model(0)
    return model.bfloat16() if kind == "fully_shard" else model  # fully_shard: bf16 compute weights


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for tokens in models.make_batches(STEPS):
        loss = models.lm_loss(model, models.rank_slice(tokens, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def late_training(kind: str, how: str) -> dict[str, Any]:
    """``how``: ``after`` (the control: built after sharding), ``swapped`` (built before, the sharded
    parameters swapped in by name), ``added`` (built over a plain parameter, the sharded ones added
    with ``add_param_group``), ``stale`` (built before and left so). Returns losses, step spans,
    warnings, what stayed installed."""
    from fsdp_patch.telemetry import FSDPOptimizerInstrumentor, semconv
    from fsdp_patch.telemetry.instrumentation import training_calls

    from fsdp_patch.adapter import adaptation_of

    handler = _Messages()
    logging.getLogger(WATCH_LOGGER).addHandler(handler)
    out: dict[str, Any] = {}
    settings = {"FSDP_PATCH_TELEMETRY": None, "FSDP_PATCH_PRECISION_EVERY": "1", "FSDP_PATCH_SUMMARY": "none"}
    try:
        with environment(**settings), in_memory_otel() as (spans, _):
            gc.collect()  # an earlier test's optimizers (and the wrappers they hold) go first
            before = global_state()
            before_registrations = training_calls._registrations
            instrumentor = FSDPOptimizerInstrumentor()
            instrumentor.instrument()
            model = _unsharded(kind)
            names = [name for name, _ in model.named_parameters()]
            if how in ("swapped", "stale"):
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
                _shard(model, kind)
                if how == "swapped":
                    sharded = dict(model.named_parameters())
                    optimizer.param_groups[0]["params"] = [sharded[name] for name in names]
            elif how == "added":
                optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-2)
                _shard(model, kind)
                optimizer.add_param_group({"params": list(model.parameters())})
            else:
                _shard(model, kind)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            out["adapted before training"] = adaptation_of(optimizer) is not None
            out["losses"] = _train(model, optimizer)
            out["adapted after training"] = adaptation_of(optimizer) is not None
            out["steps"] = sorted(
                s.attributes[semconv.ATTR_STEP] for s in spans.get_finished_spans() if s.name == semconv.SPAN_STEP
            )
            out["weights"] = [w.clone() for w in main_weights(model)] if how != "stale" else []
            # The watch's own pieces: its listener on the shared backward wrapper, its step pre-hook.
            # (The wrapper itself is shared with every live optimizer's watches, in this process
            # possibly an earlier test's: its identity is checked after uninstrument, below.)
            out["listeners after training"] = len(training_calls._backward_listeners)
            out["step hooks changed"] = (
                global_state()["global optimizer step pre-hooks"] != before["global optimizer step pre-hooks"]
            )
            registrations = training_calls._registrations
            instrumentor.uninstrument()
            gc.collect()
            out["left after uninstrument"] = {k: v for k, v in global_state().items() if v != before[k]}
            out["registrations"] = (before_registrations, registrations, training_calls._registrations)
    finally:
        logging.getLogger(WATCH_LOGGER).removeHandler(handler)
    out["warnings"] = handler.messages
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["swapped", "added"])
def test_parameters_given_after_construction_are_adapted_before_the_first_step(dist_pool, kind, how) -> None:
    pool = dist_pool(2)
    control = pool.run(late_training, kind, "after")
    late = pool.run(late_training, kind, how)
    for rank, (got, want) in enumerate(zip(late, control, strict=True)):
        assert want["adapted before training"], f"rank {rank}: the control was not adapted at construction"
        assert not got["adapted before training"] and got["adapted after training"], (
            f"rank {rank}: want adapted only once it held sharded parameters, got {got['adapted before training']}, "
            f"{got['adapted after training']}"
        )
        assert got["steps"] == list(range(1, STEPS + 1)), f"rank {rank}: want step spans 1..{STEPS}, got {got['steps']}"
        assert got["losses"] == want["losses"], f"rank {rank}: losses {got['losses']} != control {want['losses']}"
        if how == "swapped":  # the same parameters in the same order: the same model, bitwise
            differ = [
                i for i, (a, b) in enumerate(zip(got["weights"], want["weights"], strict=True)) if not torch.equal(a, b)
            ]
            assert not differ, f"rank {rank}: main weights {differ} differ from the control's"
        assert got["warnings"] == [], f"rank {rank}: unexpected warnings {got['warnings']}"
        left = got["left after uninstrument"]
        assert left == {}, (
            f"rank {rank}: left installed after uninstrument: {left} (registrations {got['registrations']})"
        )


@pytest.mark.parametrize("kind", KINDS)
def test_an_optimizer_built_before_sharding_is_warned_about_on_every_rank(dist_pool, kind) -> None:
    for rank, got in enumerate(dist_pool(2).run(late_training, kind, "stale")):
        assert not got["adapted after training"] and got["steps"] == [], f"rank {rank}: {got['steps']}"
        warned = [m for m in got["warnings"] if "build the optimizer after sharding" in m]
        assert len(warned) == 1 and len(got["warnings"]) == 1, f"rank {rank}: want one warning, got {got['warnings']}"
        assert "AdamW over" in warned[0] and "no gradient on any of its parameters" in warned[0], warned[0]
        # the first step ended the watch; the next backward removed its listener and its hook
        assert got["listeners after training"] == 0 and not got["step hooks changed"], (
            f"rank {rank}: still listening after the watch ended: {got['listeners after training']} listener(s), "
            f"step hooks changed {got['step hooks changed']}"
        )
        left = got["left after uninstrument"]
        assert left == {}, f"rank {rank}: left installed: {left} (registrations {got['registrations']})"


def refused_stale(kind: str) -> dict[str, Any]:
    """fully_shard_optimizer on an optimizer built before sharding: the error, and the optimizer untouched."""
    from fsdp_patch.adapter import adaptation_of
    from fsdp_patch.optimizer import fully_shard_optimizer

    model = _unsharded(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _shard(model, kind)
    keys = sorted(optimizer.__dict__)
    try:
        fully_shard_optimizer(optimizer)
        error = ""
    except ValueError as exc:
        error = str(exc)
    return {
        "error": error,
        "adapted": adaptation_of(optimizer) is not None,
        "unchanged": sorted(optimizer.__dict__) == keys,
    }


@pytest.mark.parametrize("kind", KINDS)
def test_fully_shard_optimizer_refuses_an_optimizer_built_before_sharding(dist_pool, kind) -> None:
    for rank, got in enumerate(dist_pool(2).run(refused_stale, kind)):
        assert (
            "param_groups[0]['params'][0]" in got["error"] and "build the optimizer after fully_shard" in got["error"]
        ), f"rank {rank}: want a refusal naming the parameter and the fix, got {got['error']!r}"
        assert not got["adapted"] and got["unchanged"], f"rank {rank}: the refused optimizer was changed: {got}"
