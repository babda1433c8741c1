"""The check step: everything about a start that can be known before a process starts, and
the start itself (kit.folder.start), built once by `check` for every way to start the recipe.

    python -m kit.run.check CONFIG [key=value ...] [--nproc N] [--nnodes N]
    begun = check(cfg, nproc_per_node=2)    # kit train, launch, run_to_end, run.sh's check step

`check` builds a start from the config, this machine (kit.budget.machine.probe), the processes
and the nodes, in order: the config file and values (kit.config), where model.name points
(kit.inputs.sources), the data file row by row (kit.inputs.datafile), the plan of the values left
at auto (kit.budget.plan: a plan that cannot fit is refused here), the pre-flight's error-level
findings for this machine (kit.doctor: pitfalls, GPUs, memory, read from that plan), what the
start would do to its run folder (kit.folder.runfolder: a refused start, a finished run) and the
data line. Every refusal is one `Refused`: one line per problem, before any process starts, with
every file of the run folder as it was. The start is written into the run folder as start.json
(kit.run.launch.prepare, or this command with --start, as run.sh runs it), and its ranks read it
instead of checking, planning and reading the data again.

Where it runs decides what it can know: `here=True` (kit train's own process, this command)
imports torch and transformers to read the data's rows once (kit.recipe.planning.Planning): the
plan, even for data.max_seq_len=auto, and the data line; a notebook's kernel (launch,
run_to_end) imports no torch, plans only a set data.max_seq_len and leaves auto to rank 0.

On success this command prints one line: the data file and the model (and, when key=value
overrides left data.path at the recipe's shipped sample, that they did), what the run will see
of its data, as the ranks will print it, the plan of the values left at auto and what the start
does to its run folder (new, resumed). Exit codes: 0 go on, 2 refused (one line per problem on
stderr), 3 nothing to do (the run is finished; run.sh then exits 0 without starting torchrun).
Importing it loads no torch.
"""

from __future__ import annotations

import argparse
import os
import sys

from kit import pitfalls
from kit.budget import plan as kplan
from kit.config import AUTO, Config, ConfigError, load_config
from kit.doctor.context import refused_plan
from kit.folder import runfolder
from kit.folder.start import Start
from kit.inputs import checks, datafile, sources
from kit.run import script

NOTHING_TO_DO = 3


