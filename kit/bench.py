"""Benchmark runner: a matrix of training configurations, each in its own torchrun, in one invocation.

    python -m kit.bench benchmarks/matrices/bench-8b.yaml --out runs/bench          # the whole matrix
    python -m kit.bench benchmarks/matrices/bench-8b.yaml --out runs/bench --only kit-40-none,article-40

A matrix (YAML) names the model, sequence length and processes, and its cases. A case is either the
article recipe (`kit.article`, the hand-written baseline) or the kit's recipe (`kit.train.Recipe`)
with config overrides, under an optional memory cap per GPU (`cap_gib`: emulates a smaller GPU with
`torch.cuda.set_per_process_memory_fraction`). Each case tries its batch sizes in ascending order
on synthetic tokens (the same for every case), until one does not fit: an out-of-memory is a
result row, not a crash. Per batch: warm-up steps excluded, tokens/s per GPU as the median step,
peak allocated and reserved memory, MFU (model FLOPs per token are printed with the table).
A case marked `equivalence: true` first trains `equivalence.steps` steps at one common batch size
from its initial adapter and records the loss of every step, so that two recipes can be compared
for what they learn, not only for speed. Both recipes are seeded alike (the matrix's `seed`,
default 42): the same LoRA initialisation, and dropout that differs per rank the same way.

Output in --out: results.jsonl (every row), table.md (the article's table, kit vs baseline per
cap, every case, equivalence), bench.png.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

# Dense bf16 tensor-core peak from the vendor's data sheet (MFU's denominator), by device name.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


# ---------------------------------------------------------------------------------------- matrix
def load_matrix(path: str | Path) -> dict:
    m = yaml.safe_load(Path(path).read_text())
    names = [c["name"] for c in m["cases"]]
    if len(set(names)) != len(names):
        raise ValueError(f"cases: names must be unique, got {names}")
    for c in m["cases"]:
        if c.get("recipe") not in ("article", "kit"):
            raise ValueError(f"cases.{c['name']}.recipe: {c.get('recipe')!r} is not allowed; "
                             "expected 'article' or 'kit'")
    return m


def synthetic_batch(step: int, rank: int, batch: int, seq: int, vocab: int, device) -> dict:
    """Tokens every recipe sees identically: a random phrase of seq/4 tokens from a fixed subset
    of the vocabulary (4,096 tokens, or 1/8 of a small one), repeated 4 times (learnable: the
    subset at once, the repeats by copying), seeded by (step, rank)."""
    g = torch.Generator().manual_seed(1_000_003 * (step + 1) + rank)
    size = min(4096, (vocab - 3) // 8)
    subset = torch.randperm(vocab - 3, generator=torch.Generator().manual_seed(0))[:size] + 3
    phrase = subset[torch.randint(0, len(subset), (batch, seq // 4 + 1), generator=g)]
    ids = phrase.repeat(1, 4)[:, :seq].contiguous()
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "labels": ids.clone().to(device)}


def flops_per_token(config, seq: int) -> float:
    """Model FLOPs per trained token for LoRA: forward (2N) + input gradients (2N) through the
    frozen linear layers, attention's matmuls forward and backward (causal), no recompute counted
    (checkpointing's extra forward is overhead, not model work). Frozen weights get no gradient."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads) or heads
    hd = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    per_layer = h * (heads * hd) + 2 * h * (kv * hd) + (heads * hd) * h + 3 * h * inter
    linear = layers * per_layer + h * vocab
    attention = 2 * seq * (heads * hd) * layers  # QK^T and AV, causal half, per token, forward
    return 4 * linear + 3 * attention


# ---------------------------------------------------------------------------------------- worker
class _Run:
    """One case inside torchrun: build the recipe, then step(batch) -> loss."""

    def __init__(self, matrix: dict, case: dict, out: Path):
        from kit import dist as kdist
        from kit import builtin

        self.case, self.matrix = case, matrix
        device = matrix.get("device", "auto")
        self.env = env = kdist.init(device, case.get("dist_timeout_min", 5))
        if case.get("cap_gib") and env.device.type == "cuda":
            total = torch.cuda.get_device_properties(env.device).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, case["cap_gib"] * 2**30 / total), env.device
            )
        with kdist.main_process_first(env):
            path = builtin.resolve(matrix["model"])
        self.seq = matrix["seq_len"]
        lr = matrix.get("lr", 2e-4)
        seed = matrix.get("seed", 42)  # the kit recipe's training.seed default
        if case["recipe"] == "article":
            from kit import article

            # Seeded as the kit's recipe seeds itself: the same adapter initialisation before
            # building, dropout differing per rank after, so that both start from one adapter.
            torch.manual_seed(seed)
            self.model, self.optimizer = article.build(path, env.device, lr=lr,
                                                       **case.get("options", {}))
            torch.manual_seed(seed + env.rank)
            # The mean over ranks, as the kit's recipe reports it.
            self._step = lambda b: kdist.mean(article.train_step(self.model, self.optimizer, b), env)
        else:
            from kit.config import load_config
            from kit.train import Recipe

            overrides = [
                f"model.name={matrix['model']}", f"training.device={device}",
                f"data.max_seq_len={self.seq}", "lora.r=16", "lora.alpha=32", "lora.dropout=0.05",
                "lora.target_modules=all-linear", f"training.lr={lr}", "training.warmup_steps=0",
                f"training.seed={seed}",
                "training.scheduler=constant", "training.weight_decay=0",
                "training.max_grad_norm=1.0", "training.eval_every=0", "training.grad_accum=1",
                f"run.output_dir={out / 'runs' / case['name']}", "run.overwrite=true",
                "checkpointing.save_adapter=false", "checkpointing.save_probe_logits=false",
                f"run.dist_timeout_min={case.get('dist_timeout_min', 5)}",
                *case.get("overrides", []),
            ]
            self.recipe = Recipe(load_config(matrix.get("kit_config"), overrides))
            self.recipe.setup()
            self.model, self.optimizer = self.recipe.model, self.recipe.optimizer
            self._step = self._kit_step
        from transformers import AutoConfig

        self.flops = flops_per_token(AutoConfig.from_pretrained(path), self.seq)
        self.vocab = AutoConfig.from_pretrained(path).vocab_size

    def _kit_step(self, batch: dict) -> float:
        self.recipe.train_batches = iter([batch])  # the recipe's own step: loop, clip, optimizer
        return self.recipe.train_step()["loss"]

    def batch(self, step: int, size: int) -> dict:
        return synthetic_batch(step, self.env.rank, size, self.seq, self.vocab, self.env.device)

    def step(self, batch: dict) -> float:
        return self._step(batch)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _any_rank(flag: bool, env) -> bool:
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _peaks(device) -> tuple[float | None, float | None]:
    if device.type != "cuda":
        from kit.train import peak_memory_gib

        return round(peak_memory_gib(device), 3), None
    return (round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
            round(torch.cuda.max_memory_reserved(device) / 2**30, 3))


