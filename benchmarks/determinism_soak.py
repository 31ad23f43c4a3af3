"""Determinism soak: the same training repeated, its final state compared bit for bit.

Each run trains the demo's transformer from one seed on every rank of a job (bf16 compute, fp32
main weights, bf16 main grads, AdamW through the adapter), with overlap on (prefetching
all-gathers, reduce-scatters left in flight while backward goes on) and several microbatches per
step (gradient sync off but for the last), alternately with telemetry on (the precision
diagnostics and the per-iteration checks at every step) and off. At its end, every rank hashes
its shards of the main weights and its optimizer state (SHA-256 of their bytes); the runs of a
job must all hold one digest per rank: telemetry on and off alike, every repetition alike. A
difference would be a race (an asynchronous reduce-scatter, a prefetch, the final step) or state
telemetry changes; the table says which runs differ, and from which.

Each job is one process per rank running its runs one after another (fresh models, a fresh
optimizer each); several jobs per world size (fresh processes each), all compared with the first
run of the first job. ``--nodes 1 2`` runs every world size's jobs as a local job (one process
per rank) and as N torchrun agents, one per node, that meet on the loopback interface
(``--nnodes N --node-rank i``): the ranks of a multi-node job, each with its node's local ranks
and its own agent, on one machine; all compared with the first run. Usage::

    python -m benchmarks.determinism_soak [--jobs 3] [--runs 10] [--world-sizes 2 4] [--nodes 1 2] [--steps 6] [--microbatches 3] [--json out-WORLD.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from fsdp_patch.app.demo.data import synthetic_batches
from fsdp_patch.app.demo.launch import run_ranks
from fsdp_patch.app.demo.model import GPT, GPTConfig, lm_loss, shard

from .common import write_results
from .telemetry_overhead import _quiet_telemetry

CONFIG = GPTConfig(vocab=1024, dim=128, heads=4, layers=3, seq=32)
# Telemetry on: diagnostics and checks on every step, so that they run beside each reduce.
SETTINGS: dict[str, dict[str, str]] = {
    "telemetry_off": {"FSDP_PATCH_TELEMETRY": "0"},
    "telemetry_on": {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "1"},
}


def _digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of this rank's main-weight shards and optimizer state, in a fixed order."""
    sha = hashlib.sha256()

    def add(tensor: torch.Tensor) -> None:
        local = getattr(tensor, "_local_tensor", tensor).detach().contiguous().cpu()
        sha.update(str((local.dtype, tuple(local.shape))).encode())
        sha.update(local.reshape(-1).view(torch.uint8).numpy().tobytes() if local.numel() else b"")

    for name, param in sorted(model.named_parameters()):
        sha.update(name.encode())
        add(param)
    for state in optimizer.state.values():
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                sha.update(key.encode())
                add(value)
    return sha.hexdigest()


