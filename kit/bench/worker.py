"""The benchmark's rank side: one case of a matrix inside torchrun, row by row into a JSON-lines file.

    torchrun --nproc_per_node=2 -m kit.bench.worker CONFIG OUT CASE --matrix MATRIX [key=value ...]

Started by the runner (kit.bench), through the case's run folder (`OUT/runs/CASE/run.sh`, written
by kit.run.launch.prepare). CONFIG is that folder's config.yaml: the training setup (model, device,
sequence length, learning rate, seed; for the kit's recipe every override of the case), and
key=value arguments override it (as run.sh passes them on). MATRIX and
CASE give the measurement: batches, warm-up and measured steps, the memory cap, the equivalence
phase, the profile. Rank 0 appends each row to `OUT/cases/CASE.jsonl` (and prints it) and writes
result.json into the run folder when the case ended.

The article recipe is built by kit.bench.article, the peer stack by kit.bench.peer, unsloth by
kit.bench.unsloth (one process, in its own folder of packages); the kit's by
kit.train.Recipe, whose own train_step runs each step (`batches: [auto]`: the batch size its setup
planned). All see the same synthetic tokens (`synthetic_batch`), or in the equivalence
phase of a real model the bundled sample text (`equivalence.data: sample`), and are seeded alike.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from kit.bench import experiment
from kit.bench.matrix import load_matrix
from kit.bench.profiling import profile_step
from kit.budget.shapes import flops_per_token, shape_of
from kit.budget.step_model import PEAK_BF16_FLOPS
from kit.config import Config
from kit.folder import jsonl
from kit.folder.layout import RunFolder
from kit.recipe import checks, faults
from kit.recipe import dist as kdist


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


def text_batch(rows: dict, index: int, rank: int, world: int, size: int, device) -> dict:
    """Batch `index` of this rank: consecutive rows, ranks side by side, wrapping around."""
    n = len(rows["input_ids"])
    pick = torch.tensor([(index * world + rank) * size + i for i in range(size)]) % n
    return {k: v[pick].to(device) for k, v in rows.items()}


def _val_loss(run: _Run, rows: dict, size: int) -> float:
    """Mean loss over the validation rows (every rank its share), after the equivalence steps."""
    from kit.recipe import dist as kdist
    from kit.recipe import quantize

    env, losses = run.env, []
    # An eval forward without gradients on a CPU with AVX512-BF16 makes bitsandbytes repack each
    # 4-bit weight in place into an inference-only layout; the article recipe's FSDP1 weights are
    # views into a flat parameter, and its held-out loss came out wrong (6.71 against the kit's
    # 6.35 after the same training; 6.35 for both with the repacking off: issue 28). The kit's
    # recipe switches the repacking off when it loads; the measurement does so for both recipes.
    quantize.keep_packing(run.model)
    run.model.eval()
    with torch.no_grad():
        for i in range(max(1, len(rows["input_ids"]) // (size * env.world_size))):
            batch = text_batch(rows, i, env.rank, env.world_size, size, env.device)
            losses.append(float(run.model(**batch).loss))
    run.model.train()
    return kdist.mean(sum(losses) / len(losses), env)


def _loaded(seconds: float, env) -> dict:
    """Load and shard time, and every rank's peak host memory so far (as kit.train records)."""
    import torch.distributed as dist

    from kit.recipe import meters

    peaks: list = [None] * env.world_size
    dist.all_gather_object(peaks, round(meters.peak_rss_mib(), 1))
    return {"seconds": round(seconds, 2), "peak_host_mib": peaks}


