"""Config: YAML + overrides, and one-line errors naming field, value and what is allowed."""

from pathlib import Path

import pytest

from kit.config import ConfigError, load_config

ROOT = Path(__file__).parents[1]
CONFIGS = sorted((ROOT / "kit" / "configs").glob("*.yaml"))  # the recipes a learner runs
MATRICES = sorted((ROOT / "benchmarks" / "matrices").glob("*.yaml"))  # kit.bench's matrices


def test_overrides_apply_and_coerce():
    cfg = load_config(None, ["sharding.engine=fsdp1", "training.lr=2e-4", "lora.target_modules=[q_proj,v_proj]"])
    assert cfg.sharding.engine == "fsdp1"
    assert cfg.training.lr == pytest.approx(2e-4)  # YAML 1.1 reads 2e-4 as a string
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]


def test_off_reads_as_off_on_the_command_line_and_in_a_file(tmp_path):
    """YAML 1.1 reads a bare `off` as false; `training.plan=off` is what the docs and the
    planner's refusal tell a user to write."""
    assert load_config(None, ["training.plan=off"]).training.plan == "off"
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  plan: off\n")
    assert load_config(path).training.plan == "off"
    with pytest.raises(ConfigError, match="training.plan: True is not allowed"):
        load_config(None, ["training.plan=on"])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_open_with_their_command(path):
    load_config(path)
    first = path.read_text().splitlines()[:4]
    assert any("kit.train" in line for line in first), first


def test_configs_hold_recipes_and_benchmarks_hold_matrices():
    assert CONFIGS and MATRICES
    assert not any("cases" in p.read_text() for p in CONFIGS)


