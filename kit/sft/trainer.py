"""The second article's recipe made correct: TRL's SFTTrainer under `accelerate launch`, on the
kit's model, LoRA, data and adapter save.

    accelerate launch --config_file accelerate.yaml -m kit.sft.trainer kit/configs/tiny-cpu.yaml \
        sharding.engine=ddp training.steps=4

What the article does, and what this does instead:
- its SFTConfig is written by hand; here `sft_config(cfg)` maps the kit config (one line naming
  the kit field for a value SFTConfig refuses, or one this path cannot honour);
- its model is bf16 from_pretrained + get_peft_model; here the kit's own: kit.recipe.model.build
  (NF4 with the packed bytes stored in model.dtype so FSDP can shard them, or
  quantization.method=none; LoRA by kit.recipe.lora, seeded alike on every rank). TRL casts the
  adapters of a quantized model to bf16; the kit's adapter dtype (kit.recipe.engines) is put back;
- its data is a datasets.Dataset it never shows; here the rows kit.inputs.datafile reads and checks,
  split as kit.recipe.data splits them, as texts (chat rows through the tokenizer's template);
- its `trainer.save_model` is what the field reports keeping only rank 0's slice under FSDP;
  here the adapter's layout (kit.recipe.checkpoint.AdapterLayout) is taken BEFORE the trainer wraps
  the model, the full trainable state is gathered after training (FSDP: torch's
  get_model_state_dict with full_state_dict; DDP or one process: the model itself), every
  tensor's shape is compared with the unsharded LoRA shape, the ranks' checksums must agree,
  then kit.recipe.checkpoint.save_adapter writes it and verify_adapter reads every tensor back. The
  same gather runs after step 1, so a run that could not save fails there.
- sharding.engine must be what accelerate runs (its config decides): FSDP1/FSDP2 from
  ACCELERATE_USE_FSDP/FSDP_VERSION, else DDP. accelerate cannot run FSDP on CPU; on CPU this
  path is accelerate's multi-process CPU DDP over gloo (SFTConfig(use_cpu=True)).
- under FSDP, recompute is accelerate's (fsdp_activation_checkpointing, which kit.run.jobs writes
  from training.recompute.enabled): SFTConfig's gradient_checkpointing is then off, as the
  Trainer refuses both at once;
- with data.packing TRL packs the texts into fewer rows: each split must still fill a batch on
  every rank (`fit_packed`), or the Trainer's evaluation reports no loss, silently;
- what kit.train refuses on the machine (kit.pitfalls.machine_violations) is refused here
  too, before loading anything: FSDP1 on one process trains, then cannot gather the adapter;
- accelerate's own MULTI_CPU launch type starts ONE process on one machine (its simple launcher
  needs mpirun for more), silently; that start is refused here (`launched_alone`).

The run folder gets what kit.train writes (config.yaml, metrics.jsonl rows per logged step,
result.json, adapter/), so the kit's readers work; the trainer's own checkpoints (save_every)
go to <run>/trainer/. Rank side.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch

from kit import pitfalls
from kit.budget import plan as kplan
from kit.config import Config, ConfigError, load_config
from kit.folder import runfolder
from kit.folder.layout import RunFolder
from kit.inputs import builtin, datafile
from kit.recipe import (
    checkpoint,
    checks,
    data,
    engines,
    lora,
    meters,
    model,
    planning,
    trackers,
    verify,
)
from kit.recipe import dist as kdist
from kit.sft.setup import accelerate_engine, fsdp_recomputes, launched_alone, sft_config


def check_launch(cfg: Config, environ, cuda: bool) -> torch.device:
    """The device this rank trains on, or one line for a launch that cannot run as configured."""
    if (why := launched_alone(environ)) is not None:
        raise ConfigError(why)
    if cfg.model.loading == "stream":  # the kit's engines fill the model; accelerate wraps
        raise ConfigError("model.loading: 'stream' is not allowed under accelerate (it shards "
                          "with the kit's own engines, kit.train); use full or rank0")
    if cfg.model.loading == "auto":  # stream is the kit's engines' own: rank 0 reads here
        cfg.model.loading = "rank0"
    device = cfg.training.device
    if device == "cuda" and not cuda:
        raise ConfigError("training.device: 'cuda' is not allowed; no GPU is visible here "
                          "(torch.cuda.is_available() is False); use auto or cpu")
    on_gpu = device == "cuda" or (device == "auto" and cuda)
    runs = accelerate_engine(environ)
    if runs.startswith("fsdp") and not on_gpu:
        raise ConfigError("sharding.engine: accelerate cannot run FSDP on CPU (its FSDP launch "
                          "wants a GPU); on CPU launch a DDP config (distributed_type: "
                          "MULTI_GPU, run as MULTI_CPU over gloo) with sharding.engine=ddp")
    if cfg.sharding.engine != runs:
        raise ConfigError(f"sharding.engine: {cfg.sharding.engine!r} is not allowed here; the "
                          f"accelerate config runs {runs} (ACCELERATE_USE_FSDP="
                          f"{environ.get('ACCELERATE_USE_FSDP', 'unset')}, FSDP_VERSION="
                          f"{environ.get('FSDP_VERSION', 'unset')}); set sharding.engine={runs} "
                          "or launch with the accelerate config that runs it")
    if fsdp_recomputes(environ) and not cfg.training.recompute.enabled:
        raise ConfigError("training.recompute.enabled: False is not allowed here; the accelerate "
                          "config recomputes every decoder layer (fsdp_activation_checkpointing: "
                          "true); set training.recompute.enabled=true or launch with "
                          "fsdp_activation_checkpointing: false")
    # What kit.train refuses on this machine before loading anything, e.g. FSDP1 on one
    # process (pitfall fsdp1_no_shard): under accelerate on one H100 it trained step 1, then
    # the adapter's gather failed ('FSDP assumes ... is in the state_dict').
    machine = {"device": "cuda" if on_gpu else "cpu", "ranks": int(environ.get("WORLD_SIZE", 1)),
               "packages": {}}
    for _, violation in pitfalls.machine_violations(cfg, machine):
        raise ConfigError(str(violation))
    return torch.device("cuda", int(environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")


def text_datasets(cfg: Config, tokenizer, world: int):
    """(train, eval) datasets.Dataset of texts: kit.inputs.datafile's checked rows, split as kit.recipe.data
    splits them (seeded, the same on every rank), chat rows through the chat template; eval
    keeps the training.eval_batches batches of every rank that kit.train evaluates."""
    from datasets import Dataset

    cfg = kplan.plain(cfg)  # batch "auto": the recipe's plain value (this path plans nothing)
    d, t = cfg.data, cfg.training
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = datafile.read_checked(d.path, d)
    if d.train_on == "assistant" and datafile.texts_column(rows, d, d.path)[0] == "messages":
        # TRL trains on every token of a rendered text (its assistant-only loss needs templates
        # with {% generation %} marks): say so rather than train on the prompts without a word.
        raise ConfigError("data.train_on: 'assistant' is not allowed with kit.sft.trainer on chat rows "
                          "(TRL trains every token of the rendered chat); use data.train_on=all, "
                          "or kit.train, which trains on the assistant's turns")
    texts = data._chats(rows, d, tokenizer, d.path)[0]  # each row rendered, checked by its number
    if d.val_path:
        val_rows = datafile.read_checked(d.val_path, d, "data.val_path")
        train, val = texts, data._chats(val_rows, d, tokenizer, d.val_path, "data.val_path")[0]
    elif d.val_fraction > 0:  # as kit.recipe.data.build_datasets
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(t.seed)).tolist()
        n_val = datafile.split_sizes(len(rows), d.val_fraction)[1]
        val, train = [texts[i] for i in order[:n_val]], [texts[i] for i in order[n_val:]]
    else:
        train, val = texts, texts[:64]
    for part, name in ((train, "training"), (val, "validation")):
        if len(part) < t.batch_size * world:
            raise ConfigError(f"training.batch_size: {t.batch_size} is not allowed; {len(part)} "
                              f"{name} rows cannot fill {world} ranks x {t.batch_size}")
    if not d.packing:  # packed, TRL makes fewer rows of these: `fit_packed` cuts them after
        val = val[: t.eval_batches * t.batch_size * world]
    return Dataset.from_dict({d.text_field: train}), Dataset.from_dict({d.text_field: val})


def fit_packed(trainer, cfg: Config, world: int) -> None:
    """With data.packing, TRL packs the texts into fewer rows of up to data.max_seq_len: each
    split must still fill a batch on every rank (the Trainer's loaders drop an incomplete batch,
    and an evaluation with none reports no loss, silently), as kit.recipe.data.loader refuses for
    kit.train; eval then keeps kit.train's training.eval_batches batches."""
    if not cfg.data.packing:
        return
    t = cfg.training
    for attr, name in (("train_dataset", "training"), ("eval_dataset", "validation")):
        rows = len(getattr(trainer, attr))
        if rows < t.batch_size * world:
            raise ConfigError(
                f"training.batch_size: {t.batch_size} is not allowed; {rows} packed {name} rows "
                f"(data.packing, data.max_seq_len={cfg.data.max_seq_len}) cannot fill {world} "
                f"ranks x {t.batch_size}; use a smaller batch or more data")
    keep = t.eval_batches * t.batch_size * world
    if len(trainer.eval_dataset) > keep:
        trainer.eval_dataset = trainer.eval_dataset.select(range(keep))


