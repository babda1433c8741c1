"""Per-GPU memory budget of a QLoRA run, from the model's shape alone (no weights, no GPU).

    est = estimate("kit:llama-8b", Setup(world_size=2, seq_len=2048, batch_size=1))
    est.table(), est.total_gib, est.fits(24)

Notebook 01's home. Kernel side: imports no torch. The model shape comes from kit.budget.shapes: a `kit:`
name (kit/inputs/builtin.py SPECS), a config dict with Hugging Face field names, a `transformers` config
object, or a local folder. What a run really holds is measured by kit.lab.memory.

Each term is a formula a reader can check by hand (see `estimate`). The two constants that are
not pure bookkeeping -- bytes autograd keeps per token in one decoder layer, and the peak of the
logits/loss -- follow from what PyTorch saves for backward and were checked against a measured
Llama-3-8B run on 2x H200 (`kit.budget.measured.REFERENCE`, from FINDINGS.md): within ~5% across batch
sizes, with and without activation checkpointing; kit.budget.measured holds the kit's own measured runs
too (70B, offloading, long context) and compares each with the estimate.

Longer than 400 lines because each term of the budget sits beside its formula and the note of
the measured run that checks it; split apart, a reader could not see which run checks which term.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kit.budget.shapes import Shape, dropped_inputs, lora_params, lora_targets, shape_of

GiB = 2**30
# GPU memory a training process holds outside torch's allocator (the CUDA context, the loaded
# kernels: cuBLAS, Triton, inductor's, bitsandbytes'; the communicator's buffers): measured
# 1.29-1.33 GiB on one H200, one rank, in every row of the kit and unsloth, dense and MoE (the
# bench's `outside_gib`, benchmarks/records/2026-11-30-headroom-32b-1xh200). A card of 24 GiB
# leaves its allocator that much less; more ranks add their communicators' buffers (unmeasured:
# not counted).
OUTSIDE_GIB = 1.3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
BLOCKSIZE = 64  # bitsandbytes 4-bit: one scale (absmax) per 64 weights
NESTED_BLOCKSIZE = 256  # double quantization: the scales quantized to 8 bits in blocks of 256


def _count(n: float) -> str:
    """1234567 -> '1.23M' (for notes a person reads)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


