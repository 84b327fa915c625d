#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/). Rerun after
changing it; the files are committed."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode("utf-8"))


def safetensors(tensors, metadata=None):
    header, blobs, offset = {}, b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs += raw
        offset += len(raw)
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + blobs


put("safetensors", "one_bf16", safetensors({"w": ("BF16", [2, 2], b"\x80\x3f" * 4)}))
put("safetensors", "mixed", safetensors({
    "a": ("F32", [3], struct.pack("<3f", 1, 2, 3)), "b": ("I32", [1], struct.pack("<i", 7)),
    "c": ("F16", [2], b"\x00\x3c\x00\x40"), "s": ("F32", [], struct.pack("<f", 0.5))},
    {"format": "pt"}))
put("safetensors", "empty", safetensors({}))
put("safetensors", "truncated", safetensors({"w": ("F32", [4], b"\x00" * 16)})[:-5])

common = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
          "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}
configs = {
    "llama": dict(common, architectures=["LlamaForCausalLM"], tie_word_embeddings=True),
    "llama3": dict(common, architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 256}),
    "qwen2": dict(common, architectures=["Qwen2ForCausalLM"], rope_theta=1e6,
                  use_sliding_window=False, sliding_window=4096),
    "qwen3": dict(common, architectures=["Qwen3ForCausalLM"], head_dim=32),
    "mistral": dict(common, architectures=["MistralForCausalLM"], sliding_window=None),
}
for name, c in configs.items():
    put("model_config", name, json.dumps(c, indent=1))

put("job_spec", "minimal", "model:\n  config: {architectures: [LlamaForCausalLM], hidden_size: 32,"
    " intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,"
    " num_key_value_heads: 2, vocab_size: 300}\ndata:\n  path: train.jsonl\n")
put("job_spec", "dpo", "model:\n  config: {architectures: [LlamaForCausalLM], hidden_size: 32,"
    " intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,"
    " num_key_value_heads: 2, vocab_size: 300}\ndata:\n  path: pairs.jsonl\n"
    "dpo: {beta: 0.1, loss: ipo, rpo_alpha: 0.5, max_length: 128, truncation: keep_end}\n")
put("job_spec", "full", """name: my-run
model:
  path: /models/Llama-3.1-8B
data:
  path: data.jsonl
  format: messages
  tokenizer: model
  chat_template: auto
  packing: pad
  truncation: truncate
  on_bad_line: skip
  seq_len: 2048
  seed: 3
train:
  steps: 1000
  micro_batch_rows: 4
  micro_batches: 8
  lr: 2.0e-5
  schedule: cosine
  warmup_steps: 50
  min_lr_ratio: 0.1
  weight_decay: 0.01
  max_grad_norm: 1.0
  activation_checkpoint_every: 2
  loss_chunk_tokens: 4096
checkpoint:
  dir: runs/my-run
  every_steps: 100
  keep_last: 3
backend: cuda
device_memory_cap_bytes: 25769803776
""")

byte_level = {
    "normalizer": {"type": "NFC"},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": " ?\\p{L}+| ?\\p{N}+|\\s+(?!\\S)|\\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False,
              "byte_fallback": False, "ignore_merges": False,
              "vocab": {"a": 0, "b": 1, "c": 2, "\u0120": 3, "ab": 4, "abc": 5, "\u0120a": 6},
              "merges": ["a b", ["ab", "c"], "\u0120 a"]},
    "decoder": {"type": "ByteLevel"},
    "added_tokens": [{"id": 7, "content": "<eos>", "special": True, "normalized": False,
                      "lstrip": False, "rstrip": False, "single_word": False}]}
metaspace = {
    "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
    "pre_tokenizer": None,
    "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "fuse_unk": True,
              "byte_fallback": True,
              "vocab": {"<unk>": 0, "\u2581": 1, "a": 2, "b": 3, "\u2581a": 4, "\u2581b": 5,
                        "<0x21>": 6},
              "merges": ["\u2581 a", "\u2581 b"]},
    "decoder": {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "added_tokens": []}
put("tokenizer_json", "byte_level", json.dumps(byte_level, ensure_ascii=False, indent=1))
put("tokenizer_json", "metaspace", json.dumps(metaspace, ensure_ascii=False, indent=1))

lines = [
    (0, {"text": "Hello, world. \u4f60\u597d \U0001f44d"}),
    (1, {"instruction": "Add", "input": "2+2", "output": "4"}),
    (6, {"instruction": "Name a colour.", "output": "Blue."}),
    (2, {"conversations": [{"from": "system", "value": "Be brief."},
                           {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}),
    (12, {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                            {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]}),
    (3, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}),
    (18, {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": " spaced \n"}]}),
    (23, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}),
    (4, {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}),
]
for i, (pick, doc) in enumerate(lines):
    put("dataset_line", f"line{i}", bytes([pick]) + json.dumps(doc, ensure_ascii=False).encode())
