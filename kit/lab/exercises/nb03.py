"""Exercises of notebook 03 (LoRA adapters): PEFT's trainable count for adapters on q and v of
the tiny model (03.1), and the largest rank whose adapters on every expert of a mixture of experts
stay within a memory budget (03.2). Hands-on: a LoRA layer's forward written from its weights
(03.3) and its merged weight (03.4, stretch), each compared with what PEFT computes for a real
LoRA layer whose B is no longer zero. torch and PEFT are imported when a check or a solution
runs, not with this module."""

from __future__ import annotations

from functools import cache

from kit.budget import shapes
from kit.lab.exercises import Exercise
from kit.lab.exercises.checks import number

TINY, RANK, QV = "kit:tiny-llama", 4, ("q_proj", "v_proj")
MOE, BUDGET_GIB = "kit:qwen3-30b-a3b", 5
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@cache
def _peft_trainable() -> int:
    """What PEFT reports trainable after kit.recipe.lora.apply_lora (r=4 on q_proj and v_proj)
    on the tiny model loaded in 4 bits, as notebook 03 loads it."""
    from kit.config import load_config
    from kit.lab.quantize_nf4 import load_on_cpu
    from kit.recipe import lora

    cfg = load_config(None, [f"model.name={TINY}", f"lora.r={RANK}",
                             f"lora.target_modules=[{','.join(QV)}]"])  # fmt: skip
    return lora.trainable_summary(lora.apply_lora(load_on_cpu(TINY), cfg))["trainable"]


def _by_hand_without_gqa() -> int:
    """The count a learner gets who gives v_proj as many outputs as q_proj (no grouped-query)."""
    shape = shapes.shape_of(TINY)
    return shape.layers * 2 * RANK * (shape.hidden + shape.heads * shape.head_dim)


def _full_matrices() -> int:
    shape = shapes.shape_of(TINY)
    return shape.layers * sum(a * b for n, (a, b) in shape.linears().items() if n in QV)


def _largest_rank(targets="all-linear") -> int:
    """The largest r whose adapters' fp32 training state (weights, gradients, AdamW's two
    moments: 16 bytes a parameter) stays within BUDGET_GIB on MOE's shape."""
    shape = shapes.shape_of(MOE)
    r = 0
    while 16 * shapes.lora_params(shape, r + 1, targets) <= BUDGET_GIB * 2**30:
        r += 1
    return r


# ---- hands-on: the adapter's arithmetic, against PEFT ----


def lora_forward(layer, x):
    """What PEFT's LoRA layer computes (in eval mode: no dropout): the frozen layer's output plus
    the adapter's, B(A(x)) scaled by alpha / r."""
    A = layer.lora_A["default"].weight  # (r, in)
    B = layer.lora_B["default"].weight  # (out, r)
    s = layer.scaling["default"]  # lora_alpha / r
    return layer.base_layer(x) + s * (x @ A.T @ B.T)


def merged_weight(layer):
    """The one weight that computes what base + adapter compute: W + s * B @ A."""
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    return layer.base_layer.weight + layer.scaling["default"] * (B @ A)


def _base_only(layer, x):
    return layer.base_layer(x)


def _unscaled_forward(layer, x):
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    return layer.base_layer(x) + x @ A.T @ B.T


def _alpha_not_over_r(layer, x):
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    return layer.base_layer(x) + layer.lora_alpha["default"] * (x @ A.T @ B.T)


def _unscaled_merge(layer):
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    return layer.base_layer.weight + B @ A


def _transposed_merge(layer):
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    return layer.base_layer.weight.T + layer.scaling["default"] * (A.T @ B.T)


# (r, lora_alpha) of the layers a learner's function is called on: scales 2, 0.5 and 1.
RANKS_ALPHAS = ((4, 8), (16, 8), (8, 8))


