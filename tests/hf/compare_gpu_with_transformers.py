#!/usr/bin/env python3
"""The CUDA backend against Hugging Face transformers + PyTorch (fp32), on small models of
every family built and randomly initialised by transformers: 8-layer Qwen2, Llama 3,
Qwen3 and Mistral, and 4-layer Qwen3-MoE (16 experts, top-4, one dense layer), Mixtral
(8 experts, top-2) and GPT-OSS (16 experts, top-4; sinks, windows of 128 on alternate
layers, YaRN, biases, the clamped SwiGLU), the MoE ones with the load-balancing loss.

For each model: transformers creates it, rounds its weights to bf16 values and saves them
(safetensors). gpu_reference (our engine, CUDA backend) then loads that folder and writes
one step's loss and gradients, a 50-step AdamW loss curve, a checkpoint and the logits of
its forward. This script checks:
  - one step: loss within 1e-4 relative (MoE: the LM loss + coef * aux, and the aux loss
    within 1e-3), every parameter's gradient within bf16 tolerance (rel L2 <= 3%);
  - 50 AdamW steps (same data, clipping, decay on matrices), against transformers fp32
    (L_hf32) and transformers under bf16 autocast (L_hf_bf16): with d(t) = |L - L_hf32| /
    L_hf32, mean d_ours <= 1.5 mean d_hf_bf16 + 0.005, and the mean of our last 10 losses
    within 2% of transformers fp32's (checked on the text data);
  - our checkpoint loads in transformers and gives our logits (rel L2 <= 1%).

Two data sets (MEGATRAIN_CMP_DATA picks one; default both):
  text    50 distinct batches of 8 x 512 tokens from a fixed bigram chain over 256 of the
          4096 ids, 4 successors each with Zipfian weights: a learnable distribution with
          the shape of text (the loss falls from ln 4096 towards the chain's entropy). The
          curve criterion is checked here.
  random  4 batches of 4 x 256 uniformly random tokens, cycled: the model memorises noise,
          which amplifies every rounding difference. A stress case: its curve distances are
          reported next to transformers' own bf16-autocast-vs-fp32 distance, not checked.
Usage: compare_gpu_with_transformers.py GPU_REFERENCE_BIN WORKDIR
"""
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, GptOssConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

STEPS = 50
LR = float(os.environ.get("MEGATRAIN_CMP_LR", "3e-4"))
WARMUP, WD, CLIP = 10, 0.01, 1.0


