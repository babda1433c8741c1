"""Pre-flight: every known pitfall a config (and the machine it will run on) walks into,
found before it costs a GPU-hour. Each check reads the merged config tree through a
`Context` and returns Findings; `preflight` runs them all.

    preflight("kit/configs/tiny-cpu.yaml", overrides=["sharding.engine=fsdp1"])
    preflight(cfg, env={"gpus": [{"name": "H100", "memory_gib": 79.6}] * 2, "vars": {}})

The pitfall checks are records of kit.pitfalls, shared with load_config, the script scan and
explain; here they run on a raw tree load_config cannot even build. The memory, data and
environment checks are this module's own.
Longer than 400 lines because the checks are one registry (CHECKS), in the order the report
prints them.
"""

from __future__ import annotations

import copy
import importlib.util
import math
from collections.abc import Callable

from kit.budget import shapes
from kit.config import ConfigError, config_from_dict
from kit.doctor.context import Context, complete_env, lookup, namespace, read_config
from kit.findings import Finding, ordered
from kit.inputs import datafile
from kit.pitfalls import PITFALLS, get

# Conservative bytes/s for moving a whole model once: a network filesystem, one TCP stream, or
# rank 0 writing a checkpoint while the others wait in a collective.
SLOW_BYTES_PER_S = 100e6
FIX_ROWS = "fix the file where the message says (every row needs its text), or use another file"
CPU_BF16_PARAMS = 40e6  # FINDINGS: this CPU has no bf16 instructions; above ~40M params use fp32

CHECKS: list[Callable[[Context], list[Finding]]] = []


def _check(fn):
    CHECKS.append(fn)
    return fn


@_check
def _pitfalls(c: Context) -> list[Finding]:
    """The pitfalls a config decides (the `config` predicates load_config runs too) and those
    the machine decides with it (`machine`)."""
    view = namespace(c.tree)
    machine = {**c.env, "ranks": c.ranks, "device": c.device}
    out = []
    for p in PITFALLS:
        found = (p.config(view) if p.config else None) or (
            p.machine(view, machine) if p.machine else None)
        if found is not None:
            out.append(p.finding(f"{found.field}={found.value!r}", field=found.field))
    return out


@_check
def _host_ram(c: Context) -> list[Finding]:
    ram = c.env.get("host_ram_gib")
    per_node = int(c.env["nproc_per_node"])
    acc = c.accelerate or {}
    if not ram or per_node < 2:
        return []
    if acc:  # accelerate without cpu_ram_efficient_loading: every rank loads to host first
        if acc["cpu_ram_efficient_loading"] or acc["distributed_type"] != "FSDP":
            return []
        return [
            Finding(
                "warning",
                "host_ram_full_load",
                f"fsdp_cpu_ram_efficient_loading is off: each of {per_node} ranks per node loads "
                "the whole model into host RAM before FSDP shards it",
                "fsdp_cpu_ram_efficient_loading: "
                "true with fsdp_sync_module_states: true (rank 0 loads, the others receive)",
            )
        ]
    if c.device != "cpu" or c.facts is None:
        return []  # on GPUs the kit loads each rank straight onto its own GPU
    dtype = c.get("model.dtype")
    held = c.facts.host_bytes(dtype, c.quantized) * per_node / 2**30
    peak = c.facts.host_bytes(dtype, False) * per_node / 2**30
    what = f"{per_node} ranks each load the whole model into host RAM"
    if held > 0.9 * ram:
        level, msg = "error", f"{what}: {held:.1f} GiB > {ram:.1f} GiB available"
    elif peak > 0.9 * ram:
        level = "warning"
        msg = f"{what}: up to {peak:.1f} GiB (unquantized) while loading, {ram:.1f} GiB free"
    else:
        return []
    fix = "model.loading=stream (FSDP2: a shard + one unit per rank), fewer ranks, or GPUs"
    return [Finding(level, "host_ram_full_load", msg, fix)]


