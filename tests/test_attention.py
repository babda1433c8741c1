"""Notebook 06's modules. kit.recipe.attention: pinned SDPA kernels registered with transformers give
sdpa's logits and hold through backward and checkpoint recompute; what cannot run says so in one
line; usable() answers what runs here. kit.lab.attention_bench: the microbenchmark records failures as
rows. kit.lab.recompute_sweep: one real recipe run per setting, named by its config overrides."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from kit.config import ConfigError, load_config
from kit.inputs import builtin
from kit.lab import attention_bench, recompute_sweep
from kit.recipe import attention, quantize
from kit.recipe.recompute import enable_activation_checkpointing

CPU_KERNELS = ("sdpa_flash", "sdpa_math")  # PyTorch's CPU SDPA kernels; efficient/cudnn: CUDA only


def tiny_model(implementation: str):
    impl, warning = attention.resolve(implementation)
    assert warning is None
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(
        builtin.resolve("kit:tiny-llama"), dtype=torch.float32, attn_implementation=impl
    )


def batch():
    ids = torch.randint(3, 1024, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: the model needs its sdpa mask
    return ids, mask


@pytest.fixture(scope="module")
def sdpa_logits():
    ids, mask = batch()
    with torch.no_grad():
        return tiny_model("sdpa")(input_ids=ids, attention_mask=mask).logits


def test_which_pinned_kernels_run_on_cpu():
    here = attention.usable("cpu", "float32")
    assert list(here) == list(attention.NAMES)  # every name the config allows, in its order
    runs = [n for n, ok in here.items() if ok is True and n != "flex_attention"]
    assert runs == ["eager", "sdpa", *CPU_KERNELS]  # flex_attention: as this torch decides
    for name in ("sdpa_efficient", "sdpa_cudnn"):
        assert "no CPU kernel" in here[name], here[name]


@pytest.mark.parametrize("name", CPU_KERNELS)
def test_pinned_kernel_gives_sdpa_logits(name, sdpa_logits):
    model = tiny_model(name)
    assert model.config._attn_implementation == attention.REGISTERED[name]
    ids, mask = batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()  # padded positions attend to nothing: their values are arbitrary
    assert torch.allclose(logits[real], sdpa_logits[real], atol=1e-5, rtol=1e-5)
    # The mask reached the kernel: without it the padded row's real tokens would differ.
    with torch.no_grad():
        unmasked = model(input_ids=ids).logits
    assert not torch.allclose(unmasked[1, 5:], sdpa_logits[1, 5:], atol=1e-3)


class AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def flash_ops(ops):
    return [op for op in ops if "flash_attention" in op]


@pytest.mark.parametrize("name", ["sdpa", *CPU_KERNELS])
def test_pinned_kernel_holds_in_backward_and_checkpoint_recompute(name):
    """On CPU plain sdpa picks the flash kernel. Pinned to math, no flash op runs anywhere;
    pinned to flash, the recompute runs flash again and backward runs flash's backward."""
    model = tiny_model(name)
    assert enable_activation_checkpointing(model) == [0, 1]
    model.train()
    ids, mask = batch()
    with AtenOps() as forward:
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    with AtenOps() as backward:
        loss.backward()
    fwd, bwd = flash_ops(forward.ops), flash_ops(backward.ops)
    if name == "sdpa_math":
        assert fwd == bwd == []
        assert backward.ops.count("_safe_softmax") == 2  # the math kernel, recomputed per layer
    else:
        kernel = "_scaled_dot_product_flash_attention_for_cpu"
        assert fwd == [kernel] * 2
        assert sorted(bwd) == sorted([kernel] * 2 + [kernel + "_backward"] * 2)


def test_unusable_kernel_is_a_one_line_error():
    with pytest.raises(ConfigError) as e:
        attention.resolve("sdpa_efficient", "cpu", "float32")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("attention.implementation: 'sdpa_efficient' cannot run on cpu")
    assert "; allowed here: eager, sdpa, sdpa_flash, sdpa_math" in message
    # Registered without a device check, the model fails at its first attention call, the same way.
    model = tiny_model("sdpa_efficient")
    with pytest.raises(ConfigError) as e:
        model(input_ids=batch()[0])
    assert "\n" not in str(e.value) and "cannot run this call (cpu float32" in str(e.value)
    assert str(e.value).endswith("allowed for it: sdpa, sdpa_flash, sdpa_math, eager")


