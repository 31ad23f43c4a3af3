"""The compute copy's lifetime (``MixedPrecisionPolicy.compute_copy``): memory at
most FSDP2's. ``"per_gather"`` must train bit for bit like the
persistent copy and like FSDP2, hold no compute-copy memory (each all-gather casts into its own output),
and keep telemetry's precision diagnostics unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.fsdp.sharded_views import full_params, rank0, record_all_gathers, world
from tests.fsdp.test_overlap import CheckpointedTransformer
from tests.models import TinyTransformer, lm_loss, make_batches, make_model, rank_slice, shard_model

CASES = [(False, 1), (True, 4)]  # (checkpointed, microbatches)


BF16 = torch.bfloat16


LAYERS = 3


STEPS = 3


BATCH = 8


IMPLS = ("persistent", "per_gather", "fsdp2")


def build(impl: str, checkpointed: bool) -> nn.Module:
    """bf16 compute, fp32 main weights, bf16 grads; FSDP2 starts from the same bf16 values."""
    torch.manual_seed(0)
    model = (CheckpointedTransformer if checkpointed else TinyTransformer)(layers=LAYERS)
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(BF16))
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    else:
        from fsdp_patch import MixedPrecisionPolicy, fully_shard

        model.to(BF16)
        policy = MixedPrecisionPolicy(compute_copy=impl)  # type: ignore[arg-type]
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _groups(model: nn.Module) -> list[Any]:
    from fsdp_patch import parameter_groups

    return list(parameter_groups(model))


def train(impl: str, checkpointed: bool, microbatches: int) -> dict[str, Any]:
    """STEPS AdamW steps (gradient sync on the last microbatch only), adapted unless FSDP2.

    Records, for ours: at every unit's forward pre-hook and every weight grad of backward
    (all-gathers in flight then), groups holding compute-copy memory; and after
    each step (before ``zero_grad``) and after ``zero_grad``, the compute copies' bytes.
    """
    rank, world_size = world()
    model = build(impl, checkpointed)
    ours = impl != "fsdp2"
    groups = _groups(model) if ours else []
    holding: list[int] = []

    def note(*_: Any) -> None:
        holding.append(sum(1 for g in groups if g.compute_storage_bytes()))

    if ours:
        for module in model.modules():
            module.register_forward_pre_hook(note)
        for group in groups:
            for param in group.unsharded_params:
                param.register_hook(lambda grad: note())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    if ours:
        from fsdp_patch.optimizer import fully_shard_optimizer

        fully_shard_optimizer(optimizer)
    facts: dict[str, Any] = {
        "losses": [],
        "compute_bytes_after_step": [],
        "compute_bytes_after_zero_grad": [],
        "stale_after_step": [],
        "fresh_after_step": [],
    }
    for tokens in make_batches(STEPS, batch=BATCH):
        pieces = rank_slice(tokens, rank, world_size).chunk(microbatches)
        total = 0.0
        for k, piece in enumerate(pieces):
            model.set_requires_gradient_sync(k == len(pieces) - 1)  # type: ignore[operator]
            loss = lm_loss(model, piece) / len(pieces)
            loss.backward()
            total += loss.item()
        facts["losses"].append(total)
        optimizer.step()
        facts["compute_bytes_after_step"].append(sum(g.compute_storage_bytes() for g in groups))
        facts["stale_after_step"].append([",".join(sorted(g.names)) for g in groups if g.compute_stale])
        facts["fresh_after_step"].append([",".join(sorted(g.names)) for g in groups if not g.compute_stale])
        optimizer.zero_grad(set_to_none=True)
        facts["compute_bytes_after_zero_grad"].append(sum(g.compute_storage_bytes() for g in groups))
    facts["params"] = full_params(model)
    facts["holding_compute_copies"] = holding
    facts["shard_compute_bytes"] = sum(g.compute_weight.numel() * g.compute_weight.element_size() for g in groups)
    return facts


def _case_id(case: tuple[bool, int]) -> str:
    return f"{'ckpt' if case[0] else 'plain'}-mb{case[1]}"


def lifetime_run(checkpointed: bool, microbatches: int) -> dict[str, Any]:
    return rank0({impl: train(impl, checkpointed, microbatches) for impl in IMPLS})


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_per_gather_trains_bitwise_like_persistent_and_fsdp2(run_once: Any, case: tuple[bool, int]) -> None:
    facts = run_once(2, lifetime_run, *case)[0]
    want = facts["persistent"]
    for impl in ("per_gather", "fsdp2"):
        got = facts[impl]
        assert got["losses"] == want["losses"], f"{impl}: losses {got['losses']}, persistent {want['losses']}"
        differ = [n for n in want["params"] if not torch.equal(got["params"][n], want["params"][n])]
        assert not differ, f"{impl}: final weights differ from the persistent copy's in {differ}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_per_gather_keeps_no_compute_copy(run_once: Any, case: tuple[bool, int]) -> None:
    got = run_once(2, lifetime_run, *case)[0]["per_gather"]
    steps = STEPS
    seen = got["holding_compute_copies"]
    assert seen, "no observation was made in forward or backward"
    assert max(seen) == 0, (
        f"groups holding compute-copy memory: up to {max(seen)}, in {sum(map(bool, seen))} of {len(seen)} observations"
    )
    assert got["compute_bytes_after_step"] == [0] * steps, (
        f"compute-copy bytes after each step: {got['compute_bytes_after_step']}"
    )
    assert got["compute_bytes_after_zero_grad"] == [0] * steps, (
        f"compute-copy bytes between steps: {got['compute_bytes_after_zero_grad']}"
    )
    assert got["fresh_after_step"] == [[]] * steps, (
        f"per step, groups not marked changed by the step: {got['fresh_after_step']}"
    )


def test_persistent_copy_is_refreshed_and_kept(run_once: Any) -> None:
    """The control: the default copy lives between steps, refreshed (not stale) by the adapter."""
    got = run_once(2, lifetime_run, *CASES[0])[0]["persistent"]
    want = [got["shard_compute_bytes"]] * STEPS
    assert got["shard_compute_bytes"] > 0, "the bf16 model has no separate compute copy"
    assert got["compute_bytes_after_zero_grad"] == want, (
        f"persistent copy bytes between steps: {got['compute_bytes_after_zero_grad']}, want {want}"
    )
    assert got["stale_after_step"] == [[]] * STEPS, (
        f"per step, groups stale after the adapter's refresh: {got['stale_after_step']}"
    )


def telemetry_run() -> dict[str, Any]:
    """Adapted AdamW with telemetry on and diagnostics every step, per lifetime:
    the refresh bytes counted and the precision gauges' values."""
    from tests.integration.otel_training import environment, in_memory_otel, metric_values

    out: dict[str, Any] = {}
    for impl in ("persistent", "per_gather"):
        with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY="1"), in_memory_otel() as (spans, reader):
            facts = train(impl, checkpointed=False, microbatches=1)
            points = metric_values(reader)
            out[impl] = {
                "losses": facts["losses"],
                "refresh_bytes": sum(
                    v
                    for attrs, v in points.get("fsdp.optimizer.cast.size", [])
                    if attrs.get("fsdp.cast.kind") == "weight_refresh"
                ),
                "grad_bytes": sum(
                    v
                    for attrs, v in points.get("fsdp.optimizer.cast.size", [])
                    if attrs.get("fsdp.cast.kind") == "grad"
                ),
                "gauges": {
                    name: sorted(v for _, v in points.get(name, []))
                    for name in (
                        "fsdp.precision.refresh.error",
                        "fsdp.precision.update.lost_ratio",
                        "fsdp.precision.grad.amax",
                    )
                },
                "counters": {
                    name: sum(v for _, v in points.get(name, []))
                    for name in ("fsdp.precision.refresh.overflow", "fsdp.precision.refresh.underflow")
                },
                "refresh_spans": sum(s.name == "fsdp.optimizer.refresh" for s in spans.get_finished_spans()),
                "shard_compute_bytes": facts["shard_compute_bytes"],
            }
    return rank0(out)


