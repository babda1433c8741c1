"""The check step: everything about a start that can be known before a process starts.

    python -m kit.run.check CONFIG [key=value ...] [--nproc N] [--nnodes N]

run.sh runs it before torchrun (and kit.run.launch calls `check` before writing the run folder), so a
mistake is one line from one process, not the same line from every rank followed by torchrun's
40-line ChildFailedError. It checks, in order: the config file and values (kit.config), where
model.name points (kit.inputs.sources), the data file row by row (kit.inputs.datafile), the pre-flight's
error-level findings for this machine (kit.doctor: pitfalls, GPUs, memory), and what the start
would do to its run folder (kit.folder.runfolder: a refused start, a finished run).

On success it prints one line: the data file and the model (and, when key=value overrides left
data.path at the recipe's shipped sample, that they did), what the run will see of its data, as
the ranks will print it (the model's tokenizer, the rows tokenized: training and validation rows,
per rank, tokens, what the loss covers, steps and epochs), the plan of the values left at auto (kit.budget.plan: a plan that
cannot fit is refused here), and what the start does to its run folder (new, resumed).
That line is the one step here that imports torch (kit.recipe.data.plan), and only in this command's own
process: `check()`, which the notebook kernel calls, does not make it.

Exit codes: 0 go on, 2 refused (one line per problem on stderr), 3 nothing to do (the run is
finished; run.sh then exits 0 without starting torchrun). Importing it loads no torch.
"""

from __future__ import annotations

import argparse
import os
import sys

from kit import pitfalls
from kit.config import Config, ConfigError, load_config
from kit.folder import runfolder
from kit.inputs import checks, datafile, sources
from kit.run import script

NOTHING_TO_DO = 3


class Refused(ConfigError):
    """Several one-line problems; str() is one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def inputs(cfg: Config, in_process: bool = False) -> None:
    """What the config points at, the model and the data (kit.inputs.checks). in_process:
    transformers read here (a process that has imported torch), not in a child process."""
    checks.check(cfg, lambda: model_read(cfg, in_process))


FACTS_VERSION = 2  # part of the cache key: a change to what model_read reads reads again
NOTHING_READ = {"facts": None, "config": None, "tokenizer": None}


def model_read(cfg: Config, in_process: bool = False) -> dict:
    """kit.inputs.checks.read for cfg's model, read in a child process (transformers
    imports torch; this process must not), kept under $KIT_HOME/facts by the model's config, its
    folder's files (names, sizes, times) and the transformers version: a few seconds once,
    nothing after. NOTHING_READ when no config is at hand or the child fails (the ranks then say
    why, as they load it)."""
    import hashlib
    import json
    from importlib.metadata import version

    from kit.inputs import builtin
    from kit.run import child

    name, trust = cfg.model.name, cfg.model.trust_remote_code
    if in_process:
        return checks.read(name, trust)
    config = sources.model_config(name)
    if config is None:
        return NOTHING_READ
    key = hashlib.sha1(json.dumps([FACTS_VERSION, name, trust, config, _stamp(name),
                                   version("transformers")], sort_keys=True,
                                  default=str).encode()).hexdigest()[:16]  # fmt: skip
    path = builtin.kit_home() / "facts" / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    try:
        found = child.call("kit.inputs.checks:read", timeout=300, name=name,
                           trust_remote_code=trust)
    except (child.ChildFailed, TimeoutError):
        return NOTHING_READ
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(found))
    os.replace(tmp, path)  # atomic: a concurrent check reads the whole file or none
    return found


def _stamp(name: str) -> list:
    """A local model folder's files (name, size, modification time): a tokenizer or weights
    replaced since the last check are read again."""
    if sources.kind(name) != "local":
        return []
    folder = os.path.expanduser(name)
    try:
        return sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                      for e in os.scandir(folder) if e.is_file())
    except OSError:
        return []


def check(cfg: Config, nproc_per_node: int = 2, nnodes: int = 1,
          env_vars: dict | None = None) -> runfolder.Plan:
    """Raise ConfigError/Refused for a start that cannot run; else return its run-folder plan
    (plan.start None: finished, nothing to do). Touches no file. Rank 0 of a start nobody
    checked (bare torchrun, python -m kit.train) makes the same checks of the config and its
    inputs (kit.inputs.checks) before it plans; the machine's it learns as it starts."""
    inputs(cfg)
    from kit import doctor  # the pre-flight: pitfalls with this machine, GPUs, memory
    from kit.budget import hardware

    machine = hardware.probe(vars=env_vars, nproc_per_node=nproc_per_node)
    machine["nnodes"] = nnodes
    gpu = bool(machine["gpus"]) and cfg.training.device != "cpu"
    facts = {**machine, "ranks": nproc_per_node * nnodes, "device": "cuda" if gpu else "cpu"}
    # The pitfalls this machine decides, in the registry's own line (as load_config says its
    # config-only ones); then the pre-flight's other errors (GPUs, memory, the model's fit).
    found = pitfalls.machine_violations(cfg, facts)
    lines = [str(violation) for _, violation in found]
    for f in doctor.preflight(cfg, machine):
        if f.level == "error" and f.code not in {p.code for p, _ in found}:
            named = f.message.startswith((f"{f.field}:", f"{f.field}=")) if f.field else False
            lines.append((f.message if named else f"{f.field or f.code}: {f.message}")
                         + (f" (fix: {f.fix})" if f.fix else ""))
    if lines:
        raise Refused(lines)
    return runfolder.plan(cfg, nproc_per_node * nnodes)


