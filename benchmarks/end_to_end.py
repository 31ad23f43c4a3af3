"""Case 6: ``fully_shard`` + the adapter against torch FSDP2, end to end, on the main job's transformer.

Both train ``fsdp_patch.app.demo.model.GPT`` with bf16 compute and fp32 main weights under AdamW, on
2 gloo ranks (on CUDA: one rank per GPU, at most 2), with 1 and 4 microbatches per step
(gradient sync on the last one only):

- ours: ``model.bfloat16()`` then ``fully_shard`` with ``main_grads_dtype`` bf16 (or fp32),
  ``fully_shard_optimizer``; with the collective overlap at its defaults, and again with every
  overlap knob at 0 (``set_overlap_limits(forward_prefetch=0, backward_prefetch=0,
  reduce_scatters_in_flight=0)``: each collective blocks where it is issued);
- FSDP2: ``torch.distributed.fsdp.fully_shard`` with ``param_dtype=bf16`` and ``reduce_dtype``
  bf16 (or fp32).

Step time: each contender is its own model from one seed, stepped in rotation on the same
batches, so the losses of every step can be compared too (bitwise, ours against FSDP2 with
bf16 reduce, and overlap on against off). Memory, per rank, of a model built and trained two
steps under a :class:`~benchmarks.memory.StorageMeter` (CUDA: the caching allocator's
counters): the peak tensor bytes of the second step, the tensor bytes between steps (after
``zero_grad(set_to_none=True)``), and the RSS high-water mark of that stretch; ours also with
its cast buffers freed between steps (``keep_cast_buffers(optimizer, False)``).

Targets: step time at most 0.9x FSDP2's with 1 microbatch and 0.8x with 4; peak and
between-step tensor bytes at most FSDP2's.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from .common import CaseResult, Clock, median, paired, paired_ratio, target_row, write_rank_result

__all__ = ["run", "rank_main"]

FULL = {"model": {"vocab": 8192, "dim": 256, "heads": 4, "layers": 8, "seq": 64}, "rows": 8, "steps": 10, "warmup": 1}
QUICK = {"model": {"vocab": 256, "dim": 64, "heads": 2, "layers": 2, "seq": 16}, "rows": 8, "steps": 2, "warmup": 1}
MICROBATCHES = (1, 4)
REDUCE = {"bf16": torch.bfloat16, "fp32": torch.float32}
OVERLAP_OFF = {"forward_prefetch": 0, "backward_prefetch": 0, "reduce_scatters_in_flight": 0}


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _ours(
    config: Any, reduce: torch.dtype, overlap: dict[str, int] | None, compute_copy: str = "persistent"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from fsdp_patch.app.demo.model import GPT, shard

    from fsdp_patch import MixedPrecisionPolicy
    from fsdp_patch.optimizer import fully_shard_optimizer

    torch.manual_seed(0)
    policy = MixedPrecisionPolicy(main_grads_dtype=reduce, compute_copy=compute_copy)  # type: ignore[arg-type]
    model = shard(GPT(config).to(_device()).bfloat16(), mp_policy=policy)
    if overlap is not None:
        model.set_overlap_limits(**overlap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with mock.patch.dict(os.environ, {"FSDP_PATCH_TELEMETRY": "0"}):
        fully_shard_optimizer(optimizer)
    return model, optimizer


def _fsdp2(config: Any, reduce: torch.dtype) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from fsdp_patch.app.demo.model import GPT
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = GPT(config).to(_device())
    with torch.no_grad():
        # Ours starts its fp32 main weights from the bf16 model's values, upcast: so does this.
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


PHASES = ("forward", "backward", "optimizer")


def _train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    microbatches: list[torch.Tensor],
    clock: Clock | None = None,
    phases: dict[str, list[float]] | None = None,
) -> float:
    """One optimizer step over ``microbatches``; with ``clock``, appends the seconds of each of
    :data:`PHASES` (summed over microbatches) to ``phases``: where the step's time goes."""
    from fsdp_patch.app.demo.model import lm_loss

    spent = dict.fromkeys(PHASES, 0.0)

    def timed(phase: str, fn: Callable[[], Any]) -> Any:
        if clock is None:
            return fn()
        start = clock.start()
        out = fn()
        spent[phase] += clock.seconds_since(start)
        return out

    total = 0.0
    for index, tokens in enumerate(microbatches):
        model.set_requires_gradient_sync(index == len(microbatches) - 1)  # type: ignore[operator]
        loss = timed("forward", lambda: lm_loss(model, tokens) / len(microbatches))
        timed("backward", loss.backward)
        total += loss.item()
    timed("optimizer", lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)))
    if phases is not None:
        for phase in PHASES:
            phases.setdefault(phase, []).append(spent[phase])
    return total