@_check
def _environment(c: Context) -> list[Finding]:
    out, env_vars = [], c.env["vars"]
    workers = lookup(c.raw, "data.num_workers", 0) or 0
    if isinstance(workers, int) and workers > 0 and "TOKENIZERS_PARALLELISM" not in env_vars:
        out.append(
            Finding(
                "warning",
                "tokenizers_parallelism",
                f"data.num_workers={workers} with TOKENIZERS_PARALLELISM unset: fast tokenizers "
                "used before the DataLoader forks can deadlock its workers",
                "export TOKENIZERS_PARALLELISM=false before launching",
            )
        )
    conf = env_vars.get("PYTORCH_CUDA_ALLOC_CONF", "") + env_vars.get("PYTORCH_ALLOC_CONF", "")
    if c.device == "cuda" and "expandable_segments:true" not in conf.replace(" ", "").lower():
        out.append(
            Finding(
                "warning",
                "cuda_alloc_conf",
                "PYTORCH_CUDA_ALLOC_CONF lacks expandable_segments:True: varying sequence lengths "
                "fragment the caching allocator into 'CUDA out of memory' with memory still free",
                "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before launching",
            )
        )
    if c.get("training.device") == "cuda" and not c.env["gpus"]:
        out.append(
            Finding(
                "error",
                "no_gpu",
                "training.device=cuda but no GPU is visible (nvidia-smi)",
                "training.device=auto (CPU/gloo here), or run on a GPU machine",
                "training.device",
            )
        )
    elif c.device == "cuda" and int(c.env["nproc_per_node"]) > len(c.env["gpus"]):
        out.append(
            Finding(
                "error",
                "more_ranks_than_gpus",
                f"{c.env['nproc_per_node']} ranks per node but {len(c.env['gpus'])} GPU(s): the "
                "extra ranks fail with 'invalid device ordinal'",
                f"--nproc_per_node={len(c.env['gpus'])} (one rank per GPU)",
            )
        )
    if (
        c.accelerate
        and c.accelerate["distributed_type"] == "FSDP"
        and (c.accelerate["use_cpu"] or not c.env["gpus"])
    ):
        out.append(
            Finding(
                "error",
                "accelerate_fsdp_cpu",
                "accelerate cannot run FSDP without GPUs: it raises 'no available devices' (with "
                "use_cpu: true it silently runs plain DDP, FSDP off)",
                "run on GPUs, or torchrun -m kit.train (FSDP over gloo works on CPU)",
            )
        )
    return out


@_check
def _timeout(c: Context) -> list[Finding]:
    if c.facts is None or c.ranks < 2:  # one rank waits on no other: no collective can time out
        return []
    minutes = c.get("run.dist_timeout_min")
    if not isinstance(minutes, (int, float)) or minutes <= 0:
        return []
    full = c.facts.host_bytes(c.get("model.dtype"), False)
    need = full / SLOW_BYTES_PER_S / 60
    if need <= minutes / 2:
        return []
    level = "error" if need > minutes else "warning"
    return [
        Finding(
            level,
            "dist_timeout_short",
            f"run.dist_timeout_min={minutes} but moving the {full / 1e9:.1f} GB model once (rank 0 "
            f"building/loading or saving it while the others wait) takes ~{need:.0f} min at "
            f"{SLOW_BYTES_PER_S / 1e6:.0f} MB/s: 'Watchdog caught collective operation timeout'",
            f"run.dist_timeout_min={max(30, math.ceil(3 * need))}",
            "run.dist_timeout_min",
        )
    ]


@_check
def _cpu_bf16(c: Context) -> list[Finding]:
    if c.device != "cpu" or c.get("model.dtype") != "bfloat16" or c.facts is None:
        return []
    if c.facts.params < CPU_BF16_PARAMS:
        return []
    return [
        Finding(
            "warning",
            "cpu_bf16_slow",
            f"{c.facts.params / 1e6:.0f}M params in bfloat16 on a CPU: without bf16 instructions "
            "matmuls run ~4x slower than float32",
            "model.dtype=float32 on CPU",
            "model.dtype",
        )
    ]


@_check
def _gpu_memory(c: Context) -> list[Finding]:
    if c.device != "cuda" or not c.env["gpus"] or c.facts is None:
        return []
    if importlib.util.find_spec("kit.budget.estimate") is None:
        return [
            Finding(
                "info",
                "memory_check_skipped",
                "kit.budget.estimate is not available: GPU memory was not estimated",
                "install the full kit",
            )
        ]
    from dataclasses import replace  # noqa: I001  (kit.budget.estimate may be absent: checked above)
    from kit.budget.estimate import Setup, estimate

    gpu = min(g["memory_gib"] for g in c.env["gpus"])
    tree = c.tree
    planned = c.planned()  # values left at auto: as the run will choose them
    if isinstance(planned, Finding):
        return [planned]
    if planned is not None:
        tree = planned.cfg.to_dict()
    try:
        est = estimate(c.facts.config, Setup.from_config(namespace(tree), c.ranks))
    except (ValueError, KeyError) as e:
        return [
            Finding(
                "info",
                "memory_check_skipped",
                f"no memory estimate: {e}",
                "estimate by hand (notebook 03) or measure a short run",
            )
        ]
    total, needed = est.total_gib, est.needed_gib()
    found = []
    if est.load_gib > gpu and est.setup.loading != "stream":  # 'CUDA out of memory' at load
        streamed = estimate(c.facts.config, replace(est.setup, loading="stream", engine="fsdp2"))
        found.append(Finding(
            "error", "memory_over_gpu_loading", f"model.loading={est.setup.loading} puts the "
            f"whole model on each GPU before sharding: {est.load_gib:.1f} GiB vs {gpu:.1f} GiB on "
            f"{c.env['gpus'][0]['name']}: 'CUDA out of memory' before the first step",
            f"sharding.engine=fsdp2 with model.loading=stream: its shard plus one unit, "
            f"{streamed.load_gib:.1f} GiB here"))  # fmt: skip
    if needed <= gpu:
        return found
    level = "error" if total > gpu else "warning"
    return found + [
        Finding(
            level,
            "memory_over_gpu",
            f"estimated peak {total:.1f} GiB per GPU ({needed:.1f} with headroom) vs {gpu:.1f} GiB "
            f"on {c.env['gpus'][0]['name']}: 'CUDA out of memory'",
            "lower training.batch_size or data.max_seq_len, turn on training.recompute.enabled, or "
            "add GPUs (FSDP shards the weights)",
        )
    ]