class _Run:
    """One case inside torchrun: build the recipe, then step(batch) -> loss."""

    def __init__(self, cfg: Config, case: dict, env):
        from kit.inputs import builtin
        from kit.recipe import dist as kdist

        self.case = case
        self.env = env  # the group the harness joined (kit.bench.experiment)
        if case.get("cap_gib") and env.device.type == "cuda":
            total = torch.cuda.get_device_properties(env.device).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, case["cap_gib"] * 2**30 / total), env.device
            )
        with kdist.main_process_first(env):
            path = builtin.resolve(cfg.model.name)
        self.seq = cfg.data.max_seq_len
        self.batches = case["batches"]
        if case["recipe"] == "unsloth":
            from kit.bench import unsloth

            unsloth.prepare()  # before transformers: it patches transformers' classes on import
            loading = time.perf_counter()
            options = {"seq_len": cfg.data.max_seq_len, "lr": cfg.training.lr,
                       "seed": cfg.training.seed, **case.get("options", {})}
            self.model, self.optimizer = unsloth.build(path, env.device, **options)
            self.load = _loaded(time.perf_counter() - loading, env)
            self._step = lambda b: unsloth.train_step(self.model, self.optimizer, b)
        elif case["recipe"] in ("article", "peer"):
            from kit.bench import article, peer

            # The article recipe and the peer stack are built alike, each by its own module.
            built = article if case["recipe"] == "article" else peer
            # Seeded as the kit's recipe seeds itself: the same adapter initialisation before
            # building, dropout differing per rank after, so that both start from one adapter.
            seed = cfg.training.seed
            torch.manual_seed(seed)
            loading = time.perf_counter()
            self.model, self.optimizer = built.build(path, env.device, lr=cfg.training.lr,
                                                     **case.get("options", {}))
            self.load = _loaded(time.perf_counter() - loading, env)
            torch.manual_seed(seed + env.rank)
            # The mean over ranks, as the kit's recipe reports it.
            self._step = lambda b: kdist.mean(built.train_step(self.model, self.optimizer, b), env)
        else:
            from kit.train import Recipe

            self.recipe = Recipe(cfg)
            self.recipe.setup()
            self.model, self.optimizer = self.recipe.model, self.recipe.optimizer
            self.load = self.recipe.load  # its seconds and peak_host_mib, as _loaded gives
            if self.batches == ["auto"]:  # the batch the recipe planned for itself in setup
                planned = self.recipe.cfg.training.batch_size
                if not (isinstance(planned, int) and planned > 0):
                    raise ValueError(f"cases.{case['name']}.batches: ['auto'] left "
                                     f"training.batch_size at {planned!r} after setup; expected "
                                     "a positive whole number")
                self.batches = [planned]
            self._step = self._kit_step
        self.shape = shape_of(path)
        self.flops = flops_per_token(self.shape, self.seq)
        self.vocab = self.shape.vocab

    def set_seq(self, seq: int) -> None:
        """Tokens per sequence from now on (a context sweep); FLOPs per token grow with it."""
        self.seq, self.flops = seq, flops_per_token(self.shape, seq)

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


