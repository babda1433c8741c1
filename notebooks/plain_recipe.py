"""QLoRA on one page, no kit: NF4 -> LoRA -> checkpointing -> fully_shard -> AdamW -> the loop.

    torchrun --nproc_per_node 2 plain_recipe.py MODEL_FOLDER ROWS.jsonl                # CPU, gloo
    torchrun --nproc_per_node 2 plain_recipe.py MODEL_FOLDER ROWS.jsonl --device cuda  # GPUs, nccl
"""
import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from transformers.optimization import get_cosine_schedule_with_warmup

args = argparse.ArgumentParser()
for name, default in [("--steps", 20), ("--batch", 8), ("--seq", 32), ("--lr", 1e-2),
                      ("--seed", 42), ("--device", "cpu")]:
    args.add_argument(name, type=type(default), default=default)
args.add_argument("model")  # a folder that from_pretrained reads
args.add_argument("rows")  # a .jsonl file of {"text": ...} rows
args = args.parse_args()

# One process per device; torchrun sets RANK, LOCAL_RANK and WORLD_SIZE.
dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
device = torch.device(args.device, local) if args.device == "cuda" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)

# 1. The base in NF4 on this rank's own device, its packed bytes stored as bf16 (FSDP shards those).
nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                         bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16,
                         bnb_4bit_quant_storage=torch.bfloat16)
base = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=nf4,
                                            dtype=torch.bfloat16, device_map={"": device},
                                            attn_implementation="sdpa")
tokenizer = AutoTokenizer.from_pretrained(args.model)

# 2. LoRA on every linear layer but the head, seeded alike on every rank; the adapters in fp32.
torch.manual_seed(args.seed)
model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                        target_modules="all-linear", task_type="CAUSAL_LM"))
for p in model.parameters():
    p.data = p.data.float() if p.requires_grad else p.data

# 3. Recompute each decoder layer in backward, and train mode (from_pretrained returns eval mode).
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.train()

# 4. Shard each decoder layer, then the root: gathered in bf16, gradients reduced in fp32.
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in base.model.layers:
    fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)

# 5. The optimizer after sharding: it must hold the sharded parameters that backward fills.
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                              weight_decay=0.0)
schedule = get_cosine_schedule_with_warmup(optimizer, 2, args.steps)

# 6. Rows: text + end token, cut or padded to --seq tokens, no loss on padding; each rank its share.
texts = [json.loads(line)["text"] + tokenizer.eos_token for line in open(args.rows)]
enc = tokenizer(texts, max_length=args.seq, truncation=True, padding="max_length",
                return_tensors="pt")
enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
rows = [{key: values[i] for key, values in enc.items()} for i in range(len(texts))]
sampler = DistributedSampler(rows, shuffle=True, seed=args.seed, drop_last=True)
loader = DataLoader(rows, batch_size=args.batch, sampler=sampler, drop_last=True)

# 7. The loop: forward, backward, clip, step; rank 0 prints the loss averaged over the ranks.
step = 0
while step < args.steps:
    sampler.set_epoch(step // len(loader))  # a new shuffle each epoch, the same on every rank
    for batch in loader:
        loss = model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().double())
        step += 1
        if rank == 0:
            print(f"step {step} loss {mean.item() / world:.8f}", flush=True)
        if step == args.steps:
            break
# 8. Leave the group once the sharded modules are collected: they live in reference cycles (their
# hooks), and a gloo thread freeing them at the interpreter's exit can abort the rank ("terminate
# called without an active exception") after every step has passed.
gc.collect()
dist.destroy_process_group()
