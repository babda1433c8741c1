"""`kit plan`: what the planner (kit.budget.plan) chooses for a config, without starting a run.

    kit plan tiny-cpu                                  # this machine (its GPUs, or a CPU)
    kit plan my.yaml model.name=kit:llama-8b --gpus 1 --gpu-mem 24 --gpu H100
    kit plan my.yaml --gpus 2 --gpu-mem 80             # a machine you do not have

Prints each value the plan chose, who chose it (you, the plan, the recipe's plain value) and
why, with the estimate's predicted peak per GPU and the step model's expected speed, the
sequence length it planned for and where that came from (data.max_seq_len=N plans for N; auto is
the longest row of data.path, the recipe's sample if you name no data), and the time a step and
the whole run (training.steps) take by that speed. A plan that cannot fit is one line on stderr
naming the smallest change that fits (exit 2); so is a model.name that cannot be loaded, said as
the check step says it (kit.inputs.sources.check_model: a hub id offline is one line at once, not
a minute of retries). The data's rows are tokenized here for data.max_seq_len=auto: this
command's own process imports torch.
"""

from __future__ import annotations

import argparse
import sys

from kit.config import AUTO, ConfigError, load_config
from kit.inputs import datafile, sources


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kit plan", description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="a kit YAML or a bundled config's name")
    parser.add_argument("overrides", nargs="*", help="key=value")
    parser.add_argument("--gpus", type=int, help="GPUs (one process each); default: this machine's")
    parser.add_argument("--gpu-mem", type=float, help="GiB per GPU: the card's (the plan leaves "
                        "kit.budget.estimate.OUTSIDE_GIB of it to the CUDA context)")
    parser.add_argument("--gpu", default="", help="the GPU's name, e.g. H100, H200, A100 (its "
                        "bf16 peak gives the expected speed; its compute capability, FP8: "
                        "kit.budget.machine.CAPABILITY)")
    parser.add_argument("--host-mem", type=float, help="GiB of host memory per GPU's process "
                        "for offloaded tensors (default: not checked, or this machine's)")
    parser.add_argument("--nproc", type=int, default=2, help="processes on a CPU (default 2)")
    args = parser.parse_intermixed_args(argv)
    path, overrides = args.config, list(args.overrides)
    if path and "=" in path:
        path, overrides = None, [path, *overrides]
    try:
        cfg = load_config(path, overrides)
        sources.check_model(cfg.model.name)  # the check step's one line, before any download
        hw = _hardware(args)
        from kit.recipe import planning  # torch: this command's own process

        planned = planning.resolve(cfg, None, hw.world_size, hw)
    except ConfigError as e:
        sys.stderr.write(f"ConfigError: {e}\n")
        return 2
    print(planned.table())
    print(sequence_line(cfg, planned.seq_len))
    print(time_line(planned))
    return 0


def sequence_line(cfg, seq_len: int) -> str:
    """The length the plan is for, and who chose it (a plan for 24-token rows is no plan for
    2,048-token ones)."""
    if cfg.data.max_seq_len != AUTO:
        return f"sequence: {seq_len:,} tokens a row (data.max_seq_len, set)"
    sample = " (the recipe's own sample)" if datafile.shipped(cfg.data.path) else ""
    return (f"sequence: {seq_len:,} tokens a row: the longest row of {cfg.data.path}{sample} "
            "(data.max_seq_len=auto); data.max_seq_len=N plans for rows of N tokens")


def run_time(planned) -> tuple[float, float] | None:
    """(seconds a step, seconds for training.steps) at the step model's speed: each GPU takes
    batch x grad_accum rows of seq_len tokens a step; None where the plan predicts no speed."""
    if not planned.tokens_per_s:
        return None
    t = planned.cfg.training
    step_s = t.batch_size * t.grad_accum * planned.seq_len / planned.tokens_per_s
    return step_s, step_s * t.steps


def time_line(planned) -> str:
    found = run_time(planned)
    if found is None:
        why = ("on a CPU" if planned.hardware.device == "cpu" else "here: no speed predicted "
               "(a mixture of experts, or a GPU the step model has no peak for: --gpu NAME)")
        return f"time: not predicted {why}; kit bench measures a step"
    t = planned.cfg.training
    step_s, total_s = found
    return (f"time: ~{step_s:.2f} s a step ({t.batch_size} x {t.grad_accum} rows of "
            f"{planned.seq_len:,} tokens per GPU at ~{planned.tokens_per_s:,.0f} tokens/s), "
            f"~{_duration(total_s)} for {t.steps:,} steps (training.steps), by the step model")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 2 * 3600 else f"{seconds / 3600:.1f} h"


def _hardware(args):
    from kit.budget import machine
    from kit.budget.fit import Hardware

    if args.gpus is None and args.gpu_mem is None:
        import torch

        if torch.cuda.is_available():
            from kit.recipe import planning

            return planning.hardware(torch.device("cuda", 0), torch.cuda.device_count())
        return Hardware("cpu", args.nproc)
    if not args.gpus or args.gpus < 1 or not args.gpu_mem or args.gpu_mem <= 0:
        raise ConfigError(f"--gpus {args.gpus} --gpu-mem {args.gpu_mem}: not allowed; expected "
                          "both, a whole number of GPUs >= 1 and GiB per GPU > 0")
    if args.host_mem is not None and args.host_mem <= 0:
        raise ConfigError(f"--host-mem {args.host_mem}: not allowed; expected GiB > 0")
    return Hardware("cuda", args.gpus, args.gpu_mem, args.gpu, machine.fp8({"name": args.gpu}),
                    host_gib=args.host_mem, grouped_gemm=machine.grouped_gemm({"name": args.gpu}),
                    triton=machine.triton_kernels({"name": args.gpu}, {"triton": True}))


if __name__ == "__main__":
    sys.exit(main())
