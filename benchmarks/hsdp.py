"""Case 7: HSDP, ``fully_shard`` + the adapter against torch FSDP2 on the same 2 x 2 mesh, 4 ranks.

Both train ``fsdp_patch.app.demo.model.GPT`` from one fp32 initialization with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (the same policy object's fields;
ours keeps fp32 main weights and a bf16 compute copy, FSDP2 its fp32 shards and a cast per
all-gather) under AdamW, each rank on its rows, 1 and 4 microbatches per step (gradient sync on
the last only). The mesh replicates over dim 0 and shards over dim 1: grads reduce-scattered over
2 ranks, then all-reduced over 2 replicas.

Step time: the two contenders stepped in rotation on the same batches (paired), rank 0's median
and the median of the per-round ratios; the losses of every step compared bitwise. Memory per
rank, of a model built and trained two steps (the largest rank): peak tensor bytes of the second
step and tensor bytes between steps. No target: the figures say what HSDP costs here against
FSDP2's, except that ours with ``compute_copy="per_gather"`` is held to FSDP2's memory (the
persistent compute copy holds 2 bytes per sharded element FSDP2 does not, see case 6).
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from typing import Any
from unittest import mock

import torch

from .common import CaseResult, Clock, median, paired, paired_ratio, target_row, write_rank_result
from .end_to_end import _batches, _bitwise, _CudaMeter, _device, _train_step

__all__ = ["run", "rank_main"]

FULL = {"model": {"vocab": 4096, "dim": 128, "heads": 4, "layers": 4, "seq": 32}, "rows": 4, "steps": 8, "warmup": 1}
QUICK = {"model": {"vocab": 256, "dim": 64, "heads": 2, "layers": 2, "seq": 16}, "rows": 4, "steps": 2, "warmup": 1}
MICROBATCHES = (1, 4)
WORLD = 4
# Ours with each compute-copy lifetime (per_gather: FSDP2's memory by design, see case 6).
CONTENDERS = ("ours", "ours_per_gather", "fsdp2")
SHAPE = (2, 2)


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(_device().type, SHAPE, mesh_dim_names=("replicate", "shard"))


def _build(name: str, config: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from fsdp_patch.app.demo.model import GPT

    torch.manual_seed(0)
    model = GPT(config).to(_device())
    ours = name.startswith("ours")
    if ours:
        from fsdp_patch import MixedPrecisionPolicy, fully_shard
        from fsdp_patch.optimizer import fully_shard_optimizer

        lifetime = {"compute_copy": "per_gather"} if name == "ours_per_gather" else {}
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, **lifetime)  # type: ignore[arg-type]
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard  # type: ignore[assignment]

        policy = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # type: ignore[assignment]
    mesh = _mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if ours:
        with mock.patch.dict(os.environ, {"FSDP_PATCH_TELEMETRY": "0"}):
            fully_shard_optimizer(optimizer)
    return model, optimizer


def _timings(config: Any, spec: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    clock = Clock(_device())
    models = {name: _build(name, config) for name in CONTENDERS}
    for microbatches in MICROBATCHES:
        batches = _batches(config, spec["rows"], spec["steps"] + spec["warmup"], microbatches)
        losses: dict[str, list[float]] = {name: [] for name in models}

        def contender(name: str) -> Any:
            model, optimizer = models[name]

            def one_step() -> float:
                step = batches[len(losses[name]) % len(batches)]
                start = clock.start()
                losses[name].append(_train_step(model, optimizer, step))
                return clock.seconds_since(start)

            return one_step

        times = paired({name: contender(name) for name in models}, spec["steps"], spec["warmup"])
        out[f"mb{microbatches}"] = {
            "step_s": {name: median(values) for name, values in times.items()},
            "ratio_ours_fsdp2": paired_ratio(times, "ours", "fsdp2"),
            "ratio_per_gather_fsdp2": paired_ratio(times, "ours_per_gather", "fsdp2"),
            "losses": losses,
            "samples_s": times,
        }
    models.clear()
    gc.collect()
    return out


def _memory(config: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from .memory import StorageMeter

    cuda = _device().type == "cuda"
    out: dict[str, Any] = {}
    for microbatches in MICROBATCHES:
        batches = _batches(config, spec["rows"], 2, microbatches)
        for name in CONTENDERS:
            with _CudaMeter() if cuda else StorageMeter() as meter:
                model, optimizer = _build(name, config)
                _train_step(model, optimizer, batches[0])
                meter.reset_peak()
                _train_step(model, optimizer, batches[1])
                gc.collect()
                out[f"{name}_mb{microbatches}"] = {"peak_bytes": meter.peak, "between_steps_bytes": meter.live}
                del model, optimizer
                gc.collect()
    return out


def rank_main(spec: dict[str, Any], out_dir: str) -> None:
    """One rank's measurements, written to ``out_dir/rank{R}.json``."""
    from fsdp_patch.app.demo.model import GPTConfig

    config = GPTConfig(**spec["model"])
    write_rank_result(out_dir, {"memory": _memory(config, spec), "timing": _timings(config, spec)})


