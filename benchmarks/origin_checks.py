"""The per-iteration checks' cost: training step time with them on against off, and escalated.

The checks that say where a NaN/Inf began (``FSDP_PATCH_PRECISION_ORIGIN``, telemetry's
*Origin*) run on every iteration: one reduction over each unit's output and its grad, the loss,
the grads before and after each reduce-scatter, and the main weights twice. Their target is a
training step at most 1.03x as long as without them, telemetry on and the diagnostics at their
default interval either way, on case 5's 27M-parameter transformer, for ``fully_shard`` and for
torch FSDP2. Escalated iterations (after a NaN/Inf) also check every module: their cost is
measured, not targeted.

A check shares nothing with a model it does not watch, so each setting trains a model of its
own: two identical models (one seed), steps alternating between them in rounds; a model built
second runs a few percent slower on a CPU (where its memory lands), so the measurement is made
twice, each setting built first once, and the ratio is the mean of the two medians of per-round
ratios. That ratio's spread from run to run on a 2-core CPU is several percent, as large
as the target; so the checks' own time is measured too, with less spread: the wall time spent
inside the checks (every hook and step entry point of the model watch and the iteration watch,
timed at the outermost call only, so that nothing counts twice) over the step time, on the model
with the checks on. On a CPU every check runs synchronously inside those calls, so that share is
what the checks add to a step, apart from the CPU they take from other threads of the rank (the
collectives' worker); on a GPU it is the checks' host time, their kernels being asynchronous.
A few more steps count the operators the checks dispatch (each a launch on a GPU, whose host pays
for it) and the Python and builtin calls they make: figures that are the same on any device and
from run to run, where a time on a shared machine is not.

On a GPU a step of this model is bound by the host (28 ms on an H200, telemetry on, for a few
milliseconds of kernels), so there the checks cost what their Python and launches take on the host.
``--host-bound`` measures that on a CPU: case 5's structure (6 blocks of the same modules and
parameters, the same units) at width 16, whose kernels cost next to nothing, with lists of tensors
checked by the fused reduction a GPU uses ([Note: one fused reduction per list on a GPU] in
``telemetry/diagnostics/probes.py``). Its own time per step is the host time the checks add to a
step of that shape, the figure that tells one change of the checks' Python from another without a GPU;
what it is on a given GPU's host (a launch costs more than a CPU kernel of 16 elements) is measured
there.

Usage::

    python -m benchmarks.origin_checks [--steps 12] [--world-size 2] [--device cuda] [--host-bound] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from fsdp_patch.app.demo.data import synthetic_batches
from fsdp_patch.app.demo.launch import run_ranks
from fsdp_patch.app.demo.model import GPT, GPTConfig, lm_loss
from fsdp_patch.telemetry.diagnostics import prepared_checks
from fsdp_patch.telemetry.diagnostics.probes import ProbeLog
from fsdp_patch.telemetry.instrumentation.fsdp2_reduce_checks import FSDP2ReduceChecks
from fsdp_patch.telemetry.instrumentation.iterations import IterationWatch
from fsdp_patch.telemetry.instrumentation.model_watch import ModelWatch
from torch.utils._python_dispatch import TorchDispatchMode

from .common import Clock, median, paired, paired_ratio, training_steps, write_results
from .telemetry_overhead import LARGE, _device, _quiet_telemetry

KINDS = ("fully_shard", "fsdp2")
# Case 5's blocks, heads and units at a width whose kernels cost next to nothing (``--host-bound``).
HOST_BOUND = GPTConfig(vocab=64, dim=16, heads=8, layers=6, seq=8)
# Setting -> the environment its optimizer is adapted under (the diagnostics at their default interval).
SETTINGS: dict[str, dict[str, str]] = {
    "off": {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_ORIGIN": "off"},
    "checks": {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_ORIGIN": "on"},
}


def _model(kind: str, config: GPTConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(config).to(_device())
    if kind == "fully_shard":
        from fsdp_patch.app.demo.model import shard

        from fsdp_patch import MixedPrecisionPolicy

        # fp32 compute with bf16 main grads, as case 5: every step casts grads and stays fast on
        # CPUs without bf16 matrix units.
        return shard(model, mp_policy=MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16))
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _trained(kind: str, config: GPTConfig, setting: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from fsdp_patch.optimizer import fully_shard_optimizer

    model = _model(kind, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with mock.patch.dict(os.environ, SETTINGS[setting]):
        fully_shard_optimizer(optimizer)
    return model, optimizer


def _escalate(optimizer: torch.optim.Optimizer) -> IterationWatch:
    """Every iteration from now on escalated (module-level checks, diagnostics every step), as the
    iterations after a NaN/Inf are (reached through the adapter's registry: a benchmark's way in,
    no public switch)."""
    from fsdp_patch.adapter import adaptation_of

    adaptation = adaptation_of(optimizer)
    assert adaptation is not None
    iterations = adaptation.observer._iterations  # type: ignore[attr-defined]
    iterations.escalated_until = 2**62  # else the next step's report ends an escalation no NaN/Inf began
    for watch in iterations.watches:
        watch.escalate()
    return iterations


def _pair(
    kind: str, config: GPTConfig, steps: int, warmup: int, order: tuple[str, str], escalated: bool
) -> dict[str, Any]:
    built = {setting: _trained(kind, config, setting) for setting in order}
    iterations = _escalate(built["checks"][1]) if escalated else None
    device = _device()
    clock = Clock(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [b[rank::world].to(device) for b in synthetic_batches(config, 4 * world, steps + warmup)]
    step = training_steps(built, batches, clock, lm_loss)
    times = paired({setting: (lambda s=setting: step(s)) for setting in order}, steps, warmup)
    result = {f"step_s_{s}": median(times[s]) for s in order}
    result["ratio"] = paired_ratio(times, "checks", "off")
    if iterations is not None:
        result["escalated_to_the_end"] = iterations.escalated and all(w.modules for w in iterations.watches)
    return result


class _OwnTime:
    """Wall time inside the checks' entry points, counted at the outermost call only."""

    # (class, method) pairs: the model watch's hooks and step checks, what torch FSDP2's patched
    # reduce calls, the probe log, the iteration watch's step entry points.
    ENTRY_POINTS = (
        (ModelWatch, "_model_input"),
        (ModelWatch, "_unit_output"),
        (ModelWatch, "_unit_output_grad"),
        (ModelWatch, "_reduced"),
        (FSDP2ReduceChecks, "_before_reduce"),
        (FSDP2ReduceChecks, "_after_reduce"),
        (ModelWatch, "before_backward"),
        (ModelWatch, "after_backward"),
        (ProbeLog, "check"),
        (IterationWatch, "begin_step"),
        (IterationWatch, "end_step"),
    )

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._originals: list[tuple[type, str, Any]] = []
        # When set, the operators the checks dispatch are counted here (not timed: counting costs).
        self.ops: collections.Counter[str] | None = None
        # When set, the Python and builtin function calls made inside the checks are counted here.
        self.calls: list[int] | None = None

    def __enter__(self) -> _OwnTime:
        for owner, name in self.ENTRY_POINTS:
            original = owner.__dict__[name]
            self._originals.append((owner, name, original))
            setattr(owner, name, self._timed(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def _timed(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.ops is not None and self._depth == 0:
                with _CountOps(self.ops):
                    return self._timed_call(fn, args, kwargs)
            if self.calls is not None and self._depth == 0:
                return self._counted_call(fn, args, kwargs, self.calls)
            return self._timed_call(fn, args, kwargs)

        return timed

    def _timed_call(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._depth += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.seconds += time.perf_counter() - start

    def _counted_call(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], calls: list[int]) -> Any:
        def profile(frame: Any, event: str, arg: Any) -> None:
            if event in ("call", "c_call"):
                calls[0] += 1

        self._depth += 1
        sys.setprofile(profile)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(None)
            self._depth -= 1


class _CountOps(TorchDispatchMode):
    """Counts the operators dispatched under it, by name: what a GPU would launch (and its host
    pay for), on any device."""

    def __init__(self, counts: collections.Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _own_share(kind: str, config: GPTConfig, steps: int, warmup: int) -> dict[str, Any]:
    """The checks' own time over the step time, on a model with the checks on (on a GPU, host
    time: see the module), and the operators they dispatch per step."""
    with _OwnTime() as own:  # before the build: the watch's hooks are bound then
        model, optimizer = _trained(kind, config, "checks")
        rank, world = dist.get_rank(), dist.get_world_size()
        batches = [b[rank::world].to(_device()) for b in synthetic_batches(config, 4 * world, steps + warmup)]
        shares = []
        for index, tokens in enumerate(batches):
            own.seconds = 0.0
            start = time.perf_counter()
            lm_loss(model, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
            if index >= warmup:
                shares.append((own.seconds, time.perf_counter() - start))
        counted = batches[:4]
        counts = own.ops = collections.Counter()
        for tokens in counted:
            lm_loss(model, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
        own.ops, own.calls = None, [0]
        for tokens in counted:
            lm_loss(model, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
    # Each rank's share, then the larger: a step waits for its slowest rank.
    share = torch.tensor([median([o / s for o, s in shares]), median([o for o, _ in shares])], dtype=torch.float64)
    dist.all_reduce(share, op=dist.ReduceOp.MAX)
    ops = {name: count / len(counted) for name, count in sorted(counts.items())}
    calls = own.calls[0] / len(counted)
    return {
        "own_share": float(share[0]),
        "own_s": float(share[1]),
        "ops_per_step": sum(ops.values()),
        "ops": ops,
        "calls_per_step": calls,
    }


@contextlib.contextmanager
def _fused_on_cpu() -> Iterator[None]:
    """Lists of CPU tensors checked by the fused reduction, as on a GPU (``--host-bound``)."""
    with mock.patch.object(prepared_checks, "FUSED_DEVICE_TYPES", prepared_checks.FUSED_DEVICE_TYPES | {"cpu"}):
        yield


def run(steps: int = 12, warmup: int = 2, config: GPTConfig = LARGE, host_bound: bool = False) -> dict[str, Any]:
    """Per kind: the checks' ratio (both build orders), their own share of a step, the escalated ratio."""
    out: dict[str, Any] = {"host_bound": host_bound}
    if host_bound:
        config = HOST_BOUND
    with _quiet_telemetry(), _fused_on_cpu() if host_bound else contextlib.nullcontext():
        for kind in KINDS:
            first = _pair(kind, config, steps, warmup, ("checks", "off"), escalated=False)
            second = _pair(kind, config, steps, warmup, ("off", "checks"), escalated=False)
            escalated = _pair(kind, config, steps, warmup, ("checks", "off"), escalated=True)
            own = _own_share(kind, config, steps, warmup)
            out[kind] = {
                "ratio_checks_off": statistics.mean([first["ratio"], second["ratio"]]),
                "ratio_checks_off_by_order": [first["ratio"], second["ratio"]],
                "step_s_off": statistics.mean([first["step_s_off"], second["step_s_off"]]),
                "step_s_checks": statistics.mean([first["step_s_checks"], second["step_s_checks"]]),
                "ratio_escalated_off": escalated["ratio"],
                "escalated_to_the_end": escalated["escalated_to_the_end"],
                **own,
            }
    out["params"] = sum(p.numel() for p in GPT(config).parameters())
    out["config"] = dataclasses.asdict(config)
    return out


def _print(results: dict[str, Any], steps: int) -> None:
    shape = (
        "case 5's structure at width 16, lists fused as on a GPU (host-bound)"
        if results["host_bound"]
        else f"{results['params'] / 1e6:.1f}M-parameter transformer"
    )
    print(
        f"per-iteration checks, {shape}, {dist.get_world_size()} rank(s), {steps} paired steps per build order; "
        "target: checks / off <= 1.03"
    )
    print()
    print(
        "| sharding | step, checks off | step, checks on | checks / off (each build order) | escalated / off "
        "| checks' own time | operators per step | Python calls per step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in KINDS:
        r = results[kind]
        low, high = r["ratio_checks_off_by_order"]
        print(
            f"| {kind} | {r['step_s_off'] * 1e3:.2f} ms | {r['step_s_checks'] * 1e3:.2f} ms "
            f"| {r['ratio_checks_off']:.3f} ({low:.3f}, {high:.3f}) | {r['ratio_escalated_off']:.3f} "
            f"| {r['own_s'] * 1e3:.2f} ms, {r['own_share']:.1%} of a step | {r['ops_per_step']:.0f} "
            f"| {r['calls_per_step']:.0f} |"
        )
    print()
    for kind in KINDS:
        ops = ", ".join(f"{name} {count:g}" for name, count in results[kind]["ops"].items())
        print(f"{kind}: operators the checks dispatch per step: {ops}")


def bench(steps: int, warmup: int, json_path: str | None, host_bound: bool = False) -> None:
    results = run(steps, warmup, host_bound=host_bound)
    if dist.get_rank() != 0:
        return
    _print(results, steps)
    if json_path:
        write_results(json_path, "origin_checks", {"steps": steps, **results})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    parser.add_argument(
        "--host-bound",
        action="store_true",
        help="case 5's structure at width 16, lists fused as on a GPU: the checks' host time (CPU only)",
    )
    parser.add_argument("--json", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.host_bound and args.device != "cpu":
        parser.error("--host-bound measures on the CPU: leave --device out")
    run_ranks(bench, args.world_size, args.steps, args.warmup, args.json, args.host_bound, device=args.device)


if __name__ == "__main__":
    main()
