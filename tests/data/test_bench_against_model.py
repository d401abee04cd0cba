"""``python -m trainer.data.bench --against-model``: loader tokens/s beside a model's forward + backward consumption
in one process (tiny on the CPU here; ``small`` on the device)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.data.bench import main


def test_against_model_reports_both_rates_and_their_ratio(short_shards: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(short_shards), "--against-model", "tiny", "--stages", "s512", "--workers", "1", "--micro-batch", "2",
          "--min-samples", "4", "--repeat", "1", "--warmup-steps", "1", "--model-steps", "2"])
    out = capsys.readouterr().out
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert (result["stage"], result["seq_len"], result["micro_batch"], result["model"], result["device"]) == (
        "s512", 512, 2, "tiny", "cpu")
    assert len(result["model_steps_s"]) == 2 and result["loader_samples"] >= 4
    assert result["model_tokens_per_s"] == pytest.approx(2 * 512 / result["model_step_s"])
    assert result["loader_over_model"] == pytest.approx(result["loader_tokens_per_s"] / result["model_tokens_per_s"])
    assert "loader / model" in out
