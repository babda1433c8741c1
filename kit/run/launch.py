"""Launch the recipe from a notebook: write ``launch/<run>/``, start torchrun, watch, stop, re-attach.

    run = launch("tiny-cpu", overrides=["training.steps=40"], nproc=2, name="try1")
    run.wait()                 # blocks; raises RunFailed naming the rank that crashed
    run.metrics()[-1], run.result()
    Run.attach("try1")         # from a new kernel: same handle, found through the run folder
    run = run_to_end("tiny-cpu", ["training.steps=4"])   # a short run, output captured: blocks

The two ways to start ranks: `launch` (watched: returns at once, a notebook streams its progress)
and `run_to_end` (captured: returns when it ended, for short demonstrations, tests and the
benchmark runner). Both write the same run folder through `prepare`, so every run, whoever
started it, is a folder a person can re-run from a terminal with its run.sh.

Kernel side: imports neither torch nor ipywidgets and never creates a process group; the ranks
are started by ``launch/<run>/run.sh``, a plain bash torchrun script that a person can also run
from a terminal or copy to a cluster node. Everything the two sides share is a file in the run
folder: ``config.yaml`` in; ``pid``, ``run.log`` (all ranks, each line prefixed ``[defaultN]:``),
``logs/`` (torchrun's per-rank stdout/stderr/error.json), ``metrics.jsonl``, ``result.json``,
``adapter/`` and ``exit_code`` out. The handle on a started run (`Run`: status, wait, stop,
metrics, failure, attach) is kit/run/runs.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kit import ROOT
from kit.config import Config, apply_overrides, config_from_dict, load_config
from kit.folder import runfolder
from kit.folder import start as start_file
from kit.folder.layout import RunFolder
from kit.run import tether
from kit.run.check import check as check_start

# The run handle lives in kit.run.runs; notebooks import it from here with launch.
from kit.run.runs import Run, RunFailed
from kit.run.script import RUN_ENV, TRAIN_ARGS, run_sh

# What a new start in a folder replaces: the files of the start itself, never a run's results or
# logs. A recipe run's earlier files move into earlier/ first (kit.folder.runfolder); another module's
# (a benchmark case, a reproduction) log of an earlier start is replaced.
PLUMBING = (RunFolder.RUN_SH, RunFolder.PID, RunFolder.EXIT_CODE, RunFolder.STOP_REQUESTED)


# --------------------------------------------------------------------------- writing a run folder


def resolve(cfg_or_path: Config | str | Path, overrides: list[str] | None = None,
            name: str | None = None) -> Config:
    """A validated Config from a Config, a YAML path or a bundled config's name ("tiny-cpu")."""
    overrides = list(overrides or [])
    if isinstance(cfg_or_path, Config):
        cfg = config_from_dict(apply_overrides(cfg_or_path.to_dict(), overrides))
    else:
        cfg = load_config(cfg_or_path, overrides)  # a bundled config's name reads kit/configs/
    if name:
        cfg.run.name = name
        cfg = config_from_dict(cfg.to_dict())  # the name checked as the config's own is
    return cfg


def run_dir(cfg: Config) -> Path:
    """Where the run's files go: cfg.output_dir, relative ones under the checkout."""
    out = cfg.output_dir
    return out if out.is_absolute() else ROOT / out


def begin(cfg: Config, nproc: int = 2, env: dict | None = None, force: bool = False,
          nnodes: int = 1) -> start_file.Start:
    """The recipe's start, checked and planned here (kit.run.check.check, in this kernel: no
    torch), for the machine as run.sh's environment and `env` show it to the ranks; raises
    kit.run.check.Refused (one line per problem). Says what a person should read: the
    pre-flight's findings, then what the start does to its run folder (a finished run: that it
    is)."""
    from kit.budget import machine

    cfg.run.output_dir = str(run_dir(cfg))
    variables = {**RUN_ENV, **{k: str(v) for k, v in (env or {}).items()}}
    begun = check_start(cfg, nproc, nnodes, machine.probe(vars=variables, nproc_per_node=nproc),
                        force=force)
    for f in begun.findings:
        print(f"[preflight {f.level}] {f.code}: {f.message}" + (f" (fix: {f.fix})" if f.fix else ""))
    for line in [begun.folder.message] if begun.folder.start is None else begun.folder.notes:
        print(line)
    return begun


