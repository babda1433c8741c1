"""Scanning a user's training script (or accelerate YAML, or launch script) for the article
patterns that fail, or silently misbehave, under FSDP. Plain regular expressions over the text
with comments removed: the script is never imported or run.

    scan_script("train_fsdp_qlora.py")   # a path, or the text itself
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

from kit.findings import Finding, ordered


@dataclass(frozen=True)
class _Pattern:
    code: str
    level: str
    needs: tuple[str, ...]  # regexes that must all match (the first one gives the line)
    absent: tuple[str, ...]  # regexes that must not match anywhere
    message: str
    fix: str


FSDP1 = r"FullyShardedDataParallel|\bFSDP\(|distributed_type:\s*FSDP|fsdp_config"
ANY_FSDP = FSDP1 + r"|fully_shard\("
DISTRIBUTED = ANY_FSDP + r"|DistributedDataParallel|init_process_group|LOCAL_RANK|torchrun"
FOUR_BIT = r"load_in_4bit|Linear4bit|bnb_4bit"
PATTERNS = [
    _Pattern(
        "prepare_kbit_fsdp1",
        "error",
        (r"prepare_model_for_kbit_training\(", FSDP1),
        (),
        "prepare_model_for_kbit_training casts norms, embeddings and lm_head to float32; "
        "FSDP1 then fails: 'Must flatten tensors with uniform dtype'",
        "drop it (with non-reentrant checkpointing it is not needed) or use FSDP2",
    ),
    _Pattern(
        "device_map_with_fsdp",
        "error",
        (r"device_map\s*=\s*[\"'](auto|balanced|balanced_low_0|sequential)[\"']", DISTRIBUTED),
        (),
        "device_map='auto' spreads each rank's copy over every visible GPU; FSDP/DDP need "
        "one whole model per rank on its own device",
        "device_map={'': local_rank} (or none, then FSDP's device_id)",
    ),
    _Pattern(
        "full_state_dict_empty_adapter",
        "error",
        (r"save_pretrained\([^)]*state_dict\s*=", r"FULL_STATE_DICT"),
        (),
        "FULL_STATE_DICT keys keep FSDP1's nested '_fsdp_wrapped_module.' prefixes, so "
        "save_pretrained(state_dict=...) writes an adapter file with ZERO tensors, no error",
        "save with get_model_state_dict + PEFT's keys taken before wrapping (kit.checkpoint), "
        "then reload and check it (kit.checkpoint.verify_adapter)",
    ),
    _Pattern(
        "offload_to_cpu_segfault",
        "warning",
        (r"offload_to_cpu\s*=\s*True",),
        (),
        "FullStateDictConfig(offload_to_cpu=True) segfaults rank 0 on CPU/gloo runs "
        "(exit code -11, no Python traceback)",
        "offload_to_cpu=False with rank0_only=True on CPU (keep True on GPUs)",
    ),
    _Pattern(
        "shard_grad_op_4bit",
        "error",
        (r"SHARD_GRAD_OP", FOUR_BIT),
        (),
        "SHARD_GRAD_OP with 4-bit weights (FSDP1) fails in backward: 'FSDP does not support "
        "changing the parameters between forward and backward'",
        "ShardingStrategy.FULL_SHARD, or FSDP2 fully_shard(reshard_after_forward=False)",
    ),
    _Pattern(
        "eval_mode_checkpointing",
        "warning",
        (r"(gradient|activation)_checkpointing_enable\(",),
        (r"\.train\(\s*(True)?\s*\)", r"Trainer\("),
        "gradient checkpointing enabled but model.train() never called: from_pretrained "
        "returns eval mode, where HF checkpointing silently does nothing (peak memory "
        "as without it)",
        "call model.train() before the training loop",
    ),
    _Pattern(
        "fsdp1_int_storage",
        "error",
        (r"load_in_4bit\s*=\s*True", FSDP1),
        (r"bnb_4bit_quant_storage",),
        "4-bit weights without bnb_4bit_quant_storage are packed in uint8; FSDP1 fails: "
        "'Cannot flatten integer dtype tensors'",
        "BitsAndBytesConfig(..., bnb_4bit_quant_storage=torch.bfloat16) (= the model dtype)",
    ),
    _Pattern(
        "fsdp1_use_orig_params",
        "error",
        (r"use_orig_params\s*(=|:)\s*(False|false)", r"peft|LoraConfig|get_peft_model"),
        (),
        "LoRA under FSDP1 with use_orig_params=False: 'Must flatten tensors with uniform "
        "`requires_grad`'; the adapters cannot train",
        "use_orig_params=True (accelerate: fsdp_use_orig_params: true)",
    ),
    _Pattern(
        "fsdp1_no_device_id",
        "warning",
        (r"FullyShardedDataParallel\(|\bFSDP\(",),
        (r"device_id\s*=",),
        "FSDP1 without device_id: on CPU it fails ('FSDP needs a non-CPU accelerator "
        "device'); on GPUs it silently uses whatever device is current",
        "FSDP(..., device_id=torch.device('cuda', local_rank)) (torch.device('cpu') on CPU)",
    ),
    _Pattern(
        "peft_auto_wrap_fp32",
        "warning",
        (r"fsdp_auto_wrap_policy\s*\(", FSDP1),
        (),
        "PEFT's fsdp_auto_wrap_policy puts float32 LoRA in units of its own; the forward "
        "then fails: 'expected m1 and m2 to have the same dtype'",
        "cast the adapters to the compute dtype, or wrap decoder layers only",
    ),
    _Pattern(
        "flash_attn_missing",
        "warning",
        (r"attn_implementation\s*=\s*[\"']flash_attention_2[\"']",),
        (),
        "flash_attention_2 needs the flash-attn package (GPU only, a long build); without "
        "it: 'FlashAttention2 has been toggled on, but it cannot be used'",
        "attn_implementation='sdpa' (a FlashAttention-2 kernel is built into PyTorch)",
    ),
    _Pattern(
        "tokenizers_parallelism",
        "warning",
        (r"num_workers\s*=\s*[1-9]",),
        (r"TOKENIZERS_PARALLELISM",),
        "DataLoader workers fork after a fast tokenizer ran: deadlocks or 'The current "
        "process just got forked, after parallelism has already been used'",
        "os.environ['TOKENIZERS_PARALLELISM'] = 'false' at the top of the script",
    ),
    _Pattern(
        "torch_dtype_deprecated",
        "info",
        (r"torch_dtype\s*=",),
        (),
        "from_pretrained(torch_dtype=...) is deprecated in transformers 5",
        "from_pretrained(dtype=...)",
    ),
]


def _strip_comments(text: str) -> str:
    """Python comments removed (line numbers kept), so '# or SHARD_GRAD_OP' does not count."""
    try:
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        lines = text.splitlines(keepends=True)
        for tok in tokens:
            if tok.type == tokenize.COMMENT:
                (row, col), end = tok.start, tok.end[1]
                lines[row - 1] = lines[row - 1][:col] + " " * (end - col) + lines[row - 1][end:]
        return "".join(lines)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return re.sub(r"(?m)(^|\s)#.*$", r"\1", text)  # YAML / shell


def scan_script(path_or_text: str | Path) -> list[Finding]:
    """Findings for a user's training script (or YAML/shell): the article patterns that fail or
    silently misbehave under FSDP. Each message starts with the line it points at."""
    text = str(path_or_text)
    if "\n" not in text and len(text) < 4096 and Path(text).is_file():
        text = Path(text).read_text()
    code = _strip_comments(text)
    out = []
    for p in PATTERNS:
        first = re.search(p.needs[0], code)
        if not first or not all(re.search(r, code) for r in p.needs[1:]):
            continue
        if any(re.search(r, code) for r in p.absent):
            continue
        line = code.count("\n", 0, first.start()) + 1
        out.append(Finding(p.level, p.code, f"line {line}: {p.message}", p.fix))
    return ordered(out)