@pytest.mark.parametrize("path", MATRICES, ids=lambda p: p.name)
def test_benchmark_matrices_hold_valid_kit_configs(path):
    """Every kit case of a kit.bench matrix is a valid recipe config (checked before a GPU run)."""
    from kit.bench.matrix import load_matrix

    matrix = load_matrix(path)
    assert any("kit.bench" in line for line in path.read_text().splitlines()[:6])
    for case in matrix["cases"]:
        if case["recipe"] == "kit":
            load_config(None, [f"model.name={matrix['model']}", *case.get("overrides", [])])
        # ["auto"]: the batch the kit's recipe plans for itself (kit.bench.matrix checks it).
        assert case["batches"] == sorted(case["batches"]), case["name"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.lr=-1"], "training.lr: -1.0 is not allowed; expected a number > 0"),
        (["trainig.lr=1"], "trainig: unknown key; did you mean training? allowed keys: run, model,"),
        (["training.lrr=1"], "training.lrr: unknown key; did you mean training.lr? allowed keys: plan, steps,"),
        (["training.step=30"], "training.step: unknown key; did you mean training.steps? allowed keys:"),
        (["training.zzz=1"], "training.zzz: unknown key; allowed keys: plan, steps,"),
        (["sharding.engine=zero3"], "sharding.engine: 'zero3' is not allowed; expected one of 'fsdp2', 'fsdp1', 'ddp'"),
        (["training.steps=ten"], "training.steps: 'ten' is not allowed; expected an integer"),
        (["training.batch_size=0"], "training.batch_size: 0 is not allowed; expected an integer >= 1"),
        (["training.recompute.mlp_tile_tokens=4096", "training.compile=true"],
         "training.recompute.mlp_tile_tokens: 4096 is not allowed; only 0 with training.compile=true"),
        (["lora.dropout=1.5"], "lora.dropout: 1.5 is not allowed"),
        (["training.compile=true", "training.activation_memory_budget=0"],
         "training.activation_memory_budget: 0.0 is not allowed; expected a number in (0, 1]"),
        (["training.compile=false", "training.compile_wrapper=cpp"],
         "training.compile_wrapper: 'cpp' is not allowed; only with training.compile=true or auto"),
        (["training.compile_wrapper=c"], "training.compile_wrapper: 'c' is not allowed; expected one of"),
        (["training.compile=false", "training.activation_memory_budget=0.5"],
         "training.activation_memory_budget: 0.5 is not allowed; only 1.0 without training.compile=true"),
        (["training.recompute.enabled=false", "training.recompute.keeps=matmuls"],
         "training.recompute.keeps: 'matmuls' is not allowed; only 'inputs' with training.recompute.enabled=false"),
        (["training.compile=true", "training.recompute.keeps=mlp_matmuls", "training.activation_memory_budget=0.5"],
         "training.activation_memory_budget: 0.5 is not allowed; only 1.0 with training.recompute.keeps='mlp_matmuls'"),
        (["training.recompute.keeps=attention_matmuls", "lora.recompute=true"],
         "lora.recompute: True is not allowed; only false with training.recompute.keeps='attention_matmuls'"),
        (["training.recompute.keeps=inputs", "training.recompute.matmul_layers=4"],
         "training.recompute.matmul_layers: 4 is not allowed; only 0 unless training.recompute.keeps is "
         "mlp_matmuls or attention_matmuls"),
        (["training.recompute.matmul_layers=-1"],
         "training.recompute.matmul_layers: -1 is not allowed; expected an integer >= 0"),
        (["training.recompute.keeps=all"],
         "training.recompute.keeps: 'all' is not allowed; expected one of 'auto', 'inputs', 'matmuls', 'mlp_matmuls', 'attention_matmuls'"),
        (["training.loss=fast"], "training.loss: 'fast' is not allowed; expected one of 'auto', 'hf', 'chunked', 'fused'"),
        (["sharding.engine=fsdp1", "quantization.storage=uint8"], "FSDP1 cannot flatten integer tensors"),
        (["sharding.engine=fsdp1", "lora.dtype=float32"], "lora.dtype: 'float32' is not allowed; FSDP1 flattens one dtype"),
        (["sharding.engine=fsdp1", "sharding.use_orig_params=false"], "sharding.use_orig_params: False is not allowed"),
        (["sharding.engine=fsdp1", "sharding.strategy=SHARD_GRAD_OP"], "SHARD_GRAD_OP fails with 4-bit"),
        (["sharding.engine=fsdp1", "sharding.strategy=NO_SHARD", "quantization.method=none"],
         "sharding.strategy: 'NO_SHARD' is not allowed; FSDP1's NO_SHARD (also what it runs on one process) and "
         "HYBRID_SHARD cannot save"),
        (["sharding.engine=fsdp1", "sharding.strategy=HYBRID_SHARD"],
         "sharding.strategy: 'HYBRID_SHARD' is not allowed; FSDP1's NO_SHARD"),
        (["training.lr=nan"], "training.lr: 'nan' is not allowed; expected a finite number"),
        (["training.max_grad_norm=.inf"], "training.max_grad_norm: inf is not allowed; expected a finite number"),
        (["run.overwrite=true"], "run.overwrite: renamed; use run.start_over"),
        (["model.dtype=float32", "attention.implementation=flash_attention_2"], "flash attention needs model.dtype"),
        (["training"], "override 'training': expected key=value"),
        # Renamed keys: one line to the new name (activation recomputation is not a checkpoint).
        (["training.activation_checkpointing=false"],
         "training.activation_checkpointing: renamed; use training.recompute.enabled"),
        (["training.checkpoint_every=2"],
         "training.checkpoint_every: renamed; use training.recompute.every"),
        (["training.checkpoint_keeps=mlp"],
         "training.checkpoint_keeps: renamed; use training.recompute.keeps (inputs, matmuls, "
         "mlp_matmuls, attention_matmuls; mlp -> mlp_matmuls"),
        (["training.recompute.every=0"], "training.recompute.every: 0 is not allowed; expected an integer >= 1"),
        # Once a rank traceback (torch's "Overflow when unpacking long long"), and a run folder
        # written outside launch/: one line each, from whatever loads the config.
        (["training.seed=18446744073709551617"], "training.seed: 18446744073709551617 is not "
         "allowed; expected an integer from 0 to 2**63 - 1"),
        (["training.seed=-1"], "training.seed: -1 is not allowed"),
        (["run.name=../../x"], "run.name: '../../x' is not allowed; expected letters, digits, "
         "'.', '_' or '-', starting with a letter or digit (it names a folder under launch/; "
         "run.output_dir=<path> writes elsewhere)"),
        (["run.name=a/b"], "run.name: 'a/b' is not allowed"),
        (["checkpointing.keep_best=true", "checkpointing.save_every=5", "training.eval_every=2"],
         "checkpointing.keep_best: True is not allowed; only false unless every checkpoint has a "
         "held-out loss: checkpointing.save_every > 0 a multiple of training.eval_every > 0 (they "
         "are 5 and 2)"),
        (["checkpointing.keep_best=true"], "checkpointing.keep_best: True is not allowed"),
    ],
)
def test_bad_values_get_one_line_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    text = str(err.value)
    assert message in text and "\n" not in text


def test_missing_file_is_named():
    with pytest.raises(ConfigError, match="config file: 'nope.yaml' does not exist"):
        load_config("nope.yaml")


@pytest.mark.parametrize("text, where", [
    ("run:\n  name: x\n model: [\n", "line 3 column 2 is not valid YAML"),
    ("training:\n  lr: [1, 2\n", "line 3 column 1 is not valid YAML"),
    ("- a list\n", "holds list"),
])
def test_a_broken_yaml_file_is_one_line_naming_file_line_and_column(tmp_path, text, where):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "c.yaml")
    message = str(err.value)
    assert message.startswith("config file: ") and "c.yaml" in message and where in message
    assert "\n" not in message


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["sharding.engine=ddp", "run.name=x"])
    (tmp_path / "c.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path / "c.yaml") == cfg
    assert cfg.output_dir == Path("launch/x")
