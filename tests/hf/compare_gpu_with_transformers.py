#!/usr/bin/env python3
"""The CUDA backend against Hugging Face transformers + PyTorch (fp32), on 8-layer
Qwen2-style and Llama-3-style models built and randomly initialised by transformers.

For each model: transformers creates it, rounds its weights to bf16 values and saves them
(safetensors). gpu_reference (our engine, CUDA backend) then loads that folder and writes
one step's loss and gradients, a 50-step AdamW loss curve, a checkpoint and the logits of
its forward. This script checks:
  - one step: loss within 1%, every parameter's gradient within bf16 tolerance (rel L2);
  - 50 AdamW steps (same data, clipping, decay on matrices): every loss within 1%;
  - our checkpoint loads in transformers and gives our logits (bf16 tolerance).

Two data sets (MEGATRAIN_CMP_DATA picks one; default both):
  text    50 distinct batches of 8 x 512 tokens from a fixed bigram chain over 256 of the
          4096 ids, 4 successors each with Zipfian weights: a learnable distribution with
          the shape of text (the loss falls from ln 4096 towards the chain's entropy). The 1% curve criterion is checked here.
  random  4 batches of 4 x 256 uniformly random tokens, cycled: the model memorises noise,
          which amplifies every rounding difference. A stress case: its curve distance is
          reported next to transformers' own bf16-autocast-vs-fp32 distance, not checked,
          because bf16 compute alone (transformers' included) moves it past 1%.
Usage: compare_gpu_with_transformers.py GPU_REFERENCE_BIN WORKDIR
"""
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

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


def rel(a, b):
    return float((a.float() - b.float()).norm() / max(float(b.float().norm()), 1e-30))


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
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
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


def check(bin_path, work, name, config, data):
    d = os.path.join(work, f"{name}-{data}")
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # bf16-exact: both sides see one model
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
    model = model.cuda()
    ids = batches[0].cuda()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    ours = json.load(open(os.path.join(out, "step.json")))
    loss_err = abs(ours["loss"] - loss.item()) / loss.item()
    if loss_err > 1e-2:
        problems.append(f"step loss {ours['loss']} vs {loss.item()}")
    grads = load_file(os.path.join(out, "grads.safetensors"))
    grad_errs = {}
    for n, p in model.named_parameters():
        grad_errs[n] = rel(grads[n].cuda(), p.grad)
        if grad_errs[n] > 5e-2:
            problems.append(f"gradient of {n}: relative error {grad_errs[n]:.3e}")
    model.zero_grad()

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
    vs_bf16 = max(abs(a - b) / b for a, b in zip(our_losses, hf_bf16_losses))
    if max(curve_errs) > 1e-2:
        problems.append(f"loss curves differ by up to {max(curve_errs):.3%} (transformers "
                        f"under bf16 autocast: {bf16_spread:.3%} from its fp32 curve)")

    # Our checkpoint in transformers: same logits as our forward.
    ck = os.path.join(out, f"checkpoint-{STEPS}")
    loaded = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32,
                                                  attn_implementation="eager").cuda()
    with torch.no_grad():
        hf_logits = loaded(input_ids=ids).logits.reshape(-1, config.vocab_size)
    our_logits = load_file(os.path.join(out, "logits.safetensors"))["logits"].cuda()
    logit_err = rel(our_logits, hf_logits)
    if logit_err > 2e-2:
        problems.append(f"logits of our checkpoint: relative error {logit_err:.3e}")
    worst = sorted(grad_errs.items(), key=lambda kv: -kv[1])[:3]
    result = {"model": name, "data": data, "tokens_per_step": int(batches[0].numel()),
              "params": sum(p.numel() for p in model.parameters()),
              "step_loss_ours": ours["loss"], "step_loss_transformers": loss.item(),
              "step_loss_rel_err": loss_err,
              "grad_rel_err_max": max(grad_errs.values()),
              "grad_rel_err_median": sorted(grad_errs.values())[len(grad_errs) // 2],
              "grad_worst": worst,
              "curve_first_last_ours": [our_losses[0], our_losses[-1]],
              "curve_first_last_transformers": [hf_losses[0], hf_losses[-1]],
              "lr": LR,
              "curve_max_rel_diff": max(curve_errs),
              "transformers_bf16_autocast_vs_fp32_max_rel_diff": bf16_spread,
              "ours_vs_transformers_bf16_autocast_max_rel_diff": vs_bf16,
              "curve_max_rel_diff_step": curve_errs.index(max(curve_errs)),
              "curve_ours": [round(x, 4) for x in our_losses],
              "curve_transformers": [round(x, 4) for x in hf_losses],
              "logits_rel_err": logit_err, "problems": problems}
    print(json.dumps(result), flush=True)
    return not problems


def main():
    bin_path, work = sys.argv[1], sys.argv[2]
    datas = os.environ.get("MEGATRAIN_CMP_DATA", "random,text").split(",")
    ok = all([check(bin_path, work, name, cfg, data)
              for data in datas for name, cfg in configs()])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