def worker(matrix_path: str, name: str, out: str) -> int:
    matrix = load_matrix(matrix_path)
    case = next(c for c in matrix["cases"] if c["name"] == name)
    out = Path(out)
    rows_file = out / "cases" / f"{name}.jsonl"
    started = time.perf_counter()
    run = _Run(matrix, case, out)
    env = run.env
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)
    base = {"case": name, "recipe": case["recipe"], "label": case.get("label", name),
            "role": case.get("role", ""), "table": case.get("table", ""),
            "cap_gib": case.get("cap_gib"), "seq_len": run.seq, "world": env.world_size,
            "device": device_name, "flops_per_token": run.flops}

    def emit(row: dict) -> None:
        if env.is_main:
            rows_file.parent.mkdir(parents=True, exist_ok=True)
            with open(rows_file, "a") as f:
                f.write(json.dumps({**base, **row}) + "\n")
            print(json.dumps(row), flush=True)

    emit({"kind": "setup", "seconds": round(time.perf_counter() - started, 1)})
    fail_at = int(os.environ.get("KIT_BENCH_OOM_AT_BATCH", "0"))  # tests: an injected OOM

    eq = matrix.get("equivalence", {})
    if case.get("equivalence") and eq:
        trainable = [p for p in run.model.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in trainable]
        losses = [run.step(run.batch(10_000 + s, eq["batch"])) for s in range(eq["steps"])]
        emit({"kind": "curve", "batch": eq["batch"], "losses": losses})
        with torch.no_grad():  # back to the initial adapter and a fresh optimizer
            for p, p0 in zip(trainable, start, strict=True):
                p.copy_(p0)
        run.optimizer.state.clear()
        del start

    warmup, measure = case.get("warmup_steps", matrix.get("warmup_steps", 1)), \
        case.get("measure_steps", matrix.get("measure_steps", 3))
    step_no = 0
    for size in case["batches"]:
        # A compiled case compiles each batch size afresh, with static shapes, as a run of that
        # size would (otherwise the second size recompiles with dynamic shapes).
        torch._dynamo.reset()
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(env.device)
        times, losses, oom, error = [], [], False, None
        try:
            for i in range(warmup + measure):
                batch = run.batch(step_no, size)
                step_no += 1
                if fail_at and size >= fail_at:
                    raise torch.OutOfMemoryError(f"injected (KIT_BENCH_OOM_AT_BATCH={fail_at})")
                _sync(env.device)
                t = time.perf_counter()
                losses.append(run.step(batch))
                _sync(env.device)
                if i >= warmup:
                    times.append(time.perf_counter() - t)
                elif i == 0:
                    first = time.perf_counter() - t
        except torch.OutOfMemoryError as e:
            oom, error = True, str(e).splitlines()[0][:200]
        if _any_rank(oom, env):
            emit({"kind": "batch", "batch": size, "status": "oom", "error": error})
            break  # larger batches will not fit either; the process state after an OOM is spent
        step_s = statistics.median(times)
        tps = size * run.seq / step_s
        alloc, reserved = _peaks(env.device)
        emit({"kind": "batch", "batch": size, "status": "ok", "step_s": round(step_s, 4),
              "first_step_s": round(first, 2), "tokens_per_s_gpu": round(tps, 1),
              "mfu": round(tps * run.flops / peak, 4) if peak else None,
              "peak_alloc_gib": alloc, "peak_reserved_gib": reserved,
              "loss_first": losses[0], "loss_last": losses[-1]})
    if case.get("profile") and env.device.type == "cuda" and not oom and case["batches"]:
        emit({"kind": "profile", "batch": size, **profile_step(run, run.batch(step_no, size))})
    emit({"kind": "done", "seconds": round(time.perf_counter() - started, 1)})
    return 0


