"""Two ranks (torchrun, gloo): kit.recipe.optim against torch's AdamW and clip_grad_norm_ on the
same FSDP2-sharded parameters. Prints one JSON line on rank 0 (tests/test_optim.py reads it)."""

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from kit.recipe import optim
from kit.recipe.dist import cleanup


def build():
    torch.manual_seed(0)
    # Uneven first dimensions (7, 3): one rank's shard of the 3-row tensor is smaller.
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3), torch.nn.Linear(3, 8))
    model[2].weight.requires_grad_(False)  # frozen, as the base model's weights are
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(opt_class, clip, max_norm: float):
    model = build()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = opt_class(params, lr=0.05, weight_decay=0.1)
    norms = []
    for step in range(4):
        torch.manual_seed(100 + step + dist.get_rank())  # each rank its own data
        loss = model(torch.randn(6, 5)).square().mean() * (10 if step == 1 else 1)
        loss.backward()
        norms.append(float(clip(params, max_norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, norms


def torch_clip(params, max_norm):
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor()


def main():
    dist.init_process_group("gloo")
    kit_model, kit_opt, kit_norms = train(optim.ShardAdamW, optim.clip_grad_norm, 0.5)
    sharded = optim._sharded([p for p in kit_model.parameters() if p.requires_grad])
    ref_model, ref_opt, ref_norms = train(torch.optim.AdamW, torch_clip, 0.5)
    diff = max(float((a.full_tensor() - b.full_tensor()).abs().max())
               for a, b in zip(kit_model.parameters(), ref_model.parameters(), strict=True))
    kit_state = get_optimizer_state_dict(kit_model, kit_opt)
    ref_state = get_optimizer_state_dict(ref_model, ref_opt)
    layout = lambda s: sorted((k, sorted((n, type(v).__name__) for n, v in d.items()))  # noqa: E731
                              for k, d in s["state"].items())
    steps_taken = sorted({float(d["step"]) for d in kit_state["state"].values()})
    if dist.get_rank() == 0:
        print(json.dumps({"kit_norms": kit_norms, "torch_norms": ref_norms, "max_param_diff": diff,
                          "same_state_layout": layout(kit_state) == layout(ref_state),
                          "state_entries": len(kit_state["state"]), "steps": steps_taken,
                          "world": dist.get_world_size(), "shard_path": sharded,
                          "threads": os.environ.get("OMP_NUM_THREADS")}))
    # Collected, then left (kit.recipe.dist.cleanup): the sharded modules' cycles otherwise
    # outlive the group, and a gloo thread freeing them at exit aborted rank 1 once on a 2-core
    # CPU ("terminate called without an active exception") after both ranks had passed.
    cleanup()


if __name__ == "__main__":
    main()
