#!/usr/bin/env python3
"""Generation (megatrain-generate, CUDA backend) against transformers' generate, on 4-layer
models of each family at full width, first trained by megatrain so that their predictions
are peaked.

For each family: transformers creates the model (random init, weights rounded to bf16,
saved as safetensors); megatrain-train trains it TRAIN_STEPS steps on text-shaped data (a
bigram chain over 256 ids, 4 successors each with Zipfian weights) and writes a checkpoint;
32 prompts (16 to 48 tokens of the chain) are then completed greedily, 64 new tokens each,
by megatrain-generate and by transformers (bf16, eager attention, one prompt at a time).
It reports and checks:
  - the logit error: for every token we generate, |our log-probability - transformers'| of
    it on the same prefix (transformers' teacher-forced forward over our sequence); the
    prefill's (the first new token's) max is `prefill_logprob_error`;
  - greedy equality: the first step at which our tokens differ from transformers' generate,
    per prompt. A divergence is excused where transformers' own two top logits at that step
    are closer than twice the largest logit error measured at prefill, or than one bf16 unit
    in the last place of the top logit (transformers' logits are bf16, so that is the finest
    gap they show): a near-tie that bf16 rounding may decide either way, counted as
    `near_ties`; any other is a failure;
  - the same seed and options repeat bit for bit: a second sampled run (temperature 0.8,
    top_p 0.9, seed 7) gives the first's tokens.
Usage: compare_generation_with_transformers.py BIN_DIR WORKDIR [family ...]
Prints one JSON line per family and exits non-zero on a failure.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import time

import torch
from transformers import (AutoModelForCausalLM, GptOssConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

# 0 compares the untrained model.
TRAIN_STEPS = int(os.environ.get("MEGATRAIN_GEN_TRAIN_STEPS", "200"))
LR = float(os.environ.get("MEGATRAIN_GEN_TRAIN_LR", "3e-4"))
PROMPTS, NEW = 32, 64


def configs():
    """Each family at its released width, 4 layers."""
    yield "qwen2", Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4,
                               num_attention_heads=28, num_key_value_heads=4,
                               vocab_size=152064, rope_theta=1e6, tie_word_embeddings=False)
    yield "llama3", LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                                num_attention_heads=32, num_key_value_heads=8,
                                vocab_size=128256, rope_theta=500000.0, rope_scaling={
                                    "rope_type": "llama3", "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})
    # A window shorter than prompt + completion, so that decoding slides it.
    yield "mistral", MistralConfig(hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=4, num_attention_heads=32,
                                   num_key_value_heads=8, vocab_size=32768, rope_theta=1e6,
                                   sliding_window=32)
    yield "qwen3", Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=4,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               vocab_size=151936, rope_theta=1e6, tie_word_embeddings=False)
    yield "qwen3_moe", Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144,
                                      moe_intermediate_size=768, num_hidden_layers=4,
                                      num_attention_heads=32, num_key_value_heads=4,
                                      head_dim=128, num_experts=128, num_experts_per_tok=8,
                                      norm_topk_prob=True, vocab_size=151936, rope_theta=1e6)
    # Two layers: four (5.9B parameters) need more disk for the checkpoint than the H200 box has.
    yield "mixtral", MixtralConfig(hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=2, num_attention_heads=32,
                                   num_key_value_heads=8, num_local_experts=8,
                                   num_experts_per_tok=2, vocab_size=32000, rope_theta=1e6)
    yield "gpt_oss", GptOssConfig(hidden_size=2880, intermediate_size=2880, num_hidden_layers=4,
                                  num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                  num_local_experts=32, num_experts_per_tok=4,
                                  sliding_window=128, attention_bias=True, vocab_size=201088,
                                  rope_parameters={"rope_type": "yarn", "factor": 32.0,
                                                   "beta_fast": 32.0, "beta_slow": 1.0,
                                                   "truncate": False, "rope_theta": 150000.0,
                                                   "original_max_position_embeddings": 4096})


def chain(vocab, seed=0):
    """The bigram chain: 256 live ids, each with 4 successors of weights 1/(k+1)."""
    g = torch.Generator().manual_seed(seed)
    live = torch.randperm(vocab, generator=g)[:256]
    succ = torch.randint(0, 256, (256, 4), generator=g)
    return g, live, succ


def walk(g, live, succ, rows, length):
    probs = 1.0 / torch.arange(1, 5, dtype=torch.float64)
    cur = torch.randint(0, 256, (rows,), generator=g)
    out = [cur]
    for _ in range(length - 1):
        cur = succ[cur, torch.multinomial(probs.expand(rows, 4), 1, generator=g).squeeze(1)]
        out.append(cur)
    return live[torch.stack(out, dim=1)]


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def train(bins, work, model_dir, vocab, g, live, succ):
    data = os.path.join(work, "train.jsonl")
    with open(data, "w") as f:
        for row in walk(g, live, succ, 8 * TRAIN_STEPS, 256).tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    spec = os.path.join(work, "train.yaml")
    with open(spec, "w") as f:
        f.write(f"model: {{path: {model_dir}}}\n"
                f"data: {{path: {data}, format: tokens, seq_len: 256, packing: pad}}\n"
                f"optimizer: {{state_dtype: int8}}\n"
                f"train: {{steps: {TRAIN_STEPS}, micro_batch_rows: 8, micro_batches: 1, "
                f"lr: {LR}, warmup_steps: 5, max_grad_norm: 1.0}}\n"
                f"checkpoint: {{dir: {work}/ckpt, keep_last: 1}}\n")
    r = run([os.path.join(bins, "megatrain-train"), spec, "--log-every", "50"])
    losses = [float(l.split(" loss ")[1].split()[0]) for l in r.stdout.splitlines()
              if l.startswith("step ") and " loss " in l]
    return os.path.join(work, "ckpt", f"checkpoint-{TRAIN_STEPS}"), losses


def ours(bins, ckpt, prompts_path, out_path, extra=()):
    run([os.path.join(bins, "megatrain-generate"), ckpt, "--prompts", prompts_path, "--output",
         out_path, "--max-new-tokens", str(NEW), "--ignore-eos", "--tokenizer", "byte",
         "--backend", "cuda", *extra])
    rows = [json.loads(l) for l in open(out_path)]
    rows.sort(key=lambda r: r["index"])
    return [r["ids"] for r in rows], [r.get("logprobs", []) for r in rows]


def check(bins, work, name, config):
    os.makedirs(work, exist_ok=True)
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model_dir = os.path.join(work, "init")
    model.save_pretrained(model_dir)
    del model
    g, live, succ = chain(config.vocab_size)
    ckpt, losses = model_dir, []
    if TRAIN_STEPS > 0:
        ckpt, losses = train(bins, work, model_dir, config.vocab_size, g, live, succ)
    print(f"{name}: trained, loss {losses[:1]} -> {losses[-1:]}", file=sys.stderr, flush=True)
    if TRAIN_STEPS > 0:
        shutil.rmtree(model_dir)  # the checkpoint is what both sides read
    prompts = [walk(g, live, succ, 1, 16 + (i * 31) % 33)[0].tolist() for i in range(PROMPTS)]
    prompts_path = os.path.join(work, "prompts.jsonl")
    with open(prompts_path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"input_ids": p}) + "\n")
    our_ids, our_lp = ours(bins, ckpt, prompts_path, os.path.join(work, "greedy.jsonl"))
    sampled = [ours(bins, ckpt, prompts_path, os.path.join(work, f"sampled{k}.jsonl"),
                    ("--temperature", "0.8", "--top-p", "0.9", "--seed", "7"))[0]
               for k in range(2)]

    hf = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.bfloat16,
                                              attn_implementation="eager").cuda().eval()
    lp_err, prefill_err, first_diff, gaps = [], [], [], []
    with torch.no_grad():
        for p, mine, mine_lp in zip(prompts, our_ids, our_lp):
            seq = torch.tensor([p + mine], device="cuda")
            logp = torch.log_softmax(hf(seq).logits[0].float(), dim=-1)
            theirs_lp = [logp[len(p) - 1 + j, t].item() for j, t in enumerate(mine)]
            errs = [abs(a - b) for a, b in zip(mine_lp, theirs_lp)]
            lp_err.append(max(errs))
            prefill_err.append(errs[0])
            gen = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW,
                              do_sample=False, output_logits=True, return_dict_in_generate=True)
            theirs = gen.sequences[0, len(p):].tolist()
            d = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
            first_diff.append(d)
            if d is not None:
                top2 = torch.topk(gen.logits[d][0].float(), 2).values
                # transformers' logits are bf16: one unit in the last place of the top one
                # is the finest gap they can show, and one rounding either side can flip it.
                ulp = 2.0 ** (math.floor(math.log2(abs(float(top2[0])))) - 7)
                gaps.append((float(top2[0] - top2[1]), ulp))
    tolerance = 2 * max(prefill_err)
    near_ties = sum(1 for gap, ulp in gaps if gap <= max(tolerance, ulp))
    result = {
        "family": name, "params": sum(p.numel() for p in hf.parameters()),
        "train_loss_first_last": [losses[0], losses[-1]] if losses else None,
        "prefill_logprob_error_max": max(prefill_err), "logprob_error_max": max(lp_err),
        "prompts_equal": sum(1 for d in first_diff if d is None),
        "divergences": len(gaps), "near_ties": near_ties,
        "divergence_steps": [d for d in first_diff if d is not None], "top2_gaps": [g for g, _ in gaps],
        "top1_ulps": [u for _, u in gaps],
        "sampled_repeat_bitwise": sampled[0] == sampled[1],
    }
    result["ok"] = near_ties == len(gaps) and result["sampled_repeat_bitwise"]
    del hf
    torch.cuda.empty_cache()
    return result


def main():
    bins, work = sys.argv[1], sys.argv[2]
    wanted = set(sys.argv[3:])
    ok = True
    for name, config in configs():
        if wanted and name not in wanted:
            continue
        start = time.time()
        r = check(bins, os.path.join(work, name), name, config)
        r["seconds"] = round(time.time() - start, 1)
        print(json.dumps(r), flush=True)
        shutil.rmtree(os.path.join(work, name), ignore_errors=True)  # the box's disk is small
        ok = ok and r["ok"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
