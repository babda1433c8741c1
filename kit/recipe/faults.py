"""Failure injection for tests and demos: make one rank crash at a chosen step.

Rank side (the recipe calls it once per optimizer step); off unless the environment asks:

    KIT_FAIL_RANK=1 KIT_FAIL_STEP=3 torchrun --nproc_per_node=2 -m kit.train kit/configs/tiny-cpu.yaml

makes rank 1 raise ``InjectedFailure`` right after step 3, while rank 0 goes on into the next
collective: exactly the situation a real crash (OOM, a bad batch) creates on one GPU. It lets the
tests and notebook 07 check that the launcher names the failed rank and shows its traceback
instead of hanging. KIT_FAIL_STEP defaults to 1. KIT_FAIL_SIGNAL=SIGKILL makes that rank die of
the signal instead (no exception, no error file: what the kernel's OOM killer does to a process).
They act on a run's first attempt only: a rank restarted (run.sh's KIT_RESTART_COUNT or
torchrun's TORCHELASTIC_RESTART_COUNT > 0) resumes and goes on, as after a real one-off crash.
"""

from __future__ import annotations

import os
import signal


class InjectedFailure(RuntimeError):
    """Raised on purpose by maybe_fail; never caught by the kit."""


def maybe_fail(step: int, rank: int) -> None:
    """Raise InjectedFailure if KIT_FAIL_RANK names this rank and KIT_FAIL_STEP this step."""
    fail_rank = os.environ.get("KIT_FAIL_RANK", "")
    if fail_rank == "" or int(fail_rank) != rank or _restarted():
        return
    if step == int(os.environ.get("KIT_FAIL_STEP", "1")):
        if os.environ.get("KIT_FAIL_SIGNAL"):
            os.kill(os.getpid(), getattr(signal, os.environ["KIT_FAIL_SIGNAL"]))
        raise InjectedFailure(
            f"injected failure on rank {rank} at step {step} (KIT_FAIL_RANK/KIT_FAIL_STEP are set)"
        )


def maybe_fail_in_save(step: int, rank: int) -> None:
    """KIT_FAIL_SAVE_STEP=N: every rank dies in the middle of writing checkpoint N (shards written,
    not yet marked complete), as a killed job would; resume must skip that checkpoint."""
    if os.environ.get("KIT_FAIL_SAVE_STEP", "") == str(step) and not _restarted():
        os._exit(17)  # no cleanup, no exception handling: a hard kill


def maybe_fill_disk(step: int) -> None:
    """KIT_FAIL_DISK_STEP=N: from checkpoint N on, no file this rank writes may grow past 64 KiB
    (RLIMIT_FSIZE, SIGXFSZ ignored: the write fails with EFBIG), as on a disk that filled up."""
    if os.environ.get("KIT_FAIL_DISK_STEP", "") == str(step) and not _restarted():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))


def maybe_slow_save() -> None:
    """KIT_SLOW_SAVE_S=N: every save takes N seconds more, between writing its files and marking
    it complete (a large model's save, on a test's scale): a second stop request lands inside."""
    seconds = float(os.environ.get("KIT_SLOW_SAVE_S", "0") or 0)
    if seconds > 0:
        import time

        time.sleep(seconds)


def maybe_fail_gather(rank: int) -> None:
    """KIT_FAIL_GATHER=1: the adapter's gather fails on every rank, as FSDP1 HYBRID_SHARD's does
    ('FSDP assumes ... is in the state_dict'); the recipe must stop after its first step."""
    if os.environ.get("KIT_FAIL_GATHER") == "1":
        raise RuntimeError(f"injected: the adapter cannot be gathered on rank {rank} "
                           "(KIT_FAIL_GATHER is set)")


def maybe_hang_after_done() -> None:
    """KIT_HANG_AFTER_DONE=N: a benchmark case's processes sleep N seconds after its last row (its
    "done"), as a teardown that hangs does; the bench's timeout then stops a case that measured
    everything, and the case must keep its rows (kit.bench.runner)."""
    seconds = float(os.environ.get("KIT_HANG_AFTER_DONE", "0") or 0)
    if seconds > 0:
        import time

        time.sleep(seconds)


def _restarted() -> bool:
    return any(os.environ.get(name, "0") not in ("", "0")
               for name in ("KIT_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"))
