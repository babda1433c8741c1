"""The benchmark's tables and plot, from the rows it recorded: what notebook 09's kernel imports.

    rows = kit.folder.jsonl.read("benchmarks/records/2026-11-23-speed-8b-2xh200/rows.jsonl")
    print(render(rows, matrix))           # table.md: the article's table, kit vs the baselines per cap
    best_by_case(rows), largest_by_case(rows), plot(rows, "bench.png")

Kernel side: imports no torch (matplotlib only inside `plot`, without pyplot). The rows come from
kit.bench.worker (one JSON line per setup, batch, curve, profile, done) through the runner
kit.bench, which writes results.jsonl and calls `render` and `plot`.
"""

from __future__ import annotations

from pathlib import Path


def _top_by_case(rows: list[dict], key: str) -> dict[str, dict]:
    """case -> its ok batch row with the largest `key`."""
    top: dict[str, dict] = {}
    for r in rows:
        if r.get("kind") == "batch" and r["status"] == "ok":
            if r["case"] not in top or r[key] > top[r["case"]][key]:
                top[r["case"]] = r
    return top


def best_by_case(rows: list[dict]) -> dict[str, dict]:
    """case -> its fastest batch row."""
    return _top_by_case(rows, "tokens_per_s_gpu")


def largest_by_case(rows: list[dict]) -> dict[str, dict]:
    """case -> its largest batch that fitted."""
    return _top_by_case(rows, "batch")


def fastest(best: dict[str, dict], matrix: dict, role: str, cap) -> dict | None:
    """The fastest of the best rows (`best_by_case`) of the cases with this role ("baseline",
    "peer", "kit") and memory cap; None when none of them fitted."""
    rows = [best[c["name"]] for c in matrix["cases"]
            if c.get("role") == role and c.get("cap_gib") == cap and c["name"] in best]
    return max(rows, key=lambda r: r["tokens_per_s_gpu"], default=None)


def versus_rows(rows: list[dict], matrix: dict) -> list[dict]:
    """Per cap of the matrix's kit cases, one row: the article recipe's, the peer stack's and the
    kit's best tokens/s, the kit's speed over each, and the kit case's predicted peak (its plan,
    kit.budget.plan, from the case's setup row) beside the measured one."""
    best = best_by_case(rows)
    plans = {r["case"]: r["plan"] for r in rows if r["kind"] == "setup" and r.get("plan")}
    out = []
    for cap in sorted({c["cap_gib"] for c in matrix["cases"] if c.get("role") == "kit"}):
        a, p, k = (fastest(best, matrix, role, cap) for role in ("baseline", "peer", "kit"))
        a_, p_, k_ = (r["tokens_per_s_gpu"] for r in (a, p, k))
        out.append({"model": matrix["model"], "cap GiB": cap, "article tokens/s": f"{a_:,.0f}",
                    "peer tokens/s": f"{p_:,.0f}", "kit tokens/s": f"{k_:,.0f}",
                    "kit batch": k["batch"], "kit / article": f"{k_ / a_:.2f}x",
                    "kit / peer": f"{k_ / p_:.2f}x",
                    "peak predicted GiB": f"{plans[k['case']]['predicted_gib']:.1f}",
                    "peak measured GiB": f"{k['peak_alloc_gib']:.1f}"})
    return out


def _fmt(x, spec=",.0f", none="-"):
    return none if x is None else format(x, spec)


def render(rows: list[dict], matrix: dict) -> str:
    """The report's markdown: the header line, then each table the matrix's cases call for."""
    best = best_by_case(rows)
    status = _statuses(rows, matrix)
    lines = [_header(rows, matrix), ""]
    lines += article_table(largest_by_case(rows), matrix, status)
    ran = {r["case"] for r in rows}  # caps of cases not run (--only) get no row
    caps = sorted({c.get("cap_gib") for c in matrix["cases"]
                   if c.get("role") in ("baseline", "kit", "peer", "unsloth") and c["name"] in ran},
                  key=lambda x: (x is None, x))
    if caps and any(c.get("role") in ("peer", "unsloth") for c in matrix["cases"]):
        lines += peer_table(rows, best, matrix, caps)
    elif caps:
        lines += cap_table(best, matrix, caps)
    sweeps = [c for c in matrix["cases"] if c.get("seq_lens")]
    if sweeps:
        lines += context_table(rows, sweeps)
    lines += scaling_table(best, matrix)
    lines += case_table(rows, best, matrix, status)
    lines += curve_table(rows)
    return "\n".join(lines)


