"""Short summary of a device run's output folder: the loader-vs-model JSON lines and one line per training step.

    python3 devrun/summary.py OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    bench = out / "loader_vs_model.log"
    for line in bench.read_text().splitlines() if bench.is_file() else []:
        if line.startswith("{"):
            r = json.loads(line)
            print(f"loader vs {r['model']} at {r['stage']} (micro-batch {r['micro_batch']}, {r['workers']} workers): "
                  f"loader {r['loader_tokens_per_s']:,.0f} tokens/s, model {r['model_tokens_per_s']:,.0f} tokens/s "
                  f"(step {r['model_step_s']:.2f} s, MFU {r['mfu'] or 0:.1%}, peak {r['peak_memory_gib'] or 0:.1f} GiB)"
                  f" -> loader/model {r['loader_over_model']:.1f}x")
    metrics = out / "run" / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        m = json.loads(line)
        print(f"step {m['step']} {m['stage']} ({m['micro_batch']}x{m['seq_len']} x{m['grad_accum']}): "
              f"{m['step_seconds']:.1f} s, {m['tokens_per_s']:,.0f} tokens/s, MFU {m['mfu'] or 0:.2%}, "
              f"peak {m.get('peak_memory_gib', 0):.1f} GiB, loss {m['loss']:.3f}, at {m['process_seconds']:.0f} s")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
