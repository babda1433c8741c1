"""Every way to launch one config on N nodes x M GPUs, written into one folder; nothing is started.

    python -m kit jobs kit/configs/llama-1b-gpu.yaml --nnodes 2 --nproc-per-node 8 --out launch/big
    write("llama-1b-gpu", ["training.steps=200"], nnodes=2, nproc_per_node=8, out="launch/big")

The folder is the run folder (the run's outputs land there too) and holds:

- config.yaml, run.sh: kit.run.launch.prepare's, M processes per node. Across nodes run.sh meets at
  node 0 through torchrun's c10d rendezvous (MASTER_ADDR:MASTER_PORT, which node 0 hosts); it
  reads the kit's variables (NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT) and,
  for those unset, the Kubeflow operators' PET_* ones. Its comments say the NCCL variables and
  the collective timeout that matter across nodes;
- accelerate.yaml: the same sharding (FSDP2, FSDP1 or DDP) for `accelerate launch -m kit.sft.trainer`
  (TRL's SFTTrainer on the kit's model and data) or a script of your own;
- job.sbatch: Slurm, one task per node running run.sh, node 0 the allocation's first host;
- trainjob.yaml: a Kubeflow Trainer v2 TrainJob on the torch-distributed runtime;
- pytorchjob.yaml: a Kubeflow training-operator v1 PyTorchJob (Master + N-1 Workers).

Both Kubernetes manifests are checked against their CRDs (kit.run.schemas) before anything is
written: an invalid one is never written. No secret is written anywhere: a pod's HF_TOKEN comes
from the Kubernetes Secret `hf-token` by name, when it exists.

The folder's run.sh started as two nodes would start it, on one machine: kit.run.nodes.start_nodes
(notebook 10). Kernel side: no torch.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from kit import ROOT, pitfalls
from kit.config import Config, ConfigError
from kit.folder import runfolder
from kit.folder.layout import RunFolder
from kit.run import launch, quoting, schemas

IMAGE = "registry.example.com/kit:latest"  # a placeholder: an image with the kit's dependencies
PVC = "kit-workspace"  # the volume holding this checkout, the data and the run folder
TIME = "01:00:00"  # Slurm's time limit
PORT = 29500  # node 0's rendezvous port, where nothing else sets MASTER_PORT
WORKSPACE = "/workspace"  # where a pod mounts the volume; the checkout is WORKSPACE/kit
SECRET, SECRET_KEY = "hf-token", "token"  # HF_TOKEN's Secret, by name (optional: may not exist)
SHM = "16Gi"  # /dev/shm in a pod: NCCL's intra-node buffers and data loader workers
# Restarts on a cluster: run.sh starts a node's torchrun again this many times after a rank fails
# (each restart resumes from the last valid checkpoint), and the PyTorchJob its pods as many times.
RESTARTS = 3
# What a pod runs: the run's run.sh, resuming (a new run's folder has nothing to resume and
# starts at step 0; a finished one is left as it is), so a restarted pod continues the run.
RESUME = "training.resume=auto"
GRACE_S = 30  # Kubernetes' SIGTERM-to-SIGKILL period, as the ranks' preemption save expects
# The torch-distributed runtime's trainer job and container (kit/schemas' runtime example).
TRAINER_JOB, TRAINER_CONTAINER = "trainer-node", "trainer"
FILES = RunFolder.LAUNCHERS  # and run.sh; a start never moves them (kit.folder.runfolder)
# What each file is for, as the command line prints it.
USES = {
    RunFolder.RUN_SH: f"bash {{folder}}/{RunFolder.RUN_SH}, on each node (NNODES, NODE_RANK, "
                      "MASTER_ADDR, MASTER_PORT)",
    "accelerate.yaml": "accelerate launch --config_file {folder}/accelerate.yaml -m kit.sft.trainer "
                       f"{{folder}}/{RunFolder.CONFIG}",
    "job.sbatch": "sbatch {folder}/job.sbatch   (Slurm)",
    "trainjob.yaml": "kubectl apply -f {folder}/trainjob.yaml   (Kubeflow Trainer v2)",
    "pytorchjob.yaml": "kubectl apply -f {folder}/pytorchjob.yaml   (training-operator v1)",
}
MIXED = {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}
STATE_DICT = {"sharded": "SHARDED_STATE_DICT", "full": "FULL_STATE_DICT"}


def write(config: Config | str | Path, overrides: list[str] | None = None, nnodes: int = 1,
          nproc_per_node: int = 8, out: str | Path | None = None, image: str = IMAGE,
          pvc: str = PVC, time: str = TIME, name: str | None = None) -> Path:
    """Write the folder (default: the config's run folder, launch/<run.name>); return it.
    A bad option or config value raises ConfigError (one line) before anything is written."""
    nnodes, nproc = _count("--nnodes", nnodes), _count("--nproc-per-node", nproc_per_node)
    _option("--image", image, r"\S+", "an image reference, without spaces")
    _option("--pvc", pvc, r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?",
            "a PersistentVolumeClaim name: lowercase letters, digits, '-' and '.'")
    _option("--time", time, r"(\d+-)?\d+(:\d\d){0,2}",
            "a Slurm time limit: minutes, HH:MM:SS or D-HH:MM:SS")
    cfg = launch.resolve(config, overrides, name)
    if out is not None:
        cfg.run.output_dir = str(Path(out).expanduser().resolve())
    folder = launch.run_dir(cfg)
    cfg.run.output_dir = str(folder)
    device = "cpu" if cfg.training.device == "cpu" else "cuda"
    machine = {"ranks": nnodes * nproc, "device": device, "nnodes": nnodes,
               "nproc_per_node": nproc, "packages": {"flash_attn": True}}  # unknown there
    found = pitfalls.machine_violations(cfg, machine)  # e.g. FSDP1 on one process
    if found:
        raise ConfigError("\n".join(str(v) for _, v in found))
    start = runfolder.decide(cfg, nnodes * nproc)  # refuses a start that would replace a run
    start.displaced = [n for n in start.displaced  # ours are written anew; an empty logs/ is no
                       if n not in FILES and not _empty_dir(folder / n)]  # record of a run
    pod_dir = _pod_dir(folder)
    texts = {"accelerate.yaml": accelerate_yaml(cfg, nnodes, nproc),
             "job.sbatch": sbatch(cfg, folder, nnodes, nproc, time),
             "trainjob.yaml": _manifest(trainjob(cfg, pod_dir, nnodes, nproc, image, pvc),
                                        cfg, pod_dir, pvc),
             "pytorchjob.yaml": _manifest(pytorchjob(cfg, pod_dir, nnodes, nproc, image, pvc),
                                          cfg, pod_dir, pvc)}
    launch.prepare(cfg, nproc=nproc, decision=start, nnodes=nnodes)  # run.sh: c10d across nodes
    try:  # under prepare's claim; nothing is started here, so it is given up after
        for file, text in texts.items():
            (folder / file).write_text(text)
        RunFolder(folder).logs.mkdir(exist_ok=True)  # Slurm opens its output there first
        (folder / "job.sbatch").chmod(0o755)
    except OSError as e:
        raise runfolder.FolderRefused(f"run.output_dir: {str(folder)!r} cannot be written "
                                      f"({e.strerror or e})") from None
    finally:
        runfolder.release(folder / runfolder.CLAIM)
    return folder


def _count(option: str, value) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{option}: {value!r} is not allowed; expected an integer >= 1")
    return int(text)


def _option(option: str, value, pattern: str, allowed: str) -> None:
    if not isinstance(value, str) or not re.fullmatch(pattern, value):
        raise ConfigError(f"{option}: {value!r} is not allowed; expected {allowed}")


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _k8s_name(run_name: str) -> str:
    """run.name as a Kubernetes object name (also the rendezvous id): lowercase letters, digits
    and '-', starting with a letter; short enough for the pods' host names built on it."""
    name = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")
    name = name if name[:1].isalpha() else f"kit-{name}"
    return name[:40].rstrip("-")


def _pod_dir(folder: Path) -> str:
    """The run folder inside a pod: under the checkout on the volume, or beside it."""
    try:
        return f"{WORKSPACE}/kit/{folder.relative_to(ROOT).as_posix()}"
    except ValueError:
        return f"{WORKSPACE}/{folder.name}"


# --------------------------------------------------------------------------- accelerate


def accelerate_config(cfg: Config, nnodes: int, nproc: int) -> dict:
    """accelerate's config (what `accelerate config` writes) for the same sharding."""
    s, world = cfg.sharding, nnodes * nproc
    kind = {"fsdp2": "FSDP", "fsdp1": "FSDP"}.get(s.engine, "MULTI_GPU" if world > 1 else "NO")
    tree = {"compute_environment": "LOCAL_MACHINE", "distributed_type": kind,
            "mixed_precision": MIXED[cfg.model.dtype], "use_cpu": False, "debug": False,
            "num_machines": nnodes, "num_processes": world, "machine_rank": 0,
            "main_process_ip": "127.0.0.1" if nnodes == 1 else "node-0.invalid",
            "main_process_port": PORT}
    if kind != "FSDP":
        return tree
    fsdp = {"fsdp_version": 2 if s.engine == "fsdp2" else 1,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_offload_params": s.cpu_offload,
            # The kit loads itself (model.loading: rank0 is this flag's intent, for 4-bit weights)
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_state_dict_type": STATE_DICT[cfg.checkpointing.format],
            "fsdp_activation_checkpointing": cfg.training.recompute.enabled}
    if s.engine == "fsdp2":
        fsdp["fsdp_reshard_after_forward"] = s.reshard_after_forward
    else:
        fsdp.update(fsdp_sharding_strategy=s.strategy, fsdp_reshard_after_forward=s.strategy,
                    fsdp_backward_prefetch="NO_PREFETCH" if s.backward_prefetch == "none"
                    else s.backward_prefetch, fsdp_forward_prefetch=s.forward_prefetch,
                    fsdp_use_orig_params=s.use_orig_params,
                    fsdp_sync_module_states=s.sync_module_states)
    tree["fsdp_config"] = fsdp
    return tree


def accelerate_yaml(cfg: Config, nnodes: int, nproc: int) -> str:
    tree = accelerate_config(cfg, nnodes, nproc)
    lines = [
        quoting.comment(f'# accelerate\'s config for "{cfg.run.name}" ({cfg.sharding.engine}, '
                        f"{cfg.model.dtype}): {nnodes} node(s) x {nproc} GPUs. Written by "
                        f"kit.run.jobs, {_now()}."),
        "# The kit's recipe runs under torchrun (run.sh); under accelerate the same run is kit.sft.trainer",
        "# (TRL's SFTTrainer), or a script of your own, started on each node from the checkout:",
        "#   accelerate launch --config_file accelerate.yaml --machine_rank \"$NODE_RANK\" \\",
        "#       --main_process_ip \"$MASTER_ADDR\" --main_process_port \"$MASTER_PORT\" \\",
        "#       -m kit.sft.trainer config.yaml",
    ]
    if nnodes > 1:
        lines.append("# main_process_ip is a placeholder (.invalid never resolves): node 0's address.")
    if tree["distributed_type"] == "FSDP":
        lines += [
            "# The FSDP unit is the decoder layer the model names in _no_split_modules, as in",
            "# kit/recipe/layers.py: accelerate reads it itself when fsdp_transformer_layer_cls_to_wrap is",
            "# left out. cpu_ram_efficient_loading is off: the kit loads the model itself, as",
            "# model.loading says (rank0: rank 0 reads, the others receive every tensor, 4-bit",
            "# ones with their quantization state, before accelerate wraps it).",
        ]
        if cfg.training.recompute.enabled and cfg.training.recompute.keeps not in ("inputs", "auto"):
            lines.append(quoting.comment(
                f"# training.recompute.keeps={cfg.training.recompute.keeps} has no accelerate "
                "key: activation checkpointing recomputes whole layers."))
    return "\n".join(lines) + "\n" + quoting.yaml_document(tree)


# --------------------------------------------------------------------------- Slurm

SBATCH = """\
#!/usr/bin/env bash
# Slurm: "{name}" on {nnodes} node(s) x {nproc} {unit}, run.sh once per node. Written by kit.run.jobs,
# {date}. Options on sbatch's command line override the #SBATCH lines, key=value arguments
# after the script override config.yaml:
#   sbatch {script}
#   sbatch --partition=gpu --time=04:00:00 {script} training.steps=200
# The run folder must be on a filesystem every node sees: outputs land there; logs/ holds each
# node's torchrun logs (its ranks' output) and Slurm's own, slurm-<job id>.out.
#SBATCH --job-name={job}
#SBATCH --nodes={nnodes}
#SBATCH --ntasks-per-node=1
#SBATCH {resources}
#SBATCH --exclusive
#SBATCH --time={time}
#SBATCH --output={output}/{LOGS}/slurm-%j.out
# Preemption and time limits: requeued, never lost. SIGUSR1 120 s before --time ends (and
# Slurm's SIGTERM when it preempts) makes the ranks save a checkpoint and run.sh exit 75
# (kit.recipe.preempt); the job then requeues itself, and the requeued job (SLURM_RESTART_COUNT > 0)
# resumes from that checkpoint with no option added. After a rank crashes, run.sh starts torchrun
# again (KIT_MAX_RESTARTS times), whose ranks resume the same way. The SIGUSR1 goes to this
# script only (B:), which passes it on as SIGTERM (below); a requeued job appends to its output.
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
set -euo pipefail
RUN_DIR={folder_q}   # sbatch runs a copy of this script: the folder is named here
# Node 0 is the allocation's first host: it hosts the c10d rendezvous (run.sh, NODE_RANK=0).
# (sed, not head: head closes the pipe early, and under pipefail scontrol's SIGPIPE ends the job)
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
export MASTER_ADDR
export MASTER_PORT="${{MASTER_PORT:-{port}}}"
export NNODES="$SLURM_JOB_NUM_NODES"
export NPROC_PER_NODE="${{NPROC_PER_NODE:-{nproc}}}"
export RDZV_ID="$SLURM_JOB_ID"          # a requeued job meets afresh
export KIT_MAX_RESTARTS="${{KIT_MAX_RESTARTS:-{restarts}}}"
rc=0
# One task per node, with all the node's CPUs (a task gets one otherwise): its torchrun starts
# the node's {nproc} ranks. NODE_RANK is the node's SLURM_NODEID, expanded on that node (hence
# the single quotes). A node that fails stops the others.
# SIGUSR1 becomes the SIGTERM Slurm sends a preempted job's steps, to every process of every
# node's step at once (torchrun passes it on, the ranks save). Slurm signals every process of a
# step: a SIGUSR1 sent there would end torchrun, which has no handler for it, before the ranks
# had saved. srun runs in the background so that the trap runs while it does.
trap 'scancel --signal=TERM "$SLURM_JOB_ID" || true' USR1
# shellcheck disable=SC2016
srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 \\
  bash -c 'NODE_RANK="$SLURM_NODEID" exec bash "$0" "$@"' "$RUN_DIR/{RUN_SH}" "$@" &
SRUN=$!
while :; do  # wait returns early (128 + n) when the trap runs: wait again until srun ends
  rc=0; wait "$SRUN" || rc=$?
  if ! kill -0 "$SRUN" 2>/dev/null; then rc=0; wait "$SRUN" || rc=$?; break; fi
done
if [ "$rc" = 75 ]; then  # preempted, its checkpoint saved: run again from the queue
  scontrol requeue "$SLURM_JOB_ID" || true
fi
exit "$rc"
"""


def sbatch(cfg: Config, folder: Path, nnodes: int, nproc: int, time: str) -> str:
    """job.sbatch's text: values in #SBATCH lines as Slurm reads them, in commands as shell
    words, in comments escaped (kit.run.quoting)."""
    return SBATCH.format(
        name=quoting.comment(cfg.run.name), job=quoting.sbatch_value(cfg.run.name, "run.name"),
        nnodes=int(nnodes), nproc=int(nproc), date=_now(),
        script=quoting.comment(quoting.shell_word(f"{_rel(folder)}/job.sbatch")),
        time=quoting.sbatch_value(time, "--time"),
        output=quoting.sbatch_value(folder, "run.output_dir (--out)", pattern=True),
        folder_q=quoting.shell_word(folder), port=PORT, restarts=RESTARTS,
        LOGS=RunFolder.LOGS, RUN_SH=RunFolder.RUN_SH, **_resources(cfg, nproc))


def _resources(cfg: Config, nproc: int) -> dict:
    """What a node's task asks for: a GPU per rank, or on a CPU run (training.device=cpu) a CPU
    per rank and no GPU (a CPU cluster refuses a job asking GPUs: an invalid gres)."""
    if cfg.training.device == "cpu":
        return {"unit": "CPU processes", "resources": f"--cpus-per-task={int(nproc)}"}
    return {"unit": "GPUs",
            "resources": f"--gpus-per-node={int(nproc)}\n# (training.device=auto or cuda; "
                         "training.device=cpu asks a CPU per rank instead, for a cluster without "
                         "GPUs)"}


# --------------------------------------------------------------------------- Kubernetes


def _env() -> list[dict]:
    """The trainer container's environment: what run.sh exports, NCCL's report level, where the
    kit is, and HF_TOKEN from a Secret by name (optional: a built-in model needs none)."""
    plain = {**launch.RUN_ENV, "NCCL_DEBUG": "WARN", "KIT_ROOT": f"{WORKSPACE}/kit",
             "PYTHON": "python3", "KIT_MAX_RESTARTS": RESTARTS}
    env = [{"name": k, "value": str(v)} for k, v in plain.items()]
    secret = {"name": SECRET, "key": SECRET_KEY, "optional": True}
    return env + [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": secret}}]


def _volumes(pvc: str) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM}},
               {"name": "workspace", "persistentVolumeClaim": {"claimName": pvc}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "workspace", "mountPath": WORKSPACE}]
    return volumes, mounts


