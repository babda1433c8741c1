"""The recipe's opt-in levers: each trades speed for memory (or memory for speed) in one place, and
each is off unless its config key asks for it (or the planner, for a key left at "auto").

    fp8.py              quantization.fp8_matmul: the 4-bit layers' matmuls in FP8
    offload.py          training.offload_activations: saved activations in host memory
    attention_tiles.py  training.recompute.attention_tile_tokens: attention, a tile of queries
                        at a time
    tile_kernels.py     one attention tile's forward and backward (attention_tiles' kernels)
    norms.py            training.recompute.lean_norms: RMSNorms that keep their input only
    lora_groups.py      lora.group_inputs: adapters that read one input run as a group
    loss.py             training.loss = chunked | fused: no fp32 copy of every logit

kit.recipe.model and kit.recipe.recompute switch them on; what each saves is measured in
kit.budget (the estimate) and the notebooks.
"""
