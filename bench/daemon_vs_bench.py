#!/usr/bin/env python3
"""A job's step through megatraind (in its worker process) against train_bench's step of the
same shape and plan, one after the other on the same box, and what the worker process adds
to a job's start.

  for each round: train_bench (the daemon's plan, --steps N), then megatraind running the
  same shape as a job of N steps; the steady step time of each is the median of its steps
  after the first two. The worker's start is read from the job's log: "worker ready in X s:
  the trainer's setup Y s, the process Z s" (Z: fork, exec, the channel, the replies).

Usage: daemon_vs_bench.py BIN_DIR [--rounds 2] [--steps 8] [--layers 28] [--seq 4096]
                          [--tokens-per-step 65536]
Prints one JSON object. Standard library only; run on the GPU box (deploy/bundle.sh's bin/).
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile

from daemon_jobs import start_daemon, write_qwen25_7b_job, write_word_dataset


def steady(seconds):
    return statistics.median(seconds[2:] if len(seconds) > 3 else seconds)


def run_daemon_job(a, tmp, cli, env, spec_path):
    """Submits the job, reads a.steps steps' progress from `watch`, then cancels it (a 7B
    checkpoint would not fit the box's disk). Its plan, step seconds and worker start."""
    out = subprocess.run([cli, "-o", "json", "submit", spec_path], env=env, capture_output=True,
                         text=True, cwd=tmp)
    if out.returncode != 0:
        sys.exit(f"submit failed: {out.stdout}{out.stderr}")
    job = json.loads(out.stdout)
    watch = subprocess.Popen([cli, "-o", "json", "watch", str(job["id"])], env=env,
                             stdout=subprocess.PIPE, text=True)
    seconds = []
    for line in watch.stdout:
        progress = json.loads(line).get("progress")
        if progress and ("stepSeconds" in progress or "step_seconds" in progress):
            seconds.append(float(progress.get("stepSeconds", progress.get("step_seconds"))))
            if len(seconds) >= a.steps:
                break
    subprocess.run([cli, "cancel", str(job["id"])], env=env, capture_output=True)
    watch.kill()
    watch.wait()
    logs = subprocess.run([cli, "-o", "json", "logs", str(job["id"])], env=env,
                          capture_output=True, text=True).stdout
    start = {}
    for line in logs.splitlines():
        text = json.loads(line)["text"]
        m = re.match(r"worker ready in ([\d.]+) s: the trainer's setup ([\d.]+) s, the process "
                     r"([-\d.]+) s", text)
        if m:
            start = {"ready_seconds": float(m.group(1)), "trainer_setup_seconds": float(m.group(2)),
                     "process_seconds": float(m.group(3))}
    if len(seconds) < a.steps:
        sys.exit(f"job ended after {len(seconds)} steps:\n{logs[-3000:]}")
    return job["plan"], seconds, start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin_dir")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    a = ap.parse_args()
    a.bin_dir = os.path.abspath(a.bin_dir)
    tmp = tempfile.mkdtemp(prefix="daemon-vs-bench-")
    write_word_dataset(os.path.join(tmp, "data.jsonl"), 64 + a.steps * a.tokens_per_step // a.seq,
                       2 * a.seq)
    spec_path = write_qwen25_7b_job(
        tmp, "daemon-vs-bench", a.layers, a.seq,
        f"steps: 100000, tokens_per_step: {a.tokens_per_step}, lr: 1.0e-5, max_grad_norm: 0")
    daemon, env, cli = start_daemon(a.bin_dir, tmp)
    rounds = []
    plan = None
    try:
        for _ in range(a.rounds):
            if plan is None:  # the daemon's plan, which train_bench then runs
                planned = subprocess.run([cli, "-o", "json", "plan", spec_path], env=env,
                                         capture_output=True, text=True, cwd=tmp)
                if planned.returncode != 0:
                    sys.exit(f"plan failed: {planned.stdout}{planned.stderr}")
                plan = json.loads(planned.stdout)
            bench = subprocess.run(
                [os.path.join(a.bin_dir, "train_bench"), "--backend", "cuda", "--shape",
                 "qwen2.5-7b", "--layers", str(a.layers), "--seq", str(a.seq),
                 "--tokens-per-step", str(a.tokens_per_step),
                 "--micro-batch-rows", str(plan["micro_batch_rows"]),
                 "--k", str(plan["checkpoint_every"]),
                 "--checkpoints", "host" if plan.get("checkpoints_on_host") else "device",
                 "--kept-layers", str(plan.get("kept_layers", 0)),
                 "--weight-slots", str(plan["weight_slots"]), "--steps", str(a.steps),
                 "--max-grad-norm", "0"],
                capture_output=True, text=True)
            if bench.returncode != 0:
                sys.exit(f"train_bench failed: {bench.stderr[-3000:]}")
            b = json.loads(bench.stdout)
            _, seconds, start = run_daemon_job(a, tmp, cli, env, spec_path)
            d = steady(seconds)
            rounds.append({"train_bench_step_seconds": b["step_seconds"],
                           "daemon_step_seconds": d, "daemon_steps": seconds,
                           "daemon_over_bench": d / b["step_seconds"], "worker_start": start})
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(300)
    print(json.dumps({
        "benchmark": "daemon_vs_bench", "shape": "qwen2.5-7b", "layers": a.layers,
        "seq": a.seq, "tokens_per_step": a.tokens_per_step, "plan": plan, "rounds": rounds,
        "worst_daemon_over_bench": max(r["daemon_over_bench"] for r in rounds),
        "worst_worker_process_seconds": max(r["worker_start"].get("process_seconds", 0)
                                            for r in rounds)}, indent=2))


if __name__ == "__main__":
    main()