def _header(rows: list[dict], matrix: dict) -> str:
    first = next((r for r in rows if r.get("device")), {})
    worlds = sorted({r["world"] for r in rows if r.get("device") and r.get("world")})
    return (f"Device: {first.get('device', '?')} x {' and '.join(map(str, worlds)) or '?'}; model "
            f"{matrix['model']}, sequence length {matrix['seq_len']}; model FLOPs per token "
            f"{_fmt(first.get('flops_per_token', 0) / 1e9, '.3g')} G (LoRA: forward + input "
            "gradients, attention included, recompute not counted)"
            + ("; MFU against 989 TFLOP/s dense bf16." if first.get("device", "cpu") != "cpu"
               else "; no MFU on CPU."))


def _statuses(rows: list[dict], matrix: dict) -> dict[str, str]:
    """case name -> how it ended: ok, OOM at a batch, skipped, failed, not run; and the graph
    breaks of its compiled code where any (the step ran in pieces: kit.recipe.checks)."""
    out = {}
    for c in matrix["cases"]:
        name = c["name"]
        rs = [r for r in rows if r["case"] == name]
        breaks = sum(r.get("graph_breaks") or 0 for r in rs)
        skip = next((r for r in rs if r.get("kind") == "skipped"), None)
        oom = next((r for r in rs if r.get("status") == "oom"), None)
        ended = next((r for r in rs if r.get("kind") == "ended"), None)
        end = (f"; then rc {ended['rc']}" + (" at the timeout" if ended["rc"] == -9 else "")
               + f", after its last row (see logs/{name}.log)") if ended else ""
        out[name] = ("not run" if not rs
                     else "failed (see logs/" + name + ".log)" if any(r.get("kind") == "failed"
                                                                    for r in rs)
                     else f"skipped: {skip['why']}" if skip
                     else (f"OOM at batch {oom['batch']}" if oom else "ok") + end)
        out[name] += f"; {breaks} graph breaks" if breaks else ""
    return out


def article_table(largest: dict[str, dict], matrix: dict, status: dict[str, str]) -> list[str]:
    """The article's configurations: the largest batch each fits under its cap."""
    article = [c for c in matrix["cases"] if c.get("table") == "article"]
    if not article:
        return []
    lines = ["### The article's table", "",
             "| configuration | cap GiB | largest batch/GPU | peak GiB | tokens/s/GPU | status |",
             "|---|---|---|---|---|---|"]
    for c in article:
        r = largest.get(c["name"])
        lines.append(f"| {c.get('label', c['name'])} | {_fmt(c.get('cap_gib'), 'g')} | "
                     f"{r['batch'] if r else 'none fits'} | "
                     f"{_fmt(r and r['peak_alloc_gib'], '.1f')} | "
                     f"{_fmt(r and r['tokens_per_s_gpu'])} | {status[c['name']]} |")
    return lines + [""]


def cap_table(best: dict[str, dict], matrix: dict, caps: list) -> list[str]:
    """The kit against the article recipe, per memory cap: the fastest of each."""
    lines = ["### Kit vs the article recipe, per memory cap (best batch of each)", "",
             "| cap GiB/GPU | baseline tokens/s/GPU (batch, MFU) | kit best tokens/s/GPU "
             "(batch, MFU) | kit config | speed-up |", "|---|---|---|---|---|"]
    for cap in caps:
        b, k = fastest(best, matrix, "baseline", cap), fastest(best, matrix, "kit", cap)
        ratio = f"{k['tokens_per_s_gpu'] / b['tokens_per_s_gpu']:.2f}x" if b and k else "-"
        lines.append(f"| {_fmt(cap, 'g')} | {_cell(b)} | {_cell(k)} | "
                     f"{k['label'] if k else '-'} | {ratio} |")
    return lines + [""]


def case_table(rows: list[dict], best: dict[str, dict], matrix: dict,
               status: dict[str, str]) -> list[str]:
    """Every case: its load, each batch tried, its best, how it ended."""
    lines = ["### Every case", "",
             "| case | recipe | cap GiB | load s (host peak GiB, largest rank) | "
             "batches tried: tokens/s/GPU (peak GiB) | best | status |",
             "|---|---|---|---|---|---|---|"]
    for c in matrix["cases"]:
        name = c["name"]
        mine = [r for r in rows if r["case"] == name]
        setup = next((r for r in mine if r.get("kind") == "setup"), {})
        load = (f"{setup['load_s']:.1f} ({max(setup['peak_host_mib']) / 1024:.1f})"
                if setup.get("load_s") is not None else "-")
        tried = ", ".join(f"{_tried(r)}: {_fmt(r['tokens_per_s_gpu'])} ({r['peak_alloc_gib']:.1f})"
                          if r["status"] == "ok" else f"{_tried(r)}: OOM"
                          for r in mine if r.get("kind") == "batch")
        b = best.get(name)
        lines.append(f"| {c.get('label', name)} | {c['recipe']} | {_fmt(c.get('cap_gib'), 'g')} | "
                     f"{load} | {tried or '-'} | {_fmt(b and b['tokens_per_s_gpu'])} | "
                     f"{status[name]} |")
    return lines + [""]


