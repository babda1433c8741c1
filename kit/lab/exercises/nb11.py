"""Exercises of notebook 11 (troubleshooting): what the doctor says, before and after a run.
Hands-on: the first article's script, mended until the doctor's scan_script finds nothing while
it still loads in 4 bits, adds LoRA and shards: its loading and wrapping (11.2), then the whole
script with its save (11.3, stretch)."""

from __future__ import annotations

import ast
import re

from kit.lab.exercises import Exercise, one_of

H100X2 = {"gpus": [{"name": "NVIDIA H100", "memory_gib": 79.6}] * 2, "vars": {},
          "host_ram_gib": 64}
BIG = ["model.name=kit:llama-8b", "data.max_seq_len=4096", "training.batch_size=8",
       "training.recompute.enabled=false", "run.dist_timeout_min=2"]
ERROR = "RuntimeError: Cannot flatten integer dtype tensors"


def _batch_at_8192() -> int:
    from kit import ROOT, doctor

    found = doctor.preflight(ROOT / "kit" / "configs" / "tiny-cpu.yaml", env=H100X2,
                             overrides=BIG + ["data.max_seq_len=8192"])
    fix = next(f.fix for f in found if f.code == "memory_over_gpu")
    return int(re.search(r"training\.batch_size=(\d+)", fix)[1])


def _fsdp1_fix() -> str:
    from kit import doctor

    fix = next(f.fix for f in doctor.explain(ERROR))
    return re.search(r"kit: ([\w.]+=\w+)", fix)[1]


# ---- hands-on: mend a script until the doctor finds nothing ----

# The first article's loading and wrapping (section 2's script, its first four lines) and its save.
GIVEN_WRAP = """\
bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb, device_map="auto")
model = get_peft_model(prepare_model_for_kbit_training(model), lora)
model = FSDP(model, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
"""
GIVEN_SAVE = """\
config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
    model.module.save_pretrained(out, state_dict=model.state_dict())
"""
MENDED_WRAP = """\
bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16,
                         bnb_4bit_quant_storage=torch.bfloat16)
model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb,
                                             device_map={"": local_rank})
model = get_peft_model(model, lora)
model = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True,
             device_id=torch.device("cuda", local_rank))
"""
MENDED_SAVE = """\
state = gather_trainable(model)  # get_model_state_dict, full: every rank calls it
if rank == 0:
    save_adapter(layout, state, out)  # PEFT's keys and format, written, then read back
"""
LAYOUT = """\
layout = AdapterLayout(model)  # PEFT's file keys, read before wrapping
"""


def _with_layout(wrap: str) -> str:
    """The wrap with the adapter's layout taken before the model is wrapped (kit.recipe.checkpoint)."""
    head, fsdp, tail = wrap.partition("model = FSDP(")
    return head + LAYOUT + fsdp + tail


# What the mended script must still do (a call of each), so that deleting lines is no answer.
STILL = {"BitsAndBytesConfig": "load the model in 4 bits (BitsAndBytesConfig)",
         "from_pretrained": "load it (from_pretrained)", "get_peft_model": "add LoRA (get_peft_model)"}
SHARDS = ("FSDP", "fully_shard")


def _calls(tree) -> set[str]:
    return {getattr(n.func, "attr", getattr(n.func, "id", "")) for n in ast.walk(tree)
            if isinstance(n, ast.Call)}  # fmt: skip


def _check_script(script, save: bool) -> str | None:
    from kit import doctor

    if not isinstance(script, str):
        return "the script is a string: edit the text between the triple quotes"
    try:
        called = _calls(ast.parse(script))
    except SyntaxError as e:
        return f"it is no longer Python: line {e.lineno}: {e.msg}"
    missing = [what for call, what in STILL.items() if call not in called]
    if not called & set(SHARDS):
        missing.append("shard it (FSDP or fully_shard)")
    if save and not {"save_pretrained", "save_file", "save", "save_adapter"} & called:
        missing.append("save the adapter")
    if missing:
        return (f"the script must still {', '.join(missing)}: a script that does nothing has "
                "nothing for the doctor to find")
    found = doctor.scan_script(script)
    if not found:
        return None
    first, others = found[0], sorted({f.code for f in found[1:]} - {found[0].code})
    more = f" (and {len(others)} more: {', '.join(others)})" if others else ""
    return f"the doctor still finds {first.level} {first.code}: {first.message} | fix: {first.fix}{more}"


