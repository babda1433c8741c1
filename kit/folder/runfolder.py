"""What a start may do to a run folder that already holds files: the kit never deletes them.

    d = decide(cfg, world_size=2)  # decides; touches nothing; a refusal is a one-line ConfigError
    d.start                       # 0: from scratch, N: resume at step N, None: finished, nothing to do
    d.keep_earlier(folder)        # moves what the start would replace into earlier/<time>/

The rules, for `training.resume` and `run.start_over`:

- A fresh start (resume "") into a folder holding a run (adapter/, result.json, a checkpoint) is
  refused, naming what is there. `run.start_over=true` starts over: the whole earlier run moves,
  byte for byte, into earlier/<time>/. What a crashed attempt left before saving anything
  (metrics.jsonl, run.log) moves there too, without a refusal.
- `resume=auto` on a finished run (result.json completed at training.steps or beyond) says so and
  does nothing. Otherwise it continues from the newest complete checkpoint whose manifest checks
  (kit.folder.manifest: files, sizes, checksums, the config that made it); newer damaged ones are named
  and skipped. A run with trained files but no valid checkpoint is refused: an exact resume
  needs one, and retraining from step 0 would replace what was trained.
- A resume replaces the run's end (adapter/, result.json, probe.pt), drops metrics rows past its
  step and leaves the checkpoints past it (damaged, or of a timeline an explicit path leaves):
  those move into earlier/<time>/ first, with the config.yaml they were made with.

Kernel side, no torch: a start plans before it writes anything (kit.run.check.check: a refused or
finished start leaves every file byte-identical) and hands the plan to its ranks in start.json
(kit.folder.start); rank 0 of a start nobody checked (bare torchrun), or of a restart, plans for
itself.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kit.config import Config, ConfigError
from kit.folder import manifest
from kit.folder.layout import RunFolder

# What a run writes when it ends (or stops).
END = (RunFolder.ADAPTER, RunFolder.RESULT, RunFolder.PROBE)
EARLIER = RunFolder.EARLIER


@dataclass
class Decision:
    start: int | None  # first step is start + 1; None: finished, nothing to do
    checkpoint: Path | None = None
    notes: list[str] = field(default_factory=list)  # skipped checkpoints, what moves where
    displaced: list[str] = field(default_factory=list)  # names that move into earlier/<time>/
    trim_metrics: bool = False  # metrics.jsonl has rows past `start`: keep a trimmed copy
    message: str = ""  # the line a person reads: what this start does

    def keep_earlier(self, folder: Path, why: str = "") -> Path | None:
        """Move `displaced` into earlier/<time>/ (renames: the bytes stay as they were); returns
        that folder, None when nothing moves. Call once, on one process, before writing."""
        names = [n for n in self.displaced if (folder / n).exists()]
        if not names:
            return None
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        dest = folder / EARLIER / stamp
        n = 1
        while dest.exists():
            n += 1
            dest = folder / EARLIER / f"{stamp}-{n}"
        dest.mkdir(parents=True)
        for name in names:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(folder / name, dest / name)  # a rename: the bytes stay as they were
        if self.trim_metrics and RunFolder(dest).metrics.is_file():
            kept = [line for line in RunFolder(dest).metrics.read_text().splitlines(True)
                    if line.strip() and json.loads(line).get("step", 0) <= (self.start or 0)]
            RunFolder(folder).metrics.write_text("".join(kept))
        (dest / "why.txt").write_text("\n".join([why or self.message, *self.notes,
                                                 f"moved: {', '.join(names)}"]) + "\n")
        self.notes.append(f"kept the earlier {', '.join(names)} in {dest}")
        self.displaced = []  # moved: a later call (the ranks, with the start) moves nothing more
        return dest

    def to_json(self) -> dict:
        return {"start": self.start, "checkpoint": str(self.checkpoint) if self.checkpoint else None,
                "notes": list(self.notes), "displaced": list(self.displaced),
                "trim_metrics": self.trim_metrics, "message": self.message}

    @classmethod
    def from_json(cls, found: dict) -> Decision:
        return cls(found["start"], Path(found["checkpoint"]) if found["checkpoint"] else None,
                   list(found["notes"]), list(found["displaced"]), found["trim_metrics"],
                   found["message"])


def _unwritable(out: Path) -> str | None:
    """Why the folder `out` cannot be created and written, None when it can: judged from its
    nearest existing folder, without writing anything (a read-only mount fails even for root)."""
    path = next(p for p in (out, *out.parents) if p.exists() or p.is_symlink() or p == p.parent)
    if not path.is_dir():
        return f"{str(path)!r} is a file, not a folder"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{str(path)!r} is not writable by this user"
    return None


def _metrics_past(folder: Path, step: int) -> bool:
    return any(row.get("step", 0) > step for row in RunFolder(folder).read_metrics())


def _config_changed(folder: Path, cfg: Config) -> bool:
    try:
        return RunFolder(folder).config.read_text() != cfg.to_yaml()
    except OSError:
        return False


# What kit.run.jobs writes beside run.sh: the other ways to start this run, not a record of one.
LAUNCHERS = set(RunFolder.LAUNCHERS)
# The claim of the start writing the folder now (claim below): hidden, never moved.
CLAIM = RunFolder.CLAIM
# Files every start writes anew (kit.run.launch.prepare, run.sh's check step: start.json), and
# the launchers: never moved.
PLUMBING = {RunFolder.RUN_SH, RunFolder.PID, RunFolder.EXIT_CODE, RunFolder.START,
            RunFolder.STOP_REQUESTED, CLAIM} | LAUNCHERS
# What the running start itself is writing when the ranks plan (run.sh's log, torchrun's logs/).
LIVE = (RunFolder.LOG, RunFolder.LOGS)


# A restart of the same run by what started it: run.sh after a failed attempt (KIT_MAX_RESTARTS),
# torchrun --max-restarts (its restarted ranks), a requeued Slurm job (the job script again,
# check step included).
RESTARTS = ("KIT_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def restart(environ=os.environ) -> str | None:
    """'NAME=N' when this start is restart N of the same run (RESTARTS), else None. A restart
    resumes by itself: as training.resume=auto (never over a finished run, and a new run's
    folder has nothing to resume, so it starts at step 0)."""
    for name in RESTARTS:
        count = environ.get(name, "0")
        if count.isdigit() and int(count) > 0:
            return f"{name}={count}"
    return None


def decide(cfg: Config, world_size: int, folder: Path | None = None, ranks: bool = False) -> Decision:
    """What starting `cfg` on `world_size` ranks would do to its run folder (default
    cfg.output_dir). Raises ConfigError (one line) for a start that would replace a run.
    ranks: planned by the ranks themselves, whose own start is already writing run.log/logs.
    A restart of the same run (`restart`) plans as training.resume=auto, whatever the first start
    said: run.start_over and a training.resume path were for that start, and a restart obeying
    them would throw away (or train again) every step since; it says so."""
    restarted = restart()
    resume, start_over = ("auto", False) if restarted else (cfg.training.resume, cfg.run.start_over)
    decided = _decide(cfg, world_size, folder, ranks, resume, start_over)
    if restarted:
        decided.notes.insert(0, f"a restart of this run ({restarted}): training.resume=auto")
    return decided


def _decide(cfg: Config, world_size: int, folder: Path | None, ranks: bool, resume: str,
          start_over: bool) -> Decision:
    out = Path(folder or cfg.output_dir)
    if (why := _unwritable(out)) is not None:
        raise ConfigError(f"run.output_dir: {str(out)!r} cannot be written ({why}); allowed: a "
                          "folder this user can create and write (run.output_dir=<path>)")
    keep = PLUMBING | set(LIVE if ranks else ())
    steps = cfg.training.steps
    if start_over and resume:
        raise ConfigError(f"run.start_over: true is not allowed with training.resume={resume!r}; "
                          "start over or resume, not both")
    result = RunFolder(out).read_result()
    complete, _ = manifest.scan(out)
    trained = [n for n in (RunFolder.ADAPTER, RunFolder.RESULT) if (out / n).exists()]
    trained += [RunFolder.CHECKPOINTS] if complete else []
    present = sorted(p.name for p in out.iterdir()  # a claim, and its files, are no record
                     if p.name != EARLIER and not p.name.startswith(CLAIM)) if out.is_dir() else []
    changed = [RunFolder.CONFIG] if _config_changed(out, cfg) else []
    # An earlier start's own record (its log, its config) when this start would replace it.
    record = [n for n in LIVE if n in present and not ranks] + changed

    if not resume:
        if trained and not start_over:
            raise ConfigError(
                f"run.output_dir: {str(out)!r} holds an earlier run ({', '.join(trained)}); "
                "allowed: training.resume=auto to continue it (a finished run is left as it "
                "is), run.start_over=true to start over (the earlier run moves into "
                f"{EARLIER}/), or another run.name")
        moved = [n for n in present if n not in keep and (n != RunFolder.CONFIG or changed)]
        what = "starting over" if trained else "starting at step 0"
        return Decision(0, displaced=moved, message=f"{out}: {what}")

    if resume == "auto":
        config = cfg.to_dict()
        ckpt, step, notes = manifest.newest_valid(out, config, world_size)
        if result and result.get("status") == "completed" and result.get("steps", 0) >= steps:
            done = result["steps"]
            more = (f"training.steps above {done} continues it from its checkpoint at step "
                    f"{step}" if ckpt is not None else "it has no valid checkpoint, so it cannot "
                    "be continued; runs keep them with checkpointing.save_every > 0")
            return Decision(None, notes=notes, message=f"{out}: finished at step {done} of "
                        f"{steps}; nothing to do; {more}")
        if ckpt is None:
            if trained:
                why = f" ({'; '.join(notes)})" if notes else ""
                raise ConfigError(
                    f"training.resume: 'auto' cannot continue {str(out)!r}: it holds "
                    f"{', '.join(trained)} but no complete valid checkpoint{why}; an exact "
                    "resume needs one (checkpointing.save_every > 0); allowed: another "
                    f"run.name, or run.start_over=true (the earlier run moves into {EARLIER}/)")
            moved = [n for n in present if n not in keep and (n != RunFolder.CONFIG or changed)]
            return Decision(0, notes=notes, displaced=moved,
                        message=f"{out}: no checkpoint yet, starting at step 0")
    else:
        ckpt = Path(resume)
        problem = manifest.problem(ckpt, cfg.to_dict(), world_size)
        if problem:
            raise ConfigError(f"training.resume: {resume!r} cannot be resumed: {problem}")
        step, notes = int((manifest.read(ckpt) or {}).get("step", 0)), []
    if step >= steps:
        return Decision(None, checkpoint=ckpt, notes=notes, message=(
            f"{out}: its checkpoint is at step {step}, training.steps={steps}; nothing to do "
            f"(training.steps above {step} continues it)"))
    if result and result.get("status") == "completed" and cfg.training.scheduler != "constant":
        done = result.get("steps")
        notes.append(f"continuing a run that completed at step {done} to {steps} steps: its "
                     f"steps up to {done} followed a {done}-step {cfg.training.scheduler} LR "
                     f"schedule, the steps from {step + 1} on follow a {steps}-step one (the LR "
                     f"jumps there): not the same as a {steps}-step run from the start")
    t = cfg.training
    rows = t.batch_size * t.grad_accum if isinstance(t.batch_size, int) else None  # None: planned
    if (other := manifest.world_note(ckpt, world_size, rows)) is not None:
        notes.append(other)
    trim = _metrics_past(out, step)
    moved = [n for n in END if (out / n).exists()] + ([RunFolder.METRICS] if trim else [])
    # Checkpoints past the one resumed (damaged ones auto skipped, or a timeline an explicit
    # path leaves): kept aside, so no later resume picks them and no save meets them.
    moved += [str(f.relative_to(out)) for s_, f in manifest.step_folders(out) if s_ > step]
    moved += record
    return Decision(step, ckpt, notes, moved, trim, f"{out}: resuming from {ckpt} at step {step}")


# --------------------------------------------------------------------------- claiming the folder


class FolderRefused(ConfigError, RuntimeError):
    """A start its run folder refuses: another start holds the claim, or the folder cannot be
    written (a RuntimeError too: what `kit train` refuses as a running run)."""


def claim(folder: Path, name: str) -> Path:
    """Claim `folder` for this start: an exclusive create of folder/.claim (hard-linked from a
    file already written, so nobody reads it half written), holding this process's pid, host and
    thread. Two starts of one run at once: one claims, the other gets FolderRefused (one line). A
    claim is stale, and taken over, when its process is gone, when its start has handed over
    to run.sh (a pid file newer than the claim: from then on the running run refuses), or when
    it is this thread's own (a second prepare). Returns the claim file; `release` removes it."""
    path, mine = folder / CLAIM, _owner()
    ours = folder / f"{CLAIM}.{mine['nonce']}"
    ours.write_text(json.dumps(mine))
    try:
        for _ in range(200):
            try:
                os.link(ours, path)
                return path
            except FileExistsError:
                held = _read(path)
                if held is None:  # gone meanwhile, or not a claim: broken once it is old
                    if _age(path) > 10:
                        _break(path, {})
                elif not _stale(held, folder, path, mine):
                    raise FolderRefused(
                        f"run {name!r} is being started by pid {held.get('pid')} on host "
                        f"{held.get('host')} (since {held.get('at')}); one start at a time: "
                        "wait for it, then attach or resume") from None
                else:
                    _break(path, held)
                time.sleep(0.005)
        raise FolderRefused(f"run {name!r}: its folder {str(folder)!r} is being claimed by "
                         "several starts at once; start again")
    finally:
        ours.unlink(missing_ok=True)