def curve_table(rows: list[dict]) -> list[str]:
    """What is learned: each case's loss curve held against the first baseline's (two or more)."""
    curves = {r["case"]: r for r in rows if r.get("kind") == "curve"}
    if len(curves) < 2:
        return []
    names = list(curves)  # held against the first baseline's curve
    first = next((n for n in names if curves[n].get("role") == "baseline"), names[0])
    ref = curves[first]
    val = all("val_loss" in c for c in curves.values())  # equivalence.data: sample
    lines = [f"### What is learned: loss per step, {len(ref['losses'])} steps at batch "
             f"{ref['batch']}, same data", "",
             "| case | loss step 1 | loss last step | max abs diff vs " + first + " |"
             + (" validation loss after |" if val else ""),
             "|---|---|---|---|" + ("---|" if val else "")]
    for n in names:
        c = curves[n]["losses"]
        diff = max(abs(a - b) for a, b in zip(c, ref["losses"], strict=False))
        lines.append(f"| {curves[n]['label']} | {c[0]:.4f} | {c[-1]:.4f} | {diff:.4f} |"
                     + (f" {curves[n]['val_loss']:.4f} |" if val else ""))
    return lines + [""]


def _cell(r: dict | None) -> str:
    return f"{_fmt(r['tokens_per_s_gpu'])} ({r['batch']}, {_fmt(r['mfu'], '.1%')})" if r else "-"


# The baselines a matrix may hold, by role, in the order their columns come.
BASELINES = (("baseline", "article recipe"), ("peer", "peer stack"), ("unsloth", "unsloth"))


def peer_table(rows: list[dict], best: dict[str, dict], matrix: dict, caps: list) -> list[str]:
    """Markdown lines: per memory cap, the baselines the matrix holds (the article recipe, role
    baseline; the peer stack, role peer; unsloth, role unsloth), best batch of each, the fastest
    kit case (role kit), and the kit's speed over each baseline; then one line per reason a
    baseline was skipped."""
    held = [(role, name) for role, name in BASELINES
            if any(c.get("role") == role for c in matrix["cases"])]
    skipped = [r for r in rows if r.get("kind") == "skipped" and r.get("role") in dict(held)]
    names = [name for _, name in held]
    said = [n if n == "unsloth" else f"the {n}" for n in names]
    said = ", ".join(said[:-1]) + " and " + said[-1] if len(said) > 1 else said[0]
    lines = [f"### Kit vs {said}, per memory cap (best batch of each)", "",
             "| cap GiB/GPU | " + " | ".join(f"{n} tokens/s/GPU (batch, MFU)" for n in names)
             + " | kit best tokens/s/GPU (batch, MFU) | kit config | "
             + " | ".join(f"over {n.split()[0]}" for n in names) + " |",
             "|---|" + "---|" * (2 * len(held) + 2)]
    for cap in caps:
        found = [fastest(best, matrix, role, cap) for role, _ in held]
        k = fastest(best, matrix, "kit", cap)
        over = [f"{k['tokens_per_s_gpu'] / x['tokens_per_s_gpu']:.2f}x" if x and k else "-"
                for x in found]
        cells = [_cell(x) if x or not any(
                     r.get("cap_gib") == cap and r["role"] == role for r in skipped) else "skipped"
                 for x, (role, _) in zip(found, held, strict=True)]
        lines.append(f"| {_fmt(cap, 'g')} | {' | '.join(cells)} | {_cell(k)} | "
                     f"{k['label'] if k else '-'} | {' | '.join(over)} |")
    lines.append("")
    for role, name in held:
        mine = [r for r in skipped if r["role"] == role]
        for why in dict.fromkeys(r["why"] for r in mine):
            cases = ", ".join(r["case"] for r in mine if r["why"] == why)
            lines += [f"{name}: skipped: {why} ({cases})", ""]
    return lines


def _tried(r: dict) -> str:
    """A batch row's label: its batch, and its sequence length where that is not the matrix's."""
    return f"{r['batch']}" if not r.get("sweep") else f"{r['batch']} x {r['seq_len']:,}"


