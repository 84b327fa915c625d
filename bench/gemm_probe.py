#!/usr/bin/env python3
"""Why the Llama-3.1-8B GEMM shapes run slower than Qwen2.5-7B's on the H200.

machine_bench (cuBLAS, cublasGemmEx's default algorithm) measured 659-695 TFLOP/s for the
4096-wide shapes at 8192 rows and 766-814 for the 3584-wide ones, in that order. This
tells apart the explanations, with torch as an independent caller of the same library:
  - the algorithm: cuBLAS against cuBLASLt's heuristic (torch's preferred_blas_library);
  - the card's power: random against zero inputs (zeros draw less power), and the
    clocks and power nvidia-smi samples over each measurement;
  - the order: every shape measured twice, Llama's first and last.
Prints one JSON object: a row per (shape, pass, library, inputs) with TFLOP/s and the
median SM clock and power over it.
With --sustained SECONDS it instead runs Llama's gate|up forward GEMM (random inputs) back to
back for that long and prints its rate and the card's clock and power every half second:
how far a run of many seconds, as a training step is, settles below the short bursts.
Usage: python3 bench/gemm_probe.py [--rows 8192] [--sustained SECONDS] [--json OUT]
"""
import argparse
import json
import subprocess
import tempfile
import time

import torch

import smi_spans  # bench/, beside this script

SHAPES = {  # name: (in_features, out_features), the layers' GEMMs (gate and up apart)
    "llama_qkv": (4096, 6144), "llama_o": (4096, 4096), "llama_up": (4096, 14336),
    "llama_down": (14336, 4096),
    "qwen_qkv": (3584, 4608), "qwen_o": (3584, 3584), "qwen_up": (3584, 18944),
    "qwen_down": (18944, 3584),
}


def sampler():
    f = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
    p = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                          "--format=csv", "-lms", "50"], stdout=f, stderr=subprocess.DEVNULL)
    return p, f.name


def samples_between(path, t0, t1):
    """Median SM clock, power and temperature of the samples between two time.time() stamps."""
    inside = [s for s in smi_spans.read_samples(path) if t0 <= s["timestamp"].timestamp() <= t1]
    if not inside:
        return None
    med = lambda h: smi_spans.quantiles([smi_spans.number(s[h]) for s in inside])["median"]
    return {"sm_mhz": med("clocks.current.sm [MHz]"), "watts": med("power.draw [W]"),
            "celsius": med("temperature.gpu"), "samples": len(inside)}


def time_gemm(fn, iters):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def sustained(a, path):
    ic, oc = 4096, 28672  # Llama-3.1-8B's fused gate|up
    xs = [torch.randn(a.rows, ic, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ws = [torch.randn(oc, ic, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(3)]
    flops = 2.0 * a.rows * ic * oc
    rows, t_end = [], time.time() + a.sustained
    while time.time() < t_end:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.time()
        start.record()
        n = 0
        while time.time() - t0 < 0.5:
            for i in range(3):
                xs[i] @ ws[i].t()
            n += 3
            if n % 30 == 0:
                torch.cuda.synchronize()
        end.record()
        end.synchronize()
        t1 = time.time()
        sec = start.elapsed_time(end) / 1e3
        row = {"t": round(t1 - (t_end - a.sustained), 2), "tflops": round(n * flops / sec / 1e12, 1)}
        time.sleep(0.12)
        row["clocks"] = samples_between(path, t0, t1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    ap.add_argument("--sustained", type=float, default=0)
    a = ap.parse_args()
    proc, path = sampler()
    if a.sustained > 0:
        try:
            rows = sustained(a, path)
        finally:
            proc.terminate()
        if a.json:
            json.dump({"tool": "bench/gemm_probe.py --sustained", "device": torch.cuda.get_device_name(),
                       "flops": "2*rows*in*out", "rows": rows}, open(a.json, "w"), indent=1)
        return
    time.sleep(0.5)
    rows = []
    order = list(SHAPES)
    passes = [("first", order), ("again", order[4:] + order[:4])]
    try:
        for pass_name, names in passes:
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                for inputs in ("randn", "zeros"):
                    for name in names:
                        ic, oc = SHAPES[name]
                        make = torch.randn if inputs == "randn" else torch.zeros
                        # three input sets rotated, so the L2 cache does not hold them
                        xs = [make(a.rows, ic, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
                        ws = [make(oc, ic, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(3)]
                        dys = [make(a.rows, oc, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
                        k = [0]

                        def fwd():
                            i = k[0] = (k[0] + 1) % 3
                            return xs[i] @ ws[i].t()

                        def dgrad():
                            i = k[0] = (k[0] + 1) % 3
                            return dys[i] @ ws[i]

                        flops = 2.0 * a.rows * ic * oc
                        for op, fn in (("forward", fwd), ("dgrad", dgrad)):
                            t0 = time.time()
                            sec = time_gemm(fn, a.iters)
                            t1 = time.time()
                            row = {"shape": name, "in": ic, "out": oc, "rows": a.rows, "op": op,
                                   "pass": pass_name, "library": lib, "inputs": inputs,
                                   "tflops": round(flops / sec / 1e12, 1)}
                            time.sleep(0.15)
                            row["clocks"] = samples_between(path, t0, t1)
                            rows.append(row)
                            print(json.dumps(row), flush=True)
                        del xs, ws, dys
    finally:
        proc.terminate()
    out = {"tool": "bench/gemm_probe.py", "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "cublas": torch.backends.cuda.preferred_blas_library().name
           if hasattr(torch.backends.cuda.preferred_blas_library(), "name") else None,
           "flops": "2*rows*in*out", "rows": rows}
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
