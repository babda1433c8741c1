"""Exercises of notebook 10 (scale out). Hands-on (10.1): the values `accelerate launch` needs on
one node of a Slurm job, written from the variables Slurm sets there, checked against the kit's
generated accelerate config (kit.run.jobs.accelerate_config) and its job.sbatch's rules for
three layouts. Then who reads a checkpoint under accelerate's loading flag (10.2)."""

from __future__ import annotations

from functools import cache

from kit.lab.exercises import Exercise, one_of

# (nodes, GPUs per node, this node's SLURM_NODEID) the learner's function is called for
LAYOUTS = ((1, 2, 0), (2, 4, 1), (4, 8, 3), (4, 8, 0))


def slurm_env(nodes: int, gpus: int, node: int) -> dict[str, str]:
    """What Slurm sets in the one task job.sbatch starts on a node (srun --ntasks-per-node=1),
    as strings, and the allocation's hosts in order (`scontrol show hostnames`)."""
    return {"SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_GPUS_ON_NODE": str(gpus),
            "SLURMD_NODENAME": f"gpu-{node:02d}"}


def hosts(nodes: int) -> list[str]:
    return [f"gpu-{n:02d}" for n in range(nodes)]


def accelerate_args(env, hosts):
    """accelerate launch's values on this node: machines and processes of the whole job, this
    machine's rank, and where machine 0 listens."""
    return {"num_machines": int(env["SLURM_JOB_NUM_NODES"]),
            "num_processes": int(env["SLURM_JOB_NUM_NODES"]) * int(env["SLURM_GPUS_ON_NODE"]),
            "machine_rank": int(env["SLURM_NODEID"]), "main_process_ip": hosts[0]}


def _per_node(env, hosts):
    return {**accelerate_args(env, hosts), "num_processes": int(env["SLURM_GPUS_ON_NODE"])}


def _local_id(env, hosts):
    return {**accelerate_args(env, hosts), "machine_rank": int(env["SLURM_LOCALID"])}


def _own_host(env, hosts):
    return {**accelerate_args(env, hosts), "main_process_ip": env["SLURMD_NODENAME"]}


@cache
def _kit_tree(nodes: int, gpus: int) -> dict:
    """The accelerate config kit.run.jobs writes for the layout (the notebook's config)."""
    from kit.run import jobs, launch

    cfg = launch.resolve("tiny-cpu", ["training.device=cpu"])
    return jobs.accelerate_config(cfg, nnodes=nodes, nproc=gpus)


HINTS = {
    "num_machines": "every node of the job is one machine: SLURM_JOB_NUM_NODES",
    "num_processes": "accelerate's num_processes counts the processes of every machine together "
                     "(section 1's accelerate.yaml), one per GPU",
    "machine_rank": "each node needs its own machine rank, the node's index: SLURM_NODEID "
                    "(SLURM_LOCALID numbers the tasks inside a node: 0 on every node here)",
    "main_process_ip": "every node must name the same address, machine 0's: the allocation's "
                       "first host (job.sbatch's MASTER_ADDR); its own name makes each node "
                       "wait for itself",
}


def _check_args(fn) -> str | None:
    if not callable(fn):
        return "give the function itself: exercises.check(\"10.1\", accelerate_args) (no parentheses)"
    for nodes, gpus, node in LAYOUTS:
        env, names = slurm_env(nodes, gpus, node), hosts(nodes)
        where = f"on node {node} of {nodes} x {gpus} GPUs"
        try:
            got = fn(dict(env), list(names))
        except Exception as e:  # the learner's code: its error is the hint
            return f"{where}: it raised {type(e).__name__}: {e}"
        tree = _kit_tree(nodes, gpus)
        want = {"num_machines": tree["num_machines"], "num_processes": tree["num_processes"],
                "machine_rank": node, "main_process_ip": names[0]}
        if not isinstance(got, dict) or set(got) != set(want):
            return f"return a dict with the keys {sorted(want)}; it returned {got!r}"
        for key, value in want.items():
            if got[key] == value:
                continue
            if str(got[key]) == str(value):
                return f"{where}: {key} is {got[key]!r}, a string: Slurm's variables are strings"
            return f"{where}: {key} is {got[key]!r}, it should be {value!r}. {HINTS[key]}"
    return None


def _readers() -> int:
    from kit.lab import second_article

    rows = second_article.who_loads(nnodes=2, nproc=2)
    return sum(r["accelerate's flag"] == "reads" for r in rows)


EXERCISES = [
    Exercise(
        key="10.1",
        question=("Hands-on: write accelerate_args(env, hosts), the values `accelerate launch` "
                  "needs on one node of a Slurm job (num_machines, num_processes, machine_rank, "
                  "main_process_ip), from the variables Slurm sets there (env, strings: "
                  "SLURM_JOB_NUM_NODES, SLURM_NODEID, SLURM_LOCALID, SLURM_GPUS_ON_NODE, "
                  "SLURMD_NODENAME) and the allocation's hosts in order. The check compares them "
                  "with the kit's generated accelerate.yaml and job.sbatch on three layouts."),
        check=_check_args,
        solution=lambda: accelerate_args,
        wrong=(_per_node, _local_id, _own_host),
        hands_on=True,
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