def outside_gib(device) -> float | None:
    """GPU memory in use beyond what torch's allocator holds (the CUDA context, loaded kernels,
    communicator buffers): the device's used memory less the allocator's reserved, now. On a card
    of its own it comes out of the card; under a per-process cap it sits beside the cap (the
    planner's reserve, kit.budget.plan.Hardware.outside_gib). Counts other processes on the
    device too: the bench runs one process per GPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return round((total - free - torch.cuda.memory_reserved(device)) / 2**30, 3)


def _peaks(device) -> tuple[float | None, float | None]:
    if device.type != "cuda":
        from kit.recipe.meters import peak_gib

        return round(peak_gib(device), 3), None
    return (round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
            round(torch.cuda.max_memory_reserved(device) / 2**30, 3))


def _curve(run: _Run, eq: dict, model: str) -> dict:
    """The matrix's `equivalence`: a few steps from the initial adapter, their losses (and, on the
    bundled sample text, the held-out loss after); then the adapter and optimizer as before."""
    env = run.env
    trainable = [p for p in run.model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in trainable]
    from kit.recipe.lora import sample_rows  # (train, held-out) rows of the bundled sample text

    text = sample_rows(model, run.seq) if eq.get("data") == "sample" else None
    batches = ((text_batch(text[0], s, env.rank, env.world_size, eq["batch"], env.device)
                if text else run.batch(10_000 + s, eq["batch"])) for s in range(eq["steps"]))
    losses = [run.step(b) for b in batches]
    curve = {"kind": "curve", "batch": eq["batch"], "losses": losses}
    if text:  # what the adapter learned, on rows it never trained on
        curve["val_loss"] = _val_loss(run, text[1], eq["batch"])
    with torch.no_grad():  # back to the initial adapter and a fresh optimizer
        for p, p0 in zip(trainable, start, strict=True):
            p.copy_(p0)
    run.optimizer.state.clear()
    return curve


def _timed_steps(run: _Run, size: int, warmup: int, measure: int, step_no: int,
                 fail_at: int) -> dict:
    """warmup + measure steps of batch `size` (batches from `step_no` on): the measured steps'
    times, the first step's, every loss; or where it ran out of memory (oom, error, step)."""
    device = run.env.device
    out = {"times": [], "losses": [], "first": None, "oom": False, "error": None, "step": 0,
           "steps": 0}
    try:
        for i in range(warmup + measure):
            out["step"] = i
            batch = run.batch(step_no + i, size)
            out["steps"] += 1
            if fail_at and size >= fail_at:
                raise torch.OutOfMemoryError(f"injected (KIT_BENCH_OOM_AT_BATCH={fail_at})")
            _sync(device)
            t = time.perf_counter()
            out["losses"].append(run.step(batch))
            _sync(device)
            if i == 0:  # with no warm-up step, the measured step is the first
                out["first"] = time.perf_counter() - t
            if i >= warmup:
                out["times"].append(time.perf_counter() - t)
    except torch.OutOfMemoryError as e:
        # the allocator's whole first line (allocated, reserved but unallocated) and the peaks
        # so far: what a planned case that runs out of memory needs to be traced
        out["oom"], out["error"] = True, str(e).splitlines()[0]
    return out


