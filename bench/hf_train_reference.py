#!/usr/bin/env python3
"""PyTorch reference training throughput for a model that fits in GPU memory: PyTorch eager
+ Hugging Face transformers (attn_implementation="sdpa"), fp32 master weights, bf16 autocast
compute, fused AdamW on the GPU, random tokens, random-init weights (no hub, no internet).

One optimizer step = tokens_per_step tokens in micro-batches of micro_batch_rows rows of
seq_len tokens, gradients accumulated. Unless --micro-batch-rows is given, the largest
power-of-two row count that does not run out of memory is chosen, starting from a whole
step in one micro-batch; if even one row does not fit, gradient checkpointing is turned on
and the search repeats (reported as gradient_checkpointing_needed).

Model FLOPs per step (same formula as train_bench.cc, matmul parameters only):
  6 * N_matmul * T + 6 * L * s * d * T
  N_matmul: parameters of the Linear layers incl. lm_head (a tied lm_head counted once),
  L layers, s seq_len, d num_heads * head_dim, T tokens per step.

RoPE is plain (no Llama-3.1 frequency scaling); it does not change the work. AdamW runs
with weight_decay 0 on one parameter group. PYTORCH_CUDA_ALLOC_CONF defaults to
expandable_segments:True so a failed (OOM) try leaves no fragmentation behind.

Usage (one GPU; JSON on stdout, progress on stderr):
  python3 bench/hf_train_reference.py --shape qwen2.5-1.5b --tokens-per-step 65536 --seq 4096
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: E402

# name: (config class, hidden, intermediate, layers, heads, kv heads, vocab, tied,
#        rope_theta, rms_norm_eps, max_position_embeddings)
SHAPES = {
    "qwen2.5-0.5b": (Qwen2Config, 896, 4864, 24, 14, 2, 151936, True, 1e6, 1e-6, 32768),
    "qwen2.5-1.5b": (Qwen2Config, 1536, 8960, 28, 12, 2, 151936, True, 1e6, 1e-6, 32768),
    "qwen2.5-7b": (Qwen2Config, 3584, 18944, 28, 28, 4, 152064, False, 1e6, 1e-6, 32768),
    "llama-3.1-8b": (LlamaConfig, 4096, 14336, 32, 32, 8, 128256, False, 5e5, 1e-5, 131072),
}


def log(msg):
    print(f"[hf_train_reference] {msg}", file=sys.stderr, flush=True)


def make_config(shape, layers, seq):
    cls, hidden, inter, num_layers, heads, kv, vocab, tied, theta, eps, max_pos = SHAPES[shape]
    # Qwen2ForCausalLM always has q/k/v biases; Llama has none (attention_bias False).
    # transformers 5 keeps rope_theta in rope_parameters and still accepts the old
    # rope_theta keyword; 4.x reads rope_theta and keeps rope_parameters as a plain attribute.
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                  num_hidden_layers=layers or num_layers, num_attention_heads=heads,
                  num_key_value_heads=kv, hidden_act="silu", rms_norm_eps=eps,
                  max_position_embeddings=max(max_pos, seq), tie_word_embeddings=tied,
                  use_cache=False)
    rope = {"rope_type": "default", "rope_theta": theta}
    try:
        return cls(rope_theta=theta, rope_parameters=rope, **kwargs)
    except (TypeError, ValueError):  # a config class that takes only rope_parameters
        return cls(rope_parameters=rope, **kwargs)


def build_model(cfg):
    kwargs = {"attn_implementation": "sdpa"}
    try:  # transformers >= 4.56 (and 5.x) call it dtype; older versions torch_dtype
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **kwargs)
    except TypeError:
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32, **kwargs)
    return model.cuda().train()


def matmul_params(model):
    seen, n = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            for p in module.parameters(recurse=False):
                if id(p) not in seen:  # a tied lm_head shares the embedding: count once
                    seen.add(id(p))
                    n += p.numel()
    return n


def run_steps(model, opt, batches, num_steps, max_grad_norm):
    """Runs num_steps optimizer steps over batches (each (rows, seq) int64 on the GPU)."""
    params = [p for p in model.parameters() if p.requires_grad]
    step_seconds, loss_sum = [], None
    for step in range(num_steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device="cuda")
        for ids in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # mean CE
            (loss / len(batches)).backward()
            loss_sum += loss.detach()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        step_seconds.append(time.perf_counter() - t0)
        log(f"step {step}: {step_seconds[-1]:.3f} s, loss {loss_sum.item() / len(batches):.4f}")
    return step_seconds, loss_sum.item() / len(batches)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="override the number of layers")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--micro-batch-rows", type=int, default=0, help="0: largest that fits")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=8, help="total steps, warm-up included")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    args = ap.parse_args()
    if args.tokens_per_step % args.seq:
        ap.error(f"--tokens-per-step {args.tokens_per_step} is not a multiple of --seq {args.seq}")
    rows_per_step = args.tokens_per_step // args.seq
    if args.micro_batch_rows and rows_per_step % args.micro_batch_rows:
        ap.error(f"--micro-batch-rows {args.micro_batch_rows} does not divide the "
                 f"{rows_per_step} rows of a step")
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs one GPU")

    torch.manual_seed(0)
    cfg = make_config(args.shape, args.layers, args.seq)
    log(f"building {args.shape} ({cfg.num_hidden_layers} layers), random init, fp32")
    model = build_model(cfg)
    params = sum(p.numel() for p in model.parameters())  # parameters() skips tied duplicates
    n_matmul = matmul_params(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    d_attn = cfg.num_attention_heads * head_dim
    flops_per_step = (6.0 * n_matmul * args.tokens_per_step
                      + 6.0 * cfg.num_hidden_layers * args.seq * d_attn * args.tokens_per_step)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    attn = getattr(model.config, "_attn_implementation", None)
    log(f"{params / 1e9:.3f} B parameters, {n_matmul / 1e9:.3f} B in matmuls, tied={tied}, "
        f"attn={attn}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0, fused=True)

    if args.micro_batch_rows:
        candidates = [args.micro_batch_rows]
    else:
        candidates = [r for r in (2 ** i for i in range(rows_per_step.bit_length() - 1, -1, -1))
                      if rows_per_step % r == 0]
    modes = [True] if args.gradient_checkpointing else [False, True]
    oom_tries, result = [], None
    for checkpointing in modes:
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        for rows in candidates:
            g = torch.Generator(device="cuda").manual_seed(0)
            batches = [  # (rows, seq) int64 token ids, labels too
                torch.randint(0, cfg.vocab_size, (rows, args.seq), device="cuda", generator=g)
                for _ in range(rows_per_step // rows)]
            log(f"trying {rows} rows x {len(batches)} micro-batches, checkpointing={checkpointing}")
            torch.cuda.reset_peak_memory_stats()
            try:
                result = run_steps(model, opt, batches, args.steps, args.max_grad_norm)
            except RuntimeError as e:  # OutOfMemoryError, or cuBLAS failing to get workspace
                if not isinstance(e, torch.cuda.OutOfMemoryError) and "ALLOC_FAILED" not in str(e):
                    raise
                result = None
            if result is not None:
                break
            # Out of the except block, so the traceback's frames (and their tensors) are gone.
            oom_tries.append({"micro_batch_rows": rows, "gradient_checkpointing": checkpointing})
            del batches
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            log(f"out of memory at {rows} rows")
        if result is not None:
            break

    out = {"benchmark": "hf_train_reference", "shape": args.shape,
           "layers": cfg.num_hidden_layers, "params": params, "matmul_params": n_matmul,
           "tied_embeddings": tied, "tokens_per_step": args.tokens_per_step,
           "seq_len": args.seq, "oom_tries": oom_tries,
           "torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(0),
           "attn_implementation": attn,
           "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    if result is None:
        out["error"] = ("out of memory at every micro-batch size tried (oom_tries); use fewer "
                        "--layers, a shorter --seq or a smaller --shape")
        print(json.dumps(out, indent=2))
        sys.exit(1)
    step_seconds, final_loss = result
    steady = statistics.median(step_seconds[args.warmup:])
    out.update({
        "micro_batch_rows": rows, "micro_batches": rows_per_step // rows,
        "gradient_checkpointing": checkpointing,
        "gradient_checkpointing_needed": checkpointing and not args.gradient_checkpointing,
        "steps": args.steps, "warmup": args.warmup, "lr": args.lr,
        "max_grad_norm": args.max_grad_norm, "final_loss": final_loss,
        "step_seconds": step_seconds, "steady_step_seconds": steady,
        "tokens_per_second": args.tokens_per_step / steady,
        "model_flops_per_step": flops_per_step, "model_tflops": flops_per_step / steady / 1e12,
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
    })
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
