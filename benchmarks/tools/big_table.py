"""One row per finished recipe run (RUN folders): what loading cost, the steady step's speed and
memory, and the memory estimator's prediction for the same setup (kit.budget.estimate), as Markdown.

    python3 benchmarks/tools/big_table.py RUN [RUN ...]
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kit.budget.estimate import Setup, estimate  # noqa: E402
from kit.config import load_config  # noqa: E402
from kit.folder import jsonl  # noqa: E402

print("| run | batch x seq | load s | host peak MiB (after load) | GPU GiB after load | "
      "tokens/s (median, steps 3+) | peak GiB | estimate GiB | estimate error | loss first -> last |")
print("|---|---|---|---|---|---|---|---|---|---|")
for folder in map(Path, sys.argv[1:]):
    result_file = folder / "result.json"
    if not result_file.is_file():
        print(f"| {folder.name} | not finished (see its log) |||||||||")
        continue
    result = json.loads(result_file.read_text())
    cfg = load_config(folder / "config.yaml")
    rows = [m for m in jsonl.read(folder / "metrics.jsonl") if m["split"] == "train"]
    speed = statistics.median(m["tokens_per_s"] for m in rows[2:])
    peak = max(m["peak_mem_gib"] for m in rows)
    est = estimate(cfg.model.name, Setup.from_config(cfg, world_size=result["world_size"]))
    load = result["load"]
    print(f"| {folder.name} | {cfg.training.batch_size} x {cfg.data.max_seq_len} | "
          f"{load['seconds']:.0f} | {max(load['peak_host_mib']):,.0f} | {load['device_gib']:.1f} | "
          f"{speed:,.0f} | {peak:.1f} | {est.total_gib:.1f} | "
          f"{100 * (est.total_gib - peak) / peak:+.1f}% | "
          f"{result['first_loss']:.3f} -> {result['final_loss']:.3f} |")