def scaling_table(best: dict[str, dict], matrix: dict) -> list[str]:
    """Markdown lines: each case that others scale (`scales:`), beside them: the same setup on
    another number of GPUs, best batch of each; the throughput of all GPUs against the scaled
    case's, and per GPU (1.00: every added GPU as fast as the first)."""
    lines = []
    for base in dict.fromkeys(c["scales"] for c in matrix["cases"] if c.get("scales")):
        group = [base] + [c["name"] for c in matrix["cases"] if c.get("scales") == base]
        ran = sorted((best[n] for n in group if n in best), key=lambda r: r["world"])
        if not lines:
            lines = ["### Scaling: one setup on more GPUs (best batch of each)", "",
                     "| case | GPUs | batch/GPU | tokens/s/GPU | tokens/s, all GPUs | "
                     "peak GiB/GPU | all GPUs vs fewest | per GPU vs fewest |",
                     "|---|---|---|---|---|---|---|---|"]
        for r in ran:  # against the fewest GPUs' row, ran[0]
            total, ref = r["tokens_per_s_gpu"] * r["world"], ran[0]
            lines.append(f"| {r['case']} | {r['world']} | {r['batch']} | "
                         f"{_fmt(r['tokens_per_s_gpu'])} | {_fmt(total)} | "
                         f"{r['peak_alloc_gib']:.1f} | "
                         f"{total / (ref['tokens_per_s_gpu'] * ref['world']):.2f}x | "
                         f"{r['tokens_per_s_gpu'] / ref['tokens_per_s_gpu']:.2f} |")
        missing = [n for n in group if n not in best]
        if missing:
            lines.append(f"| {', '.join(missing)}: nothing fitted or not run | | | | | | | |")
    return [*lines, ""] if lines else []


def context_table(rows: list[dict], sweeps: list[dict]) -> list[str]:
    """Markdown lines: per context-sweep case (`seq_lens`), tokens/s and peak at each sequence
    length (batch 1 unless the case says otherwise), OOM where it stopped, and the longest that
    trained."""
    seqs = sorted({q for c in sweeps for q in c["seq_lens"]})
    lines = ["### Context: the longest sequence that trains", "",
             "| case | cap GiB | " + " | ".join(f"{q:,}" for q in seqs) + " | longest |",
             "|---|---|" + "---|" * (len(seqs) + 1)]  # fmt: skip
    for c in sweeps:
        got = {r["seq_len"]: r for r in rows if r["case"] == c["name"] and r.get("kind") == "batch"}
        cells = [("OOM" if got[q]["status"] == "oom" else
                  f"{_fmt(got[q]['tokens_per_s_gpu'])} tok/s ({got[q]['peak_alloc_gib']:.1f} GiB)")
                 if q in got else "-" for q in seqs]  # fmt: skip
        ok = [q for q, r in got.items() if r["status"] == "ok"]
        lines.append(f"| {c.get('label', c['name'])} | {_fmt(c.get('cap_gib'), 'g')} | "
                     + " | ".join(cells) + f" | {_fmt(max(ok, default=None), ',')} |")
    return [*lines, ""]


def plot(rows: list[dict], path: str | Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend stays as it is

    sweep = [r for r in rows if r.get("kind") == "batch" and r.get("sweep")]
    fig = Figure(figsize=(18 if sweep else 12, 4.5))
    ax, bx, *cx = fig.subplots(1, 3 if sweep else 2)
    for name in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == name and r.get("kind") == "batch"
              and r["status"] == "ok"]
        style = {"marker": "o", "label": name,
                 "ls": {"article": "--", "peer": ":", "unsloth": "-."}.get(rs[0]["recipe"], "-") if rs else "-"}
        if rs and rs[0].get("sweep"):
            cx[0].plot([r["seq_len"] for r in rs], [r["tokens_per_s_gpu"] for r in rs], **style)
        elif rs:
            ax.plot([r["batch"] for r in rs], [r["tokens_per_s_gpu"] for r in rs], **style)
        for r in rows:
            if r["case"] == name and r.get("kind") == "curve":
                bx.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name)
    ax.set(xscale="log", xlabel="batch per GPU", ylabel="tokens/s per GPU",
           title="throughput (dashed: article recipe, dotted: peer stack, dash-dot: unsloth)")
    bx.set(xlabel="step", ylabel="loss", title="same data, same start")
    if cx:
        cx[0].set(xscale="log", xlabel="sequence length (batch 1)", ylabel="tokens/s per GPU",
                  title="context: until it does not fit")  # fmt: skip
    for a in (ax, bx, *cx):
        if a.lines:
            a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