@dataclass(frozen=True)
class Setup:
    """The training choices that move memory. Defaults: the reference run (FINDINGS.md)."""

    world_size: int = 2
    engine: str = "fsdp2"  # fsdp2 | fsdp1 | ddp
    quantization: str = "nf4"  # nf4 | fp4 | none
    double_quant: bool = True
    dtype: str = "bfloat16"  # compute dtype and dtype of everything not 4-bit
    lora_r: int = 16
    lora_targets: str | tuple[str, ...] = "all-linear"
    lora_dtype: str = "auto"  # auto: float32, except fsdp1 (model dtype)
    lora_dropout: bool = True
    lora_groups: bool = False  # lora.group_inputs: q/k/v and gate/up drop their input once
    batch_size: int = 1  # sequences per GPU per micro-step
    seq_len: int = 2048
    recompute: bool = True  # training.recompute.enabled
    recompute_keeps: str = "inputs"  # training.recompute.keeps (kit.recipe.recompute)
    matmul_layers: int = 0  # training.recompute.matmul_layers: of those, how many keep every matmul
    attention: str = "sdpa"  # sdpa/flash keep O(seq) per token; eager keeps the seq x seq scores
    cpu_offload: bool = False  # FSDP: shards, grads and optimizer state live in CPU memory
    reshard_after_forward: bool = True  # FSDP2: False keeps every layer gathered until backward
    prefetch_layers: int = 1  # FSDP gathers the next layer while computing this one
    # FSDP gathers the frozen weights too (4-bit weights, norms, head); False: FSDP2 on one rank
    # without cpu_offload leaves them alone (kit.recipe.engines.frozen_of) and gathers the
    # adapters only. True in the references measured before that (kit.budget.measured).
    frozen_gathered: bool = True
    loading: str = "full"  # model.loading: full | rank0 hold the whole model before sharding;
    # stream: a shard and one unit (auto is stream under FSDP, full under DDP)
    loss: str = "hf"  # training.loss: hf | chunked | fused (kit.recipe.levers.loss: how many logits exist)
    offload_activations: bool = False  # training.offload_activations: kept tensors in host memory
    mlp_tile_tokens: int = 0  # training.recompute.mlp_tile_tokens: the MLP's graph one tile at a time
    attention_tile_tokens: int = 0  # training.recompute.attention_tile_tokens: attention's, likewise
    lean_norms: bool = False  # training.recompute.lean_norms: RMSNorms keep no fp32 copy
    # A mixture's experts run grouped on the grouped GEMM (kit.budget.fit.setup_of: the GPU's
    # kernel, bf16, model.experts=grouped): the sorted rows their adapters keep are in the compute
    # dtype; otherwise in the adapters' dtype (kit.recipe.grouped_experts' loop casts them so)
    grouped_gemm: bool = False

    @classmethod
    def from_config(cls, cfg, world_size: int = 2) -> Setup:
        """The Setup a kit Config (kit/config.py) describes. Values left at "auto" that move
        memory little take the recipe's plain ones (kit.budget.plan.PLAIN); the batch and the
        sequence length must be known (a planned config: kit.budget.plan)."""
        def plain(value, default):
            return default if value == "auto" else value

        for name, value in (("training.batch_size", cfg.training.batch_size),
                            ("data.max_seq_len", cfg.data.max_seq_len)):
            if value == "auto":
                raise ValueError(f"{name} is 'auto': the planner chooses it (kit.budget.plan); "
                                 "estimate a planned config, or set it")
        targets = cfg.lora.target_modules
        return cls(
            world_size=world_size,
            engine=cfg.sharding.engine,
            quantization=cfg.quantization.method,
            double_quant=cfg.quantization.double_quant,
            dtype=cfg.model.dtype,
            lora_r=cfg.lora.r,
            lora_targets=targets if isinstance(targets, str) else tuple(targets),
            lora_dtype=cfg.lora.dtype,
            lora_dropout=cfg.lora.dropout > 0,
            lora_groups=plain(cfg.lora.group_inputs, False),
            batch_size=cfg.training.batch_size,
            seq_len=cfg.data.max_seq_len,
            recompute=cfg.training.recompute.enabled,
            recompute_keeps=plain(cfg.training.recompute.keeps, "inputs"),
            matmul_layers=cfg.training.recompute.matmul_layers,
            attention=cfg.attention.implementation,
            cpu_offload=cfg.sharding.cpu_offload,
            frozen_gathered=not (cfg.sharding.engine == "fsdp2" and world_size == 1
                                 and not cfg.sharding.cpu_offload),
            loading=cfg.model.loading if cfg.model.loading != "auto"
            else "full" if cfg.sharding.engine == "ddp" else "stream",
            reshard_after_forward=cfg.sharding.reshard_after_forward,
            loss=plain(cfg.training.loss, "hf"),
            offload_activations=plain(cfg.training.offload_activations, False),
            mlp_tile_tokens=plain(cfg.training.recompute.mlp_tile_tokens, 0),
            attention_tile_tokens=plain(cfg.training.recompute.attention_tile_tokens, 0),
            lean_norms=plain(cfg.training.recompute.lean_norms, False),
        )

    @property
    def adapter_bytes(self) -> int:
        if self.lora_dtype != "auto":
            return DTYPE_BYTES[self.lora_dtype]
        # As kit.recipe.engines answers it (FSDP1 flattens one dtype per unit): the estimate is kernel
        # side and models the engines without importing them.
        return DTYPE_BYTES[self.dtype] if self.engine == "fsdp1" else 4


def quantized_bytes_per_param(quantization: str, double_quant: bool) -> float:
    """Packed 4 bits plus the per-block scales (one fp32 per 64 weights, or with double
    quantization one byte per 64 plus one fp32 per 64*256). Constant-size code tables ignored."""
    if quantization == "none":
        raise ValueError("quantization 'none' keeps weights in the model dtype")
    scales = 1 / BLOCKSIZE + 4 / (BLOCKSIZE * NESTED_BLOCKSIZE) if double_quant else 4 / BLOCKSIZE
    return 0.5 + scales


MLP_LINEARS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")  # + a MoE's expert stacks  # the MLP's linears, as kit.budget.shapes names them


def activation_bytes_per_token_layer(shape: Shape, setup: Setup) -> int:
    """Bytes autograd keeps per token in one decoder layer for backward (no checkpointing).

    Frozen 4-bit linears keep nothing per token (bitsandbytes recomputes the weight, and the
    weight needs no gradient). What remains, a = compute dtype bytes, l = adapter dtype bytes:
      - 2 RMSNorms: the fp32 copy of their input (4h each)
      - RoPE + attention: q, k, v and the attention output (a * (2q + 2kv)), the output's
        reshaped copy fed to o_proj (a * q); eager attention also keeps the seq x seq scores
        (fp32 softmax + probabilities in a) per head
      - SwiGLU: gate and up outputs and silu(gate) (a * 3i)
      - LoRA, per targeted linear: its input after dropout in the adapter dtype (l * in), the
        dropout mask (1 byte * in), the r-wide output of A (l * r); with lora.group_inputs the
        dropped input and mask once per group of layers that share it (kit.budget.shapes.dropped_inputs)
    """
    # The two RMSNorms: the fp32 copy of their input. Lean norms (kit.recipe.levers.norms) keep less (the
    # fp32 1/rms and the second's bf16 input), but the measured peaks did not fall by it: counting
    # 2h + 8 bytes instead of 8h put both lean runs 12-16% below their peaks (131,072 and 163,840
    # tokens at the 8B shape, benchmarks/records/2026-11-27-lean-norms-context-24gib-8b-1xh100).
    # What they take off is the eager backward's fp32 temporaries (the attention-tiles branch
    # below).
    norms = 8 * shape.hidden
    return norms + attention_bytes_per_token_layer(shape, setup) + \
        mlp_bytes_per_token_layer(shape, setup)