def train_once(setting: str, steps: int, microbatches: int) -> tuple[list[float], str]:
    """One run on this rank: the losses it saw and its final state's digest."""
    from fsdp_patch import MixedPrecisionPolicy
    from fsdp_patch.optimizer import fully_shard_optimizer

    torch.manual_seed(0)
    model = GPT(CONFIG).to(torch.bfloat16)
    shard(model, mp_policy=MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    with mock.patch.dict(os.environ, SETTINGS[setting]):
        fully_shard_optimizer(optimizer)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = 2 * microbatches * world
    losses = []
    for tokens in synthetic_batches(CONFIG, rows, steps):
        mine = tokens[rank::world]
        for index, part in enumerate(mine.chunk(microbatches)):
            model.set_requires_gradient_sync(index == microbatches - 1)
            loss = lm_loss(model, part)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, _digest(model, optimizer)


def soak_on_ranks(runs: int, steps: int, microbatches: int) -> list[dict[str, Any]] | None:
    """``runs`` runs per setting, alternating; rank 0 returns every run's digests (one per rank)."""
    out = []
    with _quiet_telemetry():
        for run in range(runs):
            for setting in SETTINGS:
                losses, digest = train_once(setting, steps, microbatches)
                digests: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(digests, digest)
                out.append({"run": run, "setting": setting, "digests": digests, "last_loss": losses[-1]})
    return out if dist.get_rank() == 0 else None


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The distinct final states among the runs, and which runs differ from the first."""
    first = results[0]["digests"]

    def label(r: dict[str, Any]) -> str:
        nodes = r.get("nodes", 1)
        return f"{f'{nodes}-node ' if nodes > 1 else ''}job {r.get('job', 0)} run {r['run']} {r['setting']}"

    differing = [label(r) for r in results if r["digests"] != first]
    return {
        "runs": len(results),
        "distinct_states": len({tuple(r["digests"]) for r in results}),
        "differ_from_first": differing,
    }


def _job(runs: int, steps: int, microbatches: int, job: int, results_path: str, nodes: int = 1) -> None:
    results = soak_on_ranks(runs, steps, microbatches)
    if results is not None:
        with open(results_path, "a", encoding="utf-8") as f:
            for result in results:
                f.write(json.dumps({"nodes": nodes, "job": job, **result}) + "\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job_on_nodes(nodes: int, world: int, runs: int, steps: int, microbatches: int, job: int, path: str) -> None:
    """One job as ``nodes`` torchrun agents on the loopback interface, ``world // nodes`` ranks each."""
    port = _free_port()

    def command(node: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nodes}",
            f"--node-rank={node}",
            f"--nproc-per-node={world // nodes}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "benchmarks.determinism_soak",
            "--job-of",
            str(job),
            path,
            "--nodes",
            str(nodes),
            "--runs",
            str(runs),
            "--steps",
            str(steps),
            "--microbatches",
            str(microbatches),
        ]

    # The intra-op threads of a local job's ranks (demo.launch: the cores shared among the ranks):
    # another count sums a matmul in another order, and the states of the topologies would differ
    # by that alone, telemetry on or off (seen: 2 ranks, 2 threads each under torchrun's default).
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
    with tempfile.TemporaryDirectory() as logs:
        # Each agent's output to a file: a pipe nobody reads while another agent is waited for could fill.
        outputs = [open(os.path.join(logs, f"node{node}.log"), "w+", encoding="utf-8") for node in range(nodes)]
        try:
            agents = [
                subprocess.Popen(command(node), stdout=out, stderr=subprocess.STDOUT, env=env)
                for node, out in enumerate(outputs)
            ]
            codes = [agent.wait() for agent in agents]
            for node, (code, out) in enumerate(zip(codes, outputs, strict=True)):
                if code != 0:
                    out.seek(0)
                    raise SystemExit(f"determinism_soak: job {job}'s node {node} exited {code}:\n{out.read()[-3000:]}")
        finally:
            for out in outputs:
                out.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=3, help="jobs per world size (fresh processes each)")
    parser.add_argument("--runs", type=int, default=10, help="runs per setting in each job")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--nodes", type=int, nargs="+", default=[1], help="torchrun agents (nodes) per job, each; 1: one local job"
    )
    # One rank of a multi-node job (what each torchrun agent runs): the job's number and results file.
    parser.add_argument("--job-of", nargs=2, metavar=("JOB", "RESULTS"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument(
        "--json", default=None, help="write each world size's runs as JSON (WORLD replaced by the size)"
    )
    args = parser.parse_args(argv)
    for name in ("jobs", "runs", "steps", "microbatches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)} is too small; expected an integer >= 1")
    if any(n < 1 for n in args.nodes) or any(w < 1 or w % n for w in args.world_sizes for n in args.nodes):
        parser.error(
            f"--world-sizes {args.world_sizes}: each must be a multiple of each of --nodes {args.nodes} (>= 1)"
        )
    if args.job_of is not None:
        job, path = int(args.job_of[0]), args.job_of[1]
        run_ranks(_job, 0, args.runs, args.steps, args.microbatches, job, path, args.nodes[0])
        return
    print("| ranks | nodes | runs | steps x microbatches | final weights and optimizer state | runs that differ |")
    print("| --- | --- | --- | --- | --- | --- |")
    for world in args.world_sizes:
        with tempfile.TemporaryDirectory() as scratch:
            results_path = os.path.join(scratch, "runs.jsonl")
            for nodes in args.nodes:
                for job in range(args.jobs):
                    if nodes > 1:
                        _job_on_nodes(nodes, world, args.runs, args.steps, args.microbatches, job, results_path)
                    else:
                        run_ranks(_job, world, args.runs, args.steps, args.microbatches, job, results_path)
            with open(results_path, encoding="utf-8") as f:
                results = [json.loads(line) for line in f]
        summary = summarize(results)
        states = summary["distinct_states"]
        verdict = "all bitwise equal" if states == 1 else f"{states} distinct states"
        topologies = " and ".join(map(str, args.nodes))
        print(
            f"| {world} | {topologies} | {summary['runs']} ({len(args.nodes)} x {args.jobs} jobs x {args.runs} per setting) | {args.steps} x "
            f"{args.microbatches} | {verdict} | {', '.join(summary['differ_from_first']) or '-'} |",
            flush=True,
        )
        if args.json:
            settings = {
                "jobs": args.jobs,
                "runs_per_setting_and_job": args.runs,
                "steps": args.steps,
                "microbatches": args.microbatches,
                "nodes": args.nodes,
            }
            write_results(
                args.json.replace("WORLD", str(world)),
                "determinism_soak",
                {**settings, "summary": summary, "results": results},
                world_size=world,
            )


if __name__ == "__main__":
    main()