# Kernel families by name (first match wins): where a step's GPU time goes.
KERNEL_FAMILIES = [
    ("nccl", ("nccl",)), ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("optimizer", ("adam", "multi_tensor")),
    ("4-bit dequantize", ("dequantize", "kdequant")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "splitk", "cublas")),
    ("compiled (triton)", ("triton",)), ("copy", ("memcpy", "memset", "copy")),
]


def _is_annotation(name: str) -> bool:
    """Ranges that modules and optimizers mark on the GPU timeline: spans, not kernels."""
    marks = ("FSDP::", "Optimizer.", "FullyShardedDataParallel", "DistributedDataParallel",
             "ProfilerStep", "## ")
    return name.startswith(marks) or "#" in name


def kernel_family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in KERNEL_FAMILIES if any(k in low for k in keys)),
                "other eager kernels")


def profile_step(run: _Run, batch: dict) -> dict:
    """One more step under torch.profiler: GPU time per kernel family and the 20 costliest
    kernels, plus the share of the step the GPU sat idle (launch overhead, host syncs)."""
    from torch.profiler import ProfilerActivity, profile

    _sync(run.env.device)
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run.step(batch)
        _sync(run.env.device)
    wall_ms = (time.perf_counter() - t) * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not _is_annotation(e.name)]
    by_family: dict[str, float] = {}
    by_name: dict[str, float] = {}
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # union of kernel intervals over all streams
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    for e in kernels:
        us = e.time_range.elapsed_us()
        by_family[kernel_family(e.name)] = by_family.get(kernel_family(e.name), 0.0) + us
        by_name[e.name] = by_name.get(e.name, 0.0) + us
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:20]
    return {"wall_ms": round(wall_ms, 1), "gpu_busy_ms": round(busy / 1e3, 1),
            "families_ms": {k: round(v / 1e3, 1) for k, v in
                            sorted(by_family.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [[n[:90], round(v / 1e3, 2)] for n, v in top]}


# ---------------------------------------------------------------------------------------- runner
def run_case(matrix_path: str, case: dict, out: Path, nproc: int) -> int:
    """One torchrun, in its own process group (a timeout stops every rank, none is orphaned)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "kit.bench", "worker", str(matrix_path),
           case["name"], str(out)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env.setdefault("OMP_NUM_THREADS", "1")
    log = open(out / "logs" / f"{case['name']}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=Path(__file__).resolve().parents[1])
    try:
        return proc.wait(timeout=case.get("timeout_s", 600))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -9
    finally:
        log.close()


def run(matrix_path: str, out: str | Path, only: list[str] | None = None) -> list[dict]:
    matrix = load_matrix(matrix_path)
    out = Path(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "cases").mkdir(exist_ok=True)
    nproc = matrix.get("nproc", 2)
    for case in matrix["cases"]:
        if only and case["name"] not in only:
            continue
        (out / "cases" / f"{case['name']}.jsonl").unlink(missing_ok=True)
        t = time.perf_counter()
        rc = run_case(matrix_path, case, out, nproc)
        rows = read_rows(out / "cases" / f"{case['name']}.jsonl")
        if rc != 0 or not any(r["kind"] == "done" for r in rows):
            tail = (out / "logs" / f"{case['name']}.log").read_text().splitlines()[-3:]
            with open(out / "cases" / f"{case['name']}.jsonl", "a") as f:
                f.write(json.dumps({"case": case["name"], "recipe": case["recipe"],
                                    "label": case.get("label", case["name"]),
                                    "role": case.get("role", ""), "cap_gib": case.get("cap_gib"),
                                    "table": case.get("table", ""), "kind": "failed",
                                    "rc": rc, "log_tail": tail}) + "\n")
        print(f"{case['name']}: rc={rc} in {time.perf_counter() - t:.0f}s", flush=True)
    rows = [r for p in sorted((out / "cases").glob("*.jsonl")) for r in read_rows(p)]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = render(rows, matrix)
    (out / "table.md").write_text(table)
    print(table)
    try:
        plot(rows, out / "bench.png")
    except ImportError:
        pass
    return rows


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------- report
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


def _fmt(x, spec=",.0f", none="-"):
    return none if x is None else format(x, spec)


def render(rows: list[dict], matrix: dict) -> str:
    best, largest = best_by_case(rows), largest_by_case(rows)
    cases = [c["name"] for c in matrix["cases"]]
    by_case = {n: [r for r in rows if r["case"] == n] for n in cases}
    first = next((r for r in rows if r.get("device")), {})
    lines = [f"Device: {first.get('device', '?')} x {first.get('world', '?')}; model "
             f"{matrix['model']}, sequence length {matrix['seq_len']}; model FLOPs per token "
             f"{_fmt(first.get('flops_per_token', 0) / 1e9, '.3g')} G (LoRA: forward + input "
             "gradients, attention included, recompute not counted)"
             + ("; MFU against 989 TFLOP/s dense bf16." if first.get("device", "cpu") != "cpu"
                else "; no MFU on CPU."), ""]

    def status(name: str) -> str:
        rs = by_case.get(name, [])
        if not rs:
            return "not run"
        if any(r.get("kind") == "failed" for r in rs):
            return "failed (see logs/" + name + ".log)"
        oom = next((r for r in rs if r.get("status") == "oom"), None)
        return f"OOM at batch {oom['batch']}" if oom else "ok"

    article = [c for c in matrix["cases"] if c.get("table") == "article"]
    if article:
        lines += ["### The article's table", "",
                  "| configuration | cap GiB | largest batch/GPU | peak GiB | tokens/s/GPU | status |",
                  "|---|---|---|---|---|---|"]
        for c in article:
            r = largest.get(c["name"])
            lines.append(f"| {c.get('label', c['name'])} | {_fmt(c.get('cap_gib'), 'g')} | "
                         f"{r['batch'] if r else 'none fits'} | "
                         f"{_fmt(r and r['peak_alloc_gib'], '.1f')} | "
                         f"{_fmt(r and r['tokens_per_s_gpu'])} | {status(c['name'])} |")
        lines.append("")

    caps = sorted({c.get("cap_gib") for c in matrix["cases"] if c.get("role") in ("baseline", "kit")},
                  key=lambda x: (x is None, x))
    if caps:
        lines += ["### Kit vs the article recipe, per memory cap (best batch of each)", "",
                  "| cap GiB/GPU | baseline tokens/s/GPU (batch, MFU) | kit best tokens/s/GPU "
                  "(batch, MFU) | kit config | speed-up |", "|---|---|---|---|---|"]
        def top(role, cap):
            rs = [best[c["name"]] for c in matrix["cases"]
                  if c.get("role") == role and c.get("cap_gib") == cap and c["name"] in best]
            return max(rs, key=lambda r: r["tokens_per_s_gpu"], default=None)

        for cap in caps:
            b, k = top("baseline", cap), top("kit", cap)
            ratio = f"{k['tokens_per_s_gpu'] / b['tokens_per_s_gpu']:.2f}x" if b and k else "-"
            def cell(r):
                return (f"{_fmt(r['tokens_per_s_gpu'])} ({r['batch']}, {_fmt(r['mfu'], '.1%')})"
                        if r else "-")
            lines.append(f"| {_fmt(cap, 'g')} | {cell(b)} | {cell(k)} | "
                         f"{k['label'] if k else '-'} | {ratio} |")
        lines.append("")

    lines += ["### Every case", "",
              "| case | recipe | cap GiB | batches tried: tokens/s/GPU (peak GiB) | best | status |",
              "|---|---|---|---|---|---|"]
    for name in cases:
        rs = [r for r in by_case[name] if r.get("kind") == "batch"]
        tried = ", ".join(f"{r['batch']}: {_fmt(r['tokens_per_s_gpu'])} ({r['peak_alloc_gib']:.1f})"
                          if r["status"] == "ok" else f"{r['batch']}: OOM" for r in rs)
        b = best.get(name)
        c = next(c for c in matrix["cases"] if c["name"] == name)
        lines.append(f"| {c.get('label', name)} | {c['recipe']} | {_fmt(c.get('cap_gib'), 'g')} | "
                     f"{tried or '-'} | {_fmt(b and b['tokens_per_s_gpu'])} | {status(name)} |")
    lines.append("")

    curves = {r["case"]: r for r in rows if r.get("kind") == "curve"}
    if len(curves) >= 2:
        names = list(curves)
        ref = curves[names[0]]
        lines += [f"### What is learned: loss per step, {len(ref['losses'])} steps at batch "
                  f"{ref['batch']}, same data", "",
                  "| case | loss step 1 | loss last step | max abs diff vs " + names[0] + " |",
                  "|---|---|---|---|"]
        for n in names:
            c = curves[n]["losses"]
            diff = max(abs(a - b) for a, b in zip(c, ref["losses"], strict=False))
            lines.append(f"| {curves[n]['label']} | {c[0]:.4f} | {c[-1]:.4f} | {diff:.4f} |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend stays as it is

    fig = Figure(figsize=(12, 4.5))
    ax, bx = fig.subplots(1, 2)
    for name in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == name and r.get("kind") == "batch"
              and r["status"] == "ok"]
        if rs:
            ax.plot([r["batch"] for r in rs], [r["tokens_per_s_gpu"] for r in rs], marker="o",
                    label=name, ls="--" if rs[0]["recipe"] == "article" else "-")
        for r in rows:
            if r["case"] == name and r.get("kind") == "curve":
                bx.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name)
    ax.set(xscale="log", xlabel="batch per GPU", ylabel="tokens/s per GPU",
           title="throughput (dashed: article recipe)")
    ax.legend(fontsize=7)
    bx.set(xlabel="step", ylabel="loss", title="same data, same start")
    if bx.lines:
        bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker(*argv[1:4])
    p = argparse.ArgumentParser(prog="python -m kit.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("matrix")
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="", help="comma-separated case names")
    a = p.parse_args(argv)
    run(a.matrix, a.out, [s for s in a.only.split(",") if s] or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
