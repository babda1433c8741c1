"""The doctor: each pre-flight check fires on a config that has its pitfall and stays quiet on one
that does not; explain() maps every known raw error; scan_script flags the article patterns;
diagnose_run reads crafted and real run folders; the CLI's exit codes; notebook 11 end to end.
The records these readers share are tested against their reproductions in test_pitfalls.py."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY
from safetensors.torch import save_file

from kit import doctor
from kit.doctor.__main__ import main as cli
from kit.findings import LEVELS
from kit.recipe import checks

CPU = {"gpus": [], "vars": {}, "host_ram_gib": 24.0, "nproc_per_node": 2}
H100 = {
    "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.6}] * 2,
    "vars": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "host_ram_gib": 500.0,
    "packages": {"flash_attn": True},
}


def env(base: dict, **changes) -> dict:
    out = {**base, **changes}
    if "vars" in changes:
        out["vars"] = {**base["vars"], **changes["vars"]}
    return out


# Two 24 GB cards: the first article's machine.
TWO_24GB = env(H100, gpus=[{"name": "RTX 4090", "memory_gib": 23.6}] * 2)


def codes(overrides=(), on=CPU, cfg=TINY) -> list[str]:
    findings = doctor.preflight(cfg, env=on, overrides=list(overrides))
    for f in findings:  # the launcher's contract: four one-line fields, a known level
        assert f.level in LEVELS and f.code and f.message and f.fix
        assert "\n" not in f.message + f.fix
    return doctor.codes(findings)


# --------------------------------------------------------------------------- pre-flight

LLAMA_8B_LONG = ["model.name=kit:llama-8b", "data.max_seq_len=2048"]
LLAMA31_8B_131K = ["model.name=kit:llama31-8b", "training.device=cuda", "training.batch_size=1",
                   "data.max_seq_len=131072"]
ONE_24GB = env(H100, gpus=[{"name": "NVIDIA H100 80GB HBM3", "memory_gib": 24.0}],
               nproc_per_node=1)
# (code, overrides with the pitfall, env, overrides without it, env)
CHECKS = [
    ("fsdp1_use_orig_params", ["sharding.engine=fsdp1", "sharding.use_orig_params=false"], CPU,
     ["sharding.engine=fsdp1"], CPU),
    ("fsdp1_int_storage", ["sharding.engine=fsdp1", "quantization.storage=uint8"], CPU,
     ["sharding.engine=fsdp2", "quantization.storage=uint8"], CPU),
    ("fsdp1_mixed_dtype", ["sharding.engine=fsdp1", "lora.dtype=float32"], CPU,
     ["sharding.engine=fsdp2", "lora.dtype=float32"], CPU),
    ("fsdp1_mixed_dtype", ["sharding.engine=fsdp1", "quantization.storage=float32"], CPU,
     ["sharding.engine=fsdp1", "quantization.storage=bfloat16"], CPU),
    ("shard_grad_op_4bit", ["sharding.engine=fsdp1", "sharding.strategy=SHARD_GRAD_OP"], CPU,
     ["sharding.engine=fsdp1", "sharding.strategy=SHARD_GRAD_OP", "quantization.method=none"],
     CPU),
    ("device_map_with_fsdp", ["model.device_map=auto"], CPU, [], CPU),
    ("host_ram_full_load", ["model.name=kit:llama-1b", "model.dtype=float32"],
     env(CPU, host_ram_gib=2.0), ["model.name=kit:llama-1b", "model.dtype=float32"], CPU),
    ("flash_attn_fp32", ["attention.implementation=flash_attention_2", "model.dtype=float32"],
     H100, ["attention.implementation=flash_attention_2"], H100),
    ("flash_attn_missing", ["attention.implementation=flash_attention_2"],
     env(H100, packages={"flash_attn": False}), ["attention.implementation=flash_attention_2"],
     H100),
    ("tokenizers_parallelism", ["data.num_workers=2"], CPU, ["data.num_workers=2"],
     env(CPU, vars={"TOKENIZERS_PARALLELISM": "false"})),
    ("cuda_alloc_conf", [], env(H100, vars={"PYTORCH_CUDA_ALLOC_CONF": ""}), [], H100),
    ("dist_timeout_short", ["model.name=kit:llama-8b", "run.dist_timeout_min=1"], CPU,
     ["model.name=kit:llama-8b"], CPU),
    # one rank: nobody waits on rank 0's load, so the same timeout is no finding there
    ("dist_timeout_short", ["model.name=kit:llama-8b", "run.dist_timeout_min=1"], CPU,
     ["model.name=kit:llama-8b", "run.dist_timeout_min=1"], env(CPU, nproc_per_node=1)),
    ("memory_over_gpu", [*LLAMA_8B_LONG, "training.batch_size=16",
                         "training.recompute.enabled=false",
                         "training.offload_activations=false"], H100,
     [*LLAMA_8B_LONG, "training.batch_size=1"], H100),
    # Rows of 131,072 tokens within 24 GiB offload 32 GiB of layer inputs per process: refused
    # before start where the node's host memory cannot hold them (the plan's host check).
    ("memory_over_gpu", LLAMA31_8B_131K, env(ONE_24GB, host_ram_gib=30.0), LLAMA31_8B_131K,
     ONE_24GB),
    ("memory_over_gpu_loading",
     ["model.name=kit:llama-70b", "data.max_seq_len=256", "model.loading=full"], TWO_24GB,
     ["model.name=kit:llama-70b", "data.max_seq_len=256", "model.loading=auto"], TWO_24GB),
    ("target_modules_unmatched", ["lora.target_modules=[query_key_value]"], CPU,
     ["lora.target_modules=[q_proj,v_proj]"], CPU),
    ("target_modules_partial", ["lora.target_modules=[q_proj,nope_proj]"], CPU,
     ["lora.target_modules=[q_proj]"], CPU),
    ("target_modules_unsupported", ["lora.target_modules=[mlp]"], CPU,
     ["lora.target_modules=[gate_proj]"], CPU),
    ("max_seq_len_too_long", ["data.max_seq_len=4096"], CPU, ["data.max_seq_len=512"], CPU),
    ("text_field_missing", ["data.text_field=body"], CPU, ["data.text_field=text"], CPU),
    ("text_field_missing", ["data.path=kit:sample-chat", "data.messages_field=conversation",
                            "data.format=messages"], CPU, ["data.path=kit:sample-chat"], CPU),
    ("data_missing", ["data.path=/nonexistent/train.jsonl"], CPU, [], CPU),
    ("data_too_small", ["training.batch_size=100000"], CPU, [], CPU),
    ("no_gpu", ["training.device=cuda"], CPU, ["training.device=cuda"], H100),
    # the Triton kernels of lora.fused_down: compute capability 8.0+ and triton
    ("fused_down_no_triton", ["lora.fused_down=true"],
     env(H100, gpus=[{"name": "Tesla V100-SXM2-32GB", "memory_gib": 31.7, "capability": "7.0"}] * 2),
     ["lora.fused_down=true"], H100),
    ("fused_down_no_triton", ["lora.fused_down=true"], env(H100, packages={"triton": False}),
     ["lora.fused_down=auto"], env(H100, packages={"triton": False})),
    ("more_ranks_than_gpus", [], env(H100, gpus=H100["gpus"][:1], nproc_per_node=2), [], H100),
    ("cpu_bf16_slow", ["model.name=kit:llama-1b"], env(CPU, host_ram_gib=None),
     ["model.name=kit:llama-1b", "model.dtype=float32"], env(CPU, host_ram_gib=None)),
    ("config_invalid", ["training.lr=-1"], CPU, ["training.lr=2e-4"], CPU),
    ("model_source", ["model.name=/nonexistent/model"], CPU, [], CPU),
    ("model_source", ["model.name=kit:nope"], CPU, ["model.name=kit:tiny-qwen2"], CPU),
]  # fmt: skip


@pytest.mark.parametrize(("code", "bad", "bad_env", "good", "good_env"), CHECKS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CHECKS)])  # fmt: skip
def test_check_fires_on_its_pitfall_only(code, bad, bad_env, good, good_env):
    assert code in codes(bad, bad_env)
    assert code not in codes(good, good_env)


def test_the_kit_defaults_are_clean_here_and_on_gpus():
    assert codes() == []
    assert codes(on=H100) == []
    assert codes(["sharding.engine=fsdp1"]) == codes(["sharding.engine=ddp"]) == []


def test_config_object_dict_and_yaml_path_give_the_same_findings():
    from kit.config import load_config

    bad = ["sharding.engine=fsdp1", "lora.target_modules=[query_key_value]"]
    cfg = load_config(TINY, ["lora.target_modules=[query_key_value]"])
    expected = ["target_modules_unmatched"]
    assert codes(cfg=cfg) == codes(cfg=cfg.to_dict()) == codes(bad[1:]) == expected


LINEARS = "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"
# What kit.recipe.model.build raises on the rank side (tests/test_lora.py), said before the run.
SAME_LINE_AS_THE_RANKS = [
    (["lora.target_modules=[q_proj,q_prj,v_proj]"], "target_modules_partial",
     f"lora.target_modules: 'q_prj' matches no module of kit:tiny-llama; its linear layers: "
     f"{LINEARS}: "),
    (["lora.target_modules=[q_prj,v_proj,vproj]"], "target_modules_partial",
     f"lora.target_modules: 'q_prj', 'vproj' match no module of kit:tiny-llama; its linear "
     f"layers: {LINEARS}: "),
    (["data.max_seq_len=4096"], "max_seq_len_too_long",
     "data.max_seq_len: 4096 is not allowed; kit:tiny-llama has max_position_embeddings=512"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "code", "line"), SAME_LINE_AS_THE_RANKS,
                         ids=["one-typo", "two-typos", "max_seq_len"])
def test_model_fit_errors_say_the_ranks_line(overrides, code, line):
    findings = doctor.preflight(TINY, env=CPU, overrides=overrides)
    assert [(f.level, f.code) for f in findings] == [("error", code)]
    assert findings[0].message.startswith(line), findings[0].message


# A bad file of each kind (tests/test_data.py has them all): the pre-flight's error is the line
# kit.inputs.datafile.check_file raises, which the ranks raise too.
BAD_DATA = {
    "missing.jsonl": '{"text": "a"}\n{"body": "b"}\n',
    "broken.jsonl": '{"text": "a"}\n{"text": "a" "b"}\n',
    "empty.jsonl": "\n\n",
    "chat.jsonl": '{"messages": []}\n',
}


@pytest.mark.parametrize("name", BAD_DATA)
@pytest.mark.parametrize("key", ["data.path", "data.val_path"])
def test_bad_data_file_is_an_error_with_the_checks_line(tmp_path, name, key):
    from kit.config import ConfigError, DataConfig
    from kit.inputs import datafile

    path = tmp_path / name
    path.write_text(BAD_DATA[name])
    with pytest.raises(ConfigError) as raised:
        datafile.check_file(DataConfig(**{key.split(".")[1]: str(path)}))
    findings = doctor.preflight(TINY, env=CPU, overrides=[f"{key}={path}"])
    assert [(f.level, f.code, f.field) for f in findings] == [("error", "data_rows_invalid", key)]
    assert findings[0].message == str(raised.value)


def test_raw_tree_load_config_rejects_explains_each_field_once():
    tree = {
        "sharding": {"engine": "fsdp1", "use_orig_params": False, "strategy": "SHARD_GRAD_OP"},
        "training": {"lr": -1},
        "model": {"device_map": "auto"},
    }
    findings = doctor.preflight(tree, env=CPU)
    by_field = {}
    for f in findings:
        by_field.setdefault(f.field, []).append(f.code)
    # The specific explanation replaces load_config's generic complaint about the same field.
    assert by_field["sharding.use_orig_params"] == ["fsdp1_use_orig_params"]
    assert by_field["sharding.strategy"] == ["shard_grad_op_4bit"]
    assert by_field["model.device_map"] == ["device_map_with_fsdp"]
    assert by_field["training.lr"] == ["config_invalid"]  # no specific check: load_config's
    assert doctor.errors(findings) == findings[: len(doctor.errors(findings))]  # errors first


def test_config_errors_lists_every_rejected_field():
    fields = [f for f, _ in doctor.config_errors(
        {"training": {"lr": -1, "steps": 0}, "data": {"num_workers": 2}})]  # fmt: skip
    assert sorted(fields) == ["data.num_workers", "training.lr", "training.steps"]


def test_missing_config_file_is_a_finding_not_an_exception(tmp_path):
    assert codes(cfg=tmp_path / "nope.yaml") == ["config_missing"]


ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: {efficient}
  fsdp_sharding_strategy: {strategy}
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_use_orig_params: {orig}
mixed_precision: bf16
num_machines: 1
num_processes: 2
"""


