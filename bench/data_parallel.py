#!/usr/bin/env python3
"""Data parallelism on one box: the same job on 1 and on N GPUs (train.devices), same
global batch, same data, with the gradients reduce-scattered on the GPUs (NCCL) and/or
added on the host (train.gradient_reduce); prints JSON with every step's loss on each,
their largest relative difference from one GPU, the steady tokens/s (median of the steps
after the third), the scaling, and each run's peak resident host memory (VmRSS sampled
every 0.2 s) and its growth over one GPU. Random-init models of named shapes, byte
tokenizer, generated text.

  bench/data_parallel.py --bin BUNDLE/bin --shape qwen2.5-1.5b --steps 50 [--devices 2]
      [--reduce device,host]

Not a test: `bench/run.sh data-parallel` keeps its latest result.
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = {
    "tiny": {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 160,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 258, "tie_word_embeddings": True},
    "qwen2.5-1.5b": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536,
                     "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2,
                     "vocab_size": 151936, "tie_word_embeddings": True,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "qwen2.5-7b": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4,
                   "vocab_size": 152064, "tie_word_embeddings": False,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
}
STEP = re.compile(r"^step\s+(\d+)/\d+\s+loss (\S+)\s+lr \S+\s+grad_norm (\S+)\s+(\d+) tok/s")


def run(binary, spec_path, timeout):
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([binary, spec_path, "--log-every", "1"], stdout=out, stderr=err,
                             text=True)
        peak_kib = 0
        while p.poll() is None:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            peak_kib = max(peak_kib, int(line.split()[1]))
            except OSError:
                pass
            if time.monotonic() - start > timeout:
                p.kill()
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    p.stdout, p.stderr = stdout, stderr
    steps = []
    for line in p.stdout.splitlines():
        m = STEP.match(line)
        if m:
            steps.append({"step": int(m.group(1)), "loss": float(m.group(2)),
                          "grad_norm": float(m.group(3)), "tokens_per_second": float(m.group(4))})
    plan = [l for l in p.stdout.splitlines() if l.startswith(("plan", "data ", "step  ", "bound"))]
    return {"rc": p.returncode, "stderr": p.stderr[-2000:], "steps": steps,
            "plan": p.stdout.split("\n")[2:18], "peak_rss_gib": peak_kib / 2**20}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--repeat-one", action="store_true",
                    help="run one GPU twice: the run-to-run difference (atomics in the "
                         "embedding and norm backward) is the floor any comparison stands on")
    ap.add_argument("--reduce", default="device",
                    help="comma-separated train.gradient_reduce values to run on N GPUs")
    a = ap.parse_args()
    binary = os.path.join(a.bin, "megatrain-train")
    work = tempfile.mkdtemp(prefix="dp-")
    rng = random.Random(0)
    words = ("the quick brown fox jumps over a lazy dog while alpha beta gamma delta epsilon "
             "zeta eta theta iota kappa lambda sing along").split()
    need = a.tokens * (a.steps + 2) * 1.3
    with open(os.path.join(work, "data.jsonl"), "w") as f:
        written = 0
        while written < need:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(200, 2000)))
            f.write(json.dumps({"text": text}) + "\n")
            written += len(text)
    out = {"shape": a.shape, "tokens_per_step": a.tokens, "seq": a.seq, "steps": a.steps,
           "lr": a.lr}
    runs = [("devices_1", 1, "auto")] + ([("devices_1_again", 1, "auto")] if a.repeat_one else []) + [(f"devices_{a.devices}_{m}", a.devices, m)
                                         for m in a.reduce.split(",")]
    for name, devices, reduce in runs:
        spec = os.path.join(work, f"{name}.yaml")
        with open(spec, "w") as f:
            f.write(f"name: dp{devices}\nmodel: {{config: {json.dumps(SHAPES[a.shape])}}}\n"
                    f"data: {{path: data.jsonl, tokenizer: byte, seq_len: {a.seq}}}\n"
                    f"train: {{steps: {a.steps}, tokens_per_step: {a.tokens}, "
                    f"micro_batch_rows: 1, lr: {a.lr}, warmup_steps: 5, devices: {devices}, "
                    f"gradient_reduce: {reduce}}}\n")
        r = run(binary, spec, a.timeout)
        steady = [s["tokens_per_second"] for s in r["steps"][3:]]
        r["steady_tokens_per_second"] = statistics.median(steady) if steady else None
        out[name] = r
        print(f"{name}: rc {r['rc']}, {len(r['steps'])} steps, steady "
              f"{r['steady_tokens_per_second']} tok/s, peak RSS {r['peak_rss_gib']:.2f} GiB",
              file=sys.stderr)
    one = {s["step"]: s for s in out["devices_1"]["steps"]}
    s1 = out["devices_1"]["steady_tokens_per_second"]
    for name, devices, _ in runs[1:]:
        many = {s["step"]: s for s in out[name]["steps"]}
        pairs = [(one[k], many[k]) for k in sorted(one) if k in many]
        r = out[name]
        r["steps_compared"] = len(pairs)
        if pairs:
            r["max_loss_rel_diff"] = max(abs(b["loss"] - x["loss"]) / abs(x["loss"])
                                         for x, b in pairs)
            r["max_grad_norm_rel_diff"] = max(abs(b["grad_norm"] - x["grad_norm"]) /
                                              abs(x["grad_norm"]) for x, b in pairs)
        sn = r["steady_tokens_per_second"]
        r["scaling"] = sn / s1 if s1 and sn else None
        r["host_rss_growth_gib"] = r["peak_rss_gib"] - out["devices_1"]["peak_rss_gib"]
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