def run(device: str, quick: bool) -> CaseResult:
    """Spawns 4 ranks (CUDA: needs 4 GPUs), gathers their figures, makes the table's rows."""
    from fsdp_patch.app.demo.launch import run_ranks

    if device == "cuda" and torch.cuda.device_count() < WORLD:
        raise RuntimeError(f"case 7 (hsdp) needs {WORLD} GPUs on CUDA, found {torch.cuda.device_count()}")
    spec = dict(QUICK if quick else FULL)
    with tempfile.TemporaryDirectory() as out_dir:
        run_ranks(rank_main, WORLD, spec, out_dir, device=device)
        ranks = []
        for rank in range(WORLD):
            with open(os.path.join(out_dir, f"rank{rank}.json"), encoding="utf-8") as f:
                ranks.append(json.load(f))
    rows = []
    timing = ranks[0]["timing"]
    for key, figures in timing.items():
        microbatches = int(key[2:])
        steps = figures["step_s"]
        rows.append(
            target_row(
                "7 hsdp",
                f"ours / FSDP2 step time, 2 x 2 mesh, {microbatches} mb",
                figures["ratio_ours_fsdp2"],
                note=f"{steps['ours'] * 1e3:.0f} vs {steps['fsdp2'] * 1e3:.0f} ms",
            )
        )
        rows.append(
            target_row(
                "7 hsdp",
                f"ours (compute copy per_gather) / FSDP2 step time, 2 x 2 mesh, {microbatches} mb",
                figures["ratio_per_gather_fsdp2"],
                note=f"{steps['ours_per_gather'] * 1e3:.0f} vs {steps['fsdp2'] * 1e3:.0f} ms",
            )
        )
    equal = [
        _bitwise(r["timing"][k]["losses"][name], r["timing"][k]["losses"]["fsdp2"])
        for r in ranks
        for k in timing
        for name in ("ours", "ours_per_gather")
    ]
    rows.append(
        target_row(
            "7 hsdp",
            "losses bitwise equal to FSDP2, runs x ranks (both lifetimes)",
            sum(equal) / len(equal),
            at_least=1.0,
            unit="share",
        )
    )
    memory = {
        key: {m: max(r["memory"][key][m] for r in ranks) for m in ranks[0]["memory"][key]} for key in ranks[0]["memory"]
    }
    for microbatches in MICROBATCHES:
        theirs = memory[f"fsdp2_mb{microbatches}"]
        for name, label in (("ours", "ours"), ("ours_per_gather", "ours (compute copy per_gather)")):
            ours = memory[f"{name}_mb{microbatches}"]
            for measure in ("peak_bytes", "between_steps_bytes"):
                rows.append(
                    target_row(
                        "7 hsdp",
                        f"{label} / FSDP2 {measure.replace('_bytes', '').replace('_', ' ')} tensor bytes, {microbatches} mb",
                        ours[measure] / theirs[measure],
                        at_most=1.0 if name == "ours_per_gather" else None,
                        note=f"{ours[measure] / 2**20:.1f} vs {theirs[measure] / 2**20:.1f} MiB per rank",
                    )
                )
    return CaseResult(rows, {"spec": spec, "world_size": WORLD, "mesh": list(SHAPE), "ranks": ranks})