def trainjob(cfg: Config, pod_dir: str, nnodes: int, nproc: int, image: str, pvc: str) -> dict:
    """Kubeflow Trainer v2: the runtime sets PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE,
    PET_MASTER_ADDR and PET_MASTER_PORT in the trainer container (and refuses them in env)."""
    volumes, mounts = _volumes(pvc)
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": _k8s_name(cfg.run.name)},
        "spec": {
            "runtimeRef": {"name": "torch-distributed"},
            "trainer": {"image": image, "command": _command(pod_dir),
                        "numNodes": nnodes, "numProcPerNode": nproc,
                        "resourcesPerNode": {"limits": {"nvidia.com/gpu": nproc}},
                        "env": _env()},
            "podSpecOverrides": [{
                "targetJobs": [{"name": TRAINER_JOB}], "volumes": volumes,
                "containers": [{"name": TRAINER_CONTAINER, "volumeMounts": mounts}]}],
        },
    }


def _command(pod_dir: str) -> list[str]:
    """What a pod runs: the run folder's run.sh, resuming."""
    return ["bash", f"{pod_dir}/{RunFolder.RUN_SH}", RESUME]


def pytorchjob(cfg: Config, pod_dir: str, nnodes: int, nproc: int, image: str, pvc: str) -> dict:
    """training-operator v1: it sets MASTER_ADDR (the Master's service), MASTER_PORT (the port
    named pytorchjob-port), PET_NNODES, PET_NODE_RANK and PET_NPROC_PER_NODE in every pod."""
    volumes, mounts = _volumes(pvc)

    def replicas(n: int) -> dict:
        container = {"name": "pytorch",  # the operator finds its container by this name
                     "image": image, "command": _command(pod_dir),
                     "env": _env(),
                     "ports": [{"name": "pytorchjob-port", "containerPort": PORT}],
                     "resources": {"limits": {"nvidia.com/gpu": nproc}},
                     "volumeMounts": mounts}
        return {"replicas": n, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [container], "volumes": volumes,
                                      "terminationGracePeriodSeconds": GRACE_S}}}

    specs = {"Master": replicas(1)}
    if nnodes > 1:
        specs["Worker"] = replicas(nnodes - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": _k8s_name(cfg.run.name)},
            "spec": {"nprocPerNode": str(nproc), "pytorchReplicaSpecs": specs,
                     "runPolicy": {"backoffLimit": RESTARTS}}}