def test_accelerate_config_of_the_second_article(tmp_path):
    path = tmp_path / "fsdp_config.yaml"
    path.write_text(ACCELERATE_YAML.format(efficient="true", strategy="FULL_SHARD", orig="true"))
    assert codes(cfg=path, on=H100) == []
    assert codes(cfg=path, on=CPU) == ["accelerate_fsdp_cpu"]  # "no available devices"
    path.write_text(ACCELERATE_YAML.format(efficient="false", strategy="SHARD_GRAD_OP",
                                           orig="false"))  # fmt: skip
    assert set(codes(cfg=path, on=H100)) == {
        "fsdp1_use_orig_params", "shard_grad_op_4bit", "host_ram_full_load"}  # fmt: skip


def test_the_machine_probe_reads_this_machine_without_cuda():
    from kit.budget import machine

    found = machine.probe(vars={"X_DOCTOR": "1"}, nproc_per_node=3)
    assert found["vars"]["X_DOCTOR"] == "1" and found["nproc_per_node"] == 3
    assert found["gpus"] == [] or all(g["memory_gib"] > 0 for g in found["gpus"])
    assert found["host_ram_gib"] and found["host_ram_gib"] > 0.5
    assert not torch.cuda.is_initialized()


# --------------------------------------------------------------------------- scanning scripts

