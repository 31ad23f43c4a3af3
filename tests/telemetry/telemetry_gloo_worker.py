"""Worker of the two-process gloo test (imported by name in spawned processes)."""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist
from fsdp_patch.telemetry import semconv
from telemetry_testing import Group, in_memory_telemetry, metric_points, run_fake_step


def rank_groups(rank: int) -> tuple[list[Group], list[list[torch.Tensor]]]:
    """Different shards per rank, so that local and global diagnostics differ.

    Rank 0 overflows fp16 in its refresh; rank 1 has a NaN grad and mostly lost updates.
    Returns the groups and, per step, the main weights the "optimizer" writes.
    """
    g = torch.Generator().manual_seed(100 + rank)
    n = 64
    main = torch.randn(n, generator=g) * (1 + rank)
    fp16 = Group(
        main.clone(), main.to(torch.float16), (torch.randn(n, generator=g) * (3 + 5 * rank)).to(torch.bfloat16)
    )
    frozen_main = torch.randn(n, generator=g)
    frozen = Group(frozen_main.clone(), frozen_main.to(torch.bfloat16), None)
    step_size = 1e-1 if rank == 0 else 1e-6
    first = main + step_size * torch.randn(n, generator=g)
    if rank == 0:
        first[3] = 7e4  # beyond fp16's range
    else:
        fp16.main_grad[5] = math.nan
    second = first + 1e-1 * torch.randn(n, generator=g)
    return [fp16, frozen], [[first, frozen_main], [second, frozen_main]]


def worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    from fsdp_patch.telemetry import OptimizerObserver
    from fsdp_patch.telemetry.export import providers

    memory = in_memory_telemetry()
    observer = OptimizerObserver(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1),
        precision_aware=False,
        meter_provider=memory.meter_provider,  # spans go through the package's own installed provider
    )
    groups, steps = rank_groups(rank)
    for group in groups:
        group.process_group = dist.group.WORLD
    history = []
    for new_mains in steps:
        before = [(g.main_weight.clone(), g.compute_weight.clone()) for g in groups]
        run_fake_step(observer, groups, new_mains, cast_bytes=10 * (rank + 1))
        history.append(
            [
                {
                    "main_before": b[0].tolist(),
                    "compute_before": b[1].float().tolist(),
                    "compute_dtype": str(g.compute_weight.dtype),
                    "main_after": g.main_weight.tolist(),
                    "compute_after": g.compute_weight.float().tolist(),
                    "grad": None if g.main_grad is None else g.main_grad.float().tolist(),
                }
                for b, g in zip(before, groups, strict=True)
            ]
        )
    trace_files_before_destroy = providers.written_trace_files()
    dist.destroy_process_group()  # wrapped by telemetry: flushes spans first
    trace_files_after_destroy = providers.written_trace_files()
    events = []
    for path in trace_files_after_destroy:
        if path.endswith(".trace.json"):
            with open(path, encoding="utf-8") as f:
                events = json.load(f)["traceEvents"]
    points = metric_points(memory.metric_reader)

    def one(name: str, **attributes: str) -> float:
        (point,) = [p for p in points[name] if all(p.attributes.get(k) == v for k, v in attributes.items())]
        assert point.attributes[semconv.ATTR_RANK] == rank
        return point.value

    result = {
        "rank": rank,
        "history": history,
        "nonfinite": {
            f"{t}/{k}": one(semconv.METRIC_NONFINITE, **{semconv.ATTR_TENSOR: t, semconv.ATTR_NONFINITE_KIND: k})
            for t in semconv.TENSORS
            for k in semconv.NONFINITE_KINDS
        },
        "overflow": one(semconv.METRIC_REFRESH_OVERFLOW),
        "underflow": one(semconv.METRIC_REFRESH_UNDERFLOW),
        "refresh_error": one(semconv.METRIC_REFRESH_ERROR),
        "lost_ratio": one(semconv.METRIC_LOST_RATIO),
        "grad_amax": one(semconv.METRIC_GRAD_AMAX),
        "step_durations": points[semconv.METRIC_STEP_DURATION][0].count,
        "trace_files_before_destroy": trace_files_before_destroy,
        "trace_files_after_destroy": trace_files_after_destroy,
        "step_spans": [e["args"] for e in events if e.get("name") == semconv.SPAN_STEP],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