def test_flash_attention_2_without_the_package_falls_back(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn" else find_spec(name, *a))  # fmt: skip
    impl, warning = quantize.attention_implementation("flash_attention_2")  # what the recipe calls
    assert (impl, warning) == ("sdpa", attention.FLASH_ATTN_MISSING)
    assert "flash-attn package" in warning and "using 'sdpa'" in warning
    assert "not installed" in attention.usable("cpu", "float32")["flash_attention_2"]


def test_bad_name_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as e:
        load_config("kit/configs/tiny-cpu.yaml", ["attention.implementation=sdpa_fast"])
    assert str(e.value) == (
        "attention.implementation: 'sdpa_fast' is not allowed; expected one of 'auto', 'eager', 'sdpa', "
        "'sdpa_flash', 'sdpa_efficient', 'sdpa_cudnn', 'sdpa_math', 'flex_attention', "
        "'flash_attention_2'"
    )
    with pytest.raises(ConfigError, match="'sdpa_fast' is not allowed"):
        attention.resolve("sdpa_fast")
    for name in attention.NAMES:  # every name the config allows resolves
        load_config(None, [f"attention.implementation={name}"])
        assert attention.resolve(name)[0]


def test_sweep_records_failures_as_rows(monkeypatch):
    """Every implementation gets a row; one that fails (here flex_attention, made to run out of
    memory: compiling it on CPU takes ~40 s) or has no kernel records why."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flex_attention", out_of_memory)
    rows = attention_bench.sweep([32, 64], attention.NAMES, heads=4, kv_heads=2, head_dim=16,
                           device="cpu", dtype="float32", repeats=1)  # fmt: skip
    assert [(r["implementation"], r["seq_len"]) for r in rows] == [
        (n, s) for s in (32, 64) for n in attention.NAMES]
    by_name = {r["implementation"]: r for r in rows if r["seq_len"] == 64}
    for name in ("eager", "sdpa", *CPU_KERNELS):
        r = by_name[name]
        assert r["error"] is None and r["agrees"] and r["ms"] > 0 and r["peak_mib"] > 0, r
    assert by_name["sdpa_math"]["out_diff"] == 0  # the reference itself
    assert by_name["eager"]["peak_mib"] > by_name["sdpa_flash"]["peak_mib"]  # the seq x seq scores
    assert by_name["flex_attention"]["error"].startswith("out of memory: CUDA out of memory")
    assert "no CPU kernel" in by_name["sdpa_cudnn"]["error"]
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash-attn package is not installed" in by_name["flash_attention_2"]["error"]
    with pytest.raises(ConfigError, match="implementations: 'fast' is not allowed"):
        attention_bench.sweep([32], ["fast"])


@pytest.mark.full  # CI time: notebook 06's test runs the same two settings (test_notebooks.sweep_ran_each_setting)
def test_recompute_sweep_runs_the_recipe_once_per_setting(tmp_path):
    """Two real runs (torchrun, one CPU rank each): recomputing changes what is kept, not what is
    computed, so the losses match; each row says what the run read and where it is."""
    settings = ["training.recompute.enabled=false",
                "training.recompute.enabled=true training.recompute.keeps=matmuls"]  # fmt: skip
    rows = recompute_sweep.sweep(settings, steps=2, seq_len=64, batch_size=2, out_dir=tmp_path,
                                 overrides=["model.dtype=float32"])  # fmt: skip
    assert [r["setting"] for r in rows] == settings
    assert [(r["enabled"], r["keeps"], r["error"]) for r in rows] == [
        (False, "inputs", None), (True, "matmuls", None)]
    for r in rows:
        assert r["peak_mem_gib"] > 0.1 and r["step_s"] > 0 and r["tokens_per_s"] > 0, r
        run_config = (tmp_path / recompute_sweep.folder_name(r["setting"]) / "config.yaml")
        assert r["folder"] == str(run_config.parent) and "recompute:" in run_config.read_text()
    assert rows[0]["final_loss"] == pytest.approx(rows[1]["final_loss"], rel=1e-5)


def test_recompute_sweep_checks_every_setting_first_and_rows_failed_runs(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="training.recompute.keeps: 'mlp' is not allowed"):
        recompute_sweep.sweep(["training.recompute.enabled=false", "training.recompute.keeps=mlp"],
                              out_dir=tmp_path)  # fmt: skip
    assert not any(tmp_path.iterdir())  # nothing ran
    with pytest.raises(ValueError, match="empty setting"):
        recompute_sweep.sweep([" "], out_dir=tmp_path)
    with pytest.raises(ValueError, match="nproc: 0 is not allowed"):
        recompute_sweep.sweep(["training.recompute.every=2"], nproc=0, out_dir=tmp_path)
    with pytest.raises(ConfigError, match="model.name: 'kit:no-such-model' is not a kit model"):
        recompute_sweep.sweep(["training.recompute.every=2"], model="kit:no-such-model",
                              out_dir=tmp_path)  # the check step, before any run
    assert not any(tmp_path.iterdir())
    monkeypatch.setenv("KIT_FAIL_RANK", "0")  # what no check can know: a rank that crashes
    rows = recompute_sweep.sweep(["training.recompute.every=2"], out_dir=tmp_path)
    assert rows[0]["peak_mem_gib"] is None and "InjectedFailure" in rows[0]["error"], rows
    assert rows[0]["error"].startswith("rank 0: ") and "\n" not in rows[0]["error"]