LOAD_4BIT = """
bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16{storage})
model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb{device_map})
"""
WRAP = """
model = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cuda", rank),
             sharding_strategy=ShardingStrategy.{strategy}, use_orig_params={orig})
"""
STORAGE = ", bnb_4bit_quant_storage=torch.bfloat16"


def script(storage=STORAGE, device_map="", strategy="FULL_SHARD", orig="True", extra=""):
    return (LOAD_4BIT.format(storage=storage, device_map=device_map) + extra
            + WRAP.format(strategy=strategy, orig=orig))  # fmt: skip


SCRIPTS = [
    ("prepare_kbit_fsdp1", script(extra="model = prepare_model_for_kbit_training(model)\n")),
    ("device_map_with_fsdp", script(device_map=', device_map="auto"')),
    ("fsdp1_int_storage", script(storage="")),
    ("shard_grad_op_4bit", script(strategy="SHARD_GRAD_OP")),
    ("fsdp1_use_orig_params", script(orig="False", extra="model = get_peft_model(model, c)\n")),
    ("full_state_dict_empty_adapter", script() + """
with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
    state = model.state_dict()
model.module.save_pretrained(out, state_dict=state)
"""),
    ("offload_to_cpu_segfault", script() + "cfg = FullStateDictConfig(offload_to_cpu=True)\n"),
    ("eval_mode_checkpointing", script(extra="model.gradient_checkpointing_enable()\n")),
    ("fsdp1_no_device_id", "model = FSDP(model, use_orig_params=True)\n"),
    ("peft_auto_wrap_fp32", script().replace("=policy", "=fsdp_auto_wrap_policy(model)")),
    ("flash_attn_missing", 'm = f(name, attn_implementation="flash_attention_2")\n'),
    ("tokenizers_parallelism", "loader = DataLoader(ds, batch_size=4, num_workers=4)\n"),
]  # fmt: skip


