"""Trainer and curriculum on the CPU with the tiny model: exact resume after kill -9, stage plans and transitions."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longweave.cli import main
from trainer.config import StageRun, TrainConfig, recompute_label
from trainer.curriculum import StageError, advance, plan_stage
from trainer.run_dir import RunDir

def _config_yaml(data: Path, steps_first: int, steps_second: int, **extra: object) -> str:
    lines = [
        "model: tiny",
        f"data: {data}",
        "tokens_per_step: 1024",
        "stages:",
        f"  - {{name: s512, seq_len: 512, micro_batch: 1, token_budget: {1024 * steps_first}}}",
        f"  - {{name: s1k, seq_len: 1024, micro_batch: 1, token_budget: {1024 * steps_second}}}",
    ] + [f"{k}: {v}" for k, v in (("lr", 0.01), ("warmup_steps", 1)) if k not in extra] + [
        "num_workers: 1",
        "checkpoint_every: 2",
        "keep_checkpoints: 3",
    ] + [f"{k}: {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def _train(run: Path, config: Path | None, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "longweave.cli", "train", "--run", str(run), *extra]
    if config is not None:
        args += ["--config", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the trainer and its loader worker share two cores
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=env)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_kill_and_resume_matches_an_uninterrupted_run(short_shards: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(_config_yaml(short_shards, 3, 2))
    reference = tmp_path / "reference"
    proc = _train(reference, config)
    assert proc.wait(timeout=900) == 0, proc.stderr.read().decode()[-3000:]

    killed = tmp_path / "killed"
    proc = _train(killed, config)
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
        if (killed / "checkpoints" / "step-00000002" / "trainer_state.json").is_file():
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert RunDir(killed).latest_checkpoint() is not None, "killed before the first checkpoint"
    resumed = _train(killed, None)
    assert resumed.wait(timeout=900) == 0, resumed.stderr.read().decode()[-3000:]

    want, got = _metrics(reference), _metrics(killed)
    assert [m["step"] for m in want] == list(range(1, 6))
    assert [m["stage"] for m in want] == ["s512"] * 3 + ["s1k"] * 2  # advanced by itself at the spent budget
    assert [m["step"] for m in got] == [m["step"] for m in want]
    assert [m["sample_keys"] for m in got] == [m["sample_keys"] for m in want]
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=1e-6)
    assert min(m["loss"] for m in want[1:3]) < want[0]["loss"]  # it learns
    transitions = [json.loads(line) for line in (reference / "transitions.jsonl").read_text().splitlines()]
    assert [(t["from"], t["to"], t["step"]) for t in transitions] == [("s512", "s1k", 3)]
    assert transitions[0]["plan"]["grad_accum"] == 1


def test_stage_commands(short_shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(_config_yaml(short_shards, 2, 2, auto_advance=False))
    run = tmp_path / "run"
    proc = _train(run, config)
    assert proc.wait(timeout=900) == 0, proc.stderr.read().decode()[-3000:]

    assert main(["stage", "plan", "--run", str(run), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["current"] == "s512" and plan["next"] == "s1k"
    assert [(p["stage"], p["seq_len"], p["micro_batch"], p["grad_accum"], p["tokens_per_step"]) for p in plan["stages"]] \
        == [("s512", 512, 1, 2, 1024), ("s1k", 1024, 1, 1, 1024)]
    assert main(["stage", "status", "--run", str(run), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["stage"], status["step"], status["stage_tokens"], status["stage_budget"]) == ("s512", 2, 2048, 2048)

    # Refusals: a missing manifest, then shards packed with another tokenizer.
    manifest = short_shards / "s1k" / "manifest.json"
    saved = manifest.read_text()
    try:
        manifest.unlink()
        with pytest.raises(SystemExit, match="no manifest"):
            main(["stage", "advance", "--run", str(run)])
        data = json.loads(saved)
        data["tokenizer_fingerprint"] = "0" * 64
        manifest.write_text(json.dumps(data))
        with pytest.raises(SystemExit, match="tokenizer fingerprint"):
            main(["stage", "advance", "--run", str(run)])
    finally:
        manifest.write_text(saved)
    assert main(["stage", "advance", "--run", str(run), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["from"], record["to"], record["step"]) == ("s512", "s1k", 2)
    with pytest.raises(SystemExit, match="last stage"):
        main(["stage", "advance", "--run", str(run)])

    proc = _train(run, None)  # resume: the new stage starts from its manifest, optimizer and step carried over
    assert proc.wait(timeout=900) == 0, proc.stderr.read().decode()[-3000:]
    metrics = _metrics(run)
    assert [(m["step"], m["stage"], m["seq_len"]) for m in metrics] == [
        (1, "s512", 512), (2, "s512", 512), (3, "s1k", 1024), (4, "s1k", 1024)]


def test_two_runs_in_one_process(short_shards: Path, tmp_path: Path) -> None:
    """`longweave demo` trains, advances and trains again in one process: the second run reuses the process group
    (and DeepSpeed's groups of it), which the first must leave alive; it is torn down only at exit."""
    config = tmp_path / "config.yaml"
    config.write_text(_config_yaml(short_shards, 1, 1))
    run = tmp_path / "run"
    script = (f"from longweave.cli import main\n"
              f"assert main(['train', '--run', {str(run)!r}, '--config', {str(config)!r}, '--max-steps', '1']) == 0\n"
              f"assert main(['train', '--run', {str(run)!r}]) == 0\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(m["step"], m["stage"]) for m in _metrics(run)] == [(1, "s512"), (2, "s1k")]


def test_advance_refuses_a_run_without_checkpoint(short_shards: Path, tmp_path: Path) -> None:
    config = TrainConfig(data=str(short_shards), tokens_per_step=2048,
                         stages=(StageRun(name="s512", seq_len=512, micro_batch=2, token_budget=4096),
                                 StageRun(name="s1k", seq_len=1024, token_budget=4096)))
    run = RunDir(tmp_path / "fresh")
    run.root.mkdir()
    run.config_path.write_text(json.dumps(config.to_dict()))
    with pytest.raises(StageError, match="no complete checkpoint"):
        advance(run, config, world_size=1)
    assert plan_stage(config, config.stages[1], world_size=2).grad_accum == 1


def test_config_errors_name_the_field(short_shards: Path) -> None:
    stages = (StageRun(name="a", seq_len=1000, token_budget=3000),)
    with pytest.raises(ValueError, match=r"stages\[a\]\.token_budget"):
        TrainConfig(data=str(short_shards), tokens_per_step=2000, stages=stages)
    config = TrainConfig(data=str(short_shards), tokens_per_step=3000, stages=stages)
    with pytest.raises(ValueError, match=r"stages\[a\]: tokens_per_step 3000 is not a multiple"):
        config.grad_accum(stages[0], world_size=2)
    with pytest.raises(ValueError, match="seq_len"):
        StageRun(name="b", seq_len=0, token_budget=1)
    with pytest.raises(ValueError, match="unknown config key"):
        TrainConfig.from_dict({"data": "x", "tokens_per_step": 1, "stages": [], "colour": 1})
    for bad in ("yes", -1):
        for field in ("activation_checkpointing", "vision_checkpointing"):
            with pytest.raises(ValueError, match=rf"stages\[c\]\.{field}: must be true, false, a number of "
                                                 r"layers or absent, got"):
                StageRun(name="c", seq_len=8, token_budget=8, **{field: bad})
    with pytest.raises(ValueError, match=r"stages\[c\]\.keep_routed_rows: must be true or false, got 'yes'"):
        StageRun(name="c", seq_len=8, token_budget=8, keep_routed_rows="yes")
    with pytest.raises(ValueError, match=r"^activation_checkpointing: must be true, false or a number of layers"):
        TrainConfig(data=str(short_shards), tokens_per_step=3000, stages=stages, activation_checkpointing=1.5)
    with pytest.raises(ValueError, match=r"^kda_chunk: must be 32, 64 or absent, got 48"):
        TrainConfig(data=str(short_shards), tokens_per_step=3000, stages=stages, kda_chunk=48)
    # How `stage plan` and the logs show each setting.
    assert [recompute_label(s) for s in (True, False, 0, 1, 12)] == ["on", "off", "off", "first 1 layer",
                                                                      "first 12 layers"]


def test_benchmark_run_without_checkpoints_advances_and_refuses_resume(short_shards: Path, tmp_path: Path) -> None:
    """Also: the first stage recomputes only its first decoder layer and its first vision block, the second keeps
    the run's setting (every layer) and the preset's (no block); the second step runs under the profiler; the
    run's ``kda_chunk`` reaches the model."""
    config = tmp_path / "config.yaml"
    text = _config_yaml(short_shards, 2, 1, save_checkpoints=False, activation_checkpointing=True, profile_step=2,
                        kda_chunk=32)
    config.write_text(text.replace("micro_batch: 1, token_budget: 2048}", "micro_batch: 1, token_budget: 2048, "
                                   "activation_checkpointing: 1, vision_checkpointing: 1}"))
    run = tmp_path / "run"
    proc = _train(run, config)
    assert proc.wait(timeout=900) == 0, proc.stderr.read().decode()[-3000:]
    metrics = _metrics(run)
    assert [(m["step"], m["stage"], m["micro_batch"], m["grad_accum"], m["activation_checkpointing"],
             m["vision_checkpointing"], m["kda_chunk"]) for m in metrics] == [
        (1, "s512", 1, 2, 1, 1, 32), (2, "s512", 1, 2, 1, 1, 32), (3, "s1k", 1, 1, True, False, 32)]
    assert all(m["process_seconds"] >= m["step_seconds"] > 0 for m in metrics)
    assert RunDir(run).complete_checkpoints() == []  # none at the transition, periodically, or at the end
    assert [p.name for p in run.glob("profile-step*.txt")] == ["profile-step2.txt"]
    assert (run / "profile-step2.csv").read_text().startswith("bucket,kernel,calls_per_step,gpu_ms_per_step")
    profiled = (run / "profile-step2.txt").read_text()
    assert profiled.startswith("step 2 (s512):") and "2 micro-batches" in profiled
    assert "aten::" in profiled and "host-device synchronisations per step:" in profiled
    transitions = [json.loads(line) for line in (run / "transitions.jsonl").read_text().splitlines()]
    assert [(t["from"], t["to"], t["step"], t["checkpoint"], t["tokens_in_previous_stage"]) for t in transitions] \
        == [("s512", "s1k", 2, None, 2048)]
    again = _train(run, None)
    assert again.wait(timeout=300) != 0
    assert "cannot resume" in again.stderr.read().decode()
    with pytest.raises(SystemExit, match="no complete checkpoint"):
        main(["stage", "advance", "--run", str(run)])


def test_non_finite_gradients_stop_the_run_loudly(short_shards: Path, tmp_path: Path) -> None:
    """A learning rate of 1e15 blows the weights up in the first update: the next step's gradient norm is
    not finite, the metrics say so, and the trainer stops with an error that names the step, its samples and the
    command that locates the layer (max_nonfinite_steps: 0)."""
    config = tmp_path / "config.yaml"
    config.write_text(_config_yaml(short_shards, 4, 1, save_checkpoints=False, lr=1e15, warmup_steps=0))
    run = tmp_path / "run"
    proc = _train(run, config)
    assert proc.wait(timeout=900) != 0
    err = proc.stderr.read().decode()
    metrics = _metrics(run)
    assert metrics[0]["nonfinite_steps"] == 0 and metrics[-1]["nonfinite_steps"] == 1, metrics
    assert len(metrics) < 5 and "non-finite step(s) in a row, more than max_nonfinite_steps=0" in err, err[-2000:]
    assert f"step {metrics[-1]['step']} (s512)" in err and "trainer.model.finite_check" in err


@pytest.mark.parametrize(("name", "vision_recompute"), [("gpu_small.yaml", True), ("cpu_tiny.yaml", False)])
def test_device_recipe_plans_every_stage(name: str, vision_recompute: bool) -> None:
    """Also: stages that leave the vision tower's recompute unset get their preset's (every block for `small`, none
    for `tiny`)."""
    from trainer.config import load_train_config

    config = load_train_config(Path(__file__).parents[2] / "devrun" / name)
    plans = [plan_stage(config, stage, world_size=1) for stage in config.stages]
    assert [(p.stage, p.micro_batch, p.grad_accum) for p in plans] == [
        ("8k", 16, 8), ("64k", 2, 8), ("256k", 1, 4), ("1m", 1, 1)]
    assert all(p.steps >= 1 for p in plans) and not config.save_checkpoints and config.activation_checkpointing
    assert [p.vision_checkpointing for p in plans] == [vision_recompute] * 4


def test_device_recipe_of_the_1m_step_alone() -> None:
    from trainer.config import load_train_config

    config = load_train_config(Path(__file__).parents[2] / "devrun" / "gpu_small_1m.yaml")
    plans = [plan_stage(config, stage, world_size=1) for stage in config.stages]
    assert [(p.stage, p.seq_len, p.micro_batch, p.grad_accum, p.steps) for p in plans] == [("1m", 1048576, 1, 1, 1)]


@pytest.mark.parametrize(("name", "micro_batch", "grad_accum", "recomputed", "vision", "kept", "profiled"), [
    ("gpu_small_8k_h100.yaml", 8, 16, 6, 9, False, 2), ("gpu_small_8k_h200.yaml", 8, 16, False, False, True, 2),
    ("gpu_small_8k_h100_mb4.yaml", 4, 32, False, False, False, 2)])
def test_device_recipes_of_8k_alone(name: str, micro_batch: int, grad_accum: int, recomputed: bool | int,
                                    vision: bool | int, kept: bool, profiled: int) -> None:
    """The MFU recipes of `devrun/mfu_8k.sh`: 1,048,576 tokens a step. The H100's of 8 × 8K with 6 layers and 9 of the
    vision tower's 12 blocks recomputed; the same with nothing recomputed and the routed rows kept for the H200, and
    at 4 × 8K for the H100. Each profiles its second step (a cold call's first leaves too little time for a later
    one)."""
    from trainer.config import load_train_config

    config = load_train_config(Path(__file__).parents[2] / "devrun" / name)
    plans = [plan_stage(config, stage, world_size=1) for stage in config.stages]
    assert [(p.stage, p.micro_batch, p.grad_accum, p.steps, p.activation_checkpointing, p.vision_checkpointing,
             p.keep_routed_rows) for p in plans] == [("8k", micro_batch, grad_accum, 5, recomputed, vision, kept)]
    assert config.profile_step == profiled
    assert micro_batch * grad_accum * 8192 == config.tokens_per_step

