"""Every recorded planned run, estimated again by today's kit.budget.estimate: the peak its plan
predicted when it ran (the setup row), the peak predicted now, and the measured peak.

    python3 benchmarks/tools/reestimate.py            # the rows of every record, where they have plans
    python3 benchmarks/tools/reestimate.py scale-8b   # the rows whose <record>/<file> contains this

The model of each file comes from its name: rows-<part>.jsonl's part, the record's name for
rows.jsonl (a shape the kit builds); each measured row is
estimated with its own batch, and with the policy, loss, groups and offload its plan chose.
Used for benchmarks/records/2026-11-27-layers-24gib-8b-1xh100.
"""

import sys

from kit.bench import records
from kit.budget.estimate import Setup, estimate
from kit.budget.shapes import shape_of
from kit.folder import jsonl

MODELS = {"gpt-oss": "kit:gpt-oss-20b", "moe-30b": "kit:qwen3-30b-a3b",
          "moe-235b": "kit:qwen3-235b-a22b", "70b": "kit:llama-70b", "qwen2": "kit:qwen2-7b",
          "qwen3-8b": "kit:qwen3-8b"}  # by file name; otherwise the Llama-3-8B shape


def main(part: str = "") -> None:
    print("| file | case | GPUs | batch | keeps | matmul layers | predicted then | now | measured | "
          "now vs measured |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    found = sorted(p for p in records.RECORDS.glob("*/rows*.jsonl")
                   if part in f"{p.parent.name}/{p.name}")
    for path in found:
        rows = jsonl.read(path)
        named = path.parent.name if path.stem == "rows" else path.stem
        plans = {r["case"]: r["plan"] for r in rows if r.get("kind") == "setup" and r.get("plan")}
        model = next((m for k, m in MODELS.items() if k in named), "kit:llama-8b")
        for r in rows:
            if r.get("kind") != "batch" or r.get("status") != "ok" or r["case"] not in plans:
                continue
            plan = plans[r["case"]]
            chose = {name: value for name, value, _ in plan["choices"]}
            keeps = chose.get("training.recompute.keeps")
            # Layers keeping every matmul: the plan's choice where it made one, else the N of a
            # hand-set case named "-nN" (2026-11-27-layers-24gib-8b-1xh100; its probe-nN rows are the
            # compiler bug that section 1 there describes, not the estimate's)
            named = r["case"].rsplit("-n", 1)[-1] if "-n" in r["case"] else ""
            more = chose.get("training.recompute.matmul_layers", int(named) if named.isdigit() else 0)
            setup = Setup(world_size=plan["hardware"]["world_size"], batch_size=r["batch"],
                          seq_len=plan["seq_len"], recompute=keeps is not None,
                          recompute_keeps=keeps or "inputs",
                          loss=chose.get("training.loss", "fused"),
                          lora_groups=chose.get("lora.group_inputs", False),
                          offload_activations=chose.get("training.offload_activations", False),
                          matmul_layers=more)
            now, measured = estimate(shape_of(model), setup).total_gib, r["peak_alloc_gib"]
            print(f"| {path.parent.name}/{path.name} | {r['case']} | {setup.world_size} | {r['batch']} | {keeps} | {more} | "
                  f"{plan['predicted_gib']:.2f} | {now:.2f} | {measured:.2f} | "
                  f"{100 * (now - measured) / measured:+.1f}% |")


if __name__ == "__main__":
    main(*sys.argv[1:2])
