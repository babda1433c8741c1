"""Preemption: a cluster's request to stop becomes a checkpoint, not lost steps.

Kubernetes stops a pod with SIGTERM and kills it a grace period later (30 s unless the pod says
otherwise); Slurm sends SIGTERM when it preempts a job, and SIGUSR1 ahead of a time limit when the
job asks for it (`#SBATCH --signal=USR1@120`). torchrun's agent, on SIGTERM, forwards it to every
rank and kills them 30 s later. The recipe (kit.train) installs `Preemption` on every rank:

- the first SIGTERM or SIGUSR1 only sets a flag; the step under way finishes;
- after each step the ranks agree (one all-reduce of the flag: a signal may reach one rank only,
  e.g. SIGUSR1 sent to a single process), save a verified checkpoint of that step, write
  result.json with status "preempted", and exit with EXIT_PREEMPTED (75, EX_TEMPFAIL: "try
  again"). A restart resumes from that checkpoint (`training.resume=auto`, kit.folder.runfolder);
- a second signal, more than SAME_REQUEST_S after the first, exits at once. Nothing is left
  half-written: a checkpoint becomes step-N only when complete (kit.recipe.checkpoint), a killed save
  leaves step-N.tmp, which resume names and skips. Within SAME_REQUEST_S it is the same request:
  a signal sent to a process group reaches each rank directly and again through torchrun.

Python runs a signal handler between bytecodes of the main thread, so a rank waiting inside a
collective sees the flag when the collective returns; torchrun's own SIGKILL, 30 s after its
SIGTERM, is what ends a rank that cannot get there.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): stopped on request, resumable
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SAME_REQUEST_S = 2.0


class Preemption:
    """The flag a stop request sets on this rank, and the agreement of every rank about it."""

    def __init__(self):
        self.signal: str | None = None  # the first request's name
        self.at: float | None = None  # time.monotonic() of the first request

    def install(self) -> Preemption:
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.at is None:
            self.signal, self.at = signal.Signals(signum).name, now
        elif now - self.at > SAME_REQUEST_S:  # asked twice: leave now (128 + n, as a kill would)
            os._exit(128 + signum)

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank was asked to stop (a collective: every rank calls it
        after every step)."""
        flag = torch.tensor([0 if self.at is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def seconds(self) -> float | None:
        """Seconds since the first request on this rank (None: none here)."""
        return None if self.at is None else round(time.monotonic() - self.at, 3)

    def stop_here(self, recipe, step: int, saved: bool) -> bool:
        """After `step` (every rank): when any rank was asked to stop, checkpoint the step (unless
        `saved` just did), say so, and return True; the recipe then writes result.json with
        status "preempted" and exits with EXIT_PREEMPTED."""
        if not self.agreed(recipe.env.device):
            return False
        folder = "the one above" if saved else recipe._checkpoint(step)
        recipe.say(f"preempted ({self.signal or 'on another rank'}): checkpoint {folder} at step "
                   f"{step}, {self.seconds()} s after the request; a restart resumes from it "
                   "(training.resume=auto)")
        return True