def attention_bytes_per_token_layer(shape: Shape, setup: Setup) -> int:
    """The attention block's share of activation_bytes_per_token_layer (its norm not included):
    q, k, v, attention's output and o_proj's copy, and the adapters' dropped inputs, masks and
    r-wide outputs on q, k, v and o. A tiled attention block (kit.recipe.levers.attention_tiles) holds
    these for one tile of queries only, and keeps its input."""
    r = setup.lora_r
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    a, lb, mask = DTYPE_BYTES[setup.dtype], setup.adapter_bytes, int(setup.lora_dropout)
    total = a * (2 * q + 2 * kv) + a * q
    if setup.attention == "eager":
        total += shape.heads * setup.seq_len * (4 + a)
    for name, fan_in in dropped_inputs(shape, setup.lora_targets, setup.lora_groups).items():
        if name not in MLP_LINEARS:  # the MLP's adapters are in mlp_bytes_per_token_layer
            total += (lb + mask) * fan_in + lb * r
    return total


def mlp_bytes_per_token_layer(shape: Shape, setup: Setup) -> int:
    """The MLP's share of activation_bytes_per_token_layer: gate, up and SiLU outputs (a * 3i),
    and the adapters' dropped inputs, masks and r-wide outputs on gate, up and down. A tiled MLP
    (kit.recipe.recompute.tile_mlp) holds these for one tile of tokens only, and keeps its input.
    A mixture's expert stacks keep no mask (kit.recipe.grouped_experts hashes it again from a
    seed in backward) and their rows in the compute dtype where the grouped GEMM runs
    (setup.grouped_gemm): counted as dense adapters (adapter dtype and a mask), the 30B-A3B
    shape at 24 layers lay 7.6% above its measured peak, 1.6 GiB at batch 13
    (benchmarks/records/2026-12-01-host-step-moe-batch-1xh200)."""
    a, lb, r, mask = DTYPE_BYTES[setup.dtype], setup.adapter_bytes, setup.lora_r, int(setup.lora_dropout)
    dropped = dropped_inputs(shape, setup.lora_targets, setup.lora_groups)
    stacks, rows = shape.expert_stacks(), a if setup.grouped_gemm else lb
    return a * 3 * shape.intermediate + sum(
        rows * (f + r) if n in stacks else (lb + mask) * f + lb * r
        for n, f in dropped.items() if n in MLP_LINEARS)


def selective_bytes_per_token_layer(shape: Shape, setup: Setup) -> int:
    """Bytes one decoder layer keeps per token under training.recompute.keeps (kit.recipe.recompute):
    the matmul results the policy keeps (matmuls: q, k, v, o and gate, up; mlp_matmuls: gate,
    up; attention_matmuls: q, k, v, o), each adapter's r-wide down-projection, attention's output, and three
    hidden-wide tensors (the layer's input among them: a count of what compiled NF4 layers keep,
    benchmarks/tools/kept_per_policy.py). Within ~10% of the 8B shape's measured 6.3 / 5.1 / 3.0 GiB per
    2,048-token sequence (benchmarks/records/2026-11-23-speed-8b-2xh200)."""
    h, i, r = shape.hidden, shape.intermediate, setup.lora_r
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention, mlp = q + 2 * kv, 2 * i
    kept = {"matmuls": attention + mlp, "mlp_matmuls": mlp,
            "attention_matmuls": attention}[setup.recompute_keeps]
    stacks = shape.expert_stacks()  # a MoE: per active expert, its adapters' and down's outputs
    adapters = sum(shape.active_experts if n in stacks else 1
                   for n in lora_targets(shape, setup.lora_targets)) * setup.adapter_bytes * r
    # down's grouped GEMM (hidden-wide, one row per active expert) is kept with attention's
    # matmuls, recomputed under mlp_matmuls (kit.recipe.recompute)
    down_kept = setup.recompute_keeps != "mlp_matmuls"
    experts_out = max(shape.active_experts - 1, 0) * h * down_kept
    return DTYPE_BYTES[setup.dtype] * (3 * h + q + kept + experts_out) + adapters


# Bytes per logit at the loss's peak: the logits in the compute dtype (a), their fp32 copy (4),
# the fp32 log-probabilities cross-entropy keeps (4), the fp32 gradient it returns (4).
LOGIT_BYTES_FP32_PART = 12