def gather_adapter(trainer) -> dict[str, torch.Tensor]:
    """The full trainable state on every rank (a collective under FSDP): torch's
    get_model_state_dict(full_state_dict) of the wrapped model, or DDP's / one process's model
    itself, whose parameters are whole on every rank."""
    if trainer.is_fsdp_enabled:
        return checkpoint.gather_trainable(trainer.model_wrapped)
    own = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    return {n: p.detach().cpu() for n, p in own.named_parameters() if p.requires_grad}


def whole(layout, state: dict, when: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors, each of its unsharded LoRA shape, or CheckpointError naming one."""
    tensors = layout.select(state)
    for key, t in tensors.items():
        if tuple(t.shape) != tuple(layout.shapes[key]):
            raise checkpoint.CheckpointError(
                f"the adapter is not whole {when}: {key} gathers as {tuple(t.shape)}, expected "
                f"{tuple(layout.shapes[key])} (a rank's slice)")
    return tensors


def _all_gather(obj, world: int) -> list:
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


class Recorder:
    """A TrainerCallback (built by `recorder`): metrics.jsonl rows as kit.train writes them, the
    in-run checks, and the adapter gathered and checked after step 1."""

    def __init__(self, cfg: Config, device, is_main: bool, world: int, layout):
        self.out, self.device, self.is_main, self.world, self.layout = (
            cfg.output_dir, device, is_main, world, layout)
        self.folder = RunFolder(self.out)
        self.report = trackers.Report(cfg, self.folder)  # metrics.jsonl + run.report_to
        self.history: list[dict] = []
        self.trainer = None
        self.started = self._last = time.perf_counter()
        self._tokens = 0

    def on_train_begin(self, args, state, control, **kw):
        self.started = self._last = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step >= state.max_steps:  # kit.train logs the last step too
            control.should_log = True
        if state.global_step == 1:  # the Trainer sets train mode in its training step
            for finding in checks.check_checkpointing_active(model):
                raise RuntimeError(str(finding))
            whole(self.layout, gather_adapter(self.trainer), "after step 1")

    def on_log(self, args, state, control, logs=None, **kw):
        logs, now = logs or {}, time.perf_counter()
        if "loss" in logs:
            tokens = logs.get("num_tokens") or 0  # TRL: tokens of every rank so far
            row = {"split": "train", "step": state.global_step, "loss": logs["loss"],
                   "lr": logs.get("learning_rate"), "grad_norm": logs.get("grad_norm"),
                   "tokens_per_s": (tokens - self._tokens) / max(now - self._last, 1e-9) / self.world,
                   "mean_token_accuracy": logs.get("mean_token_accuracy")}
            self._tokens, self._last = tokens, now
        elif "eval_loss" in logs:
            row = {"split": "val", "step": state.global_step, "loss": logs["eval_loss"]}
        else:
            return
        row.update(peak_mem_gib=round(meters.peak_gib(self.device), 4),
                   elapsed_s=round(now - self.started, 3))
        for finding in checks.check_step(row):
            raise FloatingPointError(str(finding))
        self.history.append(row)
        if self.is_main:
            self.report.write(row)


def recorder(*a, **kw):
    from transformers import TrainerCallback

    return type("KitRecorder", (Recorder, TrainerCallback), {})(*a, **kw)


def _folder_start(cfg: Config, world: int, is_main: bool) -> runfolder.Decision:
    box: list = [None]
    if is_main:
        try:
            box[0] = runfolder.decide(cfg, world, ranks=True)
        except ConfigError as e:
            box[0] = e
    if world > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], ConfigError):
        raise ConfigError(str(box[0]))
    return box[0]


def run(cfg: Config) -> dict:
    import trl
    from trl import SFTTrainer

    # This path plans nothing: values left at auto take the recipe's plain ones (SFTTrainer
    # computes its own loss and compiles nothing); data.max_seq_len auto is the data's longest
    # row, known once the model's tokenizer is at hand (below).
    given, cfg = cfg, kplan.plain(cfg)
    device = check_launch(cfg, os.environ, torch.cuda.is_available())
    args = sft_config(cfg, use_cpu=device.type == "cpu", environ=os.environ)
    state = args.distributed_state  # joins the process group (gloo on CPU, nccl on GPUs)
    world, is_main, out = args.world_size, args.process_index == 0, cfg.output_dir
    say = (lambda line: print(line, flush=True)) if is_main else (lambda line: None)
    start = _folder_start(cfg, world, is_main)  # never replaces a run (kit.folder.runfolder)
    if is_main:
        start.keep_earlier(out)
        out.mkdir(parents=True, exist_ok=True)
        RunFolder(out).config.write_text(given.to_yaml())
    with state.main_process_first():  # rank 0 builds kit models / fills caches first
        builtin.resolve(cfg.model.name)
        data.warm_cache(cfg.data)
    if cfg.data.max_seq_len == "auto":
        cfg = copy.deepcopy(cfg)
        cfg.data.max_seq_len = args.max_length = planning.seq_len(cfg)
    built = model.build(cfg, device, train=False)  # load (NF4 or none) -> LoRA, seeded
    peft_model, tokenizer = built.model, built.tokenizer
    if cfg.lora.recompute:
        lora.recompute_adapters(peft_model)
    if cfg.lora.group_inputs:
        from kit.recipe.levers import lora_groups

        lora_groups.enable(peft_model, recompute=cfg.lora.recompute)
    layout = checkpoint.AdapterLayout(peft_model, base=cfg.model.name)  # before the trainer wraps it
    params = lora.trainable_summary(peft_model)
    train_ds, eval_ds = text_datasets(cfg, tokenizer, world)
    rec = recorder(given, device, is_main, world, layout)
    trainer = SFTTrainer(model=peft_model, args=args, train_dataset=train_ds,
                         eval_dataset=eval_ds, processing_class=tokenizer, callbacks=[rec])
    rec.trainer = trainer
    fit_packed(trainer, cfg, world)
    want = engines.get(cfg.sharding.engine).adapter_dtype(cfg)
    cast = [p for p in peft_model.parameters() if p.requires_grad and p.dtype != want]
    for p in cast:  # TRL casts a quantized model's adapters to bf16: the kit's dtype back
        p.data = p.data.to(want)
    say(f"{cfg.model.name}: {params['trainable']:,} trainable of {params['total']:,} params; "
        f"trl {trl.__version__} SFTTrainer, accelerate {state.distributed_type.value} "
        f"world={world} device={device.type} engine={cfg.sharding.engine} "
        f"adapters {str(want).removeprefix('torch.')}"
        + (f" (TRL had cast {len(cast)} to bf16)" if cast else ""))
    trainer.train()
    steps, t = trainer.state.global_step, cfg.training
    if not t.eval_every:  # kit.train evaluates at the last step (the Trainer does with steps)
        trainer.evaluate()
    state_dict = gather_adapter(trainer)
    whole(layout, state_dict, "after training")
    sums = _all_gather(checkpoint.checksum(layout.select(state_dict)), world)
    if len(set(sums)) != 1:
        raise checkpoint.CheckpointError(f"the ranks' adapters differ (checksums {sums})")
    result = {"lora_checksums": sums, "params": params}
    if cfg.checkpointing.save_adapter and is_main:
        folder = checkpoint.save_adapter(layout, state_dict, RunFolder(out).adapter, tokenizer)
        info = verify.verify_adapter(folder, layout.shapes)  # reads every tensor back
        result["adapter"] = {"path": str(folder), **info}
        say(f"adapter: {folder} ({info['tensors']} tensors, {info['bytes']:,} bytes, whole)")
    train = [r["loss"] for r in rec.history if r["split"] == "train"] or [None]
    val = [r["loss"] for r in rec.history if r["split"] == "val"] or [None]
    result = {"status": "completed" if steps == t.steps else "stopped", "steps": steps,
              "first_loss": train[0], "final_loss": train[-1], "final_val_loss": val[-1],
              "world_size": world, "device": device.type,
              "elapsed_s": round(time.perf_counter() - rec.started, 3),
              "trainer": f"trl {trl.__version__} SFTTrainer",
              "distributed_type": state.distributed_type.value,
              "engine": cfg.sharding.engine, "adapter_dtype": str(want).removeprefix("torch."),
              "loading": cfg.model.loading, **result}
    if is_main:
        RunFolder(out).write_result(result)
        rec.report.close()
        say(f"{result['status']} at step {steps}: loss {train[0]} -> {train[-1]} (val {val[-1]})")
    state.wait_for_everyone()
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    path, overrides = (None, argv) if "=" in argv[0] else (argv[0], argv[1:])
    code = kdist.entry(lambda: run(load_config(path, overrides)))
    if code:
        return code
    kdist.cleanup()  # collected first: a gloo thread freed at interpreter shutdown aborted a rank
    return 0


if __name__ == "__main__":
    kdist.leave(main())