def test_per_gather_keeps_precision_diagnostics_and_counts_no_refresh_bytes(run_once: Any) -> None:
    """The diagnostics derive a per_gather group's compute weight by the cast every all-gather
    makes, so they read the same values as with the refreshed persistent copy; no refresh cast
    happens at the step, so none is counted (the refresh span still marks the phase)."""
    facts = run_once(2, telemetry_run)[0]
    persistent, per_gather = facts["persistent"], facts["per_gather"]
    steps = STEPS
    assert per_gather["losses"] == persistent["losses"], f"losses {per_gather['losses']} vs {persistent['losses']}"
    assert persistent["refresh_bytes"] == steps * persistent["shard_compute_bytes"], (
        f"persistent refresh bytes {persistent['refresh_bytes']}, want {steps} x {persistent['shard_compute_bytes']}"
    )
    assert per_gather["refresh_bytes"] == 0, f"per_gather counted {per_gather['refresh_bytes']} refresh bytes"
    assert per_gather["grad_bytes"] == persistent["grad_bytes"] > 0, (
        f"grad cast bytes {per_gather['grad_bytes']} vs {persistent['grad_bytes']}"
    )
    assert per_gather["refresh_spans"] == persistent["refresh_spans"] == steps, (
        f"refresh spans {per_gather['refresh_spans']} vs {persistent['refresh_spans']}, want {steps}"
    )
    for name, values in persistent["gauges"].items():
        assert values, f"{name}: no data point"
        assert per_gather["gauges"][name] == values, (
            f"{name}: per_gather {per_gather['gauges'][name]}, persistent {values}"
        )
    assert per_gather["counters"] == persistent["counters"], f"{per_gather['counters']} vs {persistent['counters']}"


