"""Communication overlap: each unit issues the next
units' all-gathers before it computes, in forward and backward, up to a limit, and leaves its
reduce-scatter running while backward goes on. Training must not change by a bit, at most the
configured number of units may be gathered ahead, and an exception must leave nothing behind."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_patch.sharding.grad_reduce import REDUCE_INPUT
from tests.fsdp.sharded_views import full_params, rank0, unsharded_bytes, world
from tests.models import TinyTransformer, lm_loss, make_batches, rank_slice, shard_model

CASES = [  # (world size, checkpointed, microbatches, gradient sync)
    (2, False, 1, "all"),
    (2, True, 4, "last"),
    (2, False, 4, "all"),
    (4, True, 1, "all"),
    (4, False, 4, "last"),
]
LIMITS = {"off": 0, "default": 1, "deep": 2}


LAYERS = 4
REDUCES_DEEP = 4


STEPS = 3


BATCH = 8  # rows per step: 4 microbatches of 2 split over 2 ranks, or 1 microbatch over 4


class CheckpointedTransformer(TinyTransformer):
    """The test transformer with each block under non-reentrant activation checkpointing."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.norm(x))


def build(checkpointed: bool, limits: tuple[int, int, int]) -> nn.Module:
    torch.manual_seed(0)
    model = (CheckpointedTransformer if checkpointed else TinyTransformer)(layers=LAYERS)
    shard_model(model)
    forward, backward, reduces = limits
    model.set_overlap_limits(forward_prefetch=forward, backward_prefetch=backward, reduce_scatters_in_flight=reduces)
    return model


def _units(model: nn.Module) -> dict[str, nn.Module]:
    from fsdp_patch import FSDPModule

    return {name or "<root>": m for name, m in model.named_modules() if isinstance(m, FSDPModule)}


def _gathered(units: dict[str, nn.Module]) -> set[str]:
    return {name for name, m in units.items() if any(g.unsharded_storage_bytes() for g in m.fsdp_parameter_groups)}


