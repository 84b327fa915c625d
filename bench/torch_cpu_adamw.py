#!/usr/bin/env python3
"""PyTorch CPU AdamW throughput on all cores: the reference the C++ host AdamW
(engine/optim/adamw.cc) must beat. fp32 params, grads and states in host RAM, split into
--tensors equal tensors; torch.optim.AdamW's three implementations (fused=True,
foreach=True, the single-tensor loop), each timed as seconds per optimizer.step().

GB/s counts 28 bytes per parameter and step: param, grad, exp_avg, exp_avg_sq read (16)
and param, exp_avg, exp_avg_sq written (12); temporaries of the unfused paths and
write-allocate traffic are not counted. For scale, a host memory bandwidth reference
measured with torch on the same threads: copy_ of a 1 GiB fp32 tensor (counted 2 x size)
and a.add_(b, alpha=2) (counted 3 x size), best of 5.

Usage (JSON on stdout, progress on stderr):
  python3 bench/torch_cpu_adamw.py [--params 268435456] [--tensors 8] [--threads N]
"""
import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

BYTES_READ_PER_PARAM = 16  # param, grad, exp_avg, exp_avg_sq
BYTES_WRITTEN_PER_PARAM = 12  # param, exp_avg, exp_avg_sq
VARIANTS = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "single_tensor": {"foreach": False, "fused": False},
}


def log(msg):
    print(f"[torch_cpu_adamw] {msg}", file=sys.stderr, flush=True)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def time_variant(kwargs, sizes, grads, iters, warmup, lr, weight_decay):
    """Returns the per-step seconds of AdamW(**kwargs) over fresh params of the given sizes."""
    g = torch.Generator().manual_seed(1)
    params = []
    for n, grad in zip(sizes, grads):
        p = torch.nn.Parameter(torch.empty(n).normal_(0.0, 0.02, generator=g))
        p.grad = grad  # read only by the optimizer; shared across variants
        params.append(p)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=weight_decay, **kwargs)
    seconds = []
    for i in range(warmup + iters):  # the first step also allocates exp_avg, exp_avg_sq
        t0 = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t0
        if i >= warmup:
            seconds.append(dt)
    finite = all(bool(torch.isfinite(p).all()) for p in params)
    del opt, params
    gc.collect()
    return seconds, finite


def host_bandwidth(size_bytes, repeats):
    n = size_bytes // 4
    a = torch.ones(n)  # fp32; filled so pages are faulted in before timing
    b = torch.full((n,), 2.0)

    def best(fn):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    copy_s = best(lambda: a.copy_(b))
    triad_s = best(lambda: a.add_(b, alpha=2.0))
    return {
        "tensor_bytes": n * 4, "repeats": repeats, "statistic": "best",
        "copy_bytes_counted": 2 * n * 4, "copy_seconds": copy_s,
        "copy_gb_per_second": 2 * n * 4 / copy_s / 1e9,
        "add_alpha_bytes_counted": 3 * n * 4, "add_alpha_seconds": triad_s,
        "add_alpha_gb_per_second": 3 * n * 4 / triad_s / 1e9,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=268435456, help="total parameters")
    ap.add_argument("--tensors", type=int, default=8, help="split into this many tensors")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--iters", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--bandwidth-gib", type=int, default=1, help="0 skips the bandwidth test")
    args = ap.parse_args()
    if args.params < args.tensors or args.tensors < 1:
        ap.error(f"--params {args.params} must be at least --tensors {args.tensors} >= 1")
    if args.iters < 1:
        ap.error("--iters must be at least 1")
    names = [v for v in args.variants.split(",") if v]
    for v in names:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {','.join(VARIANTS)}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # Equal split; the first (params % tensors) tensors take one extra element.
    base, extra = divmod(args.params, args.tensors)
    sizes = [base + (1 if i < extra else 0) for i in range(args.tensors)]
    log(f"{args.params} params in {args.tensors} tensors, {torch.get_num_threads()} threads")
    grads = [torch.randn(n) * 1e-3 for n in sizes]

    variants = {}
    bytes_per_param = BYTES_READ_PER_PARAM + BYTES_WRITTEN_PER_PARAM
    for name in names:
        log(f"variant {name}")
        try:
            seconds, finite = time_variant(VARIANTS[name], sizes, grads, args.iters,
                                           args.warmup, args.lr, args.weight_decay)
        except Exception as e:  # an implementation this build does not support on CPU
            variants[name] = {"kwargs": VARIANTS[name], "error": f"{type(e).__name__}: {e}"}
            log(f"variant {name} failed: {type(e).__name__}: {e}")
            gc.collect()
            continue
        med = statistics.median(seconds)
        variants[name] = {
            "kwargs": VARIANTS[name], "step_seconds": seconds,
            "median_step_seconds": med, "min_step_seconds": min(seconds),
            "params_per_second": args.params / med,
            "gb_per_second": args.params * bytes_per_param / med / 1e9,
            "params_finite": finite,
        }
        log(f"variant {name}: {med * 1e3:.1f} ms/step, "
            f"{variants[name]['gb_per_second']:.1f} GB/s counted")
    del grads
    gc.collect()

    host_memory = None
    if args.bandwidth_gib > 0:
        log(f"host memory bandwidth, {args.bandwidth_gib} GiB tensors")
        host_memory = host_bandwidth(args.bandwidth_gib * 2 ** 30, repeats=5)

    print(json.dumps({
        "benchmark": "torch_cpu_adamw", "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
        "params": args.params, "tensors": args.tensors, "tensor_sizes": sizes,
        "iters": args.iters, "warmup": args.warmup, "lr": args.lr,
        "weight_decay": args.weight_decay, "statistic": "median",
        "bytes_per_param_assumed": {
            "read": BYTES_READ_PER_PARAM, "written": BYTES_WRITTEN_PER_PARAM,
            "total": bytes_per_param,
            "note": "read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq; "
                    "temporaries and write-allocate traffic not counted",
        },
        "variants": variants, "host_memory": host_memory, "torch": torch.__version__,
    }, indent=2))


if __name__ == "__main__":
    main()
