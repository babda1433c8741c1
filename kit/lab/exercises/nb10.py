"""Exercises of notebook 10 (scale out): what the generated files set, who reads a checkpoint."""

from __future__ import annotations

from kit.lab.exercises import Exercise, one_of


def _num_processes() -> int:
    from kit.run import jobs, launch

    cfg = launch.resolve("tiny-cpu", ["training.device=cpu"])
    return jobs.accelerate_config(cfg, nnodes=4, nproc=8)["num_processes"]


def _readers() -> int:
    from kit.lab import second_article

    rows = second_article.who_loads(nnodes=2, nproc=2)
    return sum(r["accelerate's flag"] == "reads" for r in rows)


EXERCISES = [
    Exercise(
        key="10.1",
        question=(
            "jobs.write(config, overrides, nnodes=4, nproc_per_node=8): what does the generated "
            "accelerate.yaml set num_processes to? (jobs.accelerate_config computes the same "
            "tree; the answer: a number)"),
        check=lambda answer: one_of(_num_processes(), {
            8: "8 is one machine's processes; accelerate's num_processes counts them over all "
               "machines (section 1's table says so).",
            4: "4 is num_machines; num_processes counts processes, one per GPU.",
        }, default="one process per GPU, counted over every node.")(answer),
        solution=_num_processes,
        wrong=(8, 4),
    ),
    Exercise(
        key="10.2",
        question=(
            "On 2 machines x 2 GPUs, with accelerate's fsdp_cpu_ram_efficient_loading=true, how "
            "many of the 4 processes read the checkpoint from disk? (second_article.who_loads "
            "tells; the answer: a number)"),
        check=lambda answer: one_of(_readers(), {
            1: "that is what the flag is meant to do, and what the kit's model.loading=rank0 "
               "does; transformers decides by LOCAL_RANK, not by the global rank.",
            4: "the flag does make some processes skip reading: which ones does LOCAL_RANK == 0 "
               "pick?",
        }, default="count the processes whose LOCAL_RANK is 0.")(answer),
        solution=_readers,
        wrong=(1, 4),
    ),
]