@pytest.mark.parametrize(("code", "text"), SCRIPTS, ids=[c for c, _ in SCRIPTS])
def test_scan_script_flags_each_article_pattern(code, text):
    assert code in doctor.codes(doctor.scan_script(text))


def test_scan_script_stays_quiet_on_the_corrected_script(tmp_path):
    good = script(extra="model.gradient_checkpointing_enable()\nmodel.train()\n")
    assert doctor.scan_script(good) == []
    # Comments do not count ("# or SHARD_GRAD_OP" in the first article), and a path works.
    path = tmp_path / "train.py"
    path.write_text(good + "# sharding_strategy=ShardingStrategy.SHARD_GRAD_OP is faster\n")
    assert doctor.scan_script(path) == []
    # accelerate's YAML key of the same name is not PEFT's function
    assert doctor.scan_script(ACCELERATE_YAML) == []


def test_scan_script_points_at_the_line():
    text = "import torch\n\nmodel = prepare_model_for_kbit_training(model)\nFSDP(model)\n"
    finding = doctor.scan_script(text)[0]
    assert finding.code == "prepare_kbit_fsdp1" and finding.message.startswith("line 3:")


# --------------------------------------------------------------------------- explaining errors

RAW = [
    ("ValueError: Must flatten tensors with uniform dtype but got torch.bfloat16 and "
     "torch.float32", "fsdp1_mixed_dtype"),
    ("ValueError: Cannot flatten integer dtype tensors", "fsdp1_int_storage"),
    ("RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16",
     "fsdp1_mixed_dtype_forward"),
    ("RuntimeError: FSDP needs a non-CPU accelerator device, but no accelerator device is "
     "detected.", "fsdp1_no_device_id"),
    ("AssertionError: FSDP does not support changing the parameters between forward and "
     "backward for HandleShardingStrategy.SHARD_GRAD_OP", "shard_grad_op_4bit"),
    ("ValueError: Must flatten tensors with uniform `requires_grad` when "
     "`use_orig_params=False`", "fsdp1_use_orig_params"),
    ("RuntimeError: no available devices", "accelerate_fsdp_cpu"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
     "capacity of 79.19 GiB", "cuda_oom"),
    ("[rank1]:[E1122 10:00:00.000 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective "
     "operation timeout: WorkNCCL(SeqNum=9, OpType=ALLGATHER, Timeout(ms)=600000) ran for "
     "600031 milliseconds before timing out.", "dist_timeout"),
    ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed "
     "out waiting 2000ms for recv operation to complete", "dist_timeout"),
    ("ImportError: FlashAttention2 has been toggled on, but it cannot be used due to the "
     "following error: the package for FlashAttention2 doesn't seem to be installed.",
     "flash_attn_missing"),
    ("Flash Attention 2 only supports torch.float16 and torch.bfloat16 dtypes, but the current "
     "dype in LlamaForCausalLM is torch.float32.", "flash_attn_fp32"),
    ("peft.utils.error.NoMatchingPeftModuleError: Target modules {'query_key_value'} not found "
     "in the base model. Please check the target modules and try again.",
     "target_modules_unmatched"),
    ("[rank 0] ConfigError: lora.target_modules: 'nope_proj' matches no module of "
     "kit:tiny-llama; its linear layers: down_proj, gate_proj", "target_modules_unmatched"),
    ("ValueError: Target module LlamaMLP(\n  (gate_proj): Linear(in_features=128)\n) is not "
     "supported. Currently, only the following modules are supported", "target_modules_unsupported"),
    ("ConfigError: data.text_field: 'body' is not a column of kit:sample; columns: text",
     "text_field_missing"),
    ("FloatingPointError: step 4: loss is nan", "loss_nonfinite"),
    ("CheckpointError: run/adapter/adapter_model.safetensors: 28 of 28 LoRA tensors missing "
     "(holds 0), e.g. base_model.model.layers.0.q_proj.lora_A.weight", "adapter_empty"),
    ("  rank      : 0 (local_rank: 0)\n  exitcode  : -11 (pid: 123)\n  traceback : Signal 11 "
     "(SIGSEGV) received by PID 123", "segfault"),
    ("  exitcode  : -9 (pid: 77)\n  traceback : Signal 9 (SIGKILL) received by PID 77",
     "killed_oom"),
    ("AssertionError: Torch not compiled with CUDA enabled", "no_gpu"),
    ("torch.AcceleratorError: CUDA error: invalid device ordinal", "more_ranks_than_gpus"),
    ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
     "network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: "
     "address already in use", "port_in_use"),
    ("RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn",
     "no_grad_inputs"),
    ("RuntimeError: Expected all tensors to be on the same device, but found at least two "
     "devices, cuda:0 and cuda:1!", "device_map_with_fsdp"),
    ("RuntimeError: Error(s) in loading state_dict: Unexpected key(s) in state_dict: "
     "\"model.layers.0.mlp.down_proj.weight.absmax\"", "strict_load"),
    ("huggingface/tokenizers: The current process just got forked, after parallelism has "
     "already been used. Disabling parallelism to avoid deadlocks...", "tokenizers_parallelism"),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled "
     "system error", "nccl_error"),
    ("RuntimeError: ERROR   lora_not_training: after 3 steps none of 28 trainable tensors "
     "changed | fix: ...", "lora_not_training"),
    ("RuntimeError: ERROR   eval_mode_checkpointing: gradient checkpointing is on in 3 modules in "
     "eval mode: no recompute", "eval_mode_checkpointing"),
    ("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer "
     "[127.0.0.1]:23202", "peer_died"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "code"), RAW, ids=[f"{c}-{i}" for i, (_, c) in enumerate(RAW)])