EXERCISES = [
    Exercise(
        key="11.1",
        question=(
            "The 2x H100 setup above (`h100`, `big`) with data.max_seq_len=8192 instead of 4096: "
            "which training.batch_size does the doctor name as the smallest change that fits? "
            "Predict it, then ask preflight (overrides=big + ['data.max_seq_len=8192']). "
            "(the answer: a number)"),
        check=lambda answer: one_of(_batch_at_8192(), {
            2: "that is the answer at 4,096 tokens; without recomputation the activations grow "
               "with batch x sequence length.",
            4: "8 did not fit at 4,096 tokens; the memory line prints the GiB per GPU a batch "
               "needs at 8,192: does 4 fit in 79.6 GiB?",
        }, default="run doctor.preflight with the override, read memory_over_gpu's fix.")(answer),
        solution=_batch_at_8192,
        wrong=(2, 4),
    ),
    Exercise(
        key="11.4",
        question=(
            f"A job under FSDP1 died with {ERROR!r}. Which override of the kit fixes it while "
            "keeping sharding.engine=fsdp1? (doctor.explain reads the error; the answer: a "
            "'key=value' string)"),
        check=lambda answer: one_of(_fsdp1_fix(), {
            "sharding.engine=fsdp2": "that avoids it too, but the question keeps FSDP1: what "
                                     "must the 4-bit bytes be stored in for FSDP1 to flatten "
                                     "them?",
            "quantization.method=none": "that drops 4-bit altogether (4x the weight memory); "
                                        "the fix keeps NF4.",
            "sharding.use_orig_params=true": "another FSDP1 pitfall; this error is about the "
                                             "dtype of the packed 4-bit weights.",
        }, default="doctor.explain(text) gives findings; the fix names the kit's key.")(answer),
        solution=_fsdp1_fix,
        wrong=("sharding.engine=fsdp2", "quantization.method=none",
               "sharding.use_orig_params=true"),
    ),
    Exercise(
        key="11.2",
        question=("Hands-on, quick: my_script holds the first article's loading and wrapping. "
                  "Mend it, line by line, until doctor.scan_script(my_script) finds nothing, "
                  "while it still loads in 4 bits, adds LoRA and shards the model."),
        check=lambda script: _check_script(script, save=False),
        solution=lambda: MENDED_WRAP,
        wrong=(MENDED_WRAP.replace(", use_orig_params=True", "").replace(
                   "FULL_SHARD", "SHARD_GRAD_OP"),
               "bnb = BitsAndBytesConfig(load_in_4bit=True)\n", GIVEN_WRAP),
        hands_on=True,
        given=GIVEN_WRAP,
    ),
    Exercise(
        key="11.3",
        question=("Hands-on, stretch: my_full_script is the article's whole script, its save "
                  "included. Mend all of it, until the doctor finds nothing and the script still "
                  "loads in 4 bits, adds LoRA, shards and saves the adapter."),
        check=lambda script: _check_script(script, save=True),
        solution=lambda: _with_layout(MENDED_WRAP) + MENDED_SAVE,
        wrong=(MENDED_WRAP + GIVEN_SAVE.replace("offload_to_cpu=True", "offload_to_cpu=False"),
               MENDED_WRAP, GIVEN_WRAP + GIVEN_SAVE),
        hands_on=True,
        given=GIVEN_WRAP + GIVEN_SAVE,
    ),
]