def configs():
    common = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False)
    yield "qwen2_8l", Qwen2Config(**common, rope_theta=1000000.0)
    yield "llama3_8l", LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})
    yield "qwen3_8l", Qwen3Config(**common, head_dim=64, rope_theta=1000000.0)
    # Context extension: positions interpolated 4x; dynamic NTK past 256 positions (the
    # rows are 512 tokens, so transformers raises the base for 512 as a job of seq_len 512).
    yield "llama_linear_4l", LlamaConfig(**dict(common, num_hidden_layers=4),
                                         rope_theta=10000.0,
                                         rope_scaling={"rope_type": "linear", "factor": 4.0})
    yield "llama_dynamic_4l", LlamaConfig(**dict(common, num_hidden_layers=4,
                                                 max_position_embeddings=256),
                                          rope_theta=10000.0,
                                          rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    yield "mistral_8l", MistralConfig(**common, sliding_window=None, rope_theta=1000000.0)
    # Sliding windows shorter than the rows (256 and 512 tokens): every Mistral layer; the
    # Qwen2 layers at or above max_window_layers.
    yield "mistral_window_4l", MistralConfig(**dict(common, num_hidden_layers=4),
                                             sliding_window=64, rope_theta=1000000.0)
    yield "qwen2_window_4l", Qwen2Config(**dict(common, num_hidden_layers=4),
                                         use_sliding_window=True, sliding_window=64,
                                         max_window_layers=2, rope_theta=1000000.0)
    moe = dict(common, num_hidden_layers=4, output_router_logits=True,
               router_aux_loss_coef=0.02)
    yield "qwen3_moe_4l", Qwen3MoeConfig(**dict(moe, intermediate_size=1024), head_dim=64,
                                         moe_intermediate_size=256, num_experts=16,
                                         num_experts_per_tok=4, norm_topk_prob=True,
                                         mlp_only_layers=[2], rope_theta=1000000.0)
    yield "mixtral_4l", MixtralConfig(**dict(moe, intermediate_size=512), num_local_experts=8,
                                      num_experts_per_tok=2, sliding_window=None,
                                      rope_theta=1000000.0)
    yield "gpt_oss_4l", GptOssConfig(**dict(moe, intermediate_size=256, rms_norm_eps=1e-5),
                                     head_dim=64, num_local_experts=16, num_experts_per_tok=4,
                                     sliding_window=128, attention_bias=True,
                                     rope_parameters={"rope_type": "yarn", "factor": 32.0,
                                                      "beta_fast": 32.0, "beta_slow": 1.0,
                                                      "truncate": False, "rope_theta": 150000.0,
                                                      "original_max_position_embeddings": 4096})


def rel(a, b):
    return float((a.float() - b.float()).norm() / max(float(b.float().norm()), 1e-30))


def our_tensor(name, ours, model_type):
    """Our per-expert tensors (the names transformers saves) as transformers 5's fused
    parameters: experts.gate_up_proj (E, 2I, C) and experts.down_proj (E, C, I). GPT-OSS's
    tensors are transformers' own."""
    if model_type == "gpt_oss":
        return ours[name]
    if ".mlp.experts.gate_up_proj" in name or ".mlp.experts.down_proj" in name:
        base = name.split(".mlp.experts.")[0]
        moe = base + (".block_sparse_moe" if model_type == "mixtral" else ".mlp")
        gate, up, down = (("w1", "w3", "w2") if model_type == "mixtral"
                          else ("gate_proj", "up_proj", "down_proj"))
        e, out = 0, []
        while f"{moe}.experts.{e}.{down}.weight" in ours:
            x = f"{moe}.experts.{e}."
            out.append(torch.cat([ours[x + gate + ".weight"], ours[x + up + ".weight"]])
                       if name.endswith("gate_up_proj") else ours[x + down + ".weight"])
            e += 1
        return torch.stack(out)
    if model_type == "mixtral" and ".mlp.gate." in name:
        return ours[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")]
    return ours[name]


def make_batches(vocab, data, seed=0):
    g = torch.Generator().manual_seed(seed)
    if data == "random":
        # 4 batches of 4 rows x 256 tokens, cycled: the model memorises them.
        return [torch.randint(0, vocab, (4, 256), generator=g) for _ in range(4)]
    # 256 live ids; each has 4 possible successors with probabilities ~ 1/(k+1).
    live = torch.randperm(vocab, generator=g)[:256]
    succ = torch.randint(0, 256, (256, 4), generator=g)
    probs = 1.0 / torch.arange(1, 5, dtype=torch.float64)
    rows, seq, n = 8, 512, STEPS
    cur = torch.randint(0, 256, (n * rows,), generator=g)
    out = [cur]
    for _ in range(seq - 1):
        k = torch.multinomial(probs.expand(n * rows, 4), 1, generator=g).squeeze(1)
        cur = succ[cur, k]
        out.append(cur)
    tokens = live[torch.stack(out, dim=1)]
    return [tokens[i * rows:(i + 1) * rows].clone() for i in range(n)]


def lr_at(step):
    return LR * step / WARMUP if step < WARMUP else LR


def hf_train(model, batches, bf16_autocast=False):
    # HF Trainer's rule (get_decay_parameter_names): no decay for biases and norms; every
    # other tensor decays, GPT-OSS's 1-D sinks included.
    def decays(n):
        return "bias" not in n and "norm" not in n
    decay = [p for n, p in model.named_parameters() if decays(n)]
    no_decay = [p for n, p in model.named_parameters() if not decays(n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, foreach=False)
    losses = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        ids = batches[step % len(batches)].cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16_autocast):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses


def make_bf16_exact(model, config):
    """Readies a freshly drawn model for a comparison: routers (and GPT-OSS's biases) that
    transformers leaves at zero drawn, so that they matter, and every weight rounded to a
    bf16 value, so that both sides read one model."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.abs().max() == 0 and n.endswith("gate.weight"):  # a router left at zero
                p.normal_(0, 0.02)
            if p.abs().max() == 0 and config.model_type == "gpt_oss" and "bias" in n:
                p.normal_(0, 0.02)  # biases transformers zeroes: make them matter here
            p.copy_(p.to(torch.bfloat16).float())


def check(bin_path, work, name, config, data):
    d = os.path.join(work, f"{name}-{data}")
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    make_bf16_exact(model, config)
    model.save_pretrained(os.path.join(d, "model"), safe_serialization=True)
    batches = make_batches(config.vocab_size, data)
    with open(os.path.join(d, "batches.json"), "w") as f:
        json.dump({"rows": [b.tolist() for b in batches], "lr": LR, "warmup": WARMUP,
                   "weight_decay": WD, "max_grad_norm": CLIP}, f)
    out = os.path.join(d, "ours")
    subprocess.run([bin_path, os.path.join(d, "model"), os.path.join(d, "batches.json"), out,
                    "--steps", str(STEPS), "--backend", "cuda"], check=True)
    problems = []

    # One step: loss and gradients, transformers in fp32 on the same (bf16-exact) weights.
    # MoE: transformers' loss is the LM loss + coef * aux_loss (output_router_logits).
    model = model.cuda()
    ids = batches[0].cuda()
    result_hf = model(input_ids=ids, labels=ids)
    loss = result_hf.loss
    loss.backward()
    ours = json.load(open(os.path.join(out, "step.json")))
    loss_err = abs(ours["total"] - loss.item()) / loss.item()
    if loss_err > 1e-4:
        problems.append(f"step loss {ours['total']} vs {loss.item()}")
    hf_aux = getattr(result_hf, "aux_loss", None)
    aux_err = None
    if hf_aux is not None:
        aux_err = abs(ours["aux_loss"] - hf_aux.item()) / hf_aux.item()
        if aux_err > 1e-3:
            problems.append(f"aux loss {ours['aux_loss']} vs {hf_aux.item()}")
    grads = load_file(os.path.join(out, "grads.safetensors"))
    hf32_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # The yardstick: transformers' own gradients under bf16 autocast, against its fp32 ones.
    # With experts, bf16 rounding moves some tokens to other experts (the router's top-k of
    # near-equal probabilities): routing_flips counts the tokens whose k choices differ.
    with torch.autocast("cuda", dtype=torch.bfloat16):
        result_bf16 = model(input_ids=ids, labels=ids)
    result_bf16.loss.backward()
    hf_bf16_grad_errs = {n: rel(p.grad, hf32_grads[n]) for n, p in model.named_parameters()}
    model.zero_grad()
    routing_flips = None
    if getattr(result_hf, "router_logits", None):
        k = config.num_experts_per_tok
        def choices(logits):
            return [torch.topk(l.float().softmax(-1), k, dim=-1).indices.sort(-1).values
                    for l in logits]
        flips = [(a != b).any(-1).float().mean().item()
                 for a, b in zip(choices(result_hf.router_logits),
                                 choices(result_bf16.router_logits))]
        routing_flips = sum(flips) / len(flips)
    grad_errs = {}
    for n, g in hf32_grads.items():
        grad_errs[n] = rel(our_tensor(n, grads, config.model_type).cuda(), g)
        if grad_errs[n] > 3e-2:
            problems.append(f"gradient of {n}: relative error {grad_errs[n]:.3e} (transformers "
                            f"bf16 autocast: {hf_bf16_grad_errs[n]:.3e})")

    # 50 AdamW steps on the same data; and, as a yardstick of what bf16 compute alone
    # does to the curve, transformers itself under bf16 autocast from the same start.
    start = {k: v.clone() for k, v in model.state_dict().items()}
    hf_losses = hf_train(model, batches)
    model.load_state_dict(start)
    hf_bf16_losses = hf_train(model, batches, bf16_autocast=True)
    model.load_state_dict(start)
    bf16_spread = max(abs(a - b) / b for a, b in zip(hf_bf16_losses, hf_losses))
    our_losses = json.load(open(os.path.join(out, "curve.json")))["losses"]
    curve_errs = [abs(a - b) / b for a, b in zip(our_losses, hf_losses)]
    hf_bf16_errs = [abs(a - b) / b for a, b in zip(hf_bf16_losses, hf_losses)]
    vs_bf16 = max(abs(a - b) / b for a, b in zip(our_losses, hf_bf16_losses))
    mean_d_ours = sum(curve_errs) / len(curve_errs)
    mean_d_hf = sum(hf_bf16_errs) / len(hf_bf16_errs)
    last10_ours = sum(our_losses[-10:]) / 10
    last10_hf = sum(hf_losses[-10:]) / 10
    last10_err = abs(last10_ours - last10_hf) / last10_hf
    curve_ok = mean_d_ours <= 1.5 * mean_d_hf + 0.005 and last10_err <= 0.02
    if data == "text" and not curve_ok:
        problems.append(f"curve: mean d_ours {mean_d_ours:.4f} vs 1.5 * mean d_hf "
                        f"{mean_d_hf:.4f} + 0.005; last-10 means differ by {last10_err:.3%}")

    # Our checkpoint in transformers: same logits as our forward.
    ck = os.path.join(out, f"checkpoint-{STEPS}")
    loaded = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32,
                                                  attn_implementation="eager").cuda()
    with torch.no_grad():
        hf_logits = loaded(input_ids=ids).logits.reshape(-1, config.vocab_size)
        # The yardstick: transformers' own bf16-autocast forward of the same checkpoint.
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hf_bf16_logits = loaded(input_ids=ids).logits.reshape(-1, config.vocab_size)
    hf_bf16_logit_err = rel(hf_bf16_logits, hf_logits)
    our_logits = load_file(os.path.join(out, "logits.safetensors"))["logits"].cuda()
    logit_err = rel(our_logits, hf_logits)
    # The same checkpoint through our CPU backend (fp32): separates the semantics (this
    # should be ~1e-5) from the CUDA backend's bf16 rounding.
    cpu_out = os.path.join(d, "ours-cpu")
    subprocess.run([bin_path, ck, os.path.join(d, "batches.json"), cpu_out, "--steps", "0",
                    "--backend", "cpu"], check=True, stdout=subprocess.DEVNULL)
    cpu_logits = load_file(os.path.join(cpu_out, "logits.safetensors"))["logits"].cuda()
    cpu_logit_err = rel(cpu_logits, hf_logits)
    if logit_err > 1e-2:
        problems.append(f"logits of our checkpoint: relative error {logit_err:.3e}")
    worst = sorted(grad_errs.items(), key=lambda kv: -kv[1])[:3]
    result = {"model": name, "data": data, "tokens_per_step": int(batches[0].numel()),
              "params": sum(p.numel() for p in model.parameters()),
              "step_loss_ours": ours["total"], "step_loss_transformers": loss.item(),
              "step_loss_rel_err": loss_err,
              "aux_loss_ours": ours["aux_loss"] if hf_aux is not None else None,
              "aux_loss_transformers": hf_aux.item() if hf_aux is not None else None,
              "aux_loss_rel_err": aux_err,
              "grad_rel_err_max": max(grad_errs.values()),
              "grad_rel_err_median": sorted(grad_errs.values())[len(grad_errs) // 2],
              "grad_worst": worst,
              "grad_worst_transformers_bf16_autocast": [[n, hf_bf16_grad_errs[n]] for n, _ in worst],
              "transformers_bf16_autocast_grad_rel_err_max": max(hf_bf16_grad_errs.values()),
              "routing_flips_bf16_autocast_vs_fp32": routing_flips,
              "curve_first_last_ours": [our_losses[0], our_losses[-1]],
              "curve_first_last_transformers": [hf_losses[0], hf_losses[-1]],
              "lr": LR,
              "curve_max_rel_diff": max(curve_errs),
              "transformers_bf16_autocast_vs_fp32_max_rel_diff": bf16_spread,
              "ours_vs_transformers_bf16_autocast_max_rel_diff": vs_bf16,
              "curve_max_rel_diff_step": curve_errs.index(max(curve_errs)),
              "curve_mean_d_ours": mean_d_ours, "curve_mean_d_hf_bf16": mean_d_hf,
              "curve_criterion_bound": 1.5 * mean_d_hf + 0.005,
              "last10_mean_rel_err": last10_err, "curve_criterion_met": curve_ok,
              "curve_ours": [round(x, 4) for x in our_losses],
              "curve_transformers": [round(x, 4) for x in hf_losses],
              "curve_transformers_bf16_autocast": [round(x, 4) for x in hf_bf16_losses],
              "logits_rel_err": logit_err,
              "transformers_bf16_autocast_logits_rel_err": hf_bf16_logit_err,
              "cpu_backend_logits_rel_err": cpu_logit_err,
              "problems": problems}
    print(json.dumps(result), flush=True)
    return not problems


def main():
    bin_path, work = sys.argv[1], sys.argv[2]
    datas = os.environ.get("MEGATRAIN_CMP_DATA", "random,text").split(",")
    only = os.environ.get("MEGATRAIN_CMP_MODELS", "")
    ok = all([check(bin_path, work, name, cfg, data)
              for data in datas for name, cfg in configs()
              if not only or name in only.split(",")])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
