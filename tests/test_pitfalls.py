"""The pitfall registry (kit.pitfalls): one record per pitfall, and every reader cites it.

Each record must recognise its own reproduction: its config predicate fires on the config that
makes the mistake (and load_config refuses it with exactly that line), its script patterns on the
source of its wrong code (and not on its fixed code), its error pattern on the error that code
raises when it runs. `disagreements` checks a record against those; a record planted with a
broken predicate or pattern must be caught by it, so the checker cannot go blind."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import TINY

from kit import doctor, pitfalls
from kit.config import Config, ConfigError, apply_overrides, load_config
from kit.doctor.context import namespace
from kit.doctor.script import script_line
from kit.findings import LEVELS
from kit.lab.reproduce import CPU, describe, launches, read, repro_table
from kit.pitfalls import FSDP1, PITFALLS, Violation

REPRODUCED = pitfalls.reproduced()


def view(overrides=()):
    """The defaults with `overrides`, unvalidated, as the predicates see a raw tree."""
    return namespace(apply_overrides(Config().to_dict(), list(overrides)))


def disagreements(p: pitfalls.Pitfall, raised: str | None = None) -> list[str]:
    """What record `p` claims that its reproduction does not show. `raised`: the raw error
    text its wrong side produced when run (None: not run)."""
    out = []
    if p.config:
        found = p.config(view(p.overrides))
        if found is None:
            out.append(f"{p.code}: its config predicate is silent on {list(p.overrides)}")
        else:
            if found.field not in p.fields:
                out.append(f"{p.code}: names {found.field}, not one of {p.fields}")
            try:
                load_config(TINY, list(p.overrides))
                out.append(f"{p.code}: load_config accepts {list(p.overrides)}")
            except ConfigError as e:
                if str(e) != str(found):
                    out.append(f"{p.code}: load_config says {e}, the record {found}")
        if p.config(view()) is not None:
            out.append(f"{p.code}: its config predicate fires on the defaults")
    if p.script and p.wrong:
        if script_line(p, pitfalls.source(p.wrong)) is None:
            out.append(f"{p.code}: its script patterns miss its wrong code ({p.wrong})")
        if script_line(p, pitfalls.source(p.fixed)) is not None:
            out.append(f"{p.code}: its script patterns flag its fixed code ({p.fixed})")
    if raised is not None:
        cause = pitfalls.get(p.raises) if p.raises else p
        if not cause.error or not re.search(cause.error, raised):
            out.append(f"{p.code}: the error pattern of {cause.code} misses {raised[:120]!r}")
    return out


# --------------------------------------------------------------------------- the records


def test_records_are_well_formed():
    assert len({p.code for p in PITFALLS}) == len(PITFALLS)
    for p in PITFALLS:
        assert p.level in LEVELS and p.title and p.message and p.fix, p.code
        assert "\n" not in p.title + p.message + p.fix, p.code
        assert bool(p.wrong) == bool(p.fixed), p.code  # a reproduction has both sides
        if p.config or p.machine:
            assert p.fields, p.code
        if p.raises:
            assert pitfalls.get(p.raises).error, p.code
        for pattern in (p.error, *p.script, *p.script_absent):
            re.compile(pattern)


def test_every_reproduction_names_functions_that_exist_and_say_what_they_do():
    assert len(REPRODUCED) >= 14
    for p in REPRODUCED:
        for function in (p.wrong, p.fixed):
            assert pitfalls.source(function).startswith(f"def {function}(cfg, env, out):")
            assert pitfalls.summary(function), function
    for missing in ("no_such_function", ""):
        with pytest.raises(KeyError):
            pitfalls.source(missing)


@pytest.mark.parametrize("p", [p for p in PITFALLS if p.config or p.script],
                         ids=lambda p: p.code)  # fmt: skip
def test_record_recognises_its_own_reproduction(p):
    assert disagreements(p) == []


def test_script_patterns_without_a_reproduction_are_the_known_few():
    # Not reproduced on the tiny model (a deprecation; a fork deadlock): test_doctor's SCRIPTS
    # hold a script for each. A new script pattern comes with a reproduction.
    unreproduced = {p.code for p in PITFALLS if p.script and not p.wrong}
    assert unreproduced == {"torch_dtype_deprecated", "tokenizers_parallelism"}


def test_load_config_refuses_exactly_the_config_predicates():
    config_pitfalls = {p.code for p in PITFALLS if p.config}
    assert config_pitfalls == {"fsdp1_int_storage", "fsdp1_mixed_dtype", "fsdp1_use_orig_params",
                               "shard_grad_op_4bit", "flash_attn_fp32", "fsdp1_no_shard"}  # fmt: skip
    # Values a predicate refuses and load_config does not: none; and the other way round.
    assert [str(v) for _, v in pitfalls.config_violations(view(["quantization.storage=float32",
                                                              "sharding.engine=fsdp1"]))] == [
        "quantization.storage: 'float32' is not allowed; FSDP1 flattens one dtype per unit; use "
        "auto or 'bfloat16' (= model.dtype)"]  # fmt: skip
    assert pitfalls.config_violations(load_config(TINY, ["sharding.engine=fsdp1"])) == []


# --------------------------------------------------------------------------- planted records


def test_planted_record_with_broken_patterns_is_caught():
    real = pitfalls.get("fsdp1_int_storage")
    assert disagreements(real, raised="ValueError: Cannot flatten integer dtype tensors") == []
    typo = dataclasses.replace(real, script=(r"load_in_8bit\s*=\s*True", FSDP1))
    assert disagreements(typo) == [
        "fsdp1_int_storage: its script patterns miss its wrong code (uint8_storage)"]
    blind = dataclasses.replace(real, script=(r"def \w+\(cfg, env",), script_absent=())
    assert disagreements(blind) == [
        "fsdp1_int_storage: its script patterns flag its fixed code (fsdp1_the_kit_way)"]
    stale = dataclasses.replace(real, error=r"Cannot flatten integer tensors")
    assert disagreements(stale, raised="ValueError: Cannot flatten integer dtype tensors") == [
        "fsdp1_int_storage: the error pattern of fsdp1_int_storage misses 'ValueError: Cannot "
        "flatten integer dtype tensors'"]  # fmt: skip


def test_planted_record_with_a_broken_config_predicate_is_caught():
    real = pitfalls.get("fsdp1_use_orig_params")
    assert disagreements(dataclasses.replace(real, config=lambda cfg: None)) == [
        "fsdp1_use_orig_params: its config predicate is silent on "
        "['sharding.engine=fsdp1', 'sharding.use_orig_params=false']"]  # fmt: skip
    reworded = dataclasses.replace(real, config=lambda cfg: Violation(
        "sharding.use_orig_params", False, "use true"))  # fmt: skip
    assert disagreements(reworded)[0].startswith(
        "fsdp1_use_orig_params: load_config says sharding.use_orig_params: False is not allowed; "
        "LoRA under FSDP1 needs true")  # fmt: skip
    always = dataclasses.replace(real, config=lambda cfg: Violation("lora.dtype", "auto", "x"))
    assert "fsdp1_use_orig_params: its config predicate fires on the defaults" in (
        disagreements(always))  # fmt: skip


# --------------------------------------------------------------------------- every reader cites it


# The raw errors of FINDINGS.md's traps, as the libraries print them.
TRAPS = {
    "fsdp1_mixed_dtype": "ValueError: Must flatten tensors with uniform dtype but got "
                         "torch.bfloat16 and torch.float32",
    "fsdp1_int_storage": "ValueError: Cannot flatten integer dtype tensors",
    "fsdp1_mixed_dtype_forward": "RuntimeError: expected m1 and m2 to have the same dtype, but "
                                 "got: float != c10::BFloat16",
    "shard_grad_op_4bit": "AssertionError: FSDP does not support changing the parameters between "
                          "forward and backward for HandleShardingStrategy.SHARD_GRAD_OP",
    "accelerate_fsdp_cpu": "RuntimeError: no available devices",
}  # fmt: skip


def test_config_preflight_script_and_explain_cite_the_same_records():
    def cited(findings, code):  # the reader answered with the record: its code, message, fix
        mine = [f for f in findings if f.code == code]
        p = pitfalls.get(code)
        assert mine and all(p.message in f.message and f.fix == p.fix for f in mine), code
        return mine

    for p in PITFALLS:
        if p.config:  # the field load_config names is the field of the doctor's finding
            found = doctor.preflight(TINY, env=CPU, overrides=list(p.overrides))
            field = p.config(view(p.overrides)).field
            assert [f.field for f in cited(found, p.code)] == [field], p.code
        if p.script and p.wrong:
            cited(doctor.scan_script(pitfalls.source(p.wrong)), p.code)
    for code, raw in TRAPS.items():
        found = doctor.explain(f"Traceback (most recent call last):\n{raw}\n")
        assert doctor.codes(found) == [code]
        cited(found, code)
    assert doctor.EXPLAIN == [p for p in PITFALLS if p.error]
    assert doctor.PATTERNS == [p for p in PITFALLS if p.script]


def test_machine_predicates_read_the_machine():
    gpu = {"gpus": [{"name": "H100", "memory_gib": 79.6}] * 2, "vars": {},
           "packages": {"flash_attn": True}}  # fmt: skip
    flash = ["attention.implementation=flash_attention_2"]
    assert "flash_attn_missing" in doctor.codes(doctor.preflight(TINY, env=CPU, overrides=flash))
    assert "flash_attn_missing" not in doctor.codes(doctor.preflight(TINY, env=gpu,
                                                                     overrides=flash))
    one_rank = {**CPU, "nproc_per_node": 1}
    assert "device_map_with_fsdp" not in doctor.codes(
        doctor.preflight(TINY, env=one_rank, overrides=["model.device_map=auto"]))


def test_launches_run_the_crashing_step_last():
    (steps,) = launches()
    assert steps[-1] == "offload_to_cpu_segfault:wrong"
    assert "offload_to_cpu_segfault:fixed" in steps[:-1]
    assert len(steps) == 2 * len(REPRODUCED)
    assert launches(["fsdp1_int_storage"], sides=["fixed"]) == [["fsdp1_int_storage:fixed"]]
    with pytest.raises(ValueError, match="has no reproduction"):
        launches(["cuda_oom"])


def test_read_names_a_launch_folder_that_was_never_run(tmp_path):
    (tmp_path / "launch-0").mkdir()  # written, not run: no exit_code, no reports
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path / 'launch-0'}: no finished launch"):
        read(out=tmp_path)


# --------------------------------------------------------------------------- run for real


@pytest.fixture(scope="module")
def runs(notebook_11):
    """Every reproduction, both sides, in one torchrun launch of 2 CPU ranks: the launch notebook
    11 made with reproduce() (conftest.notebook_11, run once per session), read back from its
    folder as reproduce() itself reads it."""
    return read(out=notebook_11 / "runs")


@pytest.mark.slow
def test_each_wrong_side_fails_as_its_record_says_and_the_fix_runs(runs):
    assert list(runs["wrong"]) == list(runs["fixed"]) == [p.code for p in REPRODUCED]
    for p in REPRODUCED:
        wrong, fixed = runs["wrong"][p.code], runs["fixed"][p.code]
        assert wrong.failed, (p.code, wrong.observed)
        assert p.expect in doctor.codes(doctor.errors(wrong.findings)), (p.code, wrong.error)
        if not wrong.ok:  # it raised (or died): the record's error pattern knows that text
            assert disagreements(p, raised=wrong.text) == [], wrong.text[-2000:]
        assert not fixed.failed, (p.code, fixed.error, fixed.text[-2000:])
    text = describe(runs, "full_state_dict_empty_adapter")
    assert "observed:     adapter_model.safetensors holds 0 tensors, no error" in text
    assert "with the fix: kit.recipe.checkpoint.save_adapter wrote 28 tensors (verified)" in text
    assert "FAILED" in repro_table(runs["wrong"]) and "FAILED" not in repro_table(runs["fixed"])
