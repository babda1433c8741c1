"""Which tensors differ between two model.loading modes on this machine (one process each way,
after LoRA and FSDP2 on one rank): name, shape, max difference. A diagnostic for a digest that
differs while the logits agree.

    torchrun --nproc_per_node=1 benchmarks/compare_loading.py CONFIG full stream [key=value ...]
"""

import sys

import torch

from kit.config import load_config
from kit.inputs import builtin
from kit.recipe import dist as kdist
from kit.recipe import engines, model


def state(cfg, env):
    import bitsandbytes as bnb

    wrapped = engines.get(cfg.sharding.engine).wrap(model.build(cfg, env.device).model, cfg,
                                                    env.device)
    out = {}
    for name, t in [*wrapped.named_parameters(), *wrapped.named_buffers()]:
        t = t.to_local() if hasattr(t, "to_local") else t
        out[name] = t.detach().cpu()
    for name, m in wrapped.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            for key, v in m.quant_state.as_dict(packed=True).items():
                out[f"{name}.{key}"] = v.detach().cpu()
    return out


config, a, b, *overrides = sys.argv[1:]
cfgs = [load_config(config, [*overrides, f"model.loading={mode}"]) for mode in (a, b)]
env = kdist.init(cfgs[0].training.device)
builtin.resolve(cfgs[0].model.name)
states = []
for cfg in cfgs:
    torch.manual_seed(cfg.training.seed)
    states.append(state(cfg, env))
    torch.cuda.empty_cache() if env.device.type == "cuda" else None
x, y = states
print("only in", a, sorted(set(x) - set(y))[:10], "| only in", b, sorted(set(y) - set(x))[:10])
diff = 0
for name in (n for n in x if n in y):
    s, t = x[name], y[name]
    if s.shape != t.shape or s.dtype != t.dtype or not torch.equal(s.view(torch.uint8), t.view(torch.uint8)):
        diff += 1
        if diff <= 12:
            detail = "" if s.shape != t.shape or s.dtype != t.dtype else \
                f"max |diff| {(s.float() - t.float()).abs().max().item():.3g}"
            print(f"{name}: {tuple(s.shape)} {s.dtype} vs {tuple(t.shape)} {t.dtype} {detail}")
print(f"{diff} of {len(x)} tensors differ")
kdist.cleanup()
