"""Explaining a failed run: the raw error strings met on this stack, each mapped to its cause
and fix. Used on a run's logs (diagnose_run), by the launcher when a run fails, and from the
command line (`python -m kit.doctor --explain run.log`).

The patterns quote the exact text the libraries print (FINDINGS.md; kit/repro.py reproduces
most of them on CPU), so a message seen an hour into a GPU job is recognised at once.
"""

from __future__ import annotations

import re

from kit.findings import LEVELS, Finding

EXPLAIN: list[tuple] = [
    # (regex over the raw text, code, cause, fix[, level: 'error' unless given])
    (
        r"Must flatten tensors with uniform `?requires_grad`?",
        "fsdp1_use_orig_params",
        "FSDP1 with use_orig_params=False cannot put frozen weights and trainable LoRA in one unit",
        "use_orig_params=True (sharding.use_orig_params=true), or FSDP2",
    ),
    (
        r"Must flatten tensors with uniform dtype",
        "fsdp1_mixed_dtype",
        "FSDP1 unit mixes dtypes: float32 LoRA (PEFT's default) or "
        "prepare_model_for_kbit_training's "
        "float32 norms next to bfloat16 weights",
        "cast adapters to the model dtype (lora.dtype=auto), skip prepare_model_for_kbit_training, "
        "or use FSDP2",
    ),
    (
        r"Cannot flatten integer dtype tensors",
        "fsdp1_int_storage",
        "FSDP1 got 4-bit weights packed in uint8 (bitsandbytes' default quant storage)",
        "bnb_4bit_quant_storage=<model dtype> (quantization.storage=auto), or FSDP2",
    ),
    (
        r"expected m1 and m2 to have the same dtype|mat1 and mat2 must have the same dtype",
        "fsdp1_mixed_dtype_forward",
        "a matmul met two dtypes: float32 LoRA weights on bfloat16 activations (PEFT's "
        "fsdp_auto_wrap_policy keeps adapters in units of their own, uncast)",
        "cast the adapters to the compute dtype (lora.dtype=auto) or wrap decoder layers only",
    ),
    (
        r"FSDP needs a non-CPU accelerator device",
        "fsdp1_no_device_id",
        "FSDP1 on CPU without device_id",
        "FSDP(..., device_id=torch.device('cpu'))",
    ),
    (
        r"FSDP does not support changing the parameters between forward and backward",
        "shard_grad_op_4bit",
        "FSDP1 SHARD_GRAD_OP keeps parameters unsharded between forward and backward, which "
        "bitsandbytes' 4-bit weights break",
        "sharding.strategy=FULL_SHARD, or FSDP2",
    ),
    (
        r"no available devices",
        "accelerate_fsdp_cpu",
        "accelerate found no GPU for its FSDP config (it cannot run FSDP on CPU)",
        "run on GPUs, or torchrun -m kit.train (FSDP over gloo works on CPU)",
    ),
    (
        r"CUDA out of memory|OutOfMemoryError",
        "cuda_oom",
        "a GPU ran out of memory (model shard + activations + logits exceed it, or fragmentation)",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; lower batch_size or max_seq_len; "
        "training.recompute.enabled=true; more GPUs",
    ),
    (
        r"Watchdog caught collective operation timeout|Timed out waiting \d+ms|"
        r"DistBackendError.*[Tt]imeout|wait timeout after \d+ms",
        "dist_timeout",
        "a collective waited past the process-group timeout: one rank was busy (saving, loading, "
        "building a model) or had died while the others waited",
        "raise run.dist_timeout_min (init_process_group(timeout=...)); check the first rank's "
        "error",
    ),
    (
        r"FlashAttention2? has been toggled on, but it cannot be used",
        "flash_attn_missing",
        "flash_attention_2 requested where the flash-attn package or a GPU is missing",
        "attention.implementation=sdpa (PyTorch's own flash/cuDNN kernels)",
    ),
    (
        r"Flash Attention \d only supports torch.float16 and torch.bfloat16",
        "flash_attn_fp32",
        "flash attention on a float32 model",
        "model.dtype=bfloat16, or sdpa",
    ),
    (
        r"Target modules? .* not found in the base model|matches no module of the model",
        "target_modules_unmatched",
        "LoRA target_modules names no module of this model",
        "lora.target_modules=all-linear, or names from python -m kit.doctor CONFIG",
    ),
    (
        r"Target module \w+\([\s\S]*?\) is not supported",
        "target_modules_unsupported",
        "a LoRA target names a block (e.g. mlp), not a linear layer",
        "name linear layers",
    ),
    (
        r"is not a column of|KeyError: '(text|messages)'",
        "text_field_missing",
        "the dataset has no column with the configured text/messages field",
        "data.text_field / data.messages_field = an existing column",
    ),
    (
        r"loss is nan|loss is inf|Loss is NaN|non-finite loss",
        "loss_nonfinite",
        "the loss became NaN/inf: learning rate too high, fp16 overflow, or bad data",
        "lower training.lr, keep max_grad_norm > 0, use bfloat16 rather than float16",
    ),
    (
        r"none of \d+ trainable tensors changed|lora_B tensors in .* are \(near\) zero",
        "lora_not_training",
        "the adapters did not move: no gradient reaches them, or the optimizer does not hold them",
        "use_orig_params=true under FSDP1, LoRA applied before sharding, optimizer built after",
    ),
    (
        r"gradient checkpointing is on in \d+ modules in eval mode",
        "eval_mode_checkpointing",
        "checkpointing was switched on in a model left in eval mode (from_pretrained's default)",
        "call model.train() before training",
    ),
    (
        r"LoRA tensors missing \(holds 0\)|adapter_model\.safetensors.*(no|zero) tensors",
        "adapter_empty",
        "the adapter file holds no tensors (FSDP-prefixed keys were not mapped)",
        "save through kit.checkpoint (PEFT keys taken before wrapping)",
    ),
    (
        r"exitcode\s*:\s*-11|Signal 11|SIGSEGV|Segmentation fault",
        "segfault",
        "a rank died of a segmentation fault; on CPU, FullStateDictConfig(offload_to_cpu=True) "
        "does this on rank 0",
        "offload_to_cpu=False with rank0_only=True on CPU; else see dmesg",
    ),
    (
        r"exitcode\s*:\s*-9\b|Signal 9 |SIGKILL",
        "killed_oom",
        "a rank was killed (SIGKILL): usually the host's out-of-memory killer, e.g. every rank "
        "loading the whole model into RAM",
        "fewer ranks per node, rank-0-only loading, more RAM",
    ),
    (
        r"Torch not compiled with CUDA enabled|No CUDA GPUs are available|Found no NVIDIA driver",
        "no_gpu",
        "CUDA requested where there is no GPU",
        "training.device=auto or cpu",
    ),
    (
        r"invalid device ordinal",
        "more_ranks_than_gpus",
        "more ranks than GPUs on this node",
        "--nproc_per_node = number of GPUs",
    ),
    (
        r"EADDRINUSE|[Aa]ddress already in use",
        "port_in_use",
        "the rendezvous port is taken (another run, or a stale one)",
        "torchrun --standalone (picks a free port), or another MASTER_PORT",
    ),
    (
        r"does not require grad and does not have a grad_fn",
        "no_grad_inputs",
        "reentrant gradient checkpointing on a frozen (quantized) model: inputs carry no grad",
        "use_reentrant=False (kit default), or model.enable_input_require_grads()",
    ),
    (
        r"on a different device than the one you're training on|Expected all tensors to be on the "
        r"same device",
        "device_map_with_fsdp",
        "the model is spread over several devices (device_map='auto') inside a distributed run",
        "device_map={'': local_rank}",
    ),
    (
        r"Missing key\(s\) in state_dict|Unexpected key\(s\).*(absmax|quant_map)|"
        r"unexpected keys.*(absmax|quant_map)",
        "strict_load",
        "a strict load of a QLoRA state dict: frozen or bitsandbytes keys (absmax, quant_map) "
        "differ",
        "set_state_dict(..., options=StateDictOptions(strict=False)) for LoRA-only state",
    ),
    (
        r"The current process just got forked, after parallelism has already been used",
        "tokenizers_parallelism",
        "a fast tokenizer ran before a fork (DataLoader workers)",
        "export TOKENIZERS_PARALLELISM=false",
    ),
    (
        r"Connection closed by peer|Connection reset by peer|Broken pipe|recvBytes",
        "peer_died",
        "this rank lost a peer: another rank failed or was killed first; its error is the cause",
        "look for the earliest failing rank's error (torchrun's summary names it)",
        "info",
    ),
    (r"ConfigError: (.*)", "config_invalid", "the config was rejected at load", "fix that field"),
    (
        r"NCCL error|ncclSystemError|ncclInternalError",
        "nccl_error",
        "NCCL failed to set up or run a collective (network interface, shared memory, driver)",
        "rerun with NCCL_DEBUG=INFO; check NCCL_SOCKET_IFNAME and /dev/shm size",
    ),
]


def explain(text: str) -> list[Finding]:
    """Known causes and fixes for the raw error text of a failed run (logs, a traceback).
    One finding per known error: causes (errors) first, each in order of first appearance."""
    hits = []
    for pattern, code, cause, fix, *level in EXPLAIN:
        m = re.search(pattern, text)
        if m:
            line = " ".join(text[text.rfind("\n", 0, m.start()) + 1 : m.end()].split())
            said = line if len(line) <= 120 else "..." + line[-117:]
            finding = Finding(level[0] if level else "error", code, f"{cause} (saw: {said})", fix)
            hits.append((m.start(), finding))
    seen, out = set(), []
    for _, f in sorted(hits, key=lambda h: (LEVELS.index(h[1].level), h[0])):
        if f.code not in seen:
            seen.add(f.code)
            out.append(f)
    return out