def test_explain_maps_each_known_raw_error(text, code):
    found = doctor.explain(f"Traceback (most recent call last):\n  ...\n{text}\n")
    assert code in doctor.codes(found)
    f = found[doctor.codes(found).index(code)]
    assert f.fix and "\n" not in f.message + f.fix and "(saw: " in f.message


def test_explain_puts_the_cause_before_its_consequences():
    log = ("[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:1\n"
           "[rank0]: ValueError: Cannot flatten integer dtype tensors\n")  # fmt: skip
    assert doctor.codes(doctor.explain(log)) == ["fsdp1_int_storage", "peer_died"]
    assert doctor.explain("step 20 loss 6.1\nadapter: launch/x/adapter (28 tensors)\n") == []


def test_requires_grad_error_is_not_mistaken_for_a_dtype_error():
    found = doctor.codes(doctor.explain(RAW[5][0]))
    assert found == ["fsdp1_use_orig_params"]


# --------------------------------------------------------------------------- in-run checks


def test_check_step_nan_inf_and_zero_gradient():
    assert doctor.codes(checks.check_step({"step": 3, "loss": math.nan})) == ["loss_nonfinite"]
    assert doctor.codes(checks.check_step({"step": 3, "loss": 2.0, "grad_norm": math.inf})) == [
        "loss_nonfinite"]  # fmt: skip
    assert doctor.codes(checks.check_step({"step": 1, "loss": 6.9, "grad_norm": 0.0})) == [
        "lora_not_training"]  # fmt: skip
    assert checks.check_step({"split": "train", "step": 1, "loss": 6.9, "grad_norm": 0.7}) == []
    assert checks.check_step({"split": "val", "step": 10, "loss": 6.5}) == []


def tiny_peft_model():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from kit.inputs.builtin import SPECS

    spec = dict(SPECS["tiny-llama"])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


