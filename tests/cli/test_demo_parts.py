"""The demo's parts that need no process group: learning-rate schedule, progress output, data, options."""

from __future__ import annotations

import argparse
import io
import math

import pytest
import torch
from fsdp_patch.app.demo.data import synthetic_batches, tokens_at
from fsdp_patch.app.demo.model import GPTConfig
from fsdp_patch.app.demo.options import DemoInputError, add_arguments, training_from_args
from fsdp_patch.app.demo.progress import Progress
from fsdp_patch.app.demo.schedule import WarmupCosine


def test_warmup_then_cosine_to_the_floor() -> None:
    schedule = WarmupCosine(warmup_steps=4, decay_steps=20, min_ratio=0.1)
    got = [schedule(step) for step in range(25)]
    assert got[:4] == [0.25, 0.5, 0.75, 1.0], got[:4]
    assert got[4] == 1.0, f"the decay starts at the peak, got {got[4]}"
    assert all(a >= b for a, b in zip(got[4:], got[5:], strict=False)), "the decay is not monotone"
    assert math.isclose(got[12], 0.1 + 0.9 * 0.5, rel_tol=1e-12), f"halfway: {got[12]}"
    assert got[20:] == [0.1] * 5, f"after decay_steps: {got[20:]}"


def test_scheduler_state_carries_the_schedule_for_a_resume() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(5, 100, 0.1))
    state = scheduler.state_dict()
    assert state["lr_lambdas"] == [{"warmup_steps": 5, "decay_steps": 100, "min_ratio": 0.1}], state["lr_lambdas"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    progress = Progress(start_step=0, total_steps=4, tokens_per_step=1000, stream=stream)
    for step in range(1, 5):
        progress.step(step, loss=5.0 - step, lr=1e-3, seconds=0.5 if step > 1 else 3.0)
    progress.note("checkpoint: x")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert progress.mode == "lines" and "\r" not in stream.getvalue()
    assert lines[0] == "step 1/4  loss 4.0000  lr 1.00e-03  333 tok/s  3000 ms/step  ETA 0:09", lines[0]
    # The first (start-up) step is left out of the average behind tokens/s and ETA.
    assert lines[1] == "step 2/4  loss 3.0000  lr 1.00e-03  2.0k tok/s  500 ms/step  ETA 0:01", lines[1]
    assert lines[-2].startswith("step 4/4") and lines[-2].endswith("ETA 0:00"), lines[-2]
    assert lines[-1] == "checkpoint: x", lines[-1]


def test_progress_bar_on_a_terminal() -> None:
    stream = _Terminal()
    progress = Progress(start_step=10, total_steps=14, tokens_per_step=1000, stream=stream)
    progress.step(11, loss=2.0, lr=1e-3, seconds=1.0)
    progress.step(12, loss=2.0, lr=1e-3, seconds=1.0)
    progress.note("checkpoint: y")
    progress.close()
    text = stream.getvalue()
    assert progress.mode == "bar", progress.mode
    assert "\rstep 12/14 [############------------] loss 2.0000" in text, repr(text)
    assert "ETA 0:02" in text and "\ncheckpoint: y\n" in text, repr(text)


def test_batches_depend_only_on_their_position() -> None:
    config = GPTConfig(vocab=50, seq=9)
    stream = synthetic_batches(config, rows=4, steps=6, seed=3)
    assert all(torch.equal(stream[i], tokens_at(config, 4, i, seed=3)) for i in range(6))
    assert not torch.equal(stream[0], stream[1]) and not torch.equal(stream[0], tokens_at(config, 4, 0, seed=4))
    assert stream[0].shape == (4, 10) and int(stream[0].max()) < 50


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_resume_takes_the_checkpoints_settings_unless_given() -> None:
    saved, _ = training_from_args(_args("--scenario", "tiny-lr", "--batch", "16", "--steps", "8"))
    resumed, given = training_from_args(_args("--steps", "20"), saved=saved.__dict__ | {"model": saved.model})
    assert resumed == saved and given == frozenset(), f"resumed with {resumed}, given {given}"
    same, given = training_from_args(_args("--batch", "16"), saved=saved.__dict__)
    assert same == saved and given == {"batch"}
    with pytest.raises(
        DemoInputError, match="it was trained with --scenario tiny-lr, this run asks for --scenario nan"
    ):
        training_from_args(_args("--scenario", "nan"), saved=saved.__dict__)


def test_scenario_defaults_and_plant_step() -> None:
    config, _ = training_from_args(_args("--scenario", "fp16-overflow", "--steps", "9"))
    assert (config.compute_dtype, config.grad_dtype, config.main_dtype) == ("float16", "float16", "float32")
    assert config.plant_step == 4, f"planted at {config.plant_step}, want half of 9 steps"
    healthy, _ = training_from_args(_args())
    assert (healthy.compute_dtype, healthy.lr, healthy.plant_step) == ("bfloat16", 3e-3, 0)
    assert math.isclose(healthy.min_lr, 3e-4), f"min lr {healthy.min_lr}, want a tenth of the peak"