def external_write_run() -> dict[str, Any]:
    """per_gather: a main-weight write outside the optimizer (``load_state_dict``, an in-place
    edit) reaches the next forward, as with the persistent copy; an explicit ``unshard``
    keeps no copy once its all-gather completed."""
    rank, world_size = world()
    tokens = rank_slice(make_batches(1, batch=BATCH)[0], rank, world_size)
    out: dict[str, Any] = {}
    for impl in ("persistent", "per_gather"):
        model = build(impl, checkpointed=False)
        before = lm_loss(model, tokens).item()
        with torch.no_grad():
            model.head.weight.mul_(0.5)  # exact in bf16 and fp32
        halved = lm_loss(model, tokens).item()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.head.weight.zero_()
        model.load_state_dict(state)
        loaded = lm_loss(model, tokens).item()
        model.unshard()  # type: ignore[operator]
        unsharded = sum(g.unsharded_storage_bytes() for g in _groups(model))
        compute_while_unsharded = sum(g.compute_storage_bytes() for g in _groups(model))
        model.reshard()  # type: ignore[operator]
        out[impl] = {
            "before": before,
            "halved": halved,
            "loaded": loaded,
            "unsharded_after_unshard": unsharded,
            "compute_bytes_while_unsharded": compute_while_unsharded,
            "shard_compute_bytes": sum(
                g.compute_weight.numel() * g.compute_weight.element_size() for g in _groups(model)
            ),
        }
    return rank0(out)


def test_per_gather_sees_writes_outside_the_optimizer(run_once: Any) -> None:
    facts = run_once(2, external_write_run)[0]
    persistent, per_gather = facts["persistent"], facts["per_gather"]
    for key in ("before", "halved", "loaded"):
        assert per_gather[key] == persistent[key], (
            f"{key}: per_gather loss {per_gather[key]}, persistent {persistent[key]}"
        )
    assert persistent["halved"] != persistent["before"], "halving the head changed nothing: the test proves nothing"
    assert per_gather["unsharded_after_unshard"] > 0, "explicit unshard gathered nothing"
    assert per_gather["compute_bytes_while_unsharded"] == 0, (
        f"per_gather kept {per_gather['compute_bytes_while_unsharded']} compute bytes after an explicit unshard"
    )
    assert persistent["compute_bytes_while_unsharded"] == persistent["shard_compute_bytes"] > 0


def test_policy_refuses_an_unknown_lifetime() -> None:
    from fsdp_patch import MixedPrecisionPolicy

    with pytest.raises(ValueError, match=r"compute_copy must be one of 'persistent', 'per_gather', got 'lazy'"):
        MixedPrecisionPolicy(compute_copy="lazy")  # type: ignore[arg-type]