def _batches(config: Any, rows: int, count: int, microbatches: int) -> list[list[torch.Tensor]]:
    """Per step, this rank's rows split into microbatches."""
    from fsdp_patch.app.demo.data import synthetic_batches

    rank, world = dist.get_rank(), dist.get_world_size()
    steps = synthetic_batches(config, rows * world, count)
    return [list(s[rank * rows : (rank + 1) * rows].to(_device()).chunk(microbatches)) for s in steps]


def _timings(config: Any, spec: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    clock = Clock(_device())
    for reduce_name, reduce in REDUCE.items():
        models = {
            "ours": _ours(config, reduce, None),
            "ours_per_gather": _ours(config, reduce, None, "per_gather"),
            "ours_no_overlap": _ours(config, reduce, OVERLAP_OFF),
            "fsdp2": _fsdp2(config, reduce),
        }
        for microbatches in MICROBATCHES:
            batches = _batches(config, spec["rows"], spec["steps"] + spec["warmup"], microbatches)
            losses: dict[str, list[float]] = {name: [] for name in models}
            phases: dict[str, dict[str, list[float]]] = {name: {} for name in models}

            def contender(name: str) -> Callable[[], float]:
                model, optimizer = models[name]

                def one_step() -> float:
                    step = batches[len(losses[name]) % len(batches)]
                    start = clock.start()
                    losses[name].append(_train_step(model, optimizer, step, clock, phases[name]))
                    return clock.seconds_since(start)

                return one_step

            times = paired({name: contender(name) for name in models}, spec["steps"], spec["warmup"])
            measured = slice(len(next(iter(phases.values()))["forward"]) - spec["steps"], None)  # after the warm-up
            out[f"{reduce_name}_mb{microbatches}"] = {
                "step_s": {name: median(values) for name, values in times.items()},
                "phase_s": {
                    name: {phase: median(v[measured]) for phase, v in by_phase.items()}
                    for name, by_phase in phases.items()
                },
                "ratio_ours_fsdp2": paired_ratio(times, "ours", "fsdp2"),
                "ratio_per_gather_fsdp2": paired_ratio(times, "ours_per_gather", "fsdp2"),
                "ratio_no_overlap_fsdp2": paired_ratio(times, "ours_no_overlap", "fsdp2"),
                "ratio_overlap_on_off": paired_ratio(times, "ours", "ours_no_overlap"),
                "losses": losses,
                "samples_s": times,
            }
        models.clear()
        gc.collect()
    return out


class _CudaMeter:
    """The caching allocator's counters, in :class:`StorageMeter`'s shape."""

    def __enter__(self) -> _CudaMeter:
        torch.cuda.synchronize()
        self._base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    @property
    def live(self) -> int:
        return torch.cuda.memory_allocated() - self._base

    @property
    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() - self._base

    def reset_peak(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _memory(config: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from fsdp_patch import keep_cast_buffers

    from .memory import StorageMeter, reset_rss_peak, rss_peak_bytes

    cuda = _device().type == "cuda"
    builders: dict[str, Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]] = {
        "ours": lambda: _ours(config, torch.bfloat16, None),
        "ours_buffers_freed": lambda: _ours(config, torch.bfloat16, None),
        "ours_per_gather": lambda: _ours(config, torch.bfloat16, None, "per_gather"),
        "fsdp2": lambda: _fsdp2(config, torch.bfloat16),
    }
    out: dict[str, Any] = {}
    for microbatches in MICROBATCHES:
        batches = _batches(config, spec["rows"], 2, microbatches)
        for name, build in builders.items():
            rss_before = 0 if cuda else reset_rss_peak()
            with _CudaMeter() if cuda else StorageMeter() as meter:
                model, optimizer = build()
                if name == "ours_buffers_freed":
                    keep_cast_buffers(optimizer, False)
                _train_step(model, optimizer, batches[0])
                meter.reset_peak()
                _train_step(model, optimizer, batches[1])
                gc.collect()
                figures = {"peak_bytes": meter.peak, "between_steps_bytes": meter.live}
                del model, optimizer
                gc.collect()
            if not cuda:
                figures["rss_peak_bytes"] = rss_peak_bytes()
                figures["rss_peak_growth_bytes"] = figures["rss_peak_bytes"] - rss_before
            out[f"{name}_mb{microbatches}"] = figures
    return out


def rank_main(spec: dict[str, Any], out_dir: str) -> None:
    """One rank's measurements, written to ``out_dir/rank{R}.json``."""
    from fsdp_patch.app.demo.model import GPTConfig

    config = GPTConfig(**spec["model"])
    write_rank_result(out_dir, {"memory": _memory(config, spec), "timing": _timings(config, spec)})


def _bitwise(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y for x, y in zip(a, b, strict=True))


def run(device: str, quick: bool) -> CaseResult:
    """Spawns the ranks, gathers their figures, and makes the table's rows (rank 0's times;
    memory: the largest rank)."""
    from fsdp_patch.app.demo.launch import run_ranks
    from fsdp_patch.app.demo.model import GPTConfig

    spec = dict(QUICK if quick else FULL)
    world = min(2, torch.cuda.device_count()) if device == "cuda" else 2
    with tempfile.TemporaryDirectory() as out_dir:
        run_ranks(rank_main, world, spec, out_dir, device=device)
        ranks = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.json"), encoding="utf-8") as f:
                ranks.append(json.load(f))
    params = GPTConfig(**spec["model"]).approx_params
    rows = []
    timing = ranks[0]["timing"]
    for key, figures in timing.items():
        reduce, microbatches = key.split("_mb")[0], int(key.split("_mb")[1])
        steps = figures["step_s"]
        batch = f"{microbatches} microbatch{'es' if microbatches > 1 else ''}, {reduce} reduce"
        rows.append(
            target_row(
                "6 end to end",
                f"ours / FSDP2 step time, {batch}",
                figures["ratio_ours_fsdp2"],
                at_most=0.9 if microbatches == 1 else 0.8,
                note=f"{steps['ours'] * 1e3:.0f} vs {steps['fsdp2'] * 1e3:.0f} ms; overlap off: "
                f"{figures['ratio_no_overlap_fsdp2']:.2f}x FSDP2, on/off {figures['ratio_overlap_on_off']:.2f}",
            )
        )
        rows.append(
            target_row(
                "6 end to end",
                f"ours (compute copy per_gather) / FSDP2 step time, {batch}",
                figures["ratio_per_gather_fsdp2"],
                at_most=0.9 if microbatches == 1 else 0.8,
                note=f"{steps['ours_per_gather'] * 1e3:.0f} vs {steps['fsdp2'] * 1e3:.0f} ms",
            )
        )
        if reduce == "bf16":
            spent = figures["phase_s"]
            rows.append(
                target_row(
                    "6 end to end",
                    f"ours / FSDP2 forward + backward time, {batch}",
                    (spent["ours"]["forward"] + spent["ours"]["backward"])
                    / (spent["fsdp2"]["forward"] + spent["fsdp2"]["backward"]),
                    note="ms forward / backward / optimizer: "
                    + "; ".join(
                        f"{name} " + " / ".join(f"{spent[name][phase] * 1e3:.0f}" for phase in PHASES)
                        for name in ("ours", "ours_per_gather", "fsdp2")
                    ),
                )
            )
    equal = [
        _bitwise(timing[key]["losses"][name], timing[key]["losses"]["fsdp2"])
        for key in timing
        if key.startswith("bf16")
        for name in ("ours", "ours_per_gather")
    ]
    overlap_equal = [_bitwise(f["losses"]["ours"], f["losses"]["ours_no_overlap"]) for f in timing.values()]
    rows.append(
        target_row(
            "6 end to end",
            "losses bitwise equal to FSDP2 (bf16 reduce; persistent and per_gather), runs",
            sum(equal) / len(equal),
            at_least=1.0,
            unit="share",
            note=f"overlap on == off in {sum(overlap_equal)}/{len(overlap_equal)} runs",
        )
    )
    memory = {
        key: {name: max(r["memory"][key][name] for r in ranks) for name in ranks[0]["memory"][key]}
        for key in ranks[0]["memory"]
    }
    for microbatches in MICROBATCHES:
        theirs = memory[f"fsdp2_mb{microbatches}"]
        for name, label in (
            ("ours", "persistent, cast buffers kept"),
            ("ours_buffers_freed", "persistent, cast buffers freed"),
            ("ours_per_gather", "compute copy per_gather"),
        ):
            ours = memory[f"{name}_mb{microbatches}"]
            for measure in ("peak_bytes", "between_steps_bytes"):
                # The persistent copy holds 2 bytes per element FSDP2 does not, by design (see
                # MixedPrecisionPolicy.compute_copy): FSDP2's memory is per_gather's target.
                rows.append(
                    target_row(
                        "6 end to end",
                        f"ours ({label}) / FSDP2 {measure.replace('_bytes', '').replace('_', ' ')} tensor bytes, "
                        f"{microbatches} mb",
                        ours[measure] / theirs[measure],
                        at_most=1.0 if name == "ours_per_gather" else None,
                        note=f"{ours[measure] / 2**20:.1f} vs {theirs[measure] / 2**20:.1f} MiB per rank",
                    )
                )
            if "rss_peak_growth_bytes" in ours:
                rows.append(
                    target_row(
                        "6 end to end",
                        f"ours ({label}) / FSDP2 RSS peak growth, {microbatches} mb",
                        ours["rss_peak_growth_bytes"] / max(1, theirs["rss_peak_growth_bytes"]),
                        note=f"{ours['rss_peak_growth_bytes'] / 2**20:.0f} vs {theirs['rss_peak_growth_bytes'] / 2**20:.0f} MiB",
                    )
                )
    raw = {"spec": spec, "world_size": world, "approx_params": params, "ranks": ranks}
    return CaseResult(rows, raw)
