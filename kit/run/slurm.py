"""Slurm from the kit: submit a run folder's job.sbatch, read the queue, and a one-node cluster on
this machine to try them on (what the tests and notebook 10 use).

    python -m kit.run.slurm start     # as root, with Debian's slurm-wlm and munge installed
    python -m kit.run.slurm stop

    job = submit("launch/tiny-cpu")   # sbatch launch/tiny-cpu/job.sbatch -> its job id
    print(queue())                    # squeue's table
    wait(job)                         # its final state, e.g. "COMPLETED"

The local cluster is Slurm 22.05 as Debian ships it, on localhost: munged as user munge (its key
in /etc/munge), slurmctld and slurmd as root with a slurm.conf written for this machine (one node,
its CPUs, no GPUs, no accounting database), state, spool and logs under STATE. Its slurm.conf is
linked at /etc/slurm/slurm.conf, where sbatch, squeue and scontrol look, only where none is:
a machine that has a Slurm configuration of its own is left as it is (start refuses).
Kernel side: no torch.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATE = Path(os.environ.get("KIT_SLURM_DIR") or Path(tempfile.gettempdir()) / "kit-slurm")
SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
MUNGE_KEY, MUNGE_RUN = Path("/etc/munge/munge.key"), Path("/run/munge")
PARTITION = "kit"
# What each finished job stays visible for in `scontrol show job` (there is no accounting
# database, so no sacct): long enough for a test or a notebook to read its final state.
MIN_JOB_AGE_S = 900
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
        "DEADLINE", "PREEMPTED")

CONF = """\
# A one-node Slurm cluster on this machine, written by kit.run.slurm ({host}, {cpus} CPUs).
ClusterName=kit
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/d
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
# No cgroups here (a container may not have them writable): processes tracked by parentage.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
# A node that was down comes back by itself; a requeued job (the kit's exit 75) may run again.
ReturnToService=2
JobRequeue=1
MinJobAge={min_age}
# The preempted job's ranks have 30 s after a SIGTERM to save (kit.recipe.preempt)
KillWait=30
SchedulerParameters=sched_interval=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName={partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmError(RuntimeError):
    """One line: what Slurm said, or why no cluster can be used here."""


def _run(*cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"{cmd[0]}: {e}") from None
    if check and proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise SlurmError(f"{' '.join(cmd[:2])}: {said[-1] if said else f'exit {proc.returncode}'}")
    return proc


def missing() -> str | None:
    """None where a Slurm controller answers here; else one line saying why none does."""
    if not shutil.which("sbatch"):
        return "no Slurm here (no sbatch): apt-get install slurm-wlm munge, then python -m kit.run.slurm start as root"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                              timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        proc = None
    if proc is None or proc.returncode != 0:
        return "no Slurm cluster answers here (sinfo): python -m kit.run.slurm start (as root) starts one"
    return None


def submit(folder: str | Path, *args: str) -> str:
    """sbatch the run folder's job.sbatch (args: sbatch options before it, e.g. "--time=10");
    return the job id."""
    script = Path(folder) / "job.sbatch"
    options = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    out = _run("sbatch", "--parsable", *options, str(script), *overrides).stdout.strip()
    return out.split(";")[0]


def queue() -> str:
    """squeue's table: every job waiting or running."""
    return _run("squeue", "-o", "%.8i %.9P %.20j %.8u %.9T %.10M %.6D %R").stdout.rstrip()


def job(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, RunTime, Restarts, ExitCode...); {} once Slurm
    has forgotten it (MIN_JOB_AGE_S after it ended)."""
    proc = _run("scontrol", "-o", "show", "job", str(job_id), check=False)
    if proc.returncode != 0:
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))


def wait(job_id: str, timeout: float = 600, poll: float = 1.0) -> dict[str, str]:
    """Wait until the job has ended (a requeued one runs again first); return its last record."""
    deadline = time.monotonic() + timeout
    while True:
        info = job(job_id)
        if info.get("JobState") in DONE:
            return info
        if time.monotonic() > deadline:
            raise SlurmError(f"job {job_id}: still {info.get('JobState', 'unknown')} after "
                             f"{timeout:.0f} s")
        time.sleep(poll)


# --------------------------------------------------------------------------- the local cluster


def host() -> str:
    return socket.gethostname().split(".")[0]


def cpus() -> int:
    return len(os.sched_getaffinity(0))


def _pid(path: Path) -> int | None:
    try:
        return _alive(int(path.read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> int | None:
    try:
        os.kill(pid, 0)
        # A daemon that ended stays a zombie where nothing reaps it (a container's first
        # process may not): it is gone all the same.
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return None if state == "Z" else pid
    except (OSError, ValueError, IndexError):
        return None


def running() -> bool:
    """The local cluster's daemons are up (their pid files under STATE name live processes)."""
    return all(_pid(STATE / f"{d}.pid") for d in ("slurmctld", "slurmd"))


def cannot_start() -> str | None:
    """None where start() can start the local cluster; else one line saying why not."""
    for binary in ("sbatch", "slurmctld", "slurmd", "munged"):
        if not shutil.which(binary) and not Path(f"/usr/sbin/{binary}").exists():
            return f"no {binary}: apt-get install slurm-wlm munge (Debian/Ubuntu), as root"
    if os.geteuid() != 0:
        return "the local Slurm cluster starts as root (munged, slurmd); this user is not"
    if (SYSTEM_CONF.exists() or SYSTEM_CONF.is_symlink()) and not _ours(SYSTEM_CONF):
        return f"{SYSTEM_CONF} exists: this machine has a Slurm configuration of its own"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no user munge (the munge package creates it)"
    return None


def _ours(path: Path) -> bool:
    return path.is_symlink() and os.readlink(path) == str(STATE / "slurm.conf")


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _munge() -> None:
    """munged as user munge, with a key only munge reads (mode 400); a running one is kept."""
    if _pid(MUNGE_RUN / "munged.pid"):
        return
    munge = pwd.getpwnam("munge")
    MUNGE_KEY.parent.mkdir(mode=0o700, exist_ok=True)
    if not MUNGE_KEY.is_file():
        MUNGE_KEY.write_bytes(os.urandom(128))
    for path in (MUNGE_KEY.parent, MUNGE_KEY):
        os.chown(path, munge.pw_uid, munge.pw_gid)
    MUNGE_KEY.chmod(0o400)
    MUNGE_RUN.mkdir(mode=0o755, exist_ok=True)
    os.chown(MUNGE_RUN, munge.pw_uid, munge.pw_gid)
    _run("runuser", "-u", "munge", "--", _sbin("munged"))  # it daemonizes once its socket is up
    (STATE / "munged.ours").touch()  # stop() ends it; one that was running is left alone


def start(timeout: float = 60) -> bool:
    """Start the local one-node cluster, or keep the one running; True when started here.
    Returns once sinfo shows the node idle. SlurmError (one line) where it cannot."""
    why = cannot_start()
    if why:
        raise SlurmError(why)
    if running() and missing() is None:
        return False
    stop()  # what a crashed start left behind
    for sub in ("ctld", "d"):
        (STATE / sub).mkdir(parents=True, exist_ok=True)
    conf = STATE / "slurm.conf"
    conf.write_text(CONF.format(host=host(), cpus=cpus(), state=STATE, partition=PARTITION,
                                min_age=MIN_JOB_AGE_S))
    SYSTEM_CONF.parent.mkdir(parents=True, exist_ok=True)
    SYSTEM_CONF.unlink(missing_ok=True)  # ours, from an earlier start (cannot_start checked)
    SYSTEM_CONF.symlink_to(conf)
    _munge()
    _run(_sbin("slurmctld"), "-i")  # -i: start without the state an earlier cluster saved
    _run(_sbin("slurmd"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = _run("sinfo", "-h", "-N", "-o", "%t", check=False)
        if proc.returncode == 0 and proc.stdout.strip() == "idle":
            return True
        time.sleep(0.5)
    log = (STATE / "slurmd.log").read_text()[-500:] if (STATE / "slurmd.log").exists() else ""
    raise SlurmError(f"the node did not become idle in {timeout:.0f} s (sinfo); {log.strip()}")


def log_tail(lines: int = 15) -> str:
    """The local cluster's daemons' last log lines (what a failed job's output cannot say)."""
    out = []
    for daemon in ("slurmctld", "slurmd"):
        path = STATE / f"{daemon}.log"
        if path.exists():
            out += [f"{path}:", *path.read_text(errors="replace").splitlines()[-lines:]]
    return "\n".join(out)


def stop() -> None:
    """Cancel every job of the local cluster, end its daemons, remove its configuration link
    and its state; munged too where start() started it."""
    if running():
        _run("scancel", f"--partition={PARTITION}", check=False)
    for daemon in ("slurmd", "slurmctld"):
        pid = _pid(STATE / f"{daemon}.pid")
        if pid:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):  # the process itself: a daemon removes its pid file first
                if not _alive(pid):
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
    munged = _pid(MUNGE_RUN / "munged.pid")
    if munged and (STATE / "munged.ours").exists():
        os.kill(munged, signal.SIGTERM)
    if _ours(SYSTEM_CONF):
        SYSTEM_CONF.unlink()
    shutil.rmtree(STATE, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in (["start"], ["stop"]):
        print("usage: python -m kit.run.slurm start|stop", file=sys.stderr)
        return 2
    try:
        if argv == ["stop"]:
            stop()
            print("the local Slurm cluster is stopped")
        else:
            started = start()
            print(f"a one-node Slurm cluster {'is up' if started else 'was already up'} on "
                  f"{host()} ({cpus()} CPUs, partition {PARTITION}); state in {STATE}")
    except SlurmError as e:
        print(f"kit.run.slurm: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