CHUNK_TOKENS = 4096  # kit.recipe.levers.loss: the chunked loss's tokens per chunk
FUSED_CHUNK_LOGITS = 2**26  # kit.recipe.levers.loss: the fused loss's logits per chunk


def loss_bytes(shape: Shape, setup: Setup, tokens: int) -> tuple[float, str]:
    """(bytes at the loss's peak, how) for training.loss (kit.recipe.levers.loss), a = compute dtype bytes:
      - hf: the logits (a), their fp32 copy, log-probabilities and gradient (12 B) per logit;
      - chunked: the logits and their gradient (2a) whole, one chunk of 4,096 tokens in fp32 (12);
      - fused: no logits of the batch: one chunk of 2^26 logits (the head's output in a, its fp32
        copy, softmax in place, the gradient cast back in a: 2a + 4 B per logit; on a GPU with
        the kit's Triton kernels the same bytes as (2a + 4) / a times the rows in a, the
        gradient written over them) and the gradient of the hidden states it keeps for backward
        (tokens x hidden x a)."""
    a, vocab = DTYPE_BYTES[setup.dtype], shape.vocab
    if setup.loss == "fused":
        chunk = min(tokens, max(1, FUSED_CHUNK_LOGITS // vocab))
        return (chunk * vocab * (2 * a + 4) + tokens * shape.hidden * a,
                f"fused: {chunk} tokens x vocab x {2 * a + 4} B + the hidden states' gradient")
    if setup.loss == "chunked":
        chunk = min(tokens, CHUNK_TOKENS)
        return (tokens * vocab * 2 * a + chunk * vocab * LOGIT_BYTES_FP32_PART,
                f"chunked: vocab x tokens x {2 * a} B + {chunk} tokens x vocab x 12 B")
    return tokens * vocab * (a + LOGIT_BYTES_FP32_PART), f"vocab x tokens x ({a} + 12) B"


# Tensors in flight under training.offload_activations: the layer computing and the copy going to
# (forward) or coming from (backward) host memory on the side stream. With whole-layer recompute
# (one input per layer) this holds: 8.50 GiB estimated, 8.62 measured at 8B, batch 2
# (benchmarks/records/2026-11-24-offload-8b-1xh200). With recompute off the copies (~13 GB a step)
# are slower than the compute and more wait on the GPU (11.4 GiB measured, 9.0 estimated): a floor.
OFFLOAD_IN_FLIGHT_LAYERS = 2
TILED_LAYER_HIDDEN = 2.25  # hidden-wide tensors per token a tiled layer holds beyond those counted


# The allocator's reserved memory beyond its allocated peak, as a share of it: a few % (8B
# shape, 24 GiB: 18.88 GiB reserved at 18.49 allocated; the 30B-A3B shape at 24 layers keeping
# every matmul, 80 GiB: 74.98 at 73.24). A mixture whose layers are recomputed whole holds more:
# its grouped GEMMs' rows take blocks of other sizes each layer, forward and again in backward
# (the 30B-A3B shape at 24 GiB: 22.84 at 20.84, 23.62 at 22.02, 22.20 at 20.45, 21.46 at 19.99:
# 7.3-9.6%; benchmarks/records/2026-12-01-host-step-moe-batch-1xh200,
# 2026-11-29-moe-vs-unsloth-1xh200, 2026-11-29-moe-scaling-gpt-oss-2xh200). Under a cap the
# reserved memory is what must fit.
FRAGMENTATION = 0.05
MOE_RECOMPUTED_FRAGMENTATION = 0.12


@dataclass
class Estimate:
    """Bytes per GPU by component; `total` is what torch.cuda.max_memory_allocated would show."""

    shape: Shape
    setup: Setup
    parts: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    cpu_bytes: float = 0.0  # per rank, in host memory (cpu_offload)
    load_bytes: float = 0.0  # per GPU while loading, before the first step (model.loading)
    load_note: str = ""

    @property
    def load_gib(self) -> float:
        return self.load_bytes / GiB

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def total_gib(self) -> float:
        return self.total / GiB

    def needed_gib(self, reserve_gib: float = OUTSIDE_GIB,
                   fragmentation: float | None = None) -> float:
        """Total plus headroom: what a process holds outside torch's allocator (OUTSIDE_GIB on a
        card of its own; 0 under an allocator cap, which that memory sits beside) and the
        allocator's fragmentation (FRAGMENTATION; MOE_RECOMPUTED_FRAGMENTATION for a mixture
        whose layers are recomputed whole)."""
        if fragmentation is None:
            s = self.setup
            whole = s.recompute and s.recompute_keeps == "inputs"
            fragmentation = (MOE_RECOMPUTED_FRAGMENTATION if self.shape.experts and whole
                             else FRAGMENTATION)
        return self.total_gib * (1 + fragmentation) + reserve_gib

    def fits(self, gpu_gib: float, **headroom) -> bool:
        return self.needed_gib(**headroom) <= gpu_gib

    def table(self, unit: int = GiB) -> list[tuple[str, float, str]]:
        """(component, size in `unit` bytes, how it was computed) rows, largest first."""
        rows = sorted(self.parts.items(), key=lambda kv: -kv[1])
        return [(k, v / unit, self.notes.get(k, "")) for k, v in rows]

    def __str__(self) -> str:
        s = self.setup
        unit, name = (GiB, "GiB") if self.total >= GiB else (2**20, "MiB")
        head = (
            f"{s.engine} x{s.world_size}, {s.quantization}, LoRA r={s.lora_r}, batch {s.batch_size}"
            f" x seq {s.seq_len}, checkpointing {'on' if s.recompute else 'off'}"
        )
        lines = [head] + [f"  {k:<28} {v:8.2f} {name}  {note}" for k, v, note in self.table(unit)]
        lines.append(f"  {'total (allocated peak)':<28} {self.total / unit:8.2f} {name}")
        if unit == GiB:
            lines.append(f"  {'with headroom':<28} {self.needed_gib():8.2f} GiB")
        lines.append(f"  {'while loading':<28} {self.load_bytes / unit:8.2f} {name}  "
                     f"{self.load_note}")
        return "\n".join(lines)


EXPERT_CHUNK_BYTES = 256 * 2**20  # kit.recipe.expert_source.CHUNK_BYTES (the rank side's)


def _expert_load(shape: Shape, setup: Setup, model, a: int,
                 per_param: float) -> tuple[float, float]:  # fmt: skip
    """(a chunk's bytes, the dense stacks' bytes beyond their 4-bit ones) that loading a mixture
    of experts adds on a GPU. From a checkpoint, stream and rank0 (kit.recipe.expert_source) read
    a stack onto the device a chunk of experts at a time in the model dtype and quantize it there
    (the chunk and its 4-bit copy); full (and rank0 in a group of one) runs from_pretrained, which
    holds every stack in the model dtype until the kit quantizes them once it has loaded. A model
    initialised at load (kit.inputs.moe_shapes.MOE_AT_LOAD) makes each stack whole, in any mode."""
    if not shape.experts or setup.quantization == "none":
        return 0.0, 0.0
    from kit.inputs.moe_shapes import MOE_AT_LOAD

    stack = max(shape.experts * i * o for i, o in shape.expert_stacks().values())
    at_load = isinstance(model, str) and model.removeprefix("kit:") in MOE_AT_LOAD
    params = stack if at_load else min(stack, EXPERT_CHUNK_BYTES // a)
    full = setup.loading == "full" or (setup.loading == "rank0" and setup.world_size == 1)
    if full and not at_load:
        per_layer = sum(i * o for i, o in shape.expert_stacks().values())
        return 0.0, shape.layers * shape.experts * per_layer * (a - per_param)
    return params * (a + per_param), 0.0


def estimate(model, setup: Setup | None = None, **changes) -> Estimate:
    """Per-GPU peak memory of one training step. `changes` override fields of `setup`."""
    shape, setup = shape_of(model), replace(setup or Setup(), **changes)
    if setup.engine not in ("fsdp2", "fsdp1", "ddp"):
        raise ValueError(f"engine: {setup.engine!r}; allowed: fsdp2, fsdp1, ddp")
    est = Estimate(shape, setup)
    base, layer_bytes, per_param = _weights(est)
    _experts(est)
    _loading(est, model, base, layer_bytes, per_param)
    _communication(est, layer_bytes)
    _activations(est, _layer_bytes(shape, setup))
    return est


def _world(setup: Setup) -> tuple[bool, int]:
    """(sharded, the ranks a sharded tensor is split over: 1 under DDP)."""
    sharded = setup.engine != "ddp"
    return sharded, setup.world_size if sharded else 1


def _weights(est: Estimate) -> tuple[float, float, float]:
    """The static parts: base weights, LoRA weights, gradients, AdamW state (on the host under
    cpu_offload); returns (the base's bytes, one decoder layer's linear bytes, bytes a param)."""
    shape, setup, parts, notes = est.shape, est.setup, est.parts, est.notes
    a = DTYPE_BYTES[setup.dtype]
    sharded, world = _world(setup)
    # Base weights: 4-bit linears in the decoder layers; embeddings, output head, norms stay in
    # the model dtype (bitsandbytes does not quantize the head).
    linear = shape.layers * shape.layer_linear_params
    if setup.quantization == "none":
        per_param, layer_bytes = a, shape.layer_linear_params * a
        notes_w = f"{_count(linear)} linear params x {a} B"
    else:
        per_param = quantized_bytes_per_param(setup.quantization, setup.double_quant)
        layer_bytes = shape.layer_linear_params * per_param
        notes_w = f"{_count(linear)} linear params x {per_param:.3f} B (4 bit + scales)"
    if shape.experts:  # kit.recipe.experts: the expert stacks in 4 bits too; routers dense
        notes_w += f", {shape.experts} experts/layer (active: {_count(shape.active_params)})"
    base = linear * per_param + (shape.embedding_params + shape.norm_params
                                 + shape.layers * shape.router_params) * a
    adapter = lora_params(shape, setup.lora_r, setup.lora_targets)
    lb = setup.adapter_bytes
    shard_note = f" / {world} ranks" if sharded else " (every rank holds all)"
    static = {
        "base weights": (base / world, notes_w + shard_note),
        "LoRA weights": (adapter * lb / world, f"{_count(adapter)} params x {lb} B{shard_note}"),
        "LoRA gradients": (adapter * lb / world, f"same size as the LoRA weights{shard_note}"),
        "optimizer (AdamW m, v)": (
            2 * adapter * lb / world,
            f"2 x LoRA weights in their dtype{shard_note}; LoRA in fp32 is its own master copy",
        ),
    }
    for name, (value, note) in static.items():
        if setup.cpu_offload and sharded:
            est.cpu_bytes += value
            name, note = name + " [CPU]", "offloaded to host memory: 0 on the GPU"
            value = 0.0
        parts[name], notes[name] = value, note
    return base, layer_bytes, per_param


def _experts(est: Estimate) -> None:
    """A mixture of experts' 4-bit stacks: their scales whole on every rank, one dequantized stack."""
    shape, setup, parts, notes = est.shape, est.setup, est.parts, est.notes
    if not shape.experts or setup.quantization == "none":
        return
    sharded, world = _world(setup)
    # kit.recipe.experts keeps each expert stack's quantization state beside its module, not
    # as a parameter (so on the GPU under cpu_offload too): FSDP shards the packed 4-bit
    # values, every rank holds all the scales.
    stacked = shape.layers * shape.experts * sum(a * b for a, b in shape.expert_stacks().values())
    scales = stacked * (quantized_bytes_per_param(setup.quantization, setup.double_quant) - 0.5)
    parts["expert scales"] = scales * (1 - 1 / world) if sharded else 0.0
    notes["expert scales"] = "the experts' 4-bit scales, whole on every rank (beyond their share above)"
    # The grouped experts (kit.recipe.grouped_experts) dequantize one stack at a time into
    # the compute dtype for its grouped GEMM, forward and backward, and keep none of it (nor
    # its fp32 scales, which the per-expert loop kept to backward: 1.7 GiB on Qwen3-30B-A3B's
    # shape, never measured by the grouped ones).
    widest = max(i * o for i, o in shape.expert_stacks().values())
    parts["dequantized expert stack"] = shape.experts * widest * DTYPE_BYTES[setup.dtype]
    notes["dequantized expert stack"] = "one layer's widest stack in the compute dtype, for its GEMM"


def _loading(est: Estimate, model, base: float, layer_bytes: float, per_param: float) -> None:
    """What loading puts on a GPU (kit.recipe.loading): full and rank0 the whole model before
    sharding; stream only this rank's shards plus the unit being filled (a decoder layer, or the
    embeddings table: the largest unit of a small model)."""
    shape, setup = est.shape, est.setup
    a = DTYPE_BYTES[setup.dtype]
    sharded, world = _world(setup)
    whole = base + lora_params(shape, setup.lora_r, setup.lora_targets) * setup.adapter_bytes
    chunk, dense = _expert_load(shape, setup, model, a, per_param)
    if sharded and setup.loading == "stream":
        unit = max(layer_bytes + 2 * shape.hidden * a, shape.vocab * shape.hidden * a)
        est.load_bytes = whole / world + unit * (1 - 1 / world) + chunk  # that unit unsharded
        est.load_note = f"model.loading=stream: 1/{world} of the model + its largest unit whole"
    elif dense:
        est.load_bytes = whole + dense
        est.load_note = (f"model.loading={setup.loading}: the whole model, before sharding, its "
                         "expert stacks in the model dtype until quantized")
    else:
        est.load_bytes = whole + chunk
        est.load_note = f"model.loading={setup.loading}: the whole model, before sharding"
    if chunk and not dense:
        est.load_note += ", and one chunk of experts in the model dtype"


def _communication(est: Estimate, layer_bytes: float) -> None:
    """FSDP all-gathers a layer before use (plus the prefetched next one) and keeps the root unit
    (head, final norm; embeddings too unless they are a unit of their own) gathered from forward
    into backward. The kit's FSDP2 engine makes untied input embeddings their own unit
    (kit.recipe.engines): gathered for the first operation only. DDP: its gradient buckets."""
    shape, setup, parts, notes = est.shape, est.setup, est.parts, est.notes
    a = DTYPE_BYTES[setup.dtype]
    adapter = lora_params(shape, setup.lora_r, setup.lora_targets)
    if setup.engine != "ddp":
        own_unit = setup.engine == "fsdp2" and not shape.tied_embeddings
        root_params = shape.embedding_params // (2 if own_unit else 1) + shape.hidden
        lora_layer = adapter / shape.layers * a
        gathered_layers = shape.layers if not setup.reshard_after_forward else 1 + setup.prefetch_layers
        if setup.frozen_gathered:
            parts["FSDP gathered params"] = root_params * a + gathered_layers * (layer_bytes + lora_layer)
            notes["FSDP gathered params"] = (
                f"root unit ({'head' if own_unit else 'embeddings + head'}) + {gathered_layers} "
                f"unsharded decoder layer(s)"
            )
        else:  # one rank: the frozen weights are used as loaded; the adapters' bf16 copies
            parts["FSDP gathered params"] = gathered_layers * lora_layer
            notes["FSDP gathered params"] = (
                f"the adapters of {gathered_layers} decoder layer(s) (one rank: the frozen "
                "weights are not gathered)")
    else:
        parts["DDP gradient buckets"] = adapter * setup.adapter_bytes
        notes["DDP gradient buckets"] = "a flat copy of all LoRA gradients for the all-reduce"


def _layer_bytes(shape, setup: Setup) -> float:
    """What one decoder layer's forward keeps for backward, for the step's tokens, with the MLP
    and attention tiles as set."""
    a = DTYPE_BYTES[setup.dtype]
    tokens = setup.batch_size * setup.seq_len
    per_layer = activation_bytes_per_token_layer(shape, setup) * tokens
    if 0 < setup.mlp_tile_tokens < tokens:  # one tile's MLP graph instead of all tokens', + its input
        per_layer -= mlp_bytes_per_token_layer(shape, setup) * (tokens - setup.mlp_tile_tokens)
        per_layer += tokens * shape.hidden * a
    if 0 < setup.attention_tile_tokens < tokens:  # one tile's graph, + its input, the whole
        # sequence's keys and values and their gradients, and a tile's share of the unmasked
        # keys' gradients before they are added (6 x kv values per token); the attention output
        # the layer's recompute keeps for backward (q values) and its log-sum-exp (fp32 per
        # head): kit.recipe.levers.tile_kernels. Measured for one layer's tiles at the 8B shape:
        # 2.36 GiB above the inputs at 131,072 tokens (benchmarks/tools/tile_attention_bench.py).
        per_layer -= attention_bytes_per_token_layer(shape, setup) * (tokens - setup.attention_tile_tokens)
        per_layer += tokens * (a * (shape.hidden + 6 * shape.kv_heads * shape.head_dim
                                    + shape.heads * shape.head_dim) + 4 * shape.heads)
        if 0 < setup.mlp_tile_tokens < tokens:  # one tile's graph at a time, not both
            per_layer -= min(attention_bytes_per_token_layer(shape, setup) * setup.attention_tile_tokens,
                             mlp_bytes_per_token_layer(shape, setup) * setup.mlp_tile_tokens)
        # Fitted, not itemised: the tiled, recomputed layer's hidden-wide tensors beyond those
        # counted (its input's and output's gradients, the residual after attention, ...). Without
        # it the 524,288-token run lay 12% below its measured peak (58.74 GiB at the 8B shape,
        # benchmarks/records/2026-11-27-tile-kernels-context-512k-8b-1xh100); with it the three lean
        # runs lie 1-8% above theirs (REFERENCE_CONTEXT_TILES).
        per_layer += tokens * TILED_LAYER_HIDDEN * shape.hidden * a
        if not setup.lean_norms:  # the eager norms' backward: fp32 temporaries of the whole
            # sequence, two at once (fitted: 98,304 and 114,688 tokens at the 8B shape measured
            # 19.88 and 22.01 GiB, benchmarks/records/2026-11-27-attention-tiles-context-8b-1xh100;
            # counted without them the estimate lay 11-13% below). kit.recipe.levers.norms runs them a
            # chunk at a time: without them 131,072 and 163,840 tokens lie 3.0% and 0.4% below the
            # estimate (19.89 and 23.15 GiB measured,
            # 2026-11-27-lean-norms-context-24gib-8b-1xh100).
            per_layer += tokens * 2 * 4 * shape.hidden
    return per_layer


def _activations(est: Estimate, per_layer: float) -> None:
    """Activations and the loss. The loss's peak comes at the end of forward, before any layer is
    recomputed or its saved tensors used: under recompute the two do not add up."""
    shape, setup, parts, notes = est.shape, est.setup, est.parts, est.notes
    a = DTYPE_BYTES[setup.dtype]
    tokens = setup.batch_size * setup.seq_len
    logits, how = loss_bytes(shape, setup, tokens)
    offload = " [host]" if setup.offload_activations else ""
    if setup.recompute and setup.recompute_keeps != "inputs":
        kept = selective_bytes_per_token_layer(shape, setup) * tokens
        more = min(setup.matmul_layers, shape.layers)  # these keep every matmul instead
        richer = selective_bytes_per_token_layer(shape, replace(setup, recompute_keeps="matmuls"))
        # Backward reruns what the policy did not keep, one layer at a time: beyond the kept
        # tensors, the recomputed layer adds the matmul results the policy did not keep (its
        # element-wise work is consumed as it is recomputed). Counting all of the layer's other
        # activations instead put the 8B shape 0.34-0.45 GiB per 2,048-token sequence above
        # every measured peak on one H100, under each policy
        # (benchmarks/records/2026-11-27-layers-24gib-8b-1xh100); this count lies 0-2.4% above
        # them (Qwen2.5-7B: 7% below).
        again = richer - kept // tokens  # per token: what `matmuls` would keep beyond it
        rerun = min(again * tokens, max(0, per_layer - kept))
        parts["activations"] = (shape.layers - more) * kept + more * richer * tokens + rerun
        notes["activations"] = (f"{shape.layers - more} layers x {kept / tokens / 1024:.0f} KiB/token "
                                f"kept ({setup.recompute_keeps})"
                                + (f", {more} x {richer / 1024:.0f} (matmuls)" if more else "")
                                + ", one layer recomputed in backward")
        parts["logits and loss"] = max(0, logits - rerun)
        notes["logits and loss"] = f"{how}, beyond the recomputed layer"
    elif setup.recompute:
        inputs = shape.layers * tokens * shape.hidden * a
        if setup.offload_activations:  # the inputs go to host memory as they are saved
            est.cpu_bytes += inputs
            inputs = OFFLOAD_IN_FLIGHT_LAYERS * tokens * shape.hidden * a
        parts["activations"] = inputs + per_layer
        notes["activations"] = (f"each layer's input kept{offload}, one layer recomputed in "
                                f"backward")
        parts["logits and loss"] = max(0, logits - per_layer)
        notes["logits and loss"] = f"{how}, beyond the recomputed layer"
    else:
        parts["activations"] = shape.layers * per_layer
        notes["activations"] = f"{shape.layers} layers x {per_layer / tokens / 1024:.0f} KiB/token"
        if setup.offload_activations:  # what layers keep goes to host; two layers in flight
            est.cpu_bytes += shape.layers * per_layer
            parts["activations"] = OFFLOAD_IN_FLIGHT_LAYERS * per_layer
            notes["activations"] = (f"{OFFLOAD_IN_FLIGHT_LAYERS} layers in flight{offload}; more "
                                    "when the copies are slower than the compute")
        parts["logits and loss"] = logits
        notes["logits and loss"] = how


def sweep(model, setup: Setup, key: str, values) -> list[Estimate]:
    """One estimate per value of Setup field `key` (for tables and plots)."""
    return [estimate(model, setup, **{key: v}) for v in values]


def scenarios(models: dict, setups: dict, gpus: dict[str, float]) -> list[dict]:
    """Rows model x setup: the estimate, its headroom total, and whether it fits each GPU
    (`gpus`: label -> GiB the device reports, e.g. {"H200": 139})."""
    rows = []
    for model_label, model in models.items():
        for setup_label, setup in setups.items():
            est = estimate(model, setup)
            row = {"model": model_label, "setup": setup_label,
                   "GiB per GPU": round(est.total_gib, 1), "with headroom": round(est.needed_gib(), 1),
                   "host GiB per rank": round(est.cpu_bytes / GiB, 1)}  # fmt: skip
            row.update({f"fits {label}": est.fits(gib) for label, gib in gpus.items()})
            rows.append(row)
    return rows


def plot_parts(estimates: dict, gpus: dict[str, float] | None = None, ax=None):
    """Stacked horizontal bars, one per labelled Estimate; dashed lines at GPU sizes (GiB)."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(9, 0.5 + 0.45 * len(estimates)))[1]
    names = list(dict.fromkeys(k for e in estimates.values() for k in e.parts))
    labels = list(estimates)
    left = [0.0] * len(labels)
    for name in names:
        values = [estimates[label].parts.get(name, 0) / GiB for label in labels]
        ax.barh(labels, values, left=left, label=name)
        left = [a + b for a, b in zip(left, values, strict=True)]
    for label, gib in (gpus or {}).items():
        ax.axvline(gib, color="k", ls="--", lw=1)
        ax.text(gib, -0.6, f" {label}", va="bottom", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GiB per GPU (allocated peak, before headroom)")
    ax.legend(fontsize=7, loc="lower right")
    return ax


def plot_sweep(model, setup: Setup, key: str, values, ax=None, label: str = ""):
    """Total GiB per GPU as Setup field `key` varies (one line per call)."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    ax.plot(values, [e.total_gib for e in sweep(model, setup, key, values)], marker="o",
            label=label or None)  # fmt: skip
    ax.set_xlabel(key)
    ax.set_ylabel("GiB per GPU")
    if label:
        ax.legend()
    return ax
