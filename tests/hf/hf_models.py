"""What the numerics comparisons against transformers share: the 4-layer models of full
width (every vocabulary cut to 16384; see compare_lora_with_peft.py's docstring), and the
results file's bookkeeping. Imported by compare_lora_with_peft.py and
compare_dpo_with_torch.py, where torch and transformers are."""
import gc
import json
import os

import torch
from transformers import GptOssConfig, LlamaConfig, Qwen2Config, Qwen3MoeConfig


def full_width_configs():
    """Each family's 4-layer config of full width, made when called (a config transformers
    refuses fails its family alone)."""
    common = dict(num_hidden_layers=4, vocab_size=16384, tie_word_embeddings=False)
    return {
        "qwen2": lambda: Qwen2Config(**common, hidden_size=3584, intermediate_size=18944,
                             num_attention_heads=28, num_key_value_heads=4,
                             max_position_embeddings=32768, rms_norm_eps=1e-6,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "llama3": lambda: LlamaConfig(**common, hidden_size=4096, intermediate_size=14336,
                              num_attention_heads=32, num_key_value_heads=8,
                              max_position_embeddings=131072, rms_norm_eps=1e-5,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                               "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192}),
        "qwen3_moe": lambda: Qwen3MoeConfig(**common, hidden_size=2048, intermediate_size=6144,
                                    num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                    num_experts=128, num_experts_per_tok=8,
                                    moe_intermediate_size=768, norm_topk_prob=True,
                                    decoder_sparse_step=1, mlp_only_layers=[],
                                    max_position_embeddings=40960, rms_norm_eps=1e-6,
                                    output_router_logits=True, router_aux_loss_coef=0.001,
                                    rope_parameters={"rope_type": "default",
                                                     "rope_theta": 1000000.0}),
        "gpt_oss": lambda: GptOssConfig(**common, hidden_size=2880, intermediate_size=2880,
                                num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                                attention_bias=True, rms_norm_eps=1e-5,
                                max_position_embeddings=131072,
                                output_router_logits=True, router_aux_loss_coef=0.9,
                                rope_parameters={"rope_type": "yarn", "factor": 32.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0,
                                                 "truncate": False, "rope_theta": 150000.0,
                                                 "original_max_position_embeddings": 4096}),
    }


def is_moe(config):
    return config.model_type in ("qwen3_moe", "gpt_oss")


def free_gpu():
    gc.collect()
    torch.cuda.empty_cache()


def record(path, result):
    """Replaces the case's line in the results file `path` (the latest measurement of each
    case)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = []
    if os.path.exists(path):
        with open(path) as f:
            lines = [l for l in f if l.strip() and json.loads(l).get("case") != result["case"]]
    lines.append(json.dumps(result) + "\n")
    with open(path, "w") as f:
        f.writelines(lines)