@_check
def _target_modules(c: Context) -> list[Finding]:
    """Every name in lora.target_modules must match a module (peft's own matching): PEFT skips
    the names that match nothing when others do, and trains fewer layers without a word."""
    targets = c.get("lora.target_modules")
    if c.facts is None or targets in ("all-linear", None, "", []):
        return []
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    supported = {"Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D"}
    names = [targets] if isinstance(targets, str) else [str(t) for t in targets]
    out, unmatched, field = [], [], "lora.target_modules"
    for name in names:
        config = LoraConfig(target_modules=[name] if not isinstance(targets, str) else name)
        hits = [k for k in c.facts.modules if check_target_module_exists(config, k)]
        kinds = {c.facts.modules[k] for k in hits}
        if not hits:
            unmatched.append(name)
        elif not kinds & supported:
            where = f"lora.target_modules: {name!r} names {', '.join(sorted(kinds))} modules"
            out.append(get("target_modules_unsupported").finding(where, field=field))
    if unmatched:  # the line kit.recipe.lora.check_targets raises on the rank side
        code = "target_modules_" + ("unmatched" if len(unmatched) == len(names) else "partial")
        where = (f"lora.target_modules: {', '.join(map(repr, unmatched))} "
                 f"match{'es' if len(unmatched) == 1 else ''} no module of {c.get('model.name')}; "
                 f"its linear layers: {', '.join(c.facts.linear_names())}")
        out.append(get(code).finding(where, field=field))
    return out


@_check
def _group_inputs(c: Context) -> list[Finding]:
    """lora.group_inputs on a model (or target list) with no adapted q/k/v or gate/up under one
    parent, e.g. fused projections: the ranks would refuse it after loading (kit.recipe.levers.lora_groups)."""
    if c.get("lora.group_inputs") is not True or c.facts is None:
        return []
    targets = c.get("lora.target_modules")
    adapted = [n for n, kind in c.facts.modules.items() if kind == "Linear" and "lm_head" not in n]
    if targets not in ("all-linear", None, "", []):  # PEFT's own matching, as _target_modules
        from peft import LoraConfig
        from peft.tuners.tuners_utils import check_target_module_exists

        config = LoraConfig(target_modules=targets)
        adapted = [n for n in adapted if check_target_module_exists(config, n)]
    if shapes.shared_input_groups(adapted):
        return []
    return [Finding("error", "group_inputs_no_group", shapes.NO_SHARED_INPUT,
                    "lora.group_inputs=false", "lora.group_inputs")]


@_check
def _fused_down(c: Context) -> list[Finding]:
    """lora.fused_down=true where its Triton kernels cannot run (a GPU below compute capability
    8.0, or no triton): the ranks would fail at their first step (kit.recipe.lora_down). A GPU
    described rather than probed is taken to have triton, as CUDA builds of torch bring it."""
    if c.get("lora.fused_down") is not True or c.device != "cuda":
        return []
    from kit.budget.machine import triton_kernels

    packages = {"triton": True, **(c.env.get("packages") or {})}
    gpus = [g for g in c.env.get("gpus") or [] if not triton_kernels(g, packages)]
    if not gpus:
        return []
    gpu = gpus[0]
    why = "triton is not installed" if not packages["triton"] else \
        f"compute capability {gpu.get('capability') or 'unknown'}, 8.0 or later needed"
    return [Finding("error", "fused_down_no_triton",
                    f"lora.fused_down: True is not allowed on {gpu.get('name', 'this GPU')} "
                    f"({why}); allowed: false, or auto (the planner's choice)",
                    "lora.fused_down=false", "lora.fused_down")]


