"""The planner: every config value left at "auto", chosen from the model's shape, the GPUs, the
engine and the data; every value a person set is kept.

    planned = plan(cfg, Hardware("cuda", world_size=1, memory_gib=24, name="NVIDIA H100"), seq_len=2048)
    planned.cfg          # a Config with no "auto" left: what the ranks train with
    print(planned.table())   # each choice, who made it, why; predicted peak and expected speed

Kernel side, no torch: rank 0 plans at start (kit.train), `kit plan CONFIG` prints it without
starting anything. Memory: the estimate's (kit.budget.estimate, checked against measured runs);
speed: the step model (kit.budget.step_model, `speed`), fitted to the kit's measured runs; what
fits the machine, the fastest of it and the one-line refusal: kit.budget.fit.

On a GPU (on a CPU, and with training.plan=off, the recipe's plain values): the fused loss where
the model allows it (a frozen head, no logit softcapping or scaling), else chunked; compiled
layers and grouped adapters where they were measured; of every recompute policy and batch the
estimate says fit (with headroom: 5%, and on a card the memory a process holds outside the
allocator), the one `speed` predicts fastest, whole layers with their inputs offloaded among them;
when nothing fits, (long rows) the MLP's tiles, then attention's with lean norms; adapters
ungrouped past GPU memory; offloaded tensors within the host's memory where it is known. FP8
base matmuls stay opt-in (they move the loss); the plan says what they would add.

Longer than 400 lines because each choice and note carries its reason and its record: what
`kit plan` prints.
The choices depend on one another in order (loss, groups, policy and batch, offload, tiles,
compile): `plan` calls one function for each step, in that order.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import asdict, dataclass, field

from kit.budget import fit
from kit.budget.estimate import estimate
from kit.budget.fit import Hardware
from kit.budget.shapes import SHARED_INPUT_GROUPS, Shape, shape_of
from kit.budget.step_model import CPP_COMPILE_S, OFFLOAD_SPEED, speed
from kit.config import AUTO, Config, ConfigError

# The recipe's plain values: what "auto" means where the kit does not plan (a CPU; plan=off).
PLAIN = {"training.batch_size": 8, "training.loss": "hf", "training.compile": False,
         "training.compile_wrapper": "python",
         "training.recompute.keeps": "inputs", "lora.group_inputs": False,
         "lora.fused_down": False,
         "training.offload_activations": False, "training.recompute.mlp_tile_tokens": 0,
         "training.recompute.attention_tile_tokens": 0, "training.recompute.lean_norms": False}
TILE_FIELDS = ("training.recompute.mlp_tile_tokens", "training.recompute.attention_tile_tokens",
               "training.recompute.lean_norms")
POLICIES = ("matmuls", "mlp_matmuls", "attention_matmuls", "inputs")
LEAN = ("mlp_matmuls", "attention_matmuls")  # policies whose first layers may keep every matmul
# Where the GPU levers were measured (benchmarks/records/2026-11-25-planned-defaults-1xh100):
# compiled layers and grouped adapters under FSDP2, grouping in these families (separate q/k/v and
# gate/up modules).
MEASURED_ENGINE = "fsdp2"
GROUPED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MAX_BATCH = 64
# Long rows, when nothing fits otherwise (the last resort, after offloaded activations): the MLP,
# then attention with lean norms, a tile at a time. TILE_TOKENS is the tile of every measured run
# (2026-11-24-caps-context-8b-1xh100, 2026-11-27-attention-tiles-context-8b-1xh100,
# 2026-11-27-lean-norms-context-24gib-8b-1xh100). Attention tiles and lean norms run on these
# families' attention and RMSNorm (kit.recipe.levers.attention_tiles, kit.recipe.levers.norms).
TILE_TOKENS = 8192
TILED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

@dataclass
class Choice:
    field: str
    value: object
    by: str  # "you" (the config set it), "plan", "plain" (the recipe's plain value)
    why: str


@dataclass
class Planned:
    cfg: Config
    hardware: Hardware
    seq_len: int
    choices: list[Choice] = field(default_factory=list)
    predicted_gib: float | None = None  # the estimate's allocated peak per GPU
    needed_gib: float | None = None  # with the estimate's headroom (what must fit)
    tokens_per_s: float | None = None  # per GPU, the step model's (`speed`)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        t, rc = self.cfg.training, self.cfg.training.recompute
        parts = [f"batch {t.batch_size} x {self.seq_len} tokens", f"loss {t.loss}",
                 f"attention {self.cfg.attention.implementation}",
                 f"compile {'on' if t.compile else 'off'}",
                 f"recompute {'keeps ' + rc.keeps if rc.enabled else 'off'}"
                 + (f" ({rc.matmul_layers} layers every matmul)" if rc.enabled
                    and rc.matmul_layers else ""),
                 f"adapters {'grouped' if self.cfg.lora.group_inputs else 'ungrouped'}"]
        if t.offload_activations:
            parts.append("activations offloaded")
        tiles = [f"{what} in {n:,}-token tiles" for what, n in
                 (("MLP", rc.mlp_tile_tokens), ("attention", rc.attention_tile_tokens))
                 if isinstance(n, int) and n]
        parts += tiles + (["lean norms"] if rc.lean_norms is True else [])
        mem = (f"; predicted peak {self.predicted_gib:.1f} GiB of {self.hardware.memory_gib:g}"
               if self.predicted_gib is not None and self.hardware.memory_gib else "")
        speed = f", ~{self.tokens_per_s:,.0f} tokens/s per GPU" if self.tokens_per_s else ""
        return f"plan: {', '.join(parts)}{mem}{speed}"

    def table(self) -> str:
        hw = self.hardware
        where = (f"{hw.world_size} x {hw.name or hw.device}"
                 + (f", {hw.memory_gib:g} GiB each" if hw.memory_gib else ""))
        rows = [f"plan for {where}; sequence {self.seq_len} tokens", "",
                "| field | value | by | why |", "|---|---|---|---|"]
        rows += [f"| {c.field} | {c.value} | {c.by} | {c.why} |" for c in self.choices]
        if self.predicted_gib is not None and hw.device == "cuda":
            rows += ["", f"predicted peak {self.predicted_gib:.1f} GiB per GPU "
                     f"({self.needed_gib:.1f} with headroom; kit.budget.estimate)"]
        elif self.predicted_gib is not None:
            rows += ["", f"predicted peak {self.predicted_gib * 1024:,.0f} MiB per process "
                     "(kit.budget.estimate)"]
        if self.tokens_per_s:
            rows.append(f"expected ~{self.tokens_per_s:,.0f} tokens/s per GPU (the planner's "
                        "step model, fitted to measured runs (kit/budget/step_model.py): one H100 "
                        "for dense models, one H200 for grouped experts; measured speeds: "
                        "notebook 09)")
        rows += self.notes
        return "\n".join(rows)

    def to_json(self) -> dict:
        """The whole plan as JSON, read back by `from_json`: what a start hands its ranks
        (kit.folder.start: they train with it instead of planning again)."""
        return {"config": self.cfg.to_dict(), "hardware": asdict(self.hardware),
                "seq_len": self.seq_len, "choices": [asdict(c) for c in self.choices],
                "predicted_gib": self.predicted_gib, "needed_gib": self.needed_gib,
                "tokens_per_s": self.tokens_per_s, "notes": list(self.notes)}

    @classmethod
    def from_json(cls, found: dict) -> Planned:
        from kit.config import config_from_dict

        return cls(config_from_dict(found["config"]), Hardware(**found["hardware"]),
                   found["seq_len"], [Choice(**c) for c in found["choices"]],
                   found["predicted_gib"], found["needed_gib"], found["tokens_per_s"],
                   list(found["notes"]))

    def as_dict(self) -> dict:
        return {"line": self.line(), "seq_len": self.seq_len, "predicted_gib": self.predicted_gib,
                "needed_gib": self.needed_gib, "tokens_per_s": self.tokens_per_s,
                "choices": [[c.field, c.value, c.by] for c in self.choices],
                "hardware": {"device": self.hardware.device, "world_size": self.hardware.world_size,
                             "memory_gib": self.hardware.memory_gib, "name": self.hardware.name}}


def _get(cfg: Config, dotted: str):
    *parents, last = dotted.split(".")
    return getattr(functools.reduce(getattr, parents, cfg), last)


def _set(cfg: Config, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    setattr(functools.reduce(getattr, parents, cfg), last, value)


def is_planned(cfg: Config) -> bool:
    """True when no value the planner chooses is left at "auto"."""
    return all(_get(cfg, f) != AUTO for f in PLAIN) and cfg.data.max_seq_len != AUTO


def _shape(cfg: Config, model_config: dict | None) -> Shape | None:
    try:
        return shape_of(model_config if model_config is not None else cfg.model.name)
    except (ValueError, KeyError, OSError):
        return None


def plan(cfg: Config, hw: Hardware, seq_len: int, model_config: dict | None = None,
         facts: dict | None = None) -> Planned:
    """The config with every "auto" chosen (see the module's doc); `facts`: what the model allows
    (kit.inputs.sources.model_facts). Raises ConfigError in one line when nothing fits the GPUs'
    memory, naming the smallest change that does. The choices, in order: `_everywhere` (every
    device), then on a GPU `_loss_and_groups`, `_fit` (policy and batch; offload, tiles) and
    `_compile_keeps_batch`; `_predict` says the peak and the speed."""
    if model_config is None:  # its config.json where one is at hand (kit models, folders, cache)
        from kit.inputs.sources import model_config as config_of

        model_config = config_of(cfg.model.name)
    planned = Planned(copy.deepcopy(cfg), hw, seq_len)
    _everywhere(planned, facts)
    if not (hw.device == "cuda" and planned.cfg.training.plan == AUTO):
        _plain_values(planned)
        _fill_memory(planned, _shape(cfg, model_config))
        return planned
    shape = _shape(cfg, model_config)
    if shape is None:
        raise ConfigError(f"model.name: {cfg.model.name!r} has no config.json at hand to plan "
                          "from; allowed: a local folder or a cached hub id, or training.plan=off")
    tiles_auto = _loss_and_groups(planned, model_config, facts)
    wrapper_by = _wrapper(planned, shape, model_config)
    search = _Search(planned, cfg, shape, model_config, tiles_auto)
    if wrapper_by is not None and planned.cfg.training.compile_wrapper == "cpp":
        wrapper_by = _cpp_pays(planned, shape, search)
    best = search.fit()
    search.say_fit()
    _compile_keeps_batch(planned, shape, best, wrapper_by)
    _predict(planned, shape)
    return planned


def _wrapper(planned: Planned, shape: Shape, model_config: dict | None) -> str | None:
    """training.compile_wrapper, chosen before the search (the step model's knee depends on it):
    inductor's C++ wrapper proposed where it was measured (the dense families of
    GROUPED_FAMILIES, under FSDP2, compile not switched off; `_cpp_pays` keeps it where the run
    is long enough), the Python wrapper elsewhere. A mixture of experts cannot
    take it (torch 2.11's C++ wrapper has no `_grouped_mm`): refused in one line. Returns why, or
    None where you set it (said once compile is known; `_compile_keeps_batch` falls back to the
    Python wrapper where the layers end up not compiled)."""
    out = planned.cfg
    t = out.training
    if t.compile_wrapper == "cpp" and shape.experts:
        raise ConfigError("training.compile_wrapper: 'cpp' is not allowed for a mixture of "
                          "experts (torch 2.11's C++ wrapper has no grouped GEMM: the first "
                          "step's compile fails); allowed: python, auto")
    if t.compile_wrapper != AUTO:
        return None
    family = (model_config or {}).get("model_type")
    if shape.experts:
        t.compile_wrapper = "python"
        return "a mixture of experts: torch 2.11's C++ wrapper has no grouped GEMM"
    if t.compile is False:
        t.compile_wrapper = "python"
        return "no compiled layers"
    if out.sharding.engine != MEASURED_ENGINE or family not in GROUPED_FAMILIES:
        t.compile_wrapper = "python"
        return (f"the C++ wrapper was measured for {', '.join(GROUPED_FAMILIES)} under "
                f"{MEASURED_ENGINE} only")
    t.compile_wrapper = "cpp"  # proposed: `_cpp_pays` keeps it or not, and says why
    return "proposed"


def _cpp_pays(planned: Planned, shape: Shape, search: _Search) -> str:
    """training.compile_wrapper where `_wrapper` proposed cpp: the C++ wrapper only where this
    run is long enough for it to pay, by the step model. Its first step takes CPP_COMPILE_S
    longer (the host compiles the wrapper); the steps after it run faster where the host bounds
    them (small batches). The fit with each wrapper (policy, batch, offloaded or not, as
    `_Search.in_memory_or_offloaded` chooses), the time each takes for the cpp plan's tokens over
    training.steps; cpp when what it saves exceeds CPP_COMPILE_S. Sets the value; returns why."""
    out, hw, seq = planned.cfg, planned.hardware, planned.seq_len
    t, rc = out.training, out.training.recompute
    given_offload = t.offload_activations
    found = {}
    for wrapper in ("cpp", "python") if hw.peak_flops else ():  # as `_Search.fit` chooses
        t.compile_wrapper = wrapper
        best = search.in_memory_or_offloaded()
        found[wrapper] = best and (best, t.offload_activations is True)
    t.offload_activations = given_offload
    search.regroup()
    t.compile_wrapper = "python"
    if not found or None in found.values():
        return ("the C++ wrapper was measured where the layers fit in GPU memory or offload "
                "their inputs, on a GPU of known peak only")
    rate = {w: speed(shape, seq, batch, keeps if rc.enabled else None, hw, rc.matmul_layers,
                     wrapper=w, offloaded=off) for w, (((keeps, batch), _), off) in found.items()}
    tokens = t.steps * t.grad_accum * found["cpp"][0][0][1] * seq
    saved = tokens / rate["python"] - tokens / rate["cpp"]
    if saved > CPP_COMPILE_S:
        t.compile_wrapper = "cpp"
        return (f"the host launches each layer's kernels from C++: ~{saved:,.0f} s saved over "
                f"{t.steps:,} steps by the step model ({rate['cpp']:,.0f} against "
                f"{rate['python']:,.0f} tokens/s), more than the ~{CPP_COMPILE_S} s its compile "
                "adds to the first step (on one H200 at 24 GiB: 14,023 against 12,502 tokens/s, "
                "benchmarks/records/2026-11-30-cpp-default-1xh200)")
    pays = (f"; it pays from ~{math.ceil(CPP_COMPILE_S * t.steps / saved):,} steps"
            if saved > 0 else "")
    return (f"the C++ wrapper would save ~{max(saved, 0):,.0f} s over {t.steps:,} steps by the "
            f"step model, less than the ~{CPP_COMPILE_S} s its compile adds to the first step"
            f"{pays} (training.steps)")


def _everywhere(planned: Planned, facts: dict | None) -> None:
    """What is chosen on every device: the length, compile for a memory budget, attention (what
    the model's class supports)."""
    out, hw, say = planned.cfg, planned.hardware, planned.choices.append
    t, seq_len = out.training, planned.seq_len
    if out.data.max_seq_len == AUTO:
        out.data.max_seq_len = seq_len
        say(Choice("data.max_seq_len", seq_len, "plan", "the data's longest row (kit.recipe.data)"))
    else:
        say(Choice("data.max_seq_len", seq_len, "you", "set in the config"))
    if t.compile_wrapper == "cpp" and hw.device != "cuda":
        raise ConfigError("training.compile_wrapper: 'cpp' is not allowed on a CPU; GPUs only (on "
                          "a CPU inductor's C++ wrapper cannot compile a recomputed layer's "
                          "saved random state, torch 2.13); allowed here: python, auto")
    if t.compile == AUTO and t.activation_memory_budget < 1:  # the budget steers the compiler
        t.compile = True
        say(Choice("training.compile", True, "plan", "training.activation_memory_budget < 1 "
                   "steers the compiler's recompute"))
    by, why = "you", "set in the config"
    if out.attention.implementation == AUTO:
        from kit.inputs import families

        by, (out.attention.implementation, why) = "plan", families.pick_attention(
            facts, hw.device, out.model.dtype, hw.flash_attn)
    say(Choice("attention.implementation", out.attention.implementation, by, why))


def _plain_values(planned: Planned) -> None:
    """A CPU, or training.plan=off: every value left at auto takes the recipe's plain one."""
    out, say = planned.cfg, planned.choices.append
    why = "training.plan=off" if out.training.plan != AUTO else "a CPU: the recipe's plain value"
    for name, value in PLAIN.items():
        if any(c.field == name for c in planned.choices):
            continue
        if _get(out, name) == AUTO:
            _set(out, name, value)
            say(Choice(name, value, "plain", why))
        else:
            say(Choice(name, _get(out, name), "you", "set in the config"))


def _loss_and_groups(planned: Planned, model_config: dict | None,
                     facts: dict | None) -> list[str]:
    """The loss and the adapters' groups first: they move memory little and speed much
    (measured). The tiles left at auto start off (the last resort, `_Search`); returns them."""
    from kit.inputs.sources import fused_blocked

    out, say = planned.cfg, planned.choices.append
    t, rc = out.training, out.training.recompute
    if t.loss == AUTO:
        blocked = fused_blocked(out, model_config, facts)
        t.loss = "chunked" if blocked else "fused"
        say(Choice("training.loss", t.loss, "plan", f"fused cannot run: {blocked}" if blocked
                   else "the head and the loss a chunk at a time: no logits of the batch"))
    else:
        say(Choice("training.loss", t.loss, "you", "set in the config"))
    tiles_auto = [f for f in TILE_FIELDS if _get(out, f) == AUTO]  # yours are kept
    lo = out.lora
    if lo.fused_down == AUTO:
        why = ("no Triton kernels here (compute capability 8.0 or later, triton installed)"
               if not planned.hardware.triton else "lora.dropout is 0: no dropout to fuse"
               if not lo.dropout else None)  # fmt: skip
        lo.fused_down = why is None
        say(Choice("lora.fused_down", lo.fused_down, "plan",
                   why or "each adapter's dropout inside its down-projection's kernel"))
    else:
        say(Choice("lora.fused_down", lo.fused_down, "you", "set in the config"))
    for name in tiles_auto:
        _set(out, name, PLAIN[name])
    if out.lora.group_inputs != AUTO:
        say(Choice("lora.group_inputs", out.lora.group_inputs, "you", "set in the config"))
        return tiles_auto
    family = (model_config or {}).get("model_type")
    targets = out.lora.target_modules
    whole = targets == "all-linear" or any(all(n in targets for n in g)
                                           for g in SHARED_INPUT_GROUPS)
    why = ("attention tiles run each projection on its own" if rc.attention_tile_tokens
           else f"measured under {MEASURED_ENGINE} only" if out.sharding.engine != MEASURED_ENGINE
           else f"measured for {', '.join(GROUPED_FAMILIES)} only" if family not in
           GROUPED_FAMILIES else "no q/k/v or gate/up group among the targets" if not whole
           else None)
    out.lora.group_inputs = why is None
    say(Choice("lora.group_inputs", why is None, "plan", why or
               "q/k/v and gate/up drop their input once, one down-projection each group"))
    return tiles_auto


class _Search:
    """The recompute policy and the batch that fit, fastest first: in GPU memory; else with the
    layers' inputs offloaded to host memory; else a tile at a time (`_tile_stages`)."""

    def __init__(self, planned: Planned, given: Config, shape: Shape, model_config: dict | None,
                 tiles_auto: list[str]):
        self.planned, self.given, self.shape = planned, given, shape
        self.model_config, self.tiles_auto = model_config, tiles_auto
        out = planned.cfg
        t, rc = out.training, out.training.recompute
        self.policies = ([rc.keeps] if rc.keeps != AUTO else
                         ["inputs"] if (not rc.enabled or rc.mlp_tile_tokens
                                        or rc.attention_tile_tokens or rc.lean_norms
                                        or out.lora.recompute
                                        or t.activation_memory_budget < 1) else
                         list(LEAN) if rc.matmul_layers else list(POLICIES))
        self.batches = [t.batch_size] if t.batch_size != AUTO else list(range(1, MAX_BATCH + 1))
        self.offload = t.offload_activations  # as given: True, False or auto
        self.tiled, self.blocked = False, {}
        self.offload_why = "nothing fits in GPU memory otherwise"
        # the adapters' groups as `_loss_and_groups` chose them (`regroup` restores them)
        self.groups = (out.lora.group_inputs,
                       [c for c in planned.choices if c.field == "lora.group_inputs"])

    def _search(self, policies):
        p = self.planned
        return fit.search(p.cfg, p.hardware, p.seq_len, self.shape, policies, self.batches)

    def _ungroup(self) -> None:
        """Past GPU memory (offloaded inputs, tiles) the adapters go ungrouped where the plan
        grouped them: every offloaded and tiled run was measured so (their saving under
        whole-layer recompute was never measured, and the estimate counted grouped MLP tiles at
        98,304 tokens into 24 GiB, where ungrouped ones measured out of memory)."""
        out, choices = self.planned.cfg, self.planned.choices
        if out.lora.group_inputs and self.given.lora.group_inputs == AUTO:
            out.lora.group_inputs = False
            choices[:] = [c for c in choices if c.field != "lora.group_inputs"]
            choices.append(Choice("lora.group_inputs", False, "plan", "measured ungrouped past "
                                  "GPU memory (offloaded inputs, tiles)"))

    def regroup(self) -> None:
        """The adapters' groups back as `_loss_and_groups` chose them (`_ungroup` undone)."""
        out, choices = self.planned.cfg, self.planned.choices
        value, said = self.groups
        if out.lora.group_inputs != value:
            out.lora.group_inputs = value
            choices[:] = [c for c in choices if c.field != "lora.group_inputs"] + said

    def in_memory_or_offloaded(self):
        """((keeps, batch), needed GiB) of the faster by the step model of: what the layers keep
        in GPU memory (every policy), and whole layers with their inputs offloaded to host memory
        (only inputs: what layers keep without recompute would fill host memory; the estimate
        counts it, the plan does not choose it). Offloaded inputs run at OFFLOAD_SPEED: taken
        where they let a larger batch run faster, or where nothing fits otherwise. Sets
        training.offload_activations (and the adapters' groups) to match; None if neither fits."""
        p, offload = self.planned, self.offload
        t, rc = p.cfg.training, p.cfg.training.recompute
        self.regroup()
        kept = moved = None
        if offload is not True:
            t.offload_activations = False
            kept = self._search(self.policies)
            kept_rate = kept and fit.rate(p.cfg, p.hardware, p.seq_len, self.shape, *kept[0])
        if offload is not False and rc.enabled and "inputs" in self.policies:
            self._ungroup()
            t.offload_activations = True
            moved = self._search(["inputs"])
            if moved is not None and (kept is None or kept_rate * 1.001 < fit.rate(
                    p.cfg, p.hardware, p.seq_len, self.shape, *moved[0])):
                self.offload_why = ("nothing fits in GPU memory otherwise" if kept is None else
                                    f"batch {moved[0][1]} with them runs faster by the step "
                                    f"model than batch {kept[0][1]} without (offloaded: x"
                                    f"{OFFLOAD_SPEED}, measured)")
                return moved
        self.regroup()
        t.offload_activations = offload is True  # False where `kept` fits
        return kept

    def fit(self):
        """((keeps, batch), needed GiB) of the fastest that fits, or ConfigError (one line)."""
        p, offload = self.planned, self.offload
        t, rc = p.cfg.training, p.cfg.training.recompute
        best = self.in_memory_or_offloaded()
        stages, self.blocked = _tile_stages(p.cfg, self.model_config, self.shape, p.seq_len,
                                            self.tiles_auto, self.policies,
                                            self.given.lora.group_inputs is True)
        for stage in stages if best is None else []:
            self._ungroup()
            for name, value in stage.items():
                _set(p.cfg, name, value)
            t.offload_activations = offload if offload != AUTO else rc.enabled
            best, self.tiled = self._search(["inputs"]), True
            if best is not None:
                break
        if best is None:  # after tiles, the refusal counts with them (a shorter length it names
            # is planned with them too); before, as you set it
            t.offload_activations = (offload if offload != AUTO
                                     else self.tiled and t.offload_activations)
            raise ConfigError(fit.refusal(p.cfg, p.hardware, p.seq_len, self.shape, self.policies,
                                       self.batches))
        return best

    def say_fit(self) -> None:
        """The choices `fit` made: offloaded activations, the tiles."""
        out, say = self.planned.cfg, self.planned.choices.append
        chose = self.offload == AUTO
        value = out.training.offload_activations
        say(Choice("training.offload_activations", value, "plan" if chose else "you",
                   "set in the config" if not chose else self.offload_why
                   if value else "what the layers keep fits in GPU memory"))
        for name in TILE_FIELDS:
            value = _get(out, name)
            say(Choice(name, value, "you", "set in the config") if name not in self.tiles_auto
                else Choice(name, value, "plan", f"nothing fits otherwise ({TILE_TOKENS:,}-token "
                            "tiles, measured on one H100: "
                            "2026-11-27-lean-norms-context-24gib-8b-1xh100)" if value else
                            self.blocked.get(name) if self.tiled and name in self.blocked else
                            "the rows fit without" if not self.tiled
                            else "the MLP's tiles were enough"))


def _compile_keeps_batch(planned: Planned, shape: Shape, best, wrapper_by: str | None) -> None:
    """Compiled layers where nothing runs outside a compiled graph, their wrapper (`_wrapper`'s
    reason, None where you set it); the policy and batch found."""
    out, hw, say = planned.cfg, planned.hardware, planned.choices.append
    t, rc = out.training, out.training.recompute
    if t.compile == AUTO:
        # Offloaded layer inputs stay outside the graph under whole-layer recompute (the
        # checkpoint around each compiled layer saves them); without recompute they would not.
        outside = ("training.recompute.mlp_tile_tokens" if rc.mlp_tile_tokens else
                   "training.recompute.attention_tile_tokens" if rc.attention_tile_tokens else
                   "training.recompute.lean_norms" if rc.lean_norms else
                   "training.offload_activations without recompute"
                   if t.offload_activations and not rc.enabled else
                   "a mixture of experts' loop over its experts (no grouped-GEMM kernel: "
                   "compute capability below 9.0, or not bfloat16)" if shape.experts and not
                   hw.grouped_kernel(out.model.dtype) else
                   "model.experts=loop (it reads each layer's routing back to the host)"
                   if shape.experts and out.model.experts == "loop" else None)
        t.compile = outside is None and out.sharding.engine == MEASURED_ENGINE
        say(Choice("training.compile", t.compile, "plan", f"{outside} runs outside a compiled "
                   "graph" if outside else f"measured under {MEASURED_ENGINE} only"
                   if not t.compile else "fuses each layer's element-wise work"))
    elif not any(c.field == "training.compile" for c in planned.choices):
        say(Choice("training.compile", t.compile, "you", "set in the config"))
    if wrapper_by is None:
        say(Choice("training.compile_wrapper", t.compile_wrapper, "you", "set in the config"))
    else:
        if t.compile is not True:
            t.compile_wrapper, wrapper_by = "python", "no compiled layers"
        say(Choice("training.compile_wrapper", t.compile_wrapper, "plan", wrapper_by))
    (keeps, batch), _ = best
    by_keeps = "you" if rc.keeps != AUTO else "plan"
    rc.keeps = keeps if rc.enabled else rc.keeps if rc.keeps != AUTO else "inputs"
    say(Choice("training.recompute.keeps", rc.keeps, by_keeps, "set in the config"
               if by_keeps == "you" else "recompute is off" if not rc.enabled else
               f"with batch {batch}: the fastest that fits, by the step model"))
    by_batch = "you" if t.batch_size != AUTO else "plan"
    t.batch_size = batch
    say(Choice("training.batch_size", batch, by_batch, "set in the config" if by_batch == "you"
               else f"the fastest that fits {hw.memory_gib:g} GiB"))


def _predict(planned: Planned, shape: Shape) -> None:
    """The estimate's peak, the step model's speed, and what the plan left for you to choose."""
    out, hw, seq_len = planned.cfg, planned.hardware, planned.seq_len
    rc = out.training.recompute
    _fill_memory(planned, shape)
    # A mixture of experts' speed is known on the grouped path, compiled (the step model's MoE
    # terms); its experts looped in Python, or uncompiled, the host bounds the step.
    grouped = not shape.experts or (hw.grouped_gemm and out.training.compile is True
                                    and out.model.experts == "grouped")
    planned.tokens_per_s = (speed(shape, seq_len, out.training.batch_size,
                                  rc.keeps if rc.enabled else None, hw, rc.matmul_layers,
                                  0 < rc.attention_tile_tokens < seq_len,
                                  out.training.compile_wrapper,
                                  out.training.offload_activations is True)
                            if hw.peak_flops and grouped else None)
    if not grouped and hw.peak_flops:
        planned.notes.append(
            "expected speed: not predicted for a mixture of experts whose layers are not compiled "
            "grouped GEMMs (the host bounds its step); measured: 6,548 tokens/s on Qwen3-30B-A3B's "
            "shape on one H200 at 80 GiB uncompiled, 12,852 compiled "
            "(benchmarks/records/2026-11-29-moe-compile-1xh200), 480 with model.experts=loop "
            "(benchmarks/records/2026-11-28-moe-grouped-1xh200)")
    if hw.fp8 and not out.quantization.fp8_matmul and out.quantization.method != "none":
        planned.notes.append(
            "not chosen: quantization.fp8_matmul=true (this GPU has FP8 tensor cores; measured "
            "+15-19% tokens/s on one H100, benchmarks/records/2026-11-24-grouped-adapters-8b-1xh100; it changes "
            "the numerics, so it stays yours to choose)")


def _tile_stages(cfg: Config, model_config: dict | None, shape: Shape, seq_len: int,
                 auto: list[str], policies, groups_yours: bool) -> tuple[list[dict], dict]:
    """The tiles the plan may turn on, in order (the MLP's; then attention's with lean norms),
    each stage with the ones before it; and why a field left at auto cannot be turned on
    (`groups_yours`: lora.group_inputs=true set in the config)."""
    mc = model_config or {}
    family = mc.get("model_type")
    mlp, attention, lean = TILE_FIELDS
    why = ("the rows are no longer than one tile" if seq_len <= TILE_TOKENS else
           "training.compile=true" if cfg.training.compile is True else
           "a selective training.recompute.keeps" if "inputs" not in policies else
           "a mixture of experts' routed MLP" if shape.experts else None)
    if why:
        return [], dict.fromkeys(auto, f"not with {why}" if "rows" not in why else why)
    stages, blocked = [], {}
    if mlp in auto:
        stages.append({mlp: TILE_TOKENS})
    sliding = ("sliding_attention" in (mc.get("layer_types") or []) or mc.get("use_sliding_window")
               or (family == "mistral" and mc.get("sliding_window")))
    why = (f"measured for {', '.join(TILED_FAMILIES)} only" if family not in TILED_FAMILIES
           else "not with sliding-window attention" if sliding
           else "not with attention dropout" if mc.get("attention_dropout")
           else "not with lora.group_inputs=true" if groups_yours else None)
    if why:
        blocked.update({f: why for f in (attention, lean) if f in auto})
    elif attention in auto or lean in auto:
        stage = dict(stages[-1]) if stages else {}
        stage.update({f: v for f, v in ((attention, TILE_TOKENS), (lean, True)) if f in auto})
        stages.append(stage)
    return stages, blocked


def _fill_memory(planned: Planned, shape: Shape | None) -> None:
    if shape is None:  # a model whose shape cannot be read: no prediction
        return
    est = estimate(shape, fit.setup_of(planned.cfg, planned.hardware, planned.seq_len))
    planned.predicted_gib = round(est.total_gib, 2)
    planned.needed_gib = round(est.needed_gib(planned.hardware.outside_gib), 2)


def plain(cfg: Config) -> Config:
    """The config with every "auto" at the recipe's plain value (outside a planned run: a
    notebook's model, merge, chat); data.max_seq_len "auto" is left for the data to decide."""
    if all(_get(cfg, f) != AUTO for f in PLAIN):
        return cfg
    out = copy.deepcopy(cfg)
    for name, value in PLAIN.items():
        if _get(out, name) == AUTO:
            _set(out, name, value)
    return out
