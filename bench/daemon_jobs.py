"""What the benchmarks that drive megatraind share: a random-word dataset, Qwen2.5-7B's
shape as an inline config, a job spec of that shape on the dataset, and a daemon started on
a Unix socket in a scratch folder. Standard library only."""
import json
import os
import random
import subprocess
import time


def write_word_dataset(path, docs, words_per_doc):
    """JSONL of `docs` documents of random common words (byte tokenizer: every id < 258
    fits any vocab)."""
    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from his an were are".split()
    with open(path, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(words_per_doc))})
                    + "\n")


def qwen25_7b_config(layers):
    """Qwen2.5-7B's shape (train_bench --shape qwen2.5-7b), `layers` deep."""
    return {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": layers,
            "num_attention_heads": 28, "num_key_value_heads": 4,
            "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
            "tie_word_embeddings": False}


def write_qwen25_7b_job(tmp, name, layers, seq, train):
    """Writes tmp/job.yaml, a CUDA job `name` training Qwen2.5-7B's shape `layers` deep on
    tmp/data.jsonl (byte tokenizer, `seq` tokens a row) with `train`, the train section's
    entries as YAML flow text; returns its path."""
    path = os.path.join(tmp, "job.yaml")
    with open(path, "w") as f:
        f.write(f"name: {name}\nmodel:\n  config: {json.dumps(qwen25_7b_config(layers))}\n"
                f"data: {{path: data.jsonl, tokenizer: byte, seq_len: {seq}}}\n"
                f"train: {{{train}}}\nbackend: cuda\n")
    return path


def start_daemon(bin_dir, tmp, metrics_listen=""):
    """Starts megatraind with its state in tmp; returns (process, env with MEGATRAIN_ADDR,
    the CLI's path) once `megatrain node` answers."""
    sock = os.path.join(tmp, "sock")
    log = open(os.path.join(tmp, "megatraind.log"), "wb")
    daemon = subprocess.Popen([os.path.join(bin_dir, "megatraind"), "--listen", "unix:" + sock,
                               "--state-dir", os.path.join(tmp, "state"),
                               "--metrics-listen", metrics_listen],
                              stdout=log, stderr=subprocess.STDOUT)
    env = dict(os.environ, MEGATRAIN_ADDR="unix:" + sock)
    cli = os.path.join(bin_dir, "megatrain")
    for _ in range(1200):
        if subprocess.run([cli, "node"], env=env, capture_output=True).returncode == 0:
            break
        time.sleep(0.1)
    return daemon, env, cli