def release(path: Path | None) -> None:
    """Remove a claim this thread holds (a claim of another start is left as it is)."""
    if path is not None and (_read(path) or {}).get("owner") == _owner()["owner"]:
        path.unlink(missing_ok=True)


def _owner() -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "owner": f"{pid}/{threading.get_ident()}",
            "started": _create_time(pid), "nonce": uuid.uuid4().hex,
            "at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}


def _create_time(pid: int) -> float | None:
    """The process's start time (a pid reused by another process has another), None if gone."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _stale(held: dict, folder: Path, path: Path, mine: dict) -> bool:
    if held.get("host") == mine["host"] and held.get("owner") == mine["owner"]:
        return True  # this thread's own earlier claim
    try:
        started = RunFolder(folder).pid.stat().st_mtime_ns >= path.stat().st_mtime_ns
    except OSError:
        started = False
    if started:
        return True
    if held.get("host") != mine["host"]:
        return False  # another machine's process: it cannot be looked at from here
    alive = _create_time(int(held.get("pid", 0)))
    return alive is None or (held.get("started") is not None and alive != held["started"])


def _break(path: Path, held: dict) -> None:
    """Remove the stale claim `held`, under a second exclusive file, so that two starts that
    both found it stale cannot remove a fresh claim one of them has just made."""
    breaker = path.with_name(CLAIM + ".break")
    try:
        fd = os.open(breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:  # a breaker left by a process that died inside these few lines
            if time.time() - breaker.stat().st_mtime > 10:
                breaker.unlink(missing_ok=True)
        except OSError:
            pass
        return
    try:
        if (_read(path) or {}).get("nonce") == held.get("nonce"):
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)
        breaker.unlink(missing_ok=True)
