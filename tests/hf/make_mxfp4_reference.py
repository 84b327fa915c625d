#!/usr/bin/env python3
"""Writes tests/engine/model/data/mxfp4_transformers.safetensors: random MXFP4 blocks under
every one of the 256 scales (w_blocks (2, 8, 16, 16) u8, w_scales (2, 8, 16) u8, each scale
once) and transformers' dequantization of them ("expected", bf16 (2, 512, 8)), computed by
transformers' own convert_moe_packed_tensors on the CPU. Also reports whether the GPU
gives the same bits. Usage: make_mxfp4_reference.py OUT_DIR
"""
import os
import sys

import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

out_dir = sys.argv[1]
gen = torch.Generator().manual_seed(2026)
blocks = torch.randint(0, 256, (2, 8, 16, 16), dtype=torch.uint8, generator=gen)
scales = torch.randperm(256, generator=gen).to(torch.uint8).reshape(2, 8, 16)
expected = convert_moe_packed_tensors(blocks.clone(), scales.clone())
print("expected", tuple(expected.shape), expected.dtype)
if torch.cuda.is_available():
    on_gpu = convert_moe_packed_tensors(blocks.cuda(), scales.cuda()).cpu()
    same = torch.equal(on_gpu.view(torch.int16), expected.view(torch.int16))
    diff = (on_gpu.view(torch.int16) != expected.view(torch.int16)).sum().item()
    print("gpu dequantization bit-equal to cpu:", same, "differing elements:", diff)
os.makedirs(out_dir, exist_ok=True)
save_file({"w_blocks": blocks, "w_scales": scales, "expected": expected.contiguous()},
          os.path.join(out_dir, "mxfp4_transformers.safetensors"))