def worker(this: experiment.Case) -> None:
    """One case of the matrix on this rank (the harness's case `this`: the case's name, its config
    with the run's overrides, the group, OUT); its rows stream into OUT/cases/CASE.jsonl."""
    # As the runner read it (validated, a scaling case filled in from the case it scales).
    matrix = load_matrix(this.options["matrix"])
    name, cfg = this.name, this.cfg
    case = next(c for c in matrix["cases"] if c["name"] == name)
    rows_file = this.out / "cases" / f"{name}.jsonl"
    started = this.started  # before the config was read and the group joined, as ever
    run = _Run(cfg, case, this.env)
    env = run.env
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)
    base = {"case": name, "recipe": case["recipe"], "label": case.get("label", name),
            "role": case.get("role", ""), "table": case.get("table", ""),
            "cap_gib": case.get("cap_gib"), "seq_len": run.seq, "world": env.world_size,
            "device": device_name, "flops_per_token": run.flops, "sweep": bool(case.get("seq_lens"))}

    def emit(row: dict) -> None:
        if env.is_main:
            rows_file.parent.mkdir(parents=True, exist_ok=True)
            jsonl.append(rows_file, {**base, **row})
            print(json.dumps(row), flush=True)

    # setup: the whole build (compile comes later, in the first step); load: loading and
    # sharding the model alone, and each rank's peak host memory by then.
    planned = getattr(getattr(run, "recipe", None), "planned", None)  # the kit's plan
    emit({"kind": "setup", "seconds": round(time.perf_counter() - started, 1),
          "load_s": run.load["seconds"], "peak_host_mib": run.load["peak_host_mib"],
          **({"plan": planned.as_dict()} if planned is not None else {}),
          # what LoRA trains (single-process recipes and FSDP2's global parameters: comparable)
          **({"trainable_params": sum(p.numel() for p in run.model.parameters() if p.requires_grad)}
             if case["recipe"] in ("kit", "unsloth") else {}),
          **({"auto_batch": run.batches[0]} if case["batches"] == ["auto"] else {})})
    fail_at = int(os.environ.get("KIT_BENCH_OOM_AT_BATCH", "0"))  # tests: an injected OOM

    eq = matrix.get("equivalence", {})
    if case.get("equivalence") and eq:
        emit(_curve(run, eq, cfg.model.name))

    warmup, measure = case.get("warmup_steps", matrix.get("warmup_steps", 1)), \
        case.get("measure_steps", matrix.get("measure_steps", 3))
    step_no, oom = 0, False
    # A context sweep (`seq_lens`): each sequence length in ascending order, its batches each.
    for seq, size in [(q, b) for q in case.get("seq_lens", [run.seq]) for b in run.batches]:
        run.set_seq(seq)
        # A compiled case compiles each batch size afresh, with static shapes, as a run of that
        # size would (otherwise the second size recompiles with dynamic shapes).
        torch._dynamo.reset()
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(env.device)
        breaks = checks.graph_breaks()
        steps = _timed_steps(run, size, warmup, measure, step_no, fail_at)
        step_no, oom = step_no + steps["steps"], steps["oom"]
        row = {"kind": "batch", "batch": size, "seq_len": seq, "flops_per_token": run.flops}
        if _any_rank(oom, env):
            alloc, reserved = _peaks(env.device) if oom else (None, None)
            emit({**row, "status": "oom", "error": steps["error"], "step": steps["step"],
                  "peak_alloc_gib": alloc, "peak_reserved_gib": reserved})
            break  # larger batches will not fit either; the process state after an OOM is spent
        step_s = statistics.median(steps["times"])
        tps = size * run.seq / step_s
        alloc, reserved = _peaks(env.device)
        emit({**row, "status": "ok", "step_s": round(step_s, 4),
              "first_step_s": round(steps["first"], 2), "tokens_per_s_gpu": round(tps, 1),
              "mfu": round(tps * run.flops / peak, 4) if peak else None,
              "peak_alloc_gib": alloc, "peak_reserved_gib": reserved,
              "outside_gib": outside_gib(env.device),
              "loss_first": steps["losses"][0], "loss_last": steps["losses"][-1],
              "graph_breaks": sum(checks.graph_breaks(since=breaks).values())})
    if case.get("profile") and env.device.type == "cuda" and not oom and run.batches:
        # `profile: trace` also writes the step's timeline beside the rows (Perfetto reads it)
        trace = (str(rows_file.with_name(f"{name}.trace.json.gz"))
                 if case["profile"] == "trace" and env.is_main else None)
        emit({"kind": "profile", "batch": size,
              **profile_step(run, run.batch(step_no, size), trace)})
    seconds = round(time.perf_counter() - started, 1)
    emit({"kind": "done", "seconds": seconds})
    if env.is_main:  # the run folder's result: kit.run.launch.Run reads the case as completed
        RunFolder(cfg.output_dir).write_result(
            {"status": "completed", "case": name, "seconds": seconds}, indent=None)
    faults.maybe_hang_after_done()
    # The harness then waits for every rank and ends the process group before the interpreter
    # does: left to exit, gloo's threads were once destroyed still running ("terminate called
    # without an active exception", SIGABRT after "done", the case's run then read as failed).


# Any case of the matrix, by name: its rows are its own (a JSON line per setup, batch, curve,
# profile, done), so the harness writes none; unseeded: each recipe seeds itself.
EXPERIMENT = experiment.Experiment(
    prog="kit.bench.worker", doc=__doc__, cases=lambda name: worker, row_path=None,
    options={"matrix": "the benchmark matrix (YAML)"}, seed=False,
)

if __name__ == "__main__":
    kdist.leave(experiment.main(EXPERIMENT))