def train(checkpointed: bool, limits: tuple[int, int, int], microbatches: int, sync: str) -> dict[str, Any]:
    """Trains STEPS AdamW steps; records, at every unit's forward and backward, which other
    units hold gathered weights besides the one computing and the root."""
    rank, world_size = world()
    model = build(checkpointed, limits)
    units = _units(model)
    ahead: dict[str, list[int]] = {"forward": [], "backward": []}
    reducing: list[int] = []

    def note(direction: str, current: str) -> None:
        ahead[direction].append(len(_gathered(units) - {current, "<root>"}))
        if direction == "backward":
            reducing.append(sum(g.reduce_in_flight for m in units.values() for g in m.fsdp_parameter_groups))

    def forward_hook(current: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if torch._C._current_graph_task_id() == -1:  # not a checkpoint's recompute
                note("forward", current)

        return hook

    packing: list[int] = []

    def at_pack(group: Any, stage: str, grads: torch.Tensor) -> None:
        if stage == REDUCE_INPUT:
            packing.append(sum(g.reduce_in_flight for m in units.values() for g in m.fsdp_parameter_groups))

    for unit in units.values():
        for group in unit.fsdp_parameter_groups:
            group.register_reduce_hook(at_pack)
    for name, unit in units.items():
        if name == "<root>":
            continue
        # Registered after fully_shard's: runs once the unit is gathered and its prefetch issued.
        unit.register_forward_pre_hook(forward_hook(name))
        # Runs when backward computes this unit's first weight grad: the unit is computing.
        unit.fsdp_parameter_groups[0].unsharded_params[0].register_hook(lambda g, name=name: note("backward", name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    batches = make_batches(STEPS, batch=BATCH)
    losses, storage_after_zero_grad = [], []
    for tokens in batches:
        pieces = rank_slice(tokens, rank, world_size).chunk(microbatches)
        step_loss = 0.0
        for k, piece in enumerate(pieces):
            if sync == "last":
                model.set_requires_gradient_sync(k == len(pieces) - 1)
            loss = lm_loss(model, piece) / len(pieces)
            loss.backward()
            step_loss += loss.item()
        losses.append(step_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        storage_after_zero_grad.append(
            sum(g.main_grad_storage_bytes() for m in units.values() for g in m.fsdp_parameter_groups)
        )
    return {
        "losses": losses,
        "params": rank0(full_params(model)),
        "ahead": ahead,
        "reducing": reducing,
        "packing": packing,
        "storage_after_zero_grad": storage_after_zero_grad,
        "gathered_at_end": sorted(_gathered(units)),
    }


def overlap_run(checkpointed: bool, microbatches: int, sync: str) -> dict[str, Any]:
    """The same training with overlap off (every collective blocking), the defaults, and deeper
    prefetch with more reduce-scatters in flight."""
    settings = {"off": (0, 0, 0), "default": (1, 1, 1), "deep": (2, 2, REDUCES_DEEP)}
    return {name: train(checkpointed, limits, microbatches, sync) for name, limits in settings.items()}


def _run(run_once: Any, case: tuple[int, bool, int, str]) -> list[dict[str, Any]]:
    world_size, checkpointed, microbatches, sync = case
    return run_once(world_size, overlap_run, checkpointed, microbatches, sync)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ws{c[0]}-{'ckpt' if c[1] else 'plain'}-mb{c[2]}-sync_{c[3]}")
def test_overlap_trains_bitwise_like_blocking_collectives(run_once: Any, case: tuple[int, bool, int, str]) -> None:
    per_rank = _run(run_once, case)
    want = per_rank[0]["off"]
    for name in ("default", "deep"):
        got = per_rank[0][name]
        for rank, facts in enumerate(per_rank):
            assert facts[name]["losses"] == facts["off"]["losses"], (
                f"rank {rank}, overlap {name}: losses {facts[name]['losses']}, blocking {facts['off']['losses']}"
            )
        differ = [n for n in want["params"] if not torch.equal(got["params"][n], want["params"][n])]
        assert not differ, f"overlap {name}: final weights differ from blocking collectives in {differ}"


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"ws{c[0]}-{'ckpt' if c[1] else 'plain'}")
def test_units_gathered_ahead_never_exceed_the_limit(run_once: Any, case: tuple[int, bool, int, str]) -> None:
    """Counted from storages at each unit's forward and backward: units other than the one
    computing and the root whose weights are gathered (or being gathered)."""
    for rank, facts in enumerate(_run(run_once, case)):
        for name, limit in LIMITS.items():
            for direction in ("forward", "backward"):
                ahead = facts[name]["ahead"][direction]
                assert ahead, f"rank {rank}: no {direction} observations"
                assert max(ahead) == limit, (
                    f"rank {rank}, limit {limit}: at most {max(ahead)} units gathered ahead in {direction} "
                    f"(want exactly {limit} at some point, never more): {ahead}"
                )
            assert facts[name]["gathered_at_end"] == [], (
                f"rank {rank}: still gathered after training: {facts[name]['gathered_at_end']}"
            )


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"ws{c[0]}-{'ckpt' if c[1] else 'plain'}")
def test_reduce_scatters_in_flight_never_exceed_the_limit(run_once: Any, case: tuple[int, bool, int, str]) -> None:
    """Counted at each unit's backward: reduce-scatters issued and not completed. As FSDP2's
    reduce_scatter_max_input_buffers: at most the limit, the last one issued included, so with
    the default 1 the previous unit's runs while this one computes; off, none."""
    limits = {"off": 0, "default": 1, "deep": min(REDUCES_DEEP, LAYERS - 1)}  # LAYERS - 1 blocks before block 0
    # When a unit packs its grads, fewer than the limit run: with its own, at most the limit.
    at_pack = {"off": 0, "default": 0, "deep": min(REDUCES_DEEP - 1, LAYERS)}
    for rank, facts in enumerate(_run(run_once, case)):
        got = {name: max(facts[name]["reducing"]) for name in limits}
        assert got == limits, f"rank {rank}: most reduce-scatters in flight at a unit's backward {got}, want {limits}"
        got_pack = {name: max(facts[name]["packing"]) for name in at_pack}
        assert got_pack == at_pack, (
            f"rank {rank}: most reduce-scatters in flight as a unit packs its grads {got_pack}, want {at_pack}"
        )


def test_main_grad_memory_is_free_after_zero_grad_set_to_none(run_once: Any) -> None:
    for rank, facts in enumerate(_run(run_once, CASES[0])):
        for name in LIMITS:
            got = facts[name]["storage_after_zero_grad"]
            assert got == [0] * STEPS, f"rank {rank}, {name}: main-grad bytes after zero_grad: {got}"


def forward_exception_run() -> dict[str, Any]:
    """A block's forward raises while the next blocks' all-gathers are in flight."""
    rank, world_size = world()
    model = build(False, (2, 2, 2))
    units = _units(model)
    tokens = rank_slice(make_batches(1, batch=BATCH)[0], rank, world_size)
    lm_loss(model, tokens).backward()  # one iteration first, so the forward order is learned

    class Boom(RuntimeError):
        pass

    def fail(module: nn.Module, args: Any) -> None:
        in_flight["at_raise"] = sum(g.gather_in_flight for m in units.values() for g in m.fsdp_parameter_groups)
        raise Boom("forward")

    in_flight: dict[str, int] = {}
    handle = model.blocks[1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(Boom, match="forward"):
            lm_loss(model, tokens)
    finally:
        handle.remove()
    facts = {
        "in_flight_at_raise": in_flight.get("at_raise"),
        "gathered_after": unsharded_bytes(model),
        "in_flight_after": sum(g.gather_in_flight for m in units.values() for g in m.fsdp_parameter_groups),
        "unsharded_in_modules": [
            n for n, p in model.named_parameters() if not isinstance(p, torch.distributed.tensor.DTensor)
        ],
    }
    model.zero_grad(set_to_none=True)
    lm_loss(model, tokens).backward()
    facts["next_iteration_no_grad"] = [n for n, p in model.named_parameters() if p.grad is None]
    return facts


def test_exception_mid_forward_leaves_nothing_gathered_or_in_flight(run_once: Any) -> None:
    for rank, facts in enumerate(run_once(2, forward_exception_run)):
        assert facts["in_flight_at_raise"] >= 1, f"rank {rank}: no all-gather was in flight when the forward raised"
        assert set(facts["gathered_after"].values()) == {0}, (
            f"rank {rank}: gathered after the exception: {facts['gathered_after']}"
        )
        assert facts["in_flight_after"] == 0, f"rank {rank}: {facts['in_flight_after']} all-gathers still in flight"
        left = facts["unsharded_in_modules"]
        assert left == [], f"rank {rank}: unsharded parameters left in the modules: {left}"
        missing = facts["next_iteration_no_grad"]
        assert missing == [], f"rank {rank}: the next iteration produced no grads for {missing}"