class Refused(ConfigError):
    """A start that cannot run: str() is one line per problem (`problems`). The one error every
    way to start the recipe raises (kit train, launch, run_to_end, run.sh's check step); a
    ConfigError, so what catches those catches it."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


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


def check(cfg: Config, nproc_per_node: int = 2, nnodes: int = 1, machine: dict | None = None,
          *, here: bool = False, force: bool = False, plan: bool = True,
          ranks: bool = False) -> Start:
    """The start of `cfg` on `nproc_per_node` x `nnodes` processes of `machine` (default: this
    one, as run.sh's environment shows it to the ranks); raises Refused (one line per problem)
    for a start that cannot run. Touches no file. begun.folder.start None: the run is finished,
    nothing to do (no data line then).

    here: plan and make the data line in this process (imports torch; the data read and
    tokenized once); else only a set data.max_seq_len is planned (a notebook's kernel). force:
    start despite the pre-flight's error-level findings (launch(force=True)). plan: False for
    rank 0 of a start nobody checked, which plans for itself. ranks: plan the run folder as the
    ranks see it (run.sh's check step: run.log and logs/ are the start's own)."""
    from kit.budget import machine as probed

    world = nproc_per_node * nnodes
    machine = {**(machine or probed.probe(vars=script.RUN_ENV, nproc_per_node=nproc_per_node)),
               "nproc_per_node": nproc_per_node, "nnodes": nnodes}
    gpu = bool(machine["gpus"]) and cfg.training.device != "cpu"
    hw = probed.for_plan(machine, world, "cuda" if gpu else "cpu")
    with datafile.read_once(stdlib=not here):  # the data file read once here, whoever asks
        facts = _inputs(cfg, here)
        planned, unplanned, broken = None, [], None
        if plan and cfg.data.max_seq_len != AUTO and (here or facts is not None):
            try:  # a set length plans without the data (no torch): before the pre-flight
                planned = kplan.plan(cfg, hw, cfg.data.max_seq_len,
                                     sources.model_config(cfg.model.name), facts)
            except ConfigError as e:  # nothing fits: the pre-flight reads it as its finding
                planned, unplanned = refused_plan(e), str(e).splitlines()
            except (ValueError, KeyError) as e:  # a value the pre-flight refuses (a target
                broken = e  # module the model has not): its line first, else this
        findings, lines = _machine(cfg, machine, world, planned)
        if (lines or unplanned) and not force:
            raise Refused(lines + unplanned)
        if broken is not None and not force:
            raise broken
        folder = _refused_as_one(runfolder.decide, cfg, world, ranks=ranks)
        data = None
        if here and plan and folder.start is not None:
            from kit.recipe import planning  # torch, transformers: a command's own process

            made = _refused_as_one(planning.Planning, cfg, hw, world, facts,
                                   planned if isinstance(planned, kplan.Planned) else None)
            planned, data = made.planned, _refused_as_one(made.data_line)
    plan_json = planned.to_json() if isinstance(planned, kplan.Planned) else None
    return Start(cfg.to_dict(), nproc_per_node, nnodes, folder, plan_json, data, findings)


def _refused_as_one(step, *args, **kwargs):
    try:
        return step(*args, **kwargs)
    except ConfigError as e:
        if isinstance(e, Refused):
            raise
        raise Refused(str(e).splitlines()) from None


def _inputs(cfg: Config, here: bool) -> dict | None:
    """What the config points at (kit.inputs.checks); what the model allows (model_facts)."""
    found = {}

    def read() -> dict:
        found.update(model_read(cfg, in_process=here))
        return found

    _refused_as_one(checks.check, cfg, read)
    return found.get("facts")


def _machine(cfg: Config, machine: dict, world: int, planned) -> tuple[list, list[str]]:
    """The pitfalls this machine decides, in the registry's own line (as load_config says its
    config-only ones); then the pre-flight's other errors (GPUs, memory, the model's fit, read
    from `planned`: the plan, or the Finding of its refusal, said by the caller). Returns (the
    findings below an error, a line per error)."""
    from kit import doctor  # the pre-flight: pitfalls with this machine, GPUs, memory

    gpu = bool(machine["gpus"]) and cfg.training.device != "cpu"
    facts = {**machine, "ranks": world, "device": "cuda" if gpu else "cpu"}
    found = pitfalls.machine_violations(cfg, facts)
    lines = [str(violation) for _, violation in found]
    findings = doctor.preflight(cfg, machine, planned=planned)
    for f in findings:
        if f.level == "error" and f.code not in {p.code for p, _ in found} and f is not planned:
            named = f.message.startswith((f"{f.field}:", f"{f.field}=")) if f.field else False
            lines.append((f.message if named else f"{f.field or f.code}: {f.message}")
                         + (f" (fix: {f.fix})" if f.fix else ""))
    return [f for f in findings if f is not planned], lines


def success_line(cfg: Config, begun: Start, overrides: list[str] | None = None) -> str:
    """The success line: the data file and the model (`source`), the data as rank 0 will print
    it, the plan, and what the start does to its run folder."""
    from kit.budget.plan import Planned

    rows = (begun.data or "").removeprefix("data: ")
    planned = f"; {Planned.from_json(begun.plan).line()}" if begun.plan else ""
    return f"data: {source(cfg, overrides)}: {rows}{planned}; run: {begun.folder.message}"


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
                        help="no success line, nothing planned (rank 0 of a bare start, which "
                        "plans for itself: kit.inputs.checks.step)")
    parser.add_argument("--start", action="store_true", help="write the start into the run "
                        "folder (start.json) for the ranks: run.sh's check step")
    args = parser.parse_intermixed_args(argv)
    path, overrides = args.config, list(args.overrides)
    if path and "=" in path:
        path, overrides = None, [path, *overrides]
    quiet = args.refusals_only
    try:
        cfg = load_config(path, overrides)
        begun = check(cfg, args.nproc, args.nnodes, here=not quiet, plan=not quiet,
                      ranks=args.start)
    except ConfigError as e:
        for line in str(e).splitlines():
            sys.stderr.write(f"ConfigError: {line}\n")
        return 2
    if begun.folder.start is None:
        print(begun.folder.message)
        return NOTHING_TO_DO
    if args.start:
        begun.write(cfg.output_dir)
    if not quiet:
        for note in begun.folder.notes:
            print(note)
        print(success_line(cfg, begun, overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
