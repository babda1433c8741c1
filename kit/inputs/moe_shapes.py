"""Mixture-of-experts shapes of the kit's built-in models (kit.inputs.builtin adds them to SPECS).

The tiny ones (2 layers, hidden 64, 4 experts, 2 active) train on 2 CPU processes in seconds with
their experts in NF4 (kit.recipe.experts); the large one is a public shape for the planner and
GPU runs, initialised at load like kit:llama-70b (never written: ~61 GB in bf16).
"""

_TINY = dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, num_experts_per_tok=2,
             tie_word_embeddings=False)  # fmt: skip

MOE_SPECS: dict[str, dict] = {
    # Mixtral: 3-D experts (E, 2I, H) / (E, H, I), a softmax-then-top-k router.
    "tiny-mixtral": dict(_TINY, model_type="mixtral", intermediate_size=128, num_local_experts=4),
    # Qwen3-MoE: RMSNorm on q and k, head_dim apart from the hidden size, normalised top-k.
    "tiny-qwen3-moe": dict(_TINY, model_type="qwen3_moe", intermediate_size=256,
                           moe_intermediate_size=128, num_experts=4, head_dim=32,
                           decoder_sparse_step=1, mlp_only_layers=[]),
    # OLMoE: RMSNorm on q and k over all heads (not per head), no normalised top-k.
    "tiny-olmoe": dict(_TINY, model_type="olmoe", intermediate_size=128, num_experts=4),
    # gpt-oss: attention sinks, biases on the experts and on attention, a clamped SwiGLU, sliding
    # windows on every other layer; its gate_up stack interleaves gate and up columns.
    "tiny-gpt-oss": dict(_TINY, model_type="gpt_oss", intermediate_size=128, num_local_experts=4,
                         head_dim=16, sliding_window=128, max_position_embeddings=131072),
    # PhiMoE (Phi-3.5-MoE): its router an nn.Linear subclass returning a tuple (never adapted:
    # kit.recipe.experts.routers), LayerNorm with biases, a sparsemixer top-2.
    "tiny-phimoe": dict(_TINY, model_type="phimoe", intermediate_size=128, num_local_experts=4),
    # Qwen3-30B-A3B's shape (30.5B parameters, 3.3B active: 48 layers, 128 experts, 8 active).
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                          mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=40960,
                          rope_theta=1000000.0, tie_word_embeddings=False),
    # Qwen3-235B-A22B's shape (235B parameters, 22B active: 94 layers, 128 experts, 8 active).
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096,
                            intermediate_size=12288, moe_intermediate_size=1536,
                            num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                            head_dim=128, num_experts=128, num_experts_per_tok=8,
                            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                            max_position_embeddings=40960, rope_theta=1000000.0,
                            tie_word_embeddings=False),
    # gpt-oss-20b's shape (20.9B parameters, 3.6B active besides the embeddings: 24 layers, 32 experts, 4 active; attention
    # sinks, biases on the experts, sliding windows on every other layer).
    "gpt-oss-20b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
                        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
                        tie_word_embeddings=False),
}
MOE_AT_LOAD = {"qwen3-30b-a3b": 0, "qwen3-235b-a22b": 0, "gpt-oss-20b": 0}  # name -> seed: weights initialised at load, never written
