#!/usr/bin/env python3
"""Several GPUs under one megatraind: one lane per GPU, jobs of two users side by side,
then (two GPUs or more) one job on all of them at once (train.devices: a gang of lanes).

Starts megatraind (--device auto: a lane per GPU) as root, creates a local user for the
run, and submits the same job three ways:
  1. alone (one job, one GPU busy): the reference throughput;
  2. one job per GPU at once, alternately root's and the user's;
and reports, as JSON on stdout: each job's device, start and end, steady tokens/s (the
median step after the first two), whether the jobs overlapped in time, who owns the
files each wrote, and the slowdown of running side by side (they share the host's
cores, memory bandwidth and PCIe root).

  bench/lanes.py --bin BUNDLE/bin [--layers 16] [--hidden 2048] [--steps 30]

Needs root and at least one GPU. Not a test: `bench/run.sh lanes` keeps
its latest result.
"""

import argparse
import json
import os
import pwd
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

USER = "mtlanes"


def sh(*cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=65536)
    a = ap.parse_args()
    megatraind = os.path.join(a.bin, "megatraind")
    megatrain = os.path.join(a.bin, "megatrain")

    root = tempfile.mkdtemp(prefix="lanes-")
    os.chmod(root, 0o755)
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        sh("useradd", "--no-create-home", "--home-dir", os.path.join(root, "home"), USER)
    pw = pwd.getpwnam(USER)
    home = os.path.join(root, "home")
    os.makedirs(home)
    os.chown(home, pw.pw_uid, pw.pw_gid)
    os.chmod(home, 0o700)
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog alpha beta gamma delta".split()
    for folder, owner in ((root, None), (home, pw)):
        path = os.path.join(folder, "data.jsonl")
        with open(path, "w") as f:
            for _ in range(4000):
                f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(400))}) + "\n")
        if owner:
            os.chown(path, owner.pw_uid, owner.pw_gid)

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": a.hidden,
              "intermediate_size": a.hidden * 11 // 4, "num_hidden_layers": a.layers,
              "num_attention_heads": a.hidden // 128, "num_key_value_heads": a.hidden // 512,
              "vocab_size": 258, "tie_word_embeddings": False}

    def spec(name, folder):
        return (f"name: {name}\nmodel: {{config: {json.dumps(config)}}}\n"
                f"data: {{path: {folder}/data.jsonl, tokenizer: byte, seq_len: 4096}}\n"
                f"train: {{steps: {a.steps}, tokens_per_step: {a.tokens}, lr: 1.0e-4, "
                f"warmup_steps: 2}}\n")

    sock = os.path.join(root, "sock")
    log = open(os.path.join(root, "megatraind.log"), "w")
    daemon = subprocess.Popen([megatraind, "--listen", "unix:" + sock, "--state-dir",
                               os.path.join(root, "state"), "--metrics-listen", ""],
                              stdout=log, stderr=subprocess.STDOUT)
    env = dict(os.environ, MEGATRAIN_ADDR="unix:" + sock)

    def cli(*args, user=None):
        kw = {}
        if user:
            kw = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [],
                  "cwd": user.pw_dir}
        r = subprocess.run([megatrain, "-o", "json", *args], capture_output=True, text=True,
                           env=env, **kw)
        if r.returncode != 0:
            raise RuntimeError(f"megatrain {args}: {r.stderr}")
        return r.stdout

    for _ in range(600):
        try:
            node = json.loads(cli("node"))
            break
        except RuntimeError:
            time.sleep(0.5)
    gpus = len(node.get("gpus", []))

    def submit(name, user):
        folder = home if user else root
        path = os.path.join(folder, name + ".yaml")
        with open(path, "w") as f:
            f.write(spec(name, folder))
        if user:
            os.chown(path, user.pw_uid, user.pw_gid)
        return int(json.loads(cli("submit", path, user=user))["id"])

    def finish(ids):
        out = []
        for i in ids:
            steps = []
            while True:
                job = json.loads(cli("status", str(i)))
                if job["state"] in ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED",
                                    "JOB_STATE_CANCELLED"):
                    break
                time.sleep(1)
            for line in cli("logs", str(i)).splitlines():
                t = json.loads(line)["text"]
                if t.startswith("step ") and " tok/s" in t:
                    steps.append(float(t.split()[-2]))
            ck = job.get("last_checkpoint", "")
            owner = pwd.getpwuid(os.stat(os.path.join(ck, "model.safetensors")).st_uid).pw_name \
                if ck and os.path.exists(os.path.join(ck, "model.safetensors")) else None
            out.append({"id": i, "owner": job["owner"], "state": job["state"],
                        "device": job["device"], "error": job.get("error", ""),
                        "started_ms": int(job["started_unix_ms"]),
                        "finished_ms": int(job["finished_unix_ms"]),
                        "logged_tokens_per_second": steps,
                        "tokens_per_second": float(job["progress"]["tokens_per_second"]),
                        "checkpoint_owner": owner})
        return out

    result = {"gpus": gpus, "model": config, "tokens_per_step": a.tokens, "steps": a.steps}
    alone = finish([submit("alone", None)])
    result["alone"] = alone
    ids = [submit(f"side{g}", pw if g % 2 else None) for g in range(max(gpus, 1))]
    side = finish(ids)
    result["side_by_side"] = side
    starts = [j["started_ms"] for j in side]
    ends = [j["finished_ms"] for j in side]
    result["overlap_seconds"] = max(0, (min(ends) - max(starts)) / 1000)
    result["devices_used"] = sorted({j["device"] for j in side})
    ref = alone[0]["tokens_per_second"]
    result["side_by_side_vs_alone"] = [j["tokens_per_second"] / ref if ref else None for j in side]
    if gpus >= 2:
        # One job on every GPU at once (a gang of lanes, data parallel), the user's.
        plain_spec = spec
        def gang_spec(name, folder):
            return plain_spec(name, folder).replace("warmup_steps: 2}",
                                                     f"warmup_steps: 2, devices: {gpus}}}")
        spec = gang_spec
        gang = finish([submit("gang", pw)])
        result["gang"] = gang
        result["gang_vs_alone"] = gang[0]["tokens_per_second"] / ref if ref else None
        result["gang_log"] = [json.loads(l)["text"] for l in cli("logs", str(gang[0]["id"])).splitlines()
                              if json.loads(l)["text"].startswith(("running on", "plan: devices",
                                                                   "plan: reduce"))]
    daemon.terminate()
    daemon.wait(timeout=120)
    log.close()
    with open(os.path.join(root, "megatraind.log")) as f:
        result["daemon_log_tail"] = f.read()[-3000:]
    json.dump(result, sys.stdout, indent=1)
    print()
    subprocess.run(["userdel", USER], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
