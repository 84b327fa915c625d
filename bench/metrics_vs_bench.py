#!/usr/bin/env python3
"""Checks megatraind's exported PCIe rates and stream busy fractions against train_bench's
own measurement of the same model shape on the same machine (issue: metrics agree with
the benchmarks within 10%).

  1. starts megatraind (metrics on a free port), submits a random-init job of the shape
     (documents longer than a row, so rows hold one attention segment as the benchmark's
     do), reads /metrics twice, STEADY_S apart, once the job is past its warm-up steps,
     and turns the counters into rates: PCIe bytes per second of step time per direction,
     and busy seconds per second of step time per stream (compute, h2d, d2h, optimizer),
     dividing by the increase of megatrain_step_duration_seconds_sum so that the window
     covers whole steps; wall-clock rates (what rate() gives) are reported too;
  2. runs train_bench on the same shape and reads its steady-state figures (with the plan the daemon chose);
  3. prints one JSON object with both and their relative differences.

Usage: metrics_vs_bench.py BIN_DIR [--steady-seconds 30] [shape flags as train_bench]
Standard library only; run on the GPU box (deploy/bundle.sh output's bin/).
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from daemon_jobs import start_daemon, write_qwen25_7b_job, write_word_dataset


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        values[name_labels] = float(value)
    return values


def pick(values, name, **labels):
    total, found = 0.0, False
    for key, v in values.items():
        if not key.startswith(name + "{") and key != name:
            continue
        if all(f'{k}="{val}"' in key for k, val in labels.items()):
            total += v
            found = True
    if not found:
        raise KeyError(f"{name} {labels} not in /metrics")
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin_dir")
    ap.add_argument("--steady-seconds", type=float, default=30)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--bench-steps", type=int, default=8)
    a = ap.parse_args()
    a.bin_dir = os.path.abspath(a.bin_dir)
    tmp = tempfile.mkdtemp(prefix="metrics-vs-bench-")

    write_word_dataset(os.path.join(tmp, "data.jsonl"), 300, 4 * a.seq)
    spec_path = write_qwen25_7b_job(
        tmp, "metrics-vs-bench", a.layers, a.seq,
        f"steps: 100000, micro_batch_rows: {a.rows}, micro_batches: {a.micro_batches}, "
        f"lr: 1.0e-5, max_grad_norm: 1.0, activation_checkpoint_every: {a.k}")

    port = free_port()
    daemon, env, cli = start_daemon(a.bin_dir, tmp, f"127.0.0.1:{port}")
    out = subprocess.run([cli, "-o", "json", "submit", spec_path], env=env,
                         capture_output=True, text=True, cwd=tmp)
    if out.returncode != 0:
        sys.exit(f"submit failed: {out.stdout}{out.stderr}")
    job = str(json.loads(out.stdout)["id"])
    plan = json.loads(out.stdout)["plan"]  # the daemon's plan; train_bench runs the same
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if pick(scrape(port), "megatrain_job_step", job=job) >= 3:
                    break
            except (KeyError, OSError):
                pass
            time.sleep(0.5)
        s1, t1 = scrape(port), time.time()
        time.sleep(a.steady_seconds)
        s2, t2 = scrape(port), time.time()
    finally:
        subprocess.run([cli, "cancel", job], env=env, capture_output=True)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(120)
    dt = t2 - t1
    step_time = (pick(s2, "megatrain_step_duration_seconds_sum", job=job) -
                 pick(s1, "megatrain_step_duration_seconds_sum", job=job))

    def delta(name, **labels):
        return pick(s2, name, job=job, **labels) - pick(s1, name, job=job, **labels)

    metrics = {
        "window_seconds": dt,
        "step_seconds_in_window": step_time,
        "pcie_bytes_per_step_second": {d: delta("megatrain_pcie_bytes_total", direction=d) / step_time
                                       for d in ("h2d", "d2h")},
        "busy_fraction_of_step_time": {
            s: delta("megatrain_stream_busy_seconds_total", stream=s) / step_time
            for s in ("compute", "h2d", "d2h", "optimizer")},
        "steps": pick(s2, "megatrain_steps_total", job=job) - pick(s1, "megatrain_steps_total", job=job),
        "pcie_bytes_per_second": {
            d: (pick(s2, "megatrain_pcie_bytes_total", job=job, direction=d) -
                pick(s1, "megatrain_pcie_bytes_total", job=job, direction=d)) / dt
            for d in ("h2d", "d2h")},
        "busy_fraction_of_wall": {
            s: (pick(s2, "megatrain_stream_busy_seconds_total", job=job, stream=s) -
                pick(s1, "megatrain_stream_busy_seconds_total", job=job, stream=s)) / dt
            for s in ("compute", "h2d", "d2h", "optimizer")},
        "tokens_per_second": (pick(s2, "megatrain_tokens_total", job=job) -
                              pick(s1, "megatrain_tokens_total", job=job)) / dt,
    }
    bench = subprocess.run(
        [os.path.join(a.bin_dir, "train_bench"), "--backend", "cuda", "--shape", "qwen2.5-7b",
         "--layers", str(a.layers), "--seq", str(a.seq),
         "--tokens-per-step", str(a.rows * a.micro_batches * a.seq),
         "--micro-batch-rows", str(plan["micro_batch_rows"]),
         "--k", str(plan["checkpoint_every"]),
         "--checkpoints", "host" if plan["checkpoints_on_host"] else "device",
         "--kept-layers", str(plan["kept_layers"]), "--weight-slots", str(plan["weight_slots"]),
         "--steps", str(a.bench_steps), "--max-grad-norm", "1.0"],
        capture_output=True, text=True)
    if bench.returncode != 0:
        sys.exit(f"train_bench failed: {bench.stderr}")
    out_b = json.loads(bench.stdout)
    b = {"pcie_bytes_per_second": {d: out_b["pcie_bytes_per_step"][d] / out_b["step_seconds"]
                                   for d in ("h2d", "d2h")},
         "busy_fraction_of_wall": out_b["busy_fraction"], "plan": out_b["plan"]}
    b_tokens = out_b["tokens_per_second"]
    diffs = {}
    for d in ("h2d", "d2h"):
        diffs[f"pcie_{d}"] = metrics["pcie_bytes_per_step_second"][d] / b["pcie_bytes_per_second"][d] - 1
    for s in ("compute", "h2d", "d2h", "optimizer"):
        diffs[f"busy_{s}"] = (metrics["busy_fraction_of_step_time"][s] /
                              b["busy_fraction_of_wall"][s] - 1)
    wall = {f"pcie_{d}": metrics["pcie_bytes_per_second"][d] / b["pcie_bytes_per_second"][d] - 1
            for d in ("h2d", "d2h")}
    wall.update({f"busy_{s}": metrics["busy_fraction_of_wall"][s] / b["busy_fraction_of_wall"][s] - 1
                 for s in ("compute", "h2d", "d2h", "optimizer")})
    diffs["tokens_per_second"] = metrics["tokens_per_second"] / b_tokens - 1
    worst = max(abs(v) for v in diffs.values())
    print(json.dumps({"benchmark": "metrics_vs_bench", "metrics": metrics, "train_bench": b,
                      "train_bench_tokens_per_second": b_tokens, "relative_difference": diffs,
                      "relative_difference_wall_clock_rates": wall,
                      "worst_abs_relative_difference": worst, "within_10_percent": worst <= 0.10},
                     indent=2))


if __name__ == "__main__":
    main()
