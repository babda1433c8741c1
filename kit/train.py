"""The training recipe: NF4 base + LoRA + FSDP2/FSDP1/DDP, one code path for CPU and GPUs.

    torchrun --nproc_per_node=2 -m kit.train kit/configs/tiny-cpu.yaml sharding.engine=fsdp1
    python -m kit check kit/configs/tiny-cpu.yaml --nproc 2   # the check step alone (kit.run.check)

Order of operations (each its own module): process group -> the start's plan (kit.folder.start:
checked and planned before any rank; rank 0 plans a start nobody checked) -> load (quantized)
model -> LoRA -> recompute + train mode -> shard -> optimizer -> train -> save.
Rank 0 writes `metrics.jsonl` and `result.json` into the run folder and shows its progress;
an exception on any rank is printed with its rank before torchrun stops the others.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from kit.config import Config, load_config
from kit.folder import manifest, runfolder
from kit.folder.layout import RunFolder
from kit.inputs import builtin, datafile
from kit.recipe import (
    checkpoint,
    checks,
    data,
    engines,
    faults,
    loading,
    lora,
    meters,
    model,
    optim,
    planning,
    preempt,
    progress,
    recompute,
    trackers,
)
from kit.recipe import dist as kdist
from kit.recipe.levers import offload


class Recipe:
    """setup -> train -> save -> cleanup, as `main` calls them."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.out = cfg.output_dir
        self.folder = RunFolder(self.out)  # what rank 0 writes there, by name
        self.report = trackers.Report(cfg, self.folder)  # metrics.jsonl + run.report_to
        self.split = None  # rank 0's tokenized rows when it measured data.max_seq_len=auto

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        with datafile.read_once():  # data.path read once in this process (warm-up, plan, split)
            self._setup()

    def _setup(self) -> None:
        cfg = self.cfg
        self.env = env = kdist.init(cfg.training.device, cfg.run.dist_timeout_min)
        kdist.joined(env)
        model.import_libraries(cfg)  # every rank, side by side
        self.engine = engines.get(cfg.sharding.engine)
        # Rank 0 reads the start (its run-folder plan and its plan of what was left at "auto");
        # every rank trains so (a mistake is rank 0's one line; the others end quietly).
        self.plan, self.planned = kdist.on_main(env, self._check_and_plan)
        if self.plan.start is None:  # finished: nothing to do, nothing touched
            return
        if env.is_main:
            self.plan.keep_earlier(self.out)
            self.out.mkdir(parents=True, exist_ok=True)
            # As given ("auto" kept): a resume here plans the same; manifests compare what was asked.
            self.folder.config.write_text(cfg.to_yaml())
        self.say(self.planned.line())
        cfg = self.cfg = self.planned.cfg
        with kdist.main_process_first(env):  # rank 0 builds kit models / fills caches first
            builtin.resolve(cfg.model.name)
            data.warm_cache(cfg.data)
        loaded = time.perf_counter()
        built = model.build(cfg, env.device)  # model.loading (kit.recipe.loading)
        self.load = {"mode": loading.loaded_as(built.model),  # completed after sharding: stream
                     "seconds": time.perf_counter() - loaded,  # loads as the engine shards
                     "device_gib": round(meters.allocated_gib(env.device), 3)}  # before sharding
        if built.attention_warning:
            self.say(built.attention_warning)
        self.peft_model, self.tokenizer = built.model, built.tokenizer
        split = self.split or data.Split(cfg.data, self.tokenizer, cfg.training.seed)
        self.train_rows, self.val_rows = split.rows(cfg.data.max_seq_len)
        self.say(data.summary(self.train_rows, self.val_rows, cfg.data, cfg.training, env.world_size))
        self.adapter_layout = checkpoint.AdapterLayout(self.peft_model,  # before sharding
                                                       base=cfg.model.name)
        checks.same_init(self.peft_model, self.env.world_size)  # before sharding
        self.params = lora.trainable_summary(self.peft_model)
        t, rc = cfg.training, cfg.training.recompute
        self.say(
            f"{cfg.model.name}: {self.params['trainable']:,} trainable of "
            f"{self.params['total']:,} params ({self.params['percent']:.3f}%); "
            f"quantization={cfg.quantization.method} engine={cfg.sharding.engine} "
            f"attention={built.attention} world={env.world_size} device={env.device.type}"
        )
        if rc.enabled and (rc.every > 1 or rc.keeps != "inputs"):
            self.say(f"recompute: {len(built.recomputed)} decoder layers, keeping their {rc.keeps}"
                     + (f" (the first {rc.matmul_layers}: every matmul)" if rc.matmul_layers else ""))
        wrapping = time.perf_counter()
        self.model = self.engine.wrap(self.peft_model, cfg, env.device)
        peaks: list = [None] * env.world_size  # each rank's peak host memory (MiB) until sharded
        dist.all_gather_object(peaks, round(meters.peak_rss_mib(), 1))
        self.load.update(peak_host_mib=peaks, seconds=round(
            self.load["seconds"] + time.perf_counter() - wrapping, 2))
        self.breaks = checks.graph_breaks()  # what compiled before this run (a notebook's kernel)
        if t.compile:
            wrapper = "python" if t.compile_wrapper == "auto" else t.compile_wrapper
            n = recompute.compile_layers(self.model, t.activation_memory_budget, wrapper)
            self.say(f"torch.compile: {n} decoder layers, {wrapper} wrapper" + (
                f", activation memory budget {t.activation_memory_budget}"
                if t.activation_memory_budget < 1 else ""))
        # What the model holds that the offload hooks leave in place (its 4-bit constants).
        self.held = (offload.persistent(self.model) if t.offload_activations is True
                     else frozenset())  # fmt: skip
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = optim.ShardAdamW(trainable, lr=t.lr, weight_decay=t.weight_decay)
        self.scheduler = optim.scheduler(self.optimizer, t)
        torch.manual_seed(t.seed + env.rank)  # dropout differs per rank, as data does
        one_row = cfg.data.packing and built.attention.startswith("flash_attention")
        self.train_batches = data.Batches(data.loader(
            self.train_rows, t.batch_size, env.rank, env.world_size, t.seed, True, one_row
        ))
        self.val_loader = data.loader(
            self.val_rows, t.batch_size, env.rank, env.world_size, t.seed, False, one_row
        )
        self.start_step = self._resume()

    def _check_and_plan(self) -> tuple[runfolder.Decision, planning.kplan.Planned | None]:
        """Rank 0: the start's plans, or a start nobody checked checked and planned here."""
        self.split, folder, planned = planning.rank_zero(self.cfg, self.env, self.engine)
        return folder, planned

    def _resume(self) -> int:
        """Restore the checkpoint the plan chose (its manifest checked by kit.folder.runfolder); the
        metrics up to its step are the history (rows past it were kept in earlier/)."""
        for note in self.plan.notes:
            self.say(note)
        step, folder = 0, self.plan.checkpoint
        if self.plan.start:
            step = checkpoint.load_training_state(
                folder, wrapped=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                batches=self.train_batches, env=self.env,
            )
            self.say(f"resumed from {folder} at step {step}")
        self.history = []
        if self.env.is_main and step:
            self.history = self.folder.read_metrics()
        return step

    def _prove_save(self) -> None:
        """After the first step: gather the adapter and check it as the end of the run will, so
        that a run which cannot save fails now, not after its last step (a collective)."""
        faults.maybe_fail_gather(self.env.rank)
        tensors = self.adapter_layout.select(checkpoint.gather_trainable(self.model))
        for key, t in tensors.items():
            want = self.adapter_layout.shapes[key]
            if tuple(t.shape) != tuple(want):
                raise checkpoint.CheckpointError(
                    f"the adapter cannot be saved: {key} gathers as {tuple(t.shape)}, expected "
                    f"{tuple(want)} (checked after the first step, before training on)")

    # ------------------------------------------------------------------ train
    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.env.device, non_blocking=True) for k, v in batch.items()}

    def train_step(self) -> dict:
        cfg, env, accum = self.cfg, self.env, self.cfg.training.grad_accum
        start = time.perf_counter()
        loss_sum, tokens = 0.0, 0
        for micro in range(accum):
            batch = next(self.train_batches)
            tokens += data.count_tokens(batch)  # on the host: a device value would be read back
            with self.engine.no_sync(self.model, active=micro < accum - 1):
                with offload.activations(cfg.training.offload_activations, env.device,
                                         held=self.held):
                    loss = self.model(**self._to_device(batch), use_cache=False).loss / accum
                loss.backward()
            loss_sum += loss.detach()
        # No value is read back until the optimizer step is queued: a read waits for the GPU, and
        # the GPU would then sit idle while Python queues clipping and the optimizer's kernels.
        grad_norm = self.engine.clip_grad_norm(self.model, cfg.training.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, grad_norm = float(loss_sum), float(grad_norm)
        seconds = time.perf_counter() - start
        per_rank = [None] * env.world_size  # one slow rank stalls every collective: name it
        dist.all_gather_object(per_rank, round(seconds, 4))
        return {
            "loss": kdist.mean(loss_sum, env),
            "grad_norm": grad_norm,
            "tokens_per_s": kdist.mean(tokens / seconds, env),  # per device
            "step_s": seconds,
            "step_s_per_rank": per_rank,
        }

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss per token over eval_batches batches of every rank."""
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        for i, batch in enumerate(self.val_loader):
            if i >= self.cfg.training.eval_batches:
                break
            batch = self._to_device(batch)
            n = int((batch["labels"][:, 1:] != -100).sum())
            loss = self.model(**batch, use_cache=False).loss.item()  # every rank, collectively
            if n:  # a small split's filler batch (kit.recipe.data.short_split) has no label: no loss
                totals += torch.tensor([loss * n, n], device=totals.device)
        dist.all_reduce(totals)
        self.model.train()
        return (totals[0] / totals[1].clamp(min=1)).item()

    def train(self) -> None:
        env, t, c = self.env, self.cfg.training, self.cfg.checkpointing
        self.started = time.perf_counter()
        last = max(self.start_step, min(t.steps, t.stop_at_step or t.steps))
        shown = progress.Progress(t.steps, self.start_step, env.is_main)  # rank 0: in place or a line
        lora_start = checks.trainable_snapshot(self.model)  # this rank's shard
        self.preempt = preempt.Preemption().install()  # SIGTERM, SIGUSR1: save, then stop
        for step in range(self.start_step + 1, last + 1):
            row = self.train_step()
            row.update(step=step, lr=self.scheduler.get_last_lr()[0])
            if logged := step % t.log_every == 0 or step == t.steps:
                self.log({"split": "train", **row})
            if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
                self.log({"split": "val", "step": step, "loss": self.evaluate()})
            shown.step(step, row, logged)
            self._check(row, step, lora_start)
            if step == self.start_step + 1 and (c.save_adapter or c.save_every):
                self._prove_save()
            faults.maybe_fail(step, env.rank)
            saved = c.save_every and step % c.save_every == 0
            if saved:
                self.say(f"checkpoint: {self._checkpoint(step)}")
            if self.preempt.stop_here(self, step, saved):  # asked to stop (kit.recipe.preempt)
                self.status, last = "preempted", step
                break
        shown.close()
        self.last_step = last

    def _checkpoint(self, step: int):
        """Checkpoint `step` (kit.recipe.checkpoint: atomic, verified, a collective); its folder.
        Its manifest records the step's held-out loss; checkpointing.keep_best keeps the lowest's
        past keep_last and says when this one is it."""
        c = self.cfg.checkpointing
        val = [r["loss"] for r in self.history if r["split"] == "val" and r["step"] == step]
        folder = checkpoint.save_training_state(
            wrapped=self.model, engine=self.engine, optimizer=self.optimizer,
            scheduler=self.scheduler, batches=self.train_batches, step=step, env=self.env,
            fmt=c.format, output_dir=self.out, layout=self.adapter_layout, keep_last=c.keep_last,
            keep_best=c.keep_best, val_loss=val[-1] if val else None, tokenizer=self.tokenizer)
        best = manifest.best(self.out) if c.keep_best and self.env.is_main else None
        if best and best["step"] == step:  # a preemption's checkpoint may have no held-out loss
            self.say(f"best: step {step}, held-out loss {best['val_loss']:.4f}: {folder} (the "
                     "lowest so far: checkpointing.keep_best keeps it)")
        return folder

    def _check(self, row: dict, step: int, lora_start: dict) -> None:
        """In-run checks (kit.recipe.checks): NaN/inf, slow ranks, rising val loss, still adapters."""
        for finding in checks.check_step(row):
            raise FloatingPointError(str(finding))
        found = checks.step_warnings(row, step, self.history)
        if step == self.start_step + 1:  # compiled code that ran in pieces
            found += checks.check_graph_breaks(checks.graph_breaks(since=self.breaks))
        for finding in found:
            self.say(f"[doctor] {finding}")
        if step == self.start_step + 3:  # adapters that have not moved by now never will
            problems = checks.check_lora_changed(lora_start, checks.trainable_snapshot(self.model), 3)
            stuck = [None] * self.env.world_size
            dist.all_gather_object(stuck, bool(problems))
            if all(stuck):
                raise RuntimeError(str(problems[0]))

    # ------------------------------------------------------------------ save
    @torch.no_grad()
    def probe_logits(self) -> dict:
        """Logits of the trained, sharded model on a fixed batch (every rank runs the forward)."""
        rows = self.val_rows.tensors  # one row, 16 tokens: small even with a 128k vocabulary
        ids = rows["input_ids"][:1, :16]
        # Packed rows have no mask; the probe only compares two runs of one batch: plain causal.
        mask = rows["attention_mask"][:1, :16] if "attention_mask" in rows else torch.ones_like(ids)
        batch = {"input_ids": ids, "attention_mask": mask}
        self.model.eval()
        logits = self.model(**self._to_device(batch), use_cache=False).logits.float().cpu()
        self.model.train()
        return {**batch, "logits": logits}

    def save(self) -> dict:
        cfg, env = self.cfg, self.env
        faults.maybe_fail_gather(env.rank)
        state = checkpoint.gather_trainable(self.model)
        sums = [None] * env.world_size
        dist.all_gather_object(sums, checkpoint.checksum(state))
        result = {"lora_checksums": sums, "params": self.params}
        if cfg.checkpointing.save_probe_logits:
            probe = self.probe_logits()
            if env.is_main:
                torch.save(probe, self.folder.probe)
        if cfg.checkpointing.save_adapter and env.is_main:
            folder = checkpoint.save_adapter(
                self.adapter_layout, state, self.folder.adapter, self.tokenizer
            )
            info = checkpoint.verify_adapter(folder, self.adapter_layout.shapes)
            result["adapter"] = {"path": str(folder), **info}
            self.say(f"adapter: {folder} ({info['tensors']} tensors, {info['bytes']:,} bytes)")
        dist.barrier()
        return result

    # ------------------------------------------------------------------ reporting
    def say(self, line: str) -> None:
        if self.env.is_main:
            print(line, flush=True)

    def log(self, row: dict) -> None:
        row = {**row, "peak_mem_gib": round(meters.peak_gib(self.env.device), 4),
               "elapsed_s": round(time.perf_counter() - self.started, 3)}
        self.history.append(row)
        if self.env.is_main:
            self.report.write(row)

    def finish(self, saved: dict) -> dict:
        train = [r["loss"] for r in self.history if r["split"] == "train"] or [None]
        val = [r for r in self.history if r["split"] == "val"]
        result = {
            "status": getattr(self, "status", None) or (
                "completed" if self.last_step == self.cfg.training.steps else "stopped"),
            "steps": self.last_step,
            "first_loss": train[0],
            "final_loss": train[-1],
            "final_val_loss": val[-1]["loss"] if val else None,
            "world_size": self.env.world_size,
            "device": self.env.device.type,
            "elapsed_s": round(time.perf_counter() - self.started, 3),
            "load": self.load,
            "plan": self.planned.as_dict(),
            **({"best": manifest.best(self.out)} if self.cfg.checkpointing.keep_best else {}),
            **saved,
        }
        if self.env.is_main:
            self.folder.write_result(result)
            self.report.close()
            def f(x):
                return "-" if x is None else f"{x:.4f}"

            self.say(
                f"{result['status']} at step {self.last_step}: loss {f(result['first_loss'])} -> "
                f"{f(result['final_loss'])} (val {f(result['final_val_loss'])}) "
                f"in {result['elapsed_s']:.1f}s"
            )
        return result

    def cleanup(self) -> None:
        kdist.cleanup()


def run(cfg: Config) -> dict:
    recipe = Recipe(cfg)
    recipe.setup()
    if recipe.plan.start is None:  # a finished run: said so, nothing started or written
        recipe.say(recipe.plan.message)
        recipe.cleanup()
        return {"status": "finished", "message": recipe.plan.message}
    recipe.train()
    if getattr(recipe, "status", None) == "preempted":  # its checkpoint holds the adapter
        result = recipe.finish({})
        recipe.cleanup()
        return result
    result = recipe.finish(recipe.save())
    # Only on success: after a failure, NCCL's destroy_process_group waits for peers stuck in a
    # collective, so the failed rank never exits and torchrun never notices (2x H200).
    recipe.cleanup()
    return result


@record
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    path, overrides = (None, argv) if "=" in argv[0] else (argv[0], argv[1:])
    kdist.say_if_alone("kit.train")
    finished = lambda: run(load_config(path, overrides)).get("status")  # noqa: E731
    return kdist.entry(lambda: preempt.EXIT_PREEMPTED if finished() == "preempted" else 0)


if __name__ == "__main__":
    kdist.leave(main())
