"""The multi-node recipe of docs/multi-node.md, as two torchrun "nodes" on the loopback interface.

``tests/integration/multi_node/hsdp_script.py`` builds its HSDP mesh from the node layout
torchrun gives (nodes replicate, each node's ranks shard). Run as 2 agents of 2 ranks each with
``FSDP_PATCH_TELEMETRY=1`` in one working directory (a shared file system's): both agents exit
0, the trace directory holds every node's ranks and ``fsdp-patch report`` reads them as one job;
the losses equal, bitwise, those of one agent running 4 ranks on the same 2 x 2 mesh.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.report_json import report_json

pytestmark = pytest.mark.long  # torchrun as two nodes

SCRIPT = Path(__file__).resolve().parent / "multi_node" / "hsdp_script.py"
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(telemetry: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if telemetry:
        env["FSDP_PATCH_TELEMETRY"] = "1"
    return env


def _losses(cwd: Path) -> dict[int, list[float]]:
    return {int(p.name.split(".")[1][4:]): json.loads(p.read_text()) for p in cwd.glob("losses.rank*.json")}


def _two_nodes(cwd: Path) -> list[str]:
    port = _free_port()
    logs = [cwd / f"node{node}.log" for node in range(2)]
    agents = []
    for node, log in enumerate(logs):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(SCRIPT),
        ]
        with log.open("w") as out:
            agents.append(subprocess.Popen(command, cwd=cwd, env=_env(True), stdout=out, stderr=subprocess.STDOUT))
    codes = [agent.wait(timeout=TIMEOUT_S) for agent in agents]
    outputs = [log.read_text() for log in logs]
    for node, (code, output) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"node {node}'s agent exited {code}:\n{output[-4000:]}"
    return outputs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    nodes = tmp_path_factory.mktemp("two_nodes")
    outputs = _two_nodes(nodes)
    single = tmp_path_factory.mktemp("one_node")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        str(SCRIPT),
        "--mesh",
        "2",
        "2",
    ]
    result = subprocess.run(command, cwd=single, env=_env(False), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"one node, 4 ranks, exited {result.returncode}:\n{result.stderr[-4000:]}"
    return {"nodes": nodes, "outputs": outputs, "single": single}


def test_both_nodes_train_as_one_job_bitwise_as_one_node(runs: dict) -> None:
    got, want = _losses(runs["nodes"]), _losses(runs["single"])
    assert sorted(got) == [0, 1, 2, 3], f"want losses of ranks 0-3 from the two nodes, got ranks {sorted(got)}"
    assert got == want, f"two nodes' losses {got} differ from one node's on the same mesh {want}"


def test_the_shared_trace_directory_holds_every_node_s_ranks(runs: dict) -> None:
    traces = runs["nodes"] / "fsdp_patch_traces"
    files = sorted(p.name for p in traces.glob("rank*.trace.json"))
    want = [f"rank{rank}.trace.json" for rank in range(4)]
    assert files == want, f"want {want} in the shared trace directory, got {files}"
    report = report_json(traces)
    assert report["ranks"] == [0, 1, 2, 3], f"want the report over ranks 0-3, got {report.get('ranks')}"