def _manifest(doc: dict, cfg: Config, pod_dir: str, pvc: str) -> str:
    """The manifest as YAML with a header, after checking it against its CRD (kit.run.schemas)."""
    problems = schemas.validate(doc)
    if problems:
        raise ValueError("kit.run.jobs wrote an invalid manifest:\n  " + "\n  ".join(problems))
    spec = doc["spec"]
    what = ("Kubeflow Trainer v2 TrainJob (runtime torch-distributed)" if doc["kind"] == "TrainJob"
            else "Kubeflow training-operator v1 PyTorchJob")
    nodes = spec["trainer"]["numNodes"] if doc["kind"] == "TrainJob" else sum(
        r["replicas"] for r in spec["pytorchReplicaSpecs"].values())
    header = [
        quoting.comment(f'# {what} for "{cfg.run.name}": {nodes} node(s).'),
        f"# Written by kit.run.jobs, {_now()}:  kubectl apply -f {doc['kind'].lower()}.yaml",
        quoting.comment(f'# The PersistentVolumeClaim "{pvc}" (ReadWriteMany: every node reads '
                        "the kit and writes"),
        f"# the run folder) holds this checkout at {WORKSPACE}/kit, the data, and the run folder",
        quoting.comment(f"#   {pod_dir}"),
        "# where the outputs land. The image holds Python with the kit's dependencies (bash",
        "# setup.sh on a CUDA torch image). No secret is written here: HF_TOKEN comes from the",
        f'# Secret "{SECRET}" (key "{SECRET_KEY}") when it exists:',
        f"#   kubectl create secret generic {SECRET} --from-literal={SECRET_KEY}=<your token>",
    ]
    return "\n".join(header) + "\n" + quoting.yaml_document(doc)


def _rel(folder: Path) -> str:
    try:
        return str(folder.relative_to(ROOT))
    except ValueError:
        return str(folder)


def _now() -> str:
    return datetime.now().strftime("%F %T")