def prepare(cfg_or_path: Config | str | Path, overrides: list[str] | None = None,
            nproc: int = 2, name: str | None = None, module: str = "kit.train",
            args: tuple[str, ...] | list[str] = TRAIN_ARGS,
            decision: runfolder.Decision | None = None, nnodes: int = 1,
            start: start_file.Start | None = None) -> Path:
    """Write config.yaml and run.sh into the run folder; return the folder. A resolved Config is
    used as it is (launch and run_to_end resolve once); a path or name is resolved here.

    module, args: what torchrun runs on each rank (default: the recipe). In args, "{config}",
    "{run_dir}" and "{timeout}" stand for the folder's config.yaml, the folder and the collective
    timeout ("{run_dir_yaml}": the folder as a quoted YAML string, for a key=value override);
    everything else is passed as written. Nothing a run wrote is deleted: a recipe
    start that would replace an earlier run is refused (kit.folder.runfolder: run.start_over moves it
    into earlier/, a resume keeps what it replaces there).

    start: the recipe's start (kit.run.check.check: kit train, launch and run_to_end check and plan
    before they call this), written into the folder as start.json for the ranks; its run-folder
    decision is `decision`. decision: what kit.folder.runfolder decided for the folder (decided
    here when not given); its earlier files move into earlier/ first.
    nnodes: the nodes run.sh starts on when neither NNODES nor PET_NNODES says (kit.run.jobs).

    The folder is claimed first (kit.folder.runfolder.claim): of two starts of one run at once, one
    writes and the other is refused (FolderRefused, one line). The claim stays until run.sh has
    started (its pid file) or this process ends; `runfolder.release(folder / runfolder.CLAIM)`
    gives it up earlier. A folder that cannot be written is a ConfigError naming it."""
    cfg = cfg_or_path
    if not isinstance(cfg, Config) or overrides or name:
        cfg = resolve(cfg_or_path, overrides, name)
    folder = run_dir(cfg)
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # to take back if refused
    held = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        held = runfolder.claim(folder, cfg.run.name)
        if Run(folder).status == "running":
            raise RuntimeError(f"run {cfg.run.name!r} is running; stop it first: "
                               f"Run.attach({cfg.run.name!r}).stop()")
        _write(cfg, folder, nproc, module, args, start.folder if start else decision, nnodes)
        if start is not None:  # after _write: what moved into earlier/ is said, nothing to move
            start.config = cfg.to_dict()
            start.write(folder)
    except BaseException as e:
        runfolder.release(held)
        _remove_empty(made)
        if isinstance(e, OSError):
            raise runfolder.FolderRefused(
                f"run.output_dir: {str(folder)!r} cannot be written ({e.strerror or e}: "
                f"{e.filename or folder}); allowed: a folder this user can create and write "
                "(run.output_dir=<path>)") from None
        raise
    return folder


def _remove_empty(made: list[Path]) -> None:
    """Take back the folders a refused start created (while empty): what was there stays."""
    for path in made:
        try:
            path.rmdir()
        except OSError:
            return


def _write(cfg: Config, folder: Path, nproc: int, module: str, args, decision, nnodes: int) -> None:
    """prepare's writing, under its claim: earlier files aside, config.yaml, run.sh."""
    files = RunFolder(folder)
    cfg.run.output_dir = str(folder)
    if module == "kit.train":
        decision = decision or runfolder.decide(cfg, nproc)
        decision.keep_earlier(folder)
    else:
        files.log.unlink(missing_ok=True)
        shutil.rmtree(files.logs, ignore_errors=True)
    for f in (*PLUMBING, RunFolder.START):  # a start's own is written after this
        (folder / f).unlink(missing_ok=True)
    files.config.write_text(cfg.to_yaml())
    files.run_sh.write_text(run_sh(cfg, folder, nproc, module, args, nnodes))
    files.run_sh.chmod(0o755)


def launch(cfg_or_path: Config | str | Path, overrides: list[str] | None = None, nproc: int = 2,
           name: str | None = None, env: dict | None = None, force: bool = False,
           detach: bool = False) -> Run:
    """Check and plan the start (`begin`), write launch/<run>/ (its start.json for the ranks),
    start run.sh; returns at once (the watched way). The run ends with this kernel (its shutdown
    or restart is a stop request: a checkpoint, exit 75, kit.run.tether) unless detach=True:
    then it goes on, and Run.attach(name) finds it.

    env: extra environment for the ranks, e.g. {"KIT_FAIL_RANK": "1"} (see kit/recipe/faults.py).
    force: start despite the pre-flight's error-level findings. A finished run
    (training.resume=auto at its training.steps) is said so and returned as it is, nothing
    started; a start that cannot run raises kit.run.check.Refused, nothing written."""
    cfg = resolve(cfg_or_path, overrides, name)
    begun = begin(cfg, nproc, env, force)
    if begun.folder.start is None:
        return Run(run_dir(cfg))
    run = Run(prepare(cfg, nproc=nproc, start=begun))
    tether.start(run, {**(env or {}), **start_file.environment(run.folder)}, detach=detach)
    return run


def run_to_end(cfg_or_path: Config | str | Path, overrides: list[str] | None = None,
               nproc: int = 2, name: str | None = None, module: str = "kit.train",
               args: tuple[str, ...] | list[str] = TRAIN_ARGS, env: dict | None = None,
               timeout: float = 900, check: bool = True) -> Run:
    """Prepare the run folder, run it, and return when it has ended (the captured way: output in
    the folder's run.log, `Run.output()`). A failed run raises RunFailed (check=False: returns
    it, `run.status == "failed"`); past `timeout` seconds every process of the run, ranks
    included, is stopped and TimeoutError raised. The recipe (module kit.train) is checked first
    as run.sh's check step would (`begin`: kit.run.check.Refused, one line per problem, before
    anything is written; a finished run is said so and returned, nothing started); other modules,
    such as the pitfalls' reproductions of what goes wrong, are not checked."""
    cfg = resolve(cfg_or_path, overrides, name)
    begun = None
    if module == "kit.train":  # what run.sh's check step would refuse, before writing anything
        begun = begin(cfg, nproc, env)
        if begun.folder.start is None:
            return Run(run_dir(cfg))
    run = Run(prepare(cfg, nproc=nproc, module=module, args=args, start=begun))
    tether.start(run, {**(env or {}), **(start_file.environment(run.folder) if begun else {})})
    try:
        run.wait(timeout=timeout, poll_s=0.2)
    except TimeoutError:
        run.stop()
        raise TimeoutError(f"run {run.name!r} stopped after {timeout}s (every process of it); "
                           f"log: {run.files.log}") from None
    except RunFailed:
        if check:
            raise
    return run


