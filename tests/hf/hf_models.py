"""What the numerics comparisons against transformers share: the 4-layer models of full
width (every vocabulary cut to 16384; see compare_lora_with_peft.py's docstring), and the
results file's bookkeeping. Imported by compare_lora_with_peft.py and
compare_dpo_with_torch.py (torch and transformers are imported where used: the latter's
self-test runs without them)."""
import gc
import json
import os


def full_width_configs():
    """Each family's 4-layer config of full width, made when called (a config transformers
    refuses fails its family alone)."""
    from transformers import GptOssConfig, LlamaConfig, Qwen2Config, Qwen3MoeConfig
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
    import torch
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


def curve_check(ours, fp32, bf16):
    """The curve criterion on two 50-step loss curves against fp32's, `ours` and the
    reference's under bf16 autocast: with d(t) = |L - L_fp32| / L_fp32, mean d of ours <=
    1.5 x mean d of bf16 + 0.005, and the last 10 steps' mean within 2% of fp32's. Returns
    (stats, problems)."""
    if not (len(ours) == len(fp32) == len(bf16)) or not ours:
        return {"curve_ok": False}, [f"curve lengths differ: ours {len(ours)}, fp32 "
                                     f"{len(fp32)}, bf16 {len(bf16)}"]
    d_ours = [abs(a - b) / b for a, b in zip(ours, fp32)]
    d_bf16 = [abs(a - b) / b for a, b in zip(bf16, fp32)]
    mean_ours, mean_bf16 = sum(d_ours) / len(d_ours), sum(d_bf16) / len(d_bf16)
    last10 = abs(sum(ours[-10:]) - sum(fp32[-10:])) / sum(fp32[-10:])
    ok = mean_ours <= 1.5 * mean_bf16 + 0.005 and last10 <= 0.02
    stats = {"curve_mean_d_ours": mean_ours, "curve_mean_d_bf16_autocast": mean_bf16,
             "curve_bound": 1.5 * mean_bf16 + 0.005, "last10_rel_err": last10,
             "curve_max_d_ours": max(d_ours), "curve_ok": ok,
             "curve_first_last_ours": [ours[0], ours[-1]],
             "curve_first_last_fp32": [fp32[0], fp32[-1]],
             "curve_ours": [round(x, 5) for x in ours],
             "curve_fp32": [round(x, 5) for x in fp32],
             "curve_bf16_autocast": [round(x, 5) for x in bf16]}
    problems = [] if ok else [f"curve: mean d_ours {mean_ours:.4f} vs bound "
                              f"{1.5 * mean_bf16 + 0.005:.4f}; last-10 means differ by "
                              f"{last10:.3%}"]
    return stats, problems


def run_families(bin_path, work, families, all_configs, check_family, summary):
    """Checks each of `families` (all of all_configs' when empty) with check_family(bin_path,
    work, family, make_config), prints summary(results), and exits 0 when it says they
    passed, 1 otherwise (an unknown family: its name and the choices)."""
    import sys
    families = families or list(all_configs)
    unknown = [f for f in families if f not in all_configs]
    if unknown:
        sys.exit(f"unknown families {unknown}; choose from {list(all_configs)}")
    results = []
    for family in families:
        results += check_family(bin_path, work, family, all_configs[family])
    sys.exit(0 if summary(results) else 1)
