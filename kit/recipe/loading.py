"""How each rank gets the base model: `model.loading` = full | rank0 | stream (rank side).

- full: every rank runs from_pretrained (kit.recipe.quantize.load_model), quantizes, and holds the
  whole 4-bit model until it is sharded. What both articles do.
- rank0: rank 0 runs from_pretrained; the others build the same model on the meta device and
  receive each tensor from rank 0 by broadcast, 4-bit ones packed with their quantization
  constants. What accelerate's `fsdp_cpu_ram_efficient_loading` + `fsdp_sync_module_states`
  intend, done before LoRA and wrapping: the same for FSDP2, FSDP1 and DDP, and right for 4-bit
  weights, which FSDP1's sync_module_states would broadcast without their quantization state.
- stream (FSDP2, FSDP1): the model stays on the meta device through LoRA; the engine fills each
  unit (a decoder layer, the embeddings under FSDP2, the root) one tensor at a time, quantizing on
  the device, and shards it at once (FSDP1: its param_init_fn): a rank never holds the whole model.

Every mode gives every rank the same bytes and logits (tests/test_loading.py). `python -m
kit.lab.loading_rank CONFIG DIR [MODE ...]` loads, shards and measures (kit.lab.loading_report).
Gaps filled by hand: transformers loads a 4-bit model on meta or whole, with no "receive a
quantized model from rank 0" path (accelerate's skips 4-bit quantization state) nor a "this unit
now" one; torch.distributed has no broadcast of a module tree, and its meta-device initialisation
cannot quantize.
"""

from __future__ import annotations

import contextlib
import zlib

import torch
import torch.distributed as dist

from kit.config import Config
from kit.inputs import builtin
from kit.recipe import expert_source, experts, quantize


def mode_of(cfg: Config) -> str:
    """model.loading as it will run: auto is stream in a rank of a process group under the
    sharding engines (FSDP2, FSDP1: they fill the model as they shard it), and full under DDP
    (every rank keeps the whole model anyway) or outside a group (a notebook's kernel looking
    at a model it does not shard)."""
    mode = cfg.model.loading
    if mode == "auto":
        sharded = cfg.sharding.engine != "ddp" and dist.is_initialized()
        return "stream" if sharded else "full"
    return mode


def load(cfg: Config, device: torch.device, attn: str | None = None):
    """(model, tokenizer) on `device`, by cfg.model.loading; with a group of one, rank0 is full.
    A model whose folder holds no weights (kit.inputs.builtin.AT_LOAD, e.g. kit:llama-70b) is
    initialised where it would be read (Source). With stream, the model is returned on the meta
    device with its Source attached: the engine fills each unit just before sharding it. Under
    rank0, rank 0 reads a mixture of experts through a Source too: its expert stacks a chunk of
    experts at a time (kit.recipe.expert_source), never whole on the device. Weights under other
    names are placed by transformers' own conversion mapping (a MoE's per-expert tensors); with
    auto, a weight it cannot place sends the load to rank0, and a line says so. The mode that
    ran: `loaded_as(model)`."""
    mode = mode_of(cfg)
    single = not dist.is_initialized() or dist.get_world_size() == 1
    init = builtin.init_at_load(builtin.resolve(cfg.model.name))
    model = None
    if mode == "rank0" and not single and init is None and cfg.quantization.method != "none":
        model, tokenizer = quantize.load_model(cfg, torch.device("meta"), attn)
        if not experts.find(model):  # a dense model: rank 0 runs from_pretrained
            model = None
    if mode == "stream" or init is not None or model is not None:
        if model is None:
            model, tokenizer = quantize.load_model(cfg, torch.device("meta"), attn,
                                                   weights=init is None)
        source = Source(cfg, model, device, init)
        renamed = source.missing()
        if renamed and cfg.model.loading == "stream":
            from kit.config import ConfigError

            raise ConfigError(f"model.loading: stream is not allowed for {cfg.model.name}: "
                              f"{len(renamed)} weight(s) are stored under other names in its "
                              f"checkpoint (e.g. {renamed[0]}); allowed: auto, full, rank0")
        if renamed:
            if mode == "stream":
                mode = "full" if single else "rank0"
                if not dist.is_initialized() or dist.get_rank() == 0:
                    print(f"model.loading=auto: {len(renamed)} weight(s) of {cfg.model.name} "
                          f"are stored under other names in its checkpoint (e.g. {renamed[0]}); "
                          f"loading with {mode} instead of stream", flush=True)
            return _tag(*load_weights(cfg, device, attn, mode, single), mode, cfg)
        if mode == "stream":
            model._kit_stream = source  # filled by the engine (kit.recipe.engines), unit by unit
            return _tag(model, tokenizer, mode, cfg)
        stacks = expert_source.logical_shapes(model)  # before rank 0 packs its own
        if mode == "full" or single or dist.get_rank() == 0:
            source.fill(model)
        if mode == "rank0" and not single:
            receive_from_rank0(model, device)
            expert_source.adopt(stacks)  # the packed stacks received: NF4 as rank 0's
        return _tag(model, tokenizer, mode, cfg)
    return _tag(*load_weights(cfg, device, attn, mode, single), mode, cfg)