@pytest.mark.parametrize(("lr", "trains"), [(1e-2, True), (0.0, False)])
def test_check_lora_changed_on_a_real_peft_model(lr, trains):
    model = tiny_peft_model()
    before = checks.trainable_snapshot(model)
    assert before and all("lora_" in k for k in before)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    ids = torch.randint(3, 1024, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    found = checks.check_lora_changed(before, checks.trainable_snapshot(model), step=2)
    assert doctor.codes(found) == ([] if trains else ["lora_not_training"])


def test_check_rank_times_names_the_slow_rank():
    assert checks.check_rank_times([1.0, 1.1]) == []
    slow = checks.check_rank_times([1.0, 2.0], step=7)
    assert doctor.codes(slow) == ["slow_rank"] and slow[0].message.startswith("rank 1 ")
    assert "rank 3 " in checks.check_rank_times([1.0, 1.1, 0.9, 3.0])[0].message


def test_rising_held_out_loss_is_said_once_by_the_recipe_with_its_steps_and_values():
    """kit.train's in-run checks after each step (Recipe._check, driven here with a stand-in for
    the recipe's state: no model needed): held-out loss above the evaluation before it three
    times in a row is one warning, at the evaluation that made the third rise, with the steps
    and values; rising on, or rising three times again later, says nothing more; an equal loss
    is no rise."""
    from types import SimpleNamespace

    from kit.recipe import checks
    from kit.train import Recipe

    said: list[tuple[int, str]] = []
    recipe = SimpleNamespace(history=[], start_step=10**6)  # never the 3-step adapter check
    losses = [2.0, 1.5, 1.6, 1.7, 1.8, 1.9, 1.2, 1.3, 1.4, 1.5]  # evaluations at steps 10..100
    for step in range(1, 101):
        recipe.say = lambda line, step=step: said.append((step, line))
        row = {"split": "train", "step": step, "loss": 1.0, "step_s_per_rank": [0.1, 0.1]}
        recipe.history.append(row)
        if step % 10 == 0:
            recipe.history.append({"split": "val", "step": step, "loss": losses[step // 10 - 1]})
        Recipe._check(recipe, row, step, {})
    assert said == [(50, "[doctor] WARNING val_loss_rising: held-out loss rose at 3 evaluations "
                         "in a row: step 20 1.5000, step 30 1.6000, step 40 1.7000, step 50 "
                         "1.8000 (lowest 1.5000 at step 20) | fix: the adapter is fitting its "
                         "training rows: fewer steps (training.steps=20), a lower training.lr or "
                         "more rows; checkpoints/ keeps earlier steps (checkpointing.save_every; "
                         "checkpointing.keep_best=true keeps the lowest held-out loss's)")]
    flat = [{"split": "val", "step": s, "loss": v} for s, v in ((1, 1.0), (2, 1.1), (3, 1.1),
                                                                (4, 1.2), (5, 1.3))]
    assert checks.check_val_rising(flat, 5) == []
    assert checks.check_val_rising(flat, 5, evals=2)[0].code == "val_loss_rising"


def test_graph_breaks_in_the_first_step_are_said_once_with_torchs_explanation():
    """kit.train after the first step (Recipe._check, a stand-in for the recipe's state): code
    torch.compile could not trace whole (a real graph break) is one warning naming torch's
    explanation and the fix; breaks from before the run (a notebook's kernel) are not counted,
    and a run without new ones says nothing."""
    from types import SimpleNamespace

    from kit.train import Recipe

    said: list[str] = []
    layer = torch.nn.Linear(4, 4)

    def forward(x):
        y = layer(x)
        torch._dynamo.graph_break()  # what a late import or a .item() inside a layer does
        return y.relu()

    def first_step(recipe):
        recipe.history.clear()
        row = {"split": "train", "step": 1, "loss": 1.0, "step_s_per_rank": [0.1]}
        Recipe._check(recipe, row, 1, {})

    def recipe_now():  # a run that begins now: what broke before is not its own
        return SimpleNamespace(history=[], start_step=0, say=said.append,
                               breaks=checks.graph_breaks())

    first_step(recipe_now())
    assert said == []
    recipe = recipe_now()
    torch._dynamo.reset()
    try:
        torch.compile(forward)(torch.ones(2, 4))
    finally:
        torch._dynamo.reset()
    first_step(recipe)
    assert len(said) == 1 and said[0].startswith(
        "[doctor] WARNING graph_breaks: torch.compile broke the compiled layers' graphs 1 time in "
        "the first step (most often: "), said
    assert "graph break" in said[0].split("most often: ")[1]
    assert "TORCH_LOGS=graph_breaks" in said[0]
    first_step(recipe_now())  # the same process, later: none new
    assert len(said) == 1


def test_check_checkpointing_active_in_eval_mode_only():
    model = tiny_peft_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval()  # as from_pretrained leaves a model
    assert doctor.codes(checks.check_checkpointing_active(model)) == ["eval_mode_checkpointing"]
    model.train()
    assert checks.check_checkpointing_active(model) == []


def write_adapter(folder, tensors: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


LORA_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
LORA_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(("tensors", "code"), [
    ({LORA_A: torch.randn(4, 128), LORA_B: torch.randn(128, 4)}, None),
    ({}, "adapter_empty"),
    ({LORA_A: torch.randn(4, 128), LORA_B: torch.zeros(128, 4)}, "lora_not_training"),
    ({LORA_A: torch.randn(4, 128), LORA_B: torch.full((128, 4), 2e-30)}, "lora_not_training"),
    ({LORA_A: torch.randn(4, 128), LORA_B: torch.full((128, 4), math.nan)}, "adapter_invalid"),
])  # fmt: skip
def test_check_adapter(tmp_path, tensors, code):
    folder = write_adapter(tmp_path / "adapter", tensors)
    assert doctor.codes(checks.check_adapter(folder)) == ([code] if code else [])
    assert doctor.codes(checks.check_adapter(tmp_path / "none")) == ["adapter_missing"]


# --------------------------------------------------------------------------- diagnosing run folders


def crafted_run(folder, losses, grad_norms=None, adapter=None, result=True, log="", per_rank=None):
    folder.mkdir(parents=True)
    rows = []
    for i, loss in enumerate(losses):
        row = {"split": "train", "step": i + 1, "loss": loss, "lr": 1e-2, "tokens_per_s": 100.0,
               "grad_norm": (grad_norms or [0.5] * len(losses))[i], "peak_mem_gib": 0.5}  # fmt: skip
        if per_rank:
            row["step_s_per_rank"] = per_rank[i]
        rows.append(json.dumps(row))  # json writes NaN as NaN, as the recipe's file has it
    (folder / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    if result:
        sums = result if isinstance(result, list) else ["ab12", "ab12"]
        (folder / "result.json").write_text(json.dumps({"status": "completed",
                                                        "lora_checksums": sums}))  # fmt: skip
    if adapter is not None:
        write_adapter(folder / "adapter", adapter)
    if log:
        (folder / "run.log").write_text(log)
    return folder


TRAINED = {LORA_A: torch.randn(4, 128), LORA_B: torch.randn(128, 4)}


def test_diagnose_nan_loss(tmp_path):
    run = crafted_run(tmp_path / "nan", [6.9, 6.8, math.nan], [0.7, math.nan, math.nan],
                      result=False, log="[rank 1] FloatingPointError: step 3: loss is nan\n")
    found = doctor.diagnose_run(run)
    assert doctor.codes(found) == ["loss_nonfinite"]  # once, at the first step that shows it
    assert found[0].message.startswith("step 2: grad_norm is nan")


def test_diagnose_flat_lora(tmp_path):
    zero_b = {LORA_A: torch.randn(4, 128), LORA_B: torch.zeros(128, 4)}
    run = crafted_run(tmp_path / "flat", [6.9] * 5, [0.0] * 5, adapter=zero_b)
    found = doctor.diagnose_run(run)
    assert doctor.codes(found) == ["lora_not_training"]
    run = crafted_run(tmp_path / "flat-adapter", [6.9, 6.7, 6.5, 6.4], adapter=zero_b)
    assert doctor.codes(doctor.diagnose_run(run)) == ["lora_not_training"]  # lora_B still zero


def test_diagnose_empty_adapter(tmp_path):
    run = crafted_run(tmp_path / "empty", [6.9, 6.5, 6.2], adapter={})
    found = doctor.diagnose_run(run)
    assert doctor.codes(found) == ["adapter_empty"]
    assert "holds 0 tensors" in found[0].message


def test_diagnose_diverged_ranks_slow_rank_and_a_crash(tmp_path):
    run = crafted_run(tmp_path / "div", [6.9, 6.5, 6.2], adapter=TRAINED, result=["aa", "bb"])
    assert doctor.codes(doctor.diagnose_run(run)) == ["ranks_diverged"]
    run = crafted_run(tmp_path / "slow", [6.9, 6.5, 6.2], adapter=TRAINED,
                      per_rank=[[0.1, 0.1], [0.1, 0.35], [0.1, 0.3]])  # fmt: skip
    assert doctor.codes(doctor.diagnose_run(run)) == ["slow_rank"]
    run = crafted_run(tmp_path / "crash", [], result=False,
                      log="[default0]:ValueError: Cannot flatten integer dtype tensors\n")
    assert doctor.codes(doctor.diagnose_run(run)) == ["fsdp1_int_storage"]
    run = crafted_run(tmp_path / "quiet", [6.9], result=False)
    assert doctor.codes(doctor.diagnose_run(run)) == ["run_incomplete"]


def test_diagnose_held_out_loss_that_rose_during_the_run(tmp_path):
    run = crafted_run(tmp_path / "rising", [6.9, 6.5, 6.2, 6.0, 5.8], adapter=TRAINED)
    with (run / "metrics.jsonl").open("a") as f:
        for step, loss in enumerate([6.0, 6.1, 6.2, 6.3, 6.1], 1):
            f.write(json.dumps({"split": "val", "step": step, "loss": loss}) + "\n")
    found = doctor.diagnose_run(run)
    assert doctor.codes(found) == ["val_loss_rising"] and "step 4 6.3000" in found[0].message


@pytest.mark.slow
def test_diagnose_a_real_tiny_run_finds_nothing_wrong(tiny_run):
    out = tiny_run  # the session's shared run (conftest): read, not changed
    found = doctor.diagnose_run(out)
    assert doctor.errors(found) == [], doctor.report(found)
    assert checks.check_adapter(out / "adapter") == []
    assert cli(["--run", str(out)]) == 0


# --------------------------------------------------------------------------- command line


def test_cli_exit_codes_and_one_line_per_finding(tmp_path, capsys):
    assert cli([str(TINY)]) == 0
    assert "0 error(s)" in capsys.readouterr().out
    assert cli([str(TINY), "sharding.engine=fsdp1", "sharding.use_orig_params=false"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ERROR   fsdp1_use_orig_params: sharding.use_orig_params=False: "
                               "LoRA under FSDP1") and (
        " | fix: use_orig_params=True (kit: sharding.use_orig_params=true;" in lines[0])  # fmt: skip
    bad, good = tmp_path / "bad.py", tmp_path / "good.py"
    bad.write_text(SCRIPTS[0][1])
    good.write_text(script())
    assert cli(["--script", str(bad)]) == 1 and cli(["--script", str(good)]) == 0
    log = tmp_path / "run.log"
    log.write_text(RAW[1][0])
    assert cli(["--explain", str(log)]) == 1
    nan = crafted_run(tmp_path / "nan", [6.9, math.nan])
    assert cli(["--run", str(nan)]) == 1
    capsys.readouterr()


def test_cli_as_a_module(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "kit.doctor", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    ok = run(str(TINY))
    assert ok.returncode == 0, ok.stderr
    bad = run(str(TINY), "sharding.engine=fsdp1", "quantization.storage=uint8")
    assert bad.returncode == 1
    assert "ERROR   fsdp1_int_storage: " in bad.stdout and "Cannot flatten integer" in bad.stdout


# --------------------------------------------------------------------------- notebook 11

NOTEBOOK = ROOT / "notebooks" / "11-troubleshooting.ipynb"


def checked_outputs(nb: dict) -> dict[str, str]:
    """Source -> stdout of the cells nbval compares (tagged nbval-check-output and keep_output)."""
    out = {}
    for c in nb["cells"]:
        if c["cell_type"] == "code" and "keep_output" in c["metadata"].get("tags", []):
            got = "".join("".join(o.get("text", "")) for o in c.get("outputs", []))
            out["".join(c["source"])] = got
    return out


def test_notebook_11_is_committed_clean_with_a_literal_parameters_cell():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    checked = checked_outputs(nb)
    assert len(checked) >= 2 and all(checked.values())  # deterministic cells keep their output
    for c in code:
        source = "".join(c["source"])
        if source in checked:
            assert "nbval-check-output" in c["metadata"]["tags"] and c["execution_count"]
        else:
            assert not c.get("outputs") and c.get("execution_count") is None
        assert len(source.splitlines()) <= 15
        ast.parse(source)  # plain Python, no magics
    assert "begin()" in "".join(code[0]["source"])  # the house bootstrap: run from the checkout
    params = [c for c in code if "parameters" in c["metadata"].get("tags", [])]
    assert len(params) == 1 and params[0] is code[2]
    for node in ast.parse("".join(params[0]["source"])).body:
        assert isinstance(node, ast.Assign)
        ast.literal_eval(node.value)  # literals only: papermill injects after this cell


@pytest.mark.slow
def test_notebook_11_runs_under_papermill(notebook_11):
    """Run once per session (conftest.notebook_11); test_pitfalls reads its reproductions."""
    nb = json.loads((notebook_11 / "11.ipynb").read_text())
    # What nbval --nbval-lax would compare: the stored deterministic outputs reproduce.
    assert checked_outputs(nb) == checked_outputs(json.loads(NOTEBOOK.read_text()))
    text = ""
    for cell in nb["cells"]:
        for o in cell.get("outputs", []):
            got = o.get("text", o.get("data", {}).get("text/plain", ""))
            text += got if isinstance(got, str) else "".join(got)
    summary = json.loads(text[text.rindex("SUMMARY ") + 8 :].splitlines()[0])
    from kit import pitfalls

    assert list(summary) == [p.code for p in pitfalls.reproduced()]  # every reproduction
    for case, s in summary.items():
        assert s["before"], case  # the doctor saw it coming
        assert s["raw_failed"] and s["expect"] in s["raw_codes"], (case, s)  # and explained it
        assert s["fixed_clean"], (case, s)  # and the one-line fix works
    assert "RunFailed" in text and "loss_nonfinite" in text  # the NaN run, caught and diagnosed
    assert (notebook_11 / "runs" / "nan" / "metrics.jsonl").is_file()  # out_dir reached the code
    # The check step: one line each, exit 2.
    assert "exit 2: ConfigError: data.path:" in text and "row 2 (line 2): 'text' is missing" in text
    assert "exit 2: ConfigError: attention.implementation: 'flex_attention'" in text
