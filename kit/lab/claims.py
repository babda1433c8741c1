"""The two source articles' concrete claims, as data: one row per claim, paraphrased, with where it
stands in its article. The verdicts are not here: a notebook code cell that settles a claim
carries it in its metadata (`"claims": {"A07": "demonstrated"}`, `"caveat"` or `"corrected"`; a
`"caveat"` verdict names its caveat in one line beside it, `"caveats": {"A19": "..."}`), and
`python -m kit.lab.claims_table` builds the table from both (kit.lab.claims_table).

    demonstrated  the cell shows the claim holds
    caveat        the claim holds, with a caveat the cell shows (printed "holds, with a caveat")
    corrected     the cell shows it does not hold as stated, and what does

    A = article-qlora-fsdp-flash-attention.txt (QLoRA + FSDP + Flash Attention 2, 2x RTX 4090, 70B)
    B = article-fsdp-lora-kubernetes.txt (FSDP + LoRA with accelerate and TRL on 2 H200 nodes)

`record` names a recorded GPU run (a folder of benchmarks/records/, read through kit.bench.records)
for a claim only a GPU shows; a notebook cell that prints that recorded result carries the
verdict. Kernel side: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

ARTICLES = {"A": "article-qlora-fsdp-flash-attention.txt", "B": "article-fsdp-lora-kubernetes.txt"}
VERDICTS = ("demonstrated", "caveat", "corrected")
LABELS = {"demonstrated": "demonstrated", "caveat": "holds, with a caveat", "corrected": "corrected"}


@dataclass(frozen=True)
class Claim:
    id: str
    claim: str  # paraphrased, not quoted
    where: str  # section of the article, and its line in the stored text
    record: str | None = None  # a recorded GPU run (benchmarks/records/<record>/), where one settles it


CLAIMS: list[Claim] = [
    # ------------------------------------------------------------------ A: QLoRA + FSDP + FA2
    Claim("A01", "Llama-3-70B needs about 40 GB even in 4 bits, so it cannot be loaded on one 24 GB GPU",
          "introduction, l.9"),
    Claim("A02", "DataParallel and DDP keep the whole model on every GPU, so the smallest GPU bounds the "
          "model size; they scale batch size only", "introduction, l.11; takeaways, l.397"),
    Claim("A03", "FSDP shards parameters, gradients and optimizer state over the GPUs; no GPU ever holds "
          "the whole model", "section 1, l.24"),
    Claim("A04", "for the 70B model FSDP splits the ~40 GB of 4-bit weights into a ~20 GB shard on each of "
          "two 24 GB GPUs, which is how it fits", "section 1, l.24"),
    Claim("A05", "bitsandbytes' Linear4bit stores its weight in NF4 and computes forward and backward in "
          "the compute dtype (bf16)", "section 1, l.26"),
    Claim("A06", "wrapping the whole model as one FSDP unit is inefficient and can run out of memory; a "
          "per-block auto-wrap policy is essential", "section 1, l.30"),
    Claim("A07", "transformer_auto_wrap_policy with the decoder-layer class makes each transformer block a "
          "unit, wrapping the block around PEFT's LoRA and 4-bit layers rather than those layers",
          "section 1, l.32-61"),
    Claim("A08", "in QLoRA the adapters are stored in bf16 or fp16, computation runs in bf16 and gradients "
          "are bf16", "section 1, l.65-70"),
    Claim("A09", "FSDP's MixedPrecision with bf16 params, reduction and buffers suits QLoRA: FSDP need not "
          "understand NF4, it manages the bf16 tensors the 4-bit layers present in compute",
          "section 1, l.71-92"),
    Claim("A10", "the order is init process group, load quantized, add LoRA, wrap with FSDP; one step out "
          "of place gives cryptic errors or silent failures", "section 2, l.97-102; takeaways, l.398"),
    Claim("A11", "a BitsAndBytesConfig (NF4, double quantization, bf16 compute) passed to from_pretrained "
          "quantizes the model to 4 bits while it loads", "section 2, l.100 and l.148-161"),
    Claim("A12", "device_map='auto' keeps rank 0 from loading the whole model onto its GPU before FSDP "
          "shards it (the comment speaks of the meta device)", "section 2, l.156-162 and l.258"),
    Claim("A13", "trust_remote_code=True is needed for some models such as Llama 3",
          "section 2, l.165-166"),
    Claim("A14", "prepare_model_for_kbit_training does critical preparation (hooks that keep gradients in "
          "the right precision) before get_peft_model", "section 2, l.173-175"),
    Claim("A15", "the complete script (PEFT's default adapters, FSDP1 FULL_SHARD, bf16 MixedPrecision) "
          "runs as written under torchrun on two GPUs", "section 2, l.105-256"),
    Claim("A16", "a DistributedSampler built with rank=LOCAL_RANK and num_replicas=WORLD_SIZE gives each "
          "process its share of the data", "section 2, l.223"),
    Claim("A17", "self-attention costs O(n^2) in the sequence length; Flash Attention 2 computes it in "
          "tiles and never materialises the n x n matrix", "section 3, l.263-267"),
    Claim("A18", "for long sequences Flash Attention 2 gives a 2-3x speed-up", "section 3, l.267",
          record="2026-11-22-notebook-06-1xh200"),
    Claim("A19", "Flash Attention 2 is switched on by passing attn_implementation='flash_attention_2' to "
          "from_pretrained, before quantization and FSDP", "section 3, l.269-284"),
    Claim("A20", "gradient checkpointing cuts activation memory at the price of a ~20-30% slower step",
          "section 3, l.288", record="2026-11-22-notebook-06-1xh200"),
    Claim("A21", "gradient checkpointing must be enabled after quantization and PEFT but before FSDP "
          "wrapping", "section 3, l.292-299; takeaways, l.398"),
    Claim("A22", "SHARD_GRAD_OP combined with gradient checkpointing is a common sweet spot: less "
          "communication, the memory won back by checkpointing", "section 3, l.301"),
    Claim("A23", "a plain torch.save(model.state_dict()) fails under FSDP: each rank holds only a shard, "
          "so the checkpoint is incomplete", "section 4, l.306; takeaways, l.400"),
    Claim("A24", "gathering a FULL_STATE_DICT to rank 0 and passing it to PEFT's save_pretrained saves the "
          "adapter", "section 4, l.312-338"),
    Claim("A25", "offload_to_cpu=True in FullStateDictConfig is critical to assemble the full state dict "
          "on rank 0 without running out of memory", "section 4, l.321 and l.338"),
    Claim("A26", "to load, wrap with FSDP, then in a FULL_STATE_DICT context rank 0 torch.loads "
          "adapter_model.bin, the other ranks pass None, and load_state_dict handles the communication",
          "section 4, l.342-366"),
    Claim("A27", "benchmark table: DDP + QLoRA runs out of memory on 24 GB GPUs (over 40 GB needed)",
          "section 5, l.380 and l.387", record="2026-11-23-speed-8b-2xh200"),
    Claim("A28", "benchmark table: FSDP FULL_SHARD + QLoRA without checkpointing fits batch 1 at seq 2048 "
          "in 24 GB (~22.8 GB peak)", "section 5, l.381 and l.388", record="2026-11-23-speed-8b-2xh200"),
    Claim("A29", "gradient checkpointing unlocks batching: batch 2 per GPU at stable memory; per-GPU "
          "throughput falls (85 to 65 tokens/s) but total throughput rises", "section 5, l.382 and l.389",
          record="2026-11-23-speed-8b-2xh200"),
    Claim("A30", "Flash Attention 2 on top of checkpointing lowers memory slightly and raises throughput "
          "by more than 60% over the checkpointed run", "section 5, l.383 and l.390",
          record="2026-11-23-speed-8b-2xh200"),
    # ------------------------------------------------------------------ B: FSDP + LoRA on Kubernetes
    Claim("B01", "full fine-tuning of the 11B model needs ~44 GB for its weights in fp16",
          "the problem, l.7"),
    Claim("B02", "on top of the weights, the optimizer states take three times more", "the problem, l.7"),
    Claim("B03", "without FSDP each GPU loads the full model and runs out of memory", "the problem, l.8"),
    Claim("B04", "naively every rank reads the 238 GB checkpoint from disk at once, exhausting host memory "
          "on multi-node runs", "the problem, l.10; settings, l.32-34"),
    Claim("B05", "fsdp_cpu_ram_efficient_loading makes only rank 0 load the weights; the others receive "
          "them by broadcast", "quick answer, l.4; settings, l.31-34; takeaways, l.217"),
    Claim("B06", "fsdp_sync_module_states broadcasts rank 0's loaded weights to every other rank",
          "settings, l.35-37"),
    Claim("B07", "fsdp_use_orig_params is critical for LoRA: without it FSDP flattens the parameters, "
          "selective requires_grad breaks and the adapters do not train",
          "settings, l.38-43; common issues, l.197-200"),
    Claim("B08", "a FULL_STATE_DICT checkpoint is rebuilt on rank 0 and loads directly for inference "
          "without FSDP", "settings, l.44-46; best practices, l.213"),
    Claim("B09", "SHARDED_STATE_DICT saves faster but needs FSDP to reload", "settings, l.47",
          record="2026-11-22-checkpoints-1b-2xh200"),
    Claim("B10", "BACKWARD_PRE prefetches layer i-1 during the backward of layer i, hiding the all-gather "
          "behind compute", "settings, l.48-49; takeaways, l.217"),
    Claim("B11", "the accelerate YAML (num_machines 2, num_processes 2, bf16, FULL_SHARD) runs the job on "
          "2 H200 nodes whose GPUs talk over NVLink", "config, l.13-30; launch, l.155-161"),
    Claim("B12", "LoRA r=8 on q/k/v/o of the 11B model trains 26M parameters (0.24%)",
          "training script, l.63-66 and l.105"),
    Claim("B13", "bf16 rather than fp16: better numerical stability, and no loss scaling needed",
          "training script, l.81-82; best practices, l.212"),
    Claim("B14", "TOKENIZERS_PARALLELISM=false avoids deadlocks of fast tokenizers with multi-process "
          "DataLoaders", "launch script, l.126-127; best practices, l.213"),
    Claim("B15", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces out-of-memory errors from "
          "fragmentation", "launch script, l.128-129; best practices, l.213",
          record="2026-11-26-expandable-segments-1b-1xh100"),
    Claim("B16", "per GPU the model shard is ~22 GB (11B x 2 bytes / 2 GPUs)", "memory budget, l.164"),
    Claim("B17", "LoRA adapters take ~52 MB (26M x 2 bytes) and their AdamW state ~208 MB",
          "memory budget, l.165-166"),
    Claim("B18", "a step at batch 4 x 4,096 tokens holds ~8 GB of activations, ~4 GB of KV cache and "
          "~2 GB of NCCL buffers", "memory budget, l.167-169"),
    Claim("B19", "in total ~36 GB of the H200's 141 GB are used, ~104 GB free", "memory budget, l.170-171"),
    Claim("B20", "checkpoints get too large with SHARDED_STATE_DICT or every rank saving; FULL_STATE_DICT "
          "with rank 0 alone saving fixes it", "common issues, l.201-204",
          record="2026-11-22-checkpoints-1b-2xh200"),
    Claim("B21", "an NCCL timeout during all-gather is fixed by raising NCCL_TIMEOUT (or checking RDMA and "
          "NCCL_SOCKET_IFNAME)", "common issues, l.205-208"),
    Claim("B22", "the launch script's accelerate launch (RANK as machine rank, MASTER_ADDR/PORT, 2 machines "
          "x 2 processes) handles all the distributed coordination", "launch, l.153-161; takeaways, l.218"),
    Claim("B23", "weights broadcast and FSDP all-gathers travel over NVLink, and BACKWARD_PRE hides their "
          "latency behind compute", "settings, l.33 and l.49; common issues, l.196; takeaways, l.217"),
    Claim("B24", "the H200's 141 GB leave massive headroom, enough for larger batches or longer "
          "sequences", "takeaways, l.217"),
]

BY_ID = {c.id: c for c in CLAIMS}