def exception_run() -> dict[str, Any]:
    """A forward raises while the next blocks' all-gathers (and, per_gather, their casts) are in
    flight; training then goes on. Per lifetime: what is left gathered or in flight, and the
    losses of the steps around the failure."""
    rank, world_size = world()
    batches = [rank_slice(t, rank, world_size) for t in make_batches(3, batch=BATCH)]

    class Boom(RuntimeError):
        pass

    out: dict[str, Any] = {}
    for impl in ("persistent", "per_gather"):
        model = build(impl, checkpointed=False)
        model.set_overlap_limits(forward_prefetch=2, backward_prefetch=2)  # type: ignore[operator]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        from fsdp_patch.optimizer import fully_shard_optimizer

        fully_shard_optimizer(optimizer)
        losses = []

        def step(tokens: torch.Tensor) -> None:
            loss = lm_loss(model, tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())

        step(batches[0])
        in_flight: dict[str, int] = {}

        def fail(module: nn.Module, args: Any) -> None:
            in_flight["at_raise"] = sum(g.gather_in_flight for g in _groups(model))
            raise Boom("forward")

        handle = model.blocks[0].register_forward_pre_hook(fail)
        try:
            with pytest.raises(Boom, match="forward"):
                lm_loss(model, batches[1])
        finally:
            handle.remove()
        out[impl] = {
            "in_flight_at_raise": in_flight.get("at_raise", 0),
            "in_flight_after": sum(g.gather_in_flight for g in _groups(model)),
            "unsharded_after": sum(g.unsharded_storage_bytes() for g in _groups(model)),
            "compute_bytes_after": sum(g.compute_storage_bytes() for g in _groups(model)),
        }
        step(batches[1])
        step(batches[2])
        out[impl]["losses"] = losses
    return rank0(out)


def test_exception_mid_forward_leaves_nothing_behind_and_training_goes_on(run_once: Any) -> None:
    facts = run_once(2, exception_run)[0]
    persistent, per_gather = facts["persistent"], facts["per_gather"]
    assert per_gather["in_flight_at_raise"] >= 1, "no all-gather was in flight when the forward raised"
    for key in ("in_flight_after", "unsharded_after", "compute_bytes_after"):
        assert per_gather[key] == 0, f"per_gather after the exception: {key} = {per_gather[key]}"
    assert len(per_gather["losses"]) == 3, f"steps trained: {per_gather['losses']}"
    assert per_gather["losses"] == persistent["losses"], (
        f"losses {per_gather['losses']} vs persistent {persistent['losses']}"
    )


def gather_layout_run() -> dict[str, Any]:
    """``per_gather`` over uneven shards (width 25: every flat buffer ends in a shorter last
    shard): the all-gathers of one forward and backward as they are issued, and this rank's
    parameter shard sizes.

    Each all-gather is in place, as NCCL requires of an input inside the output: the input must
    be this rank's slot of the output (rank ``r``'s at ``r`` times its size), holding this rank's
    main weights cast to the compute dtype. A cast into another slot gathers the same weights on
    gloo, which copies in turn, but has every rank read and write one slot at once under NCCL.
    """
    from fsdp_patch import MixedPrecisionPolicy, parameter_groups

    rank, world_size = world()
    model = shard_model(
        make_model(0, dim=25, heads=1).to(BF16), mp_policy=MixedPrecisionPolicy(compute_copy="per_gather")
    )
    shards = [group.main_weight.to(BF16) for group in parameter_groups(model)]
    tokens = rank_slice(make_batches(1)[0], rank, world_size)
    with record_all_gathers() as gathers:
        lm_loss(model, tokens).backward()
    wrong = []
    for index, gather in enumerate(gathers):
        size = gather["input_numel"]
        got = (gather["output_numel"], gather["offset"])
        want = (world_size * size, rank * size)
        if got != want:
            wrong.append(f"all-gather {index}: (output elements, input offset in it) {got}, want {want}")
        if not any(s.shape == gather["input"].shape and torch.equal(s, gather["input"]) for s in shards):
            wrong.append(f"all-gather {index}: its input of {size} elements is no group's main weights cast to bf16")
    return {
        "gathers": len(gathers),
        "wrong": wrong,
        "shard_sizes": [p.to_local().numel() for p in model.parameters()],
    }


@pytest.mark.parametrize("world_size", (2, 4))
def test_per_gather_casts_into_its_own_slot_of_the_gather(dist_pool: Any, world_size: int) -> None:
    """Every all-gather of a ``per_gather`` group reads this rank's slot of its own output, which
    holds this rank's cast main weights, on every rank, over uneven shards."""
    results = dist_pool(world_size).run(gather_layout_run)
    sizes = [r["shard_sizes"] for r in results]
    assert any(len(set(per_param)) > 1 for per_param in zip(*sizes, strict=True)), (
        f"shard sizes per rank {sizes}: want some parameter split unevenly"
    )
    for rank, result in enumerate(results):
        assert result["gathers"] > 0, f"{world_size} ranks, rank {rank}: no all-gather recorded"
        assert result["wrong"] == [], f"{world_size} ranks, rank {rank}: {result['wrong']}"