def load_weights(cfg: Config, device: torch.device, attn: str | None, mode: str, single: bool):
    """full: from_pretrained on every rank; rank0: on rank 0, the others receive by broadcast."""
    reads = mode == "full" or single or dist.get_rank() == 0
    model, tokenizer = quantize.load_model(cfg, device if reads else torch.device("meta"), attn)
    if mode == "rank0" and not single:
        receive_from_rank0(model, device)
    return model, tokenizer


def _tag(model: torch.nn.Module, tokenizer, mode: str, cfg: Config):
    if cfg.quantization.method != "none":  # MoE expert stacks: NF4 too (stream: as filled)
        experts.quantize(model, quantize.params4bit_kwargs(cfg))
    model._kit_loaded_as = mode
    return model, tokenizer


def loaded_as(model: torch.nn.Module) -> str:
    """The model.loading mode that loaded `model` (auto resolved), or "" if unknown."""
    return next((m._kit_loaded_as for m in model.modules() if hasattr(m, "_kit_loaded_as")), "")


class Source:
    """Where each tensor of a model built on the meta device comes from, one tensor at a time:
    the checkpoint's safetensors files (a tensor read when it is needed, with a plain read), or,
    for a folder without weights (`init`: {"seed", "std"}), a generator seeded by the tensor's
    name: matrices N(0, std), norms 1, biases 0. 4-bit weights are quantized on `device` as they
    arrive, as from_pretrained does (a MoE's expert stacks a chunk of experts at a time);
    buffers (rotary frequencies) by the model class's initialisation. At most one full-precision
    tensor (or chunk) exists at a time: a 70B model needs neither its 138 GB of bf16 weights on
    disk (init) nor in memory. Random weights are the same for the same seed on
    the same kind of device (CPU and GPU generators differ)."""

    def __init__(self, cfg: Config, model: torch.nn.Module, device: torch.device,
                 init: dict | None):  # fmt: skip
        self.device, self.init = device, init
        self.quant = quantize.params4bit_kwargs(cfg)
        self.quant_experts = {id(m): set(experts.weight_names(m)) for _, m in experts.find(model)
                              } if cfg.quantization.method != "none" else {}  # fmt: skip
        for _, m in experts.find(model) if self.quant_experts else ():
            m._kit_nf4_pending = self.quant_experts[id(m)]  # NF4 once filled (stored_bytes)
        # Checkpoint names, fixed now: PEFT will nest the 4-bit layers under `base_layer`.
        self.names = {id(m): n for n, m in model.named_modules()}
        self.config, self.model = model.config, model
        self.files = {} if init else builtin.checkpoint_files(builtin.resolve(cfg.model.name))
        # What makes each tensor: a checkpoint tensor (its name or renamed), or several converted
        # (a MoE's per-expert tensors): transformers' own conversion mapping decides.
        self.made = expert_source.placement(model, self.files) if self.files else {}
        self.headers: dict = {}  # file -> (where its bytes start, its header)
        self.most_held = 0  # the most bytes the model held on this rank after a fill

    def missing(self) -> list[str]:
        """Parameters of the model that its checkpoint does not hold, neither under the same name
        nor under one transformers' conversion mapping reads one tensor at a time (none for a
        model initialised at load)."""
        if self.init:
            return []
        seen, missing = set(), []
        for owner, kind, name, tensor in slots(self.model):
            key = f"{self.names[id(owner)]}.{name}".lstrip(".")
            if kind == "_parameters" and id(tensor) not in seen and key not in self.made:
                missing.append(key)
            seen.add(id(tensor))  # tied: the head is the embeddings, read once
        return missing

    def fill(self, module: torch.nn.Module) -> int:
        """Replace every meta parameter and buffer under `module`; returns how many."""
        import bitsandbytes as bnb

        made: dict[int, torch.Tensor] = {}
        rebuilt: dict[int, torch.nn.Module] = {}
        for owner, kind, name, meta in list(slots(module)):
            if not meta.is_meta:
                continue
            if id(meta) in made:  # tied: the same tensor
                getattr(owner, kind)[name] = made[id(meta)]
                continue
            key = f"{self.names[id(owner)]}.{name}".lstrip(".")
            if kind == "_buffers" and (self.init or key not in self.made):
                fresh = rebuilt.get(id(owner))
                if fresh is None:  # e.g. the rotary embedding's frequencies
                    fresh = rebuilt[id(owner)] = self._buffers_of(owner)
                tensor = getattr(fresh, name).to(self.device)
            elif self.quant_experts and name in self.quant_experts.get(id(owner), ()):
                self._fill_stack(owner, name, key, meta)  # a MoE expert stack: NF4 as it arrives
                made[id(meta)] = owner._parameters[name]
                continue
            elif isinstance(owner, bnb.nn.Linear4bit) and name == "weight":
                value = self._value(key, meta.shape, meta.dtype, "matrix")
                tensor = bnb.nn.Params4bit(value, requires_grad=False, module=owner,
                                           **self.quant).to(self.device)  # quantizes
            else:
                value = self._value(key, meta.shape, meta.dtype,
                                    "matrix" if meta.dim() > 1 else name)
                tensor = (torch.nn.Parameter(value, requires_grad=meta.requires_grad)
                          if kind == "_parameters" else value)  # fmt: skip
            getattr(owner, kind)[name] = made[id(meta)] = tensor
        quantize.keep_packing(module)
        self.most_held = max(self.most_held, held_bytes(self.model))
        release_freed_host_memory()
        return len(made)

    def _buffers_of(self, owner: torch.nn.Module) -> torch.nn.Module:
        """A copy of `owner` whose buffers are computed as from_pretrained computes the ones a
        checkpoint does not hold: the model class's own `_init_weights` on that module (rotary
        frequencies, Gemma 3's embedding scale), on the CPU as from_pretrained does (a GPU's
        differ in the last bits). Its parameters are meta copies, so the initialisation touches
        no filled weight. Gap filled: transformers initialises a whole model, not one module."""
        import copy

        fresh = copy.copy(owner)
        fresh._parameters = {k: None if p is None else torch.nn.Parameter(
            torch.empty_like(p, device="meta"), requires_grad=False)
            for k, p in owner._parameters.items()}  # fmt: skip
        fresh._buffers = {k: None if b is None else torch.full(b.shape, float("nan"), dtype=b.dtype)
                          if b.is_floating_point() else torch.zeros(b.shape, dtype=b.dtype)
                          for k, b in owner._buffers.items()}  # fmt: skip
        with torch.no_grad():
            self.model._init_weights(fresh)
        unset = [k for k, b in fresh._buffers.items()
                 if b is not None and b.is_floating_point() and b.isnan().all()]
        if unset:
            raise RuntimeError(
                f"model.loading: {type(self.model).__name__}._init_weights does not compute "
                f"{type(owner).__name__}'s buffer(s) {', '.join(unset)}, which the checkpoint "
                "does not hold; use model.loading=full")
        return fresh

    def _fill_stack(self, owner: torch.nn.Module, name: str, key: str, meta: torch.Tensor):
        """owner.<name>, an expert stack, quantized to NF4: from the checkpoint a chunk of experts
        at a time (kit.recipe.expert_source), or initialised whole (a model without weights)."""
        if self.init is not None:
            value = self._value(key, meta.shape, meta.dtype, "matrix")
            experts.quantize_weight(owner, name, value, self.quant)
            return
        shape = tuple(meta.shape)
        chunks = expert_source.stack_chunks(self, self.made[key], key, shape, meta.dtype)
        expert_source.quantize_chunks(owner, name, chunks, shape, meta.dtype,
                                      self.quant, self.device)  # fmt: skip

    def _value(self, key: str, shape, dtype, what: str) -> torch.Tensor:
        if self.init is None:
            made = self.made.get(key)
            if made is not None and made.converter is not None:  # converted on the host, whole
                parts = {p: [self._read(k, dtype, torch.device("cpu")) for k in keys]
                         for p, keys in made.sources.items()}  # fmt: skip
                return expert_source.convert(made, parts, key, shape, self.config).to(self.device)
            return self._read(made.key if made is not None else key, dtype)
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        if what == "matrix":
            seed = (self.init["seed"] * 1_000_003 + zlib.crc32(key.encode())) % 2**63
            generator = torch.Generator(self.device).manual_seed(seed)
            return tensor.normal_(0.0, self.init["std"], generator=generator)
        return tensor.zero_() if what == "bias" else tensor.fill_(1.0)

    def _read(self, key: str, dtype: torch.dtype, device: torch.device | None = None,
              rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Checkpoint tensor `key` (with `rows`, only its rows first:last along its first
        dimension), made in `dtype` on `device` (by default the Source's) with plain reads
        (kit.recipe.expert_source.read: why not safetensors' safe_open)."""
        if key not in self.files:
            raise RuntimeError(f"model.loading: {key} is not in the checkpoint's safetensors "
                               "files (renamed weights); use model.loading=full")
        path = self.files[key]
        if path not in self.headers:
            self.headers[path] = builtin.safetensors_header(path)
        start, header = self.headers[path]
        return expert_source.read(path, start, header[key], key, dtype, device or self.device, rows)


def release_freed_host_memory() -> None:
    """Give the C allocator's freed pages back to the system (glibc's malloc_trim; elsewhere
    nothing). Gap filled: every tensor read and quantized here is freed at once, but glibc keeps
    the freed heap memory in the process, fragmented: on kit:llama-135m streaming 30 layers left
    ~470 MiB of freed full-precision tensors in the rank's resident memory, more than the whole
    4-bit model. Called after each unit, the peak is one unit's tensors, not all of them."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: its allocator is left as it is
        pass


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers this rank holds (a sharded one: its shard; one still
    on the meta device: none), 4-bit ones as packed."""
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        t = t.to_local() if hasattr(t, "to_local") else t
        if not t.is_meta:
            total += t.numel() * t.element_size()
    return total


def streamer_of(model: torch.nn.Module) -> Source | None:
    """The Source a model loaded with model.loading=stream still has to fill, or None."""
    return next((m._kit_stream for m in model.modules()
                 if getattr(m, "_kit_stream", None) is not None), None)


@contextlib.contextmanager
def adapters_stay_put(model: torch.nn.Module):
    """While PEFT adds adapters to a model on the meta device (stream), keep them where PEFT made
    them, on the CPU with the values its seeded initialisation gave, cast to the base layer's
    dtype as PEFT casts them. Gap filled: PEFT moves each new adapter to its base layer's device,
    which here is meta, and the initial values would be lost."""
    if streamer_of(model) is None:
        yield
        return
    from peft.tuners.lora.model import LoraModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    move, replace = (BaseTunerLayer._move_adapter_to_device_of_base_layer,
                     LoraModel._replace_module)  # fmt: skip

    def move_to_cpu(self, adapter_name, device=None):  # casts to the base dtype, as PEFT does
        return move(self, adapter_name, device=torch.device("cpu") if device is None else device)

    def replace_keeping_values(self, parent, child_name, new_module, child):
        adapters = [m for n, m in new_module.named_modules() if self.prefix in n]
        kept = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in adapters]
        replace(self, parent, child_name, new_module, child)  # moves them to the base's device
        for m, values in zip(adapters, kept, strict=True):
            m.to_empty(device="cpu")
            m.load_state_dict(values)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = move_to_cpu
    LoraModel._replace_module = replace_keeping_values
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = move
        LoraModel._replace_module = replace


def slots(model: torch.nn.Module):
    """(module, kind, name, tensor) for every parameter and buffer (persistent or not), in the
    same order on every rank; a tensor shared by two modules (tied embeddings) appears twice."""
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is not None:
                    yield module, kind, name, tensor


def receive_from_rank0(model: torch.nn.Module, device: torch.device) -> int:
    """Rank 0 sends every tensor of its loaded model; the other ranks, holding the same model on
    the meta device, put what arrives in place (on `device`). Returns the bytes sent per rank.
    A collective: every rank calls it."""
    import bitsandbytes as bnb

    main = dist.get_rank() == 0
    every = list(slots(model))
    # What rank 0 holds, described once: shape, dtype, grad flag, an alias's first slot, and for
    # a 4-bit weight its quantization constants (bitsandbytes' own serialised form, all tensors).
    description: list = [None]
    if main:
        seen: dict[int, int] = {}
        described = []
        for i, (_, _, _, t) in enumerate(every):
            alias = seen.setdefault(id(t), i)
            state = getattr(t, "quant_state", None) if isinstance(t, bnb.nn.Params4bit) else None
            stats = state.as_dict(packed=True) if state is not None else None
            described.append((tuple(t.shape), t.dtype, t.requires_grad,
                              alias if alias != i else None,
                              {k: (tuple(v.shape), v.dtype) for k, v in stats.items()}
                              if stats is not None else None))  # fmt: skip
        description[0] = described
    dist.broadcast_object_list(description, src=0)
    sent = 0
    placed: list = []
    for (module, kind, name, tensor), (shape, dtype, grad, alias, stats) in zip(
            every, description[0], strict=True):  # fmt: skip
        if alias is not None:  # tied: the same object as an earlier slot
            if not main:
                getattr(module, kind)[name] = placed[alias]
            placed.append(placed[alias])
            continue
        data = tensor.data if main else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(data, src=0)
        sent += data.numel() * data.element_size()
        received = {}
        if stats is not None:
            own = tensor.quant_state.as_dict(packed=True) if main else {}
            for key, (s, d) in stats.items():
                t = own[key].to(device) if main else torch.empty(s, dtype=d, device=device)
                dist.broadcast(t, src=0)
                sent += t.numel() * t.element_size()
                received[key] = t
        if not main:
            if stats is not None:
                tensor = bnb.nn.Params4bit.from_prequantized(
                    data, received, requires_grad=grad, device=device, module=module)
            elif kind == "_parameters":
                tensor = torch.nn.Parameter(data, requires_grad=grad)
            else:
                tensor = data
            getattr(module, kind)[name] = tensor
        placed.append(tensor)
    if not main:
        quantize.keep_packing(model)
    return sent