def data_line(cfg: Config, world_size: int, plan: runfolder.Plan,
              overrides: list[str] | None = None) -> str:
    """The success line: the data file and the model (`source`), the data as rank 0 will print
    it, and what the start does to its run folder. Imports torch and transformers: for a
    command's own process, not a notebook's."""
    import torch

    from kit.recipe import data, planning  # torch, transformers: this process only (see above)

    gpu = torch.cuda.is_available() and cfg.training.device != "cpu"
    planned = planning.resolve(cfg, torch.device("cuda", 0) if gpu else torch.device("cpu"),
                               world_size)  # values left at auto: as rank 0 will choose them
    rows = data.plan(planned.cfg, world_size).removeprefix("data: ")
    return f"data: {source(cfg, overrides)}: {rows}; {planned.line()}; run: {plan.message}"


# What run.sh's check step passes (kit.run.script.TRAIN_ARGS): the kit's own, not the person's.
SCRIPT_KEYS = {arg.split("=", 1)[0] for arg in script.TRAIN_ARGS if "=" in arg}


def source(cfg: Config, overrides: list[str] | None = None) -> str:
    """The data file and the model, and, when key=value overrides changed other values but not
    data.path and it is still the recipe's shipped sample, that it is (a forgotten data.path
    trains on the kit's own rows without a word otherwise)."""
    keys = {item.split("=", 1)[0].strip() for item in overrides or []} - SCRIPT_KEYS
    forgot = bool(keys) and "data.path" not in keys and datafile.shipped(cfg.data.path)
    return f"{cfg.data.path}, model {cfg.model.name}" + (
        " (the recipe's own sample: your overrides left data.path as it was; "
        "data.path=FILE trains on yours)" if forgot else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kit check", description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="a kit YAML (optional: key=value only)")
    parser.add_argument("overrides", nargs="*", help="key=value")
    parser.add_argument("--nproc", type=int, default=2, help="processes per node")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--refusals-only", action="store_true",
                        help="no success line (rank 0 of a bare start: kit.inputs.checks.step)")
    args = parser.parse_intermixed_args(argv)
    path, overrides = args.config, list(args.overrides)
    if path and "=" in path:
        path, overrides = None, [path, *overrides]
    try:
        cfg = load_config(path, overrides)
        plan = check(cfg, args.nproc, args.nnodes)
        if plan.start is not None and not args.refusals_only:
            line = data_line(cfg, args.nproc * args.nnodes, plan, overrides)
    except ConfigError as e:
        for line in str(e).splitlines():
            sys.stderr.write(f"ConfigError: {line}\n")
        return 2
    if plan.start is None:
        print(plan.message)
        return NOTHING_TO_DO
    if not args.refusals_only:
        for note in plan.notes:
            print(note)
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