def _lora_layer(r: int, alpha: int):
    """A real PEFT LoRA layer around a 24 -> 20 linear layer, in eval mode, its B set away from
    zero (PEFT starts it at zero: an adapter that is left out would go unnoticed)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(r)
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(24, 20))
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.1,
                                             target_modules=["proj"]))  # fmt: skip
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    return model.eval(), layer


def _compare(got, want, what: str, r: int, alpha: int, known: dict) -> str | None:
    import torch

    got = torch.as_tensor(got).detach()
    if got.shape != want.shape:
        return f"{what} has shape {tuple(got.shape)} (r={r}, alpha={alpha}); PEFT's has {tuple(want.shape)}"
    if torch.allclose(got, want, atol=1e-5, rtol=1e-4):
        return None
    for hint, tensor in known.items():
        if torch.allclose(got, tensor, atol=1e-5, rtol=1e-4):
            return hint
    return (f"{what} differs from PEFT's by up to {(got - want).abs().max():.3g} (r={r}, "
            f"alpha={alpha})")


def _check_forward(fn) -> str | None:
    import torch

    if not callable(fn):
        return "give the function itself: exercises.check(\"03.3\", lora_forward) (no parentheses)"
    for r, alpha in RANKS_ALPHAS:
        model, layer = _lora_layer(r, alpha)
        x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = model(x)
            try:
                got = fn(layer, x)
            except Exception as e:  # the learner's code: its error is the hint
                return (f"it raised {type(e).__name__}: {e} (A is (r, in) = {tuple(layer.lora_A['default'].weight.shape)}, "
                        f"B is (out, r) = {tuple(layer.lora_B['default'].weight.shape)}, x is (tokens, in))")
            delta = x @ layer.lora_A["default"].weight.T @ layer.lora_B["default"].weight.T
            base = layer.base_layer(x)
            hint = _compare(got, want, "the output", r, alpha, {
                "that is the frozen layer's output alone: the adapter adds its own path, "
                "B(A(x)), scaled": base,
                "the adapter's path is there, unscaled: PEFT multiplies it by lora_alpha / r "
                "(layer.scaling['default'])": base + delta,
                "scaled by lora_alpha; the scale is lora_alpha / r (layer.scaling['default'])":
                    base + alpha * delta,
            })
        if hint:
            return hint
    return None


def _check_merge(fn) -> str | None:
    import copy

    import torch

    if not callable(fn):
        return "give the function itself: exercises.check(\"03.4\", merged_weight) (no parentheses)"
    for r, alpha in RANKS_ALPHAS:
        model, layer = _lora_layer(r, alpha)
        want = copy.deepcopy(model).merge_and_unload().proj.weight.detach()  # PEFT's own merge
        with torch.no_grad():
            try:
                got = fn(layer)
            except Exception as e:  # the learner's code: its error is the hint
                return f"it raised {type(e).__name__}: {e}"
            A, B, W = (layer.lora_A["default"].weight, layer.lora_B["default"].weight,
                       layer.base_layer.weight)  # fmt: skip
            hint = _compare(got, want, "the merged weight", r, alpha, {
                "that is the frozen weight alone: add the adapter's B @ A, scaled": W,
                "B @ A is there, unscaled: multiply it by lora_alpha / r": W + B @ A,
            })
        if hint:
            return hint
    return None


EXERCISES = [
    Exercise(
        key="03.1",
        question=(f"Apply LoRA with r={RANK} to q_proj and v_proj only of {TINY} (a kit config "
                  "with lora.target_modules=[q_proj,v_proj], through lora.apply_lora as in "
                  "section 1): how many parameters does PEFT report trainable? Count it by hand "
                  "first. (answer: a number)"),
        check=number(_peft_trainable, lambda: {
            _by_hand_without_gqa(): "v_proj is smaller than q_proj here: grouped-query "
                                    "attention gives it fewer output features (see B's shapes)",
            _full_matrices(): "that is the size of the frozen q and v matrices; LoRA trains "
                              "r x (in + out) per layer",
        }, "r x (in + out) for each adapted layer, in every decoder layer", whole=True),
        solution=_peft_trainable,
        wrong=(_by_hand_without_gqa(), _full_matrices(), RANK),
    ),
    Exercise(
        key="03.2",
        question=(f"{MOE}, adapters on all-linear (every expert gets its own): what is the "
                  "largest rank r whose fp32 training state (16 bytes a parameter) stays within "
                  f"{BUDGET_GIB} GiB? (answer: a whole number; shapes.lora_params counts)"),
        check=number(lambda: _largest_rank(), lambda: {
            _largest_rank(ATTENTION): "that is the rank for attention only; all-linear also "
                                      "adapts every expert of every layer",
            16: "r=16 needs almost twice the budget (section 7 prints its GiB)",
        }, "16 x shapes.lora_params(shape, r, 'all-linear') grows linearly with r: find where "
           "it crosses the budget", whole=True),
        solution=_largest_rank,
        wrong=(_largest_rank(ATTENTION), 16, 4),
    ),
    Exercise(
        key="03.3",
        question=("Hands-on, quick: write lora_forward(layer, x), what a PEFT LoRA layer computes "
                  "in eval mode, from its parts: layer.base_layer, the weights "
                  "layer.lora_A['default'].weight (r x in) and layer.lora_B['default'].weight "
                  "(out x r), and layer.scaling['default']. The check compares it with PEFT's "
                  "own forward on three layers whose B is not zero."),
        check=_check_forward,
        solution=lambda: lora_forward,
        wrong=(_base_only, _unscaled_forward, _alpha_not_over_r),
        hands_on=True,
    ),
    Exercise(
        key="03.4",
        question=("Hands-on, stretch: write merged_weight(layer), the single (out x in) weight "
                  "that computes what the frozen weight and the adapter compute together, what "
                  "merging writes. The check compares it with PEFT's merge_and_unload."),
        check=_check_merge,
        solution=lambda: merged_weight,
        wrong=(_unscaled_merge, _transposed_merge),
        hands_on=True,
    ),
]