@_check
def _seq_len(c: Context) -> list[Finding]:
    """data.max_seq_len past the model's positions: the rank side (kit.recipe.model.build) refuses it
    with the same line; on this CPU it would train ~30x slower before anything else went wrong."""
    length = c.get("data.max_seq_len")
    most = (c.facts.config if c.facts else {}).get("max_position_embeddings")
    if not isinstance(length, int) or not isinstance(most, int) or length <= most:
        return []
    msg = (f"data.max_seq_len: {length} is not allowed; {c.get('model.name')} has "
           f"max_position_embeddings={most}")
    return [Finding("error", "max_seq_len_too_long", msg, f"data.max_seq_len={most} or less",
                    "data.max_seq_len")]


@_check
def _model_unreadable(c: Context) -> list[Finding]:
    if c.accelerate:
        return []
    from kit.inputs.sources import check_model

    try:  # where model.name points: a kit model, a folder with config.json, a reachable hub
        check_model(str(c.get("model.name")))
    except ConfigError as e:
        return [Finding("error", "model_source", str(e), "point model.name at a local model "
                        "folder, a kit: model, or a hub id on a machine with a network",
                        "model.name")]
    if c.facts is not None:
        return []
    return [
        Finding(
            "warning",
            "model_unreadable",
            f"cannot read model {c.get('model.name')!r} offline ({c.facts_error}); size, target "
            "module and timeout checks skipped",
            "use a local folder or a kit: model, or fill the Hugging Face cache first",
            "model.name",
        )
    ]


@_check
def _data(c: Context) -> list[Finding]:
    """data.path and data.val_path read and every row checked by kit.inputs.datafile, as a run does."""
    if c.accelerate:
        return []
    out, cfg = [], namespace(c.tree["data"])
    for key in ("data.path", "data.val_path"):
        path = c.get(key)
        if not path:
            continue
        try:
            datafile.resolve_path(str(path), key)
        except ConfigError as e:
            fix = "give a .jsonl/.json/.csv/.parquet file or kit:sample"
            out.append(Finding("error", "data_missing", str(e), fix, key))
            continue
        try:
            rows = datafile.read_checked(str(path), cfg, key, stdlib=True)
        except ConfigError as e:
            field = str(e).split(":", 1)[0]  # the file's key (a row, a line), or a data.*_field
            if field == key:
                out.append(Finding("error", "data_rows_invalid", str(e), FIX_ROWS, key))
            else:
                fix = f"{field}=<one of the columns named>"
                out.append(Finding("error", "text_field_missing", str(e), fix, field))
            continue
        batch, val = c.get("training.batch_size"), c.get("data.val_fraction") or 0
        if key == "data.path" and isinstance(batch, int):
            train_rows = (len(rows) if c.get("data.val_path")
                          else datafile.split_sizes(len(rows), val)[0])
            if train_rows < batch * c.ranks:
                out.append(Finding(
                    "error", "data_too_small",
                    f"{train_rows} training rows cannot fill {c.ranks} ranks x batch {batch}",
                    "lower training.batch_size or add rows", "training.batch_size",
                ))  # fmt: skip
    return out


def preflight(cfg, env: dict | None = None, overrides: list[str] | None = None,
              planned=None) -> list[Finding]:
    """Findings for a run of `cfg` (a Config, a dict tree, a kit or accelerate YAML path) on
    `env` (kit.budget.machine.probe's dict; None: this machine). Errors first. Never raises on a
    bad config: a value load_config would reject becomes a finding, with the specific ones
    explained. planned: the start's plan of the values left at auto (kit.budget.plan.Planned, or
    the Finding of its refusal), which the memory check reads instead of planning again."""
    raw, findings = read_config(cfg, overrides)
    if raw is None:
        return findings
    ctx = Context(raw, complete_env(env), planned)
    for check in CHECKS:
        try:
            findings += check(ctx)
        except Exception as e:  # noqa: BLE001 - a wrong-typed raw value must not stop the rest
            if not ctx.accelerate:
                what = f"{check.__name__[1:]}: {e}"
                findings.append(Finding("info", "check_skipped", what, "fix the values it reads"))
    if not ctx.accelerate:
        explained = {f.field for f in findings}
        findings += [
            Finding("error", "config_invalid", msg, "see kit/config.py for the allowed values", fld)
            for fld, msg in config_errors(raw)
            if fld not in explained
        ]
    return ordered(findings)


def config_errors(tree: dict, limit: int = 20) -> list[tuple[str, str]]:
    """(field, message) of every value load_config would reject, not only the first: each
    rejected key is dropped (back to its default) and the tree validated again."""
    tree, out = copy.deepcopy(tree), []
    for _ in range(limit):
        try:
            config_from_dict(tree)
            return out
        except ConfigError as e:
            field = str(e).split(":", 1)[0]
            out.append((field, str(e)))
            parent = lookup(tree, field.rsplit(".", 1)[0]) if "." in field else tree
            key = field.rsplit(".", 1)[-1]
            if not isinstance(parent, dict) or key not in parent:
                return out
            del parent[key]
    return out
