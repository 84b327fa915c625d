#!/usr/bin/env python3
"""transformers' generate on the same work as generate_bench: a random-init model of a
released shape in bf16 on one GPU (attn_implementation="sdpa", its default dynamic KV
cache), `--prompts` prompts of `--prompt-len` random tokens in one batch (equal lengths: no
padding), greedy, exactly `--new` new tokens each (min_new_tokens = max_new_tokens, so no
sequence stops early). The reference beside generate_bench's end-to-end tokens/s.

Times `--repeats` whole generate() calls after one warm-up call and reports the median:
new tokens a second (prompts * new / seconds) and the seconds.

Usage (JSON on stdout, progress on stderr):
  python3 bench/hf_generate_reference.py --shape qwen2.5-7b --prompts 64 --prompt-len 512 --new 512
"""
import argparse
import json
import statistics
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

# name: (config class, hidden, intermediate, layers, heads, kv heads, vocab, tied, rope_theta)
SHAPES = {
    "qwen2.5-7b": (Qwen2Config, 3584, 18944, 28, 28, 4, 152064, False, 1e6),
    "llama-3.1-8b": (LlamaConfig, 4096, 14336, 32, 32, 8, 128256, False, 5e5),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    cls, hidden, inter, layers, heads, kv, vocab, tied, theta = SHAPES[a.shape]
    config = cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                 tie_word_embeddings=tied, rope_theta=theta,
                 max_position_embeddings=max(32768, a.prompt_len + a.new))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, vocab, (a.prompts, a.prompt_len), device="cuda")
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, max_new_tokens=a.new, min_new_tokens=a.new,
                  do_sample=False, pad_token_id=0)
    times = []
    with torch.no_grad():
        for r in range(a.repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            assert out.shape == (a.prompts, a.prompt_len + a.new), out.shape
            print(f"[hf_generate_reference] call {r}: {seconds:.2f} s", file=sys.stderr, flush=True)
            if r > 0:
                times.append(seconds)
    seconds = statistics.median(times)
    print(json.dumps({"shape": a.shape, "prompts": a.prompts, "prompt_len": a.prompt_len,
                      "new_tokens_each": a.new, "seconds": seconds,
                      "new_tokens_per_second": a.prompts * a.new / seconds,
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "attention": "sdpa", "cache": "dynamic"}))


if __name__ == "__main__":
    main()
