#!/usr/bin/env python3
"""Checks megatrain against Hugging Face transformers + PyTorch, as an independent reference.

For each variant exported by export_reference (OUT/<variant>/):
  1. step0/ loads with AutoModelForCausalLM.from_pretrained, no missing/unexpected keys;
  2. the loss of the batch equals transformers' (fp32 compute on the same bf16 weights);
  3. every parameter's gradient equals transformers' autograd gradient;
  4. one torch.optim.AdamW step (clip_grad_norm_, decay on matrices only) from step0's fp32
     master with our gradients equals step1's master; step1/ loads too.
Prints one JSON line per variant and exits non-zero on any mismatch.
Usage: compare_with_transformers.py OUT
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def rel(a, b):
    return float((a - b).norm() / max(b.norm(), 1e-30))


def load_dir(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def check(root, name):
    d = os.path.join(root, name)
    batch = json.load(open(os.path.join(d, "batch.json")))
    model, info = AutoModelForCausalLM.from_pretrained(
        os.path.join(d, "step0"), dtype=torch.float32, attn_implementation="eager",
        output_loading_info=True)
    problems = []
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(k):
            problems.append(f"{k}: {info[k]}")
    ids = torch.tensor(batch["rows"], dtype=torch.long)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    loss_err = abs(out.loss.item() - batch["loss"]) / abs(out.loss.item())
    if loss_err > 2e-5:
        problems.append(f"loss {batch['loss']} vs transformers {out.loss.item()}")

    ours = load_file(os.path.join(d, "grads.safetensors"))
    worst_grad = 0.0
    params = dict(model.named_parameters())
    for n, p in params.items():
        if n not in ours:
            problems.append(f"no gradient exported for {n}")
            continue
        e = rel(ours[n].float(), p.grad)
        worst_grad = max(worst_grad, e)
        if e > 1e-4:
            problems.append(f"gradient of {n}: relative error {e:.2e}")

    # AdamW from our fp32 master with our gradients, as torch does it.
    master0 = load_dir(os.path.join(d, "step0", "optimizer", "master"))
    master1 = load_dir(os.path.join(d, "step1", "optimizer", "master"))
    names = sorted(master0)
    ps = [torch.nn.Parameter(master0[n].clone()) for n in names]
    for p, n in zip(ps, names):
        p.grad = ours[n].clone()
    torch.nn.utils.clip_grad_norm_(ps, batch["max_grad_norm"])
    decay = [p for p, n in zip(ps, names) if p.dim() >= 2]
    no_decay = [p for p, n in zip(ps, names) if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": batch["weight_decay"]},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=batch["lr"], betas=(batch["beta1"], batch["beta2"]), eps=batch["eps"],
        foreach=False)
    opt.step()
    worst_update = 0.0
    for p, n in zip(ps, names):
        step_ours = master1[n] - master0[n]
        step_torch = p.detach() - master0[n]
        e = rel(step_ours, step_torch)
        worst_update = max(worst_update, e)
        if e > 1e-4:
            problems.append(f"AdamW update of {n}: relative error {e:.2e}")
    AutoModelForCausalLM.from_pretrained(os.path.join(d, "step1"), dtype=torch.float32)
    result = {"variant": name, "loss_ours": batch["loss"], "loss_transformers": out.loss.item(),
              "loss_rel_err": loss_err, "worst_grad_rel_err": worst_grad,
              "worst_adamw_update_rel_err": worst_update, "problems": problems}
    print(json.dumps(result))
    return not problems


def main():
    root = sys.argv[1]
    ok = all([check(root, v) for v in sorted(os.listdir(root))
              if os.path.isdir(os.path.join(root, v))])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
