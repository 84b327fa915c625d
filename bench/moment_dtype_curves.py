#!/usr/bin/env python3
"""200-step loss curves of one small model with AdamW's moments in fp32, bf16 and int8
(optimizer.state_dtype), everything else equal: the issue's check that the smaller
moments train as fp32 ones do (the mean of the last 20 losses within 1% of fp32's).

The data is text-shaped: a fixed bigram chain over 256 of the 4096 ids, 4 successors each
with Zipfian weights (the loss falls from ln 4096 towards the chain's entropy), written as
data.format tokens. The model: Llama, hidden 128, 4 layers, 4 heads (2 kv), vocab 4096,
8 rows of 128 tokens a step, lr 2e-3 cosine with 20 warm-up steps, clipping at 1.0,
weight decay 0.1. Runs megatrain-train on the CPU backend (the optimizer is the same code
on every backend); prints one JSON object.

Usage: bench/moment_dtype_curves.py MEGATRAIN_TRAIN_BIN WORKDIR [--steps 200]
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys


def write_data(path, docs=2000, length=400, seed=0):
    rng = random.Random(seed)
    states = rng.sample(range(4096), 256)
    succ = {s: rng.sample(states, 4) for s in states}
    weights = [1.0, 0.5, 1 / 3, 0.25]
    with open(path, "w") as f:
        for _ in range(docs):
            cur = rng.choice(states)
            ids = [cur]
            for _ in range(length - 1):
                cur = rng.choices(succ[cur], weights)[0]
                ids.append(cur)
            f.write(json.dumps({"input_ids": ids}) + "\n")


SPEC = """name: curve-{dtype}
backend: cpu
model:
  config: {{architectures: [LlamaForCausalLM], hidden_size: 128, intermediate_size: 344,
           num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 2,
           vocab_size: 4096, tie_word_embeddings: false}}
  init_seed: 1
data: {{path: {data}, format: tokens, seq_len: 128, seed: 2}}
train:
  steps: {steps}
  tokens_per_step: 1024
  micro_batch_rows: 8
  lr: 2.0e-3
  schedule: cosine
  warmup_steps: 20
  weight_decay: 0.1
  max_grad_norm: 1.0
optimizer: {{state_dtype: {dtype}}}
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("train_bin")
    ap.add_argument("workdir")
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    data = os.path.join(a.workdir, "chain.jsonl")
    write_data(data)
    curves = {}
    for dtype in ("fp32", "bf16", "int8"):
        spec = os.path.join(a.workdir, f"{dtype}.yaml")
        with open(spec, "w") as f:
            f.write(SPEC.format(dtype=dtype, data=data, steps=a.steps))
        out = subprocess.run([a.train_bin, spec, "--log-every", "1"], capture_output=True,
                             text=True, check=True).stdout
        curves[dtype] = [float(m.group(1))
                         for m in re.finditer(r"^step +\d+/\d+ +loss (\S+)", out, re.M)]
        print(f"{dtype}: {len(curves[dtype])} steps, last {curves[dtype][-1]:.4f}", file=sys.stderr)
    tail = {d: sum(c[-20:]) / 20 for d, c in curves.items()}
    result = {
        "benchmark": "moment_dtype_curves",
        "steps": a.steps,
        "last20_mean": tail,
        "last20_vs_fp32": {d: tail[d] / tail["fp32"] - 1 for d in tail},
        "max_abs_gap_vs_fp32": {d: max(abs(x - y) for x, y in zip(c, curves["fp32"]))
                                for d, c in curves.items()},
        "losses": curves,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
