#!/usr/bin/env python3
"""LoRA and frozen tensors on the CUDA backend against peft + transformers (fp32), on
4-layer models of full width:
  qwen2      Qwen2.5-7B's width: hidden 3584, intermediate 18944, 28 heads, 4 KV heads
  llama3     Llama-3.1-8B's: hidden 4096, intermediate 14336, 32 heads, 8 KV heads, llama3 RoPE
  qwen3_moe  Qwen3-30B-A3B's: hidden 2048, 32 heads, 4 KV heads, head_dim 128, 128 experts
             top-8, moe_intermediate 768 (router aux coef 0.001)
  gpt_oss    GPT-OSS-20B's: hidden 2880, 64 heads of 64, 8 KV heads, 32 experts top-4,
             sinks, windows of 128 on alternate layers, YaRN, biases (router aux coef 0.9)
every vocabulary cut to 16384, the MoE ones with their load-balancing loss
(output_router_logits). No expert count is shrunk: the largest, GPT-OSS, is 3.4 B
parameters (13.5 GB in fp32), frozen under LoRA, well inside an H200's 140 GB.

Cases (rank 16, alpha 32, adapters drawn by our engine, B zero):
  dense families: LoRA on all seven projections, and on [q_proj, v_proj];
  MoE families:   LoRA on the attention, [q_proj, k_proj, v_proj, o_proj]; on the attention
                  and the experts (+ experts.gate_up_proj, experts.down_proj: PEFT's
                  target_parameters, a ParamWrapper per parameter, the down_proj one
                  wrapped around the gate_up_proj one, whose adapter is then
                  "...mlp.experts.base_layer.lora_A.weight"); and on experts.down_proj
                  alone (its adapter un-nested, "...mlp.experts.lora_A.weight");
  qwen2 also:     a full fine-tune with the embedding frozen (--freeze embed_tokens)
                  against transformers with embed_tokens.weight.requires_grad_(False).

For each family transformers creates the model (torch.manual_seed(0)), rounds its weights
to bf16 values and saves them. For each case gpu_reference (our engine, CUDA backend) runs
with the LoRA options and writes its initial adapter as a PEFT folder (OUT/adapter-0), one
step's loss and adapter gradients, a 50-step AdamW curve, the trained adapter (a PEFT
folder, OUT/checkpoint-50) and the logits of its forward. peft loads OUT/adapter-0 over
the base (PeftModel.from_pretrained(model, path, is_trainable=True), fp32, and the same
model under bf16 autocast as the yardstick) and the script checks:
  - before peft loads a folder: that its adapter_config.json's target_modules /
    target_parameters are the case's, and that its adapter_model.safetensors holds exactly
    the tensors (names and shapes) peft creates from that config on this model (built on
    the meta device); PeftModel.from_pretrained only warns about missing keys, leaving
    those adapters at peft's own draws, so a mismatch of the tensors ends the case with
    both lists of names (the layer numbers as N). After loading: peft holds the folder's
    values (get_peft_model_state_dict), every adapter tensor, the experts' included, is
    trainable, and nothing else is;
  - step 1: our loss within 1e-4 relative of peft fp32's (MoE: LM loss + coef * aux);
    every adapter gradient, the experts' included, rel L2 <= 3% (MoE: <= 1.5 x
    transformers' own bf16-autocast-vs-fp32 error of that tensor + 0.01, the larger of
    its eager and its sdpa attention's where both run). B is zero at
    step 1, so A's gradient is exactly zero on both sides: the same check is repeated at
    the trained adapter (our --lora-adapter OUT/checkpoint-50 --steps 0 against peft
    loading that folder), where both A and B have gradients;
  - 50 AdamW steps (torch.optim.AdamW on every trainable tensor of the PeftModel, i.e. the
    adapters, the experts' included; same lr, warmup, decay on the matrices, clipping):
    with d(t) = |L - L_fp32| / L_fp32, mean d_ours <= 1.5 x mean d_bf16_autocast + 0.005,
    and the mean of our last 10 losses within 2% of fp32's;
  - our trained adapter folder, loaded by peft over the base, gives our logits (rel L2
    <= 1%).
Every gradient check also runs a second bf16 yardstick: the same model under bf16 autocast
with its attention switched to attn_implementation="sdpa" (PyTorch's flash kernel, else its
memory-efficient one; none for GPT-OSS, whose sinks sdpa lacks), a flash-style bf16
attention like ours where the eager one keeps the softmax and its backward in fp32, to tell
what bf16 attention itself costs from a fault of ours; and reports the eager yardstick's
loss error (bf16_autocast_loss_rel_err) beside ours.
The full fine-tune checks the step-1 loss and every trainable gradient (the embedding has
none on either side), the curve, the logits of our checkpoint in transformers, and that
its embedding is the base's bit for bit.

Data: the text set of compare_gpu_with_transformers.py (50 batches of 8 x 512 tokens from
a bigram chain over 256 ids). Learning rates: MEGATRAIN_LORA_LR (default 1e-3) for the
adapters, MEGATRAIN_FULL_LR (default 1e-4: the full-width model is wider than that
script's) for the full fine-tune; warmup 10, weight decay 0.01, clipping 1.0.

One JSON line per case goes to tests/hf/results/cuda-lora.jsonl (a case run again replaces
its line; a LoRA case's carries every adapter gradient's rel errors [ours, eager bf16, sdpa
bf16] in grad_errors and trained_adapter_grad_errors); a summary is printed; the exit status
is 1 when any check fails. Each family's work folder (its model, our outputs) is deleted
once its cases are done (MEGATRAIN_CMP_KEEP=1 keeps them).

Usage: compare_lora_with_peft.py GPU_REFERENCE_BIN WORKDIR [FAMILIES...]
  FAMILIES: any of qwen2 llama3 qwen3_moe gpt_oss (default: all).
"""
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import traceback

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402
from hf_models import free_gpu, is_moe  # noqa: E402
from compare_gpu_with_transformers import (  # noqa: E402
    STEPS, WARMUP, WD, CLIP, make_batches, make_bf16_exact, rel)

RANK, ALPHA = 16, 32
LORA_LR = float(os.environ.get("MEGATRAIN_LORA_LR", "1e-3"))
FULL_LR = float(os.environ.get("MEGATRAIN_FULL_LR", "1e-4"))
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]  # PEFT target_parameters "mlp." + these
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cuda-lora.jsonl")


def cases(family, config):
    """(case name, LoRA targets or None, freeze patterns) of a family."""
    if is_moe(config):
        return [("lora-attn", ATTN, []), ("lora-attn-experts", ATTN + EXPERTS, []),
                ("lora-experts-down", ["experts.down_proj"], [])]
    out = [("lora-all", ALL_PROJ, []), ("lora-q_v", ["q_proj", "v_proj"], [])]
    if family == "qwen2":
        out.append(("full-freeze-embed_tokens", None, ["embed_tokens"]))
    return out


def make_model(config, path):
    """The family's base: drawn by transformers, every weight a bf16 value, saved in bf16."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    make_bf16_exact(model, config)
    model.to(torch.bfloat16)  # exact: halves the disk; both sides read these values
    model.save_pretrained(path, safe_serialization=True)
    del model
    free_gpu()


def load_base(path, config):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").cuda()
    if is_moe(config) and hasattr(model, "set_experts_implementation"):
        # The loop over experts with F.linear: bf16 under autocast, as our experts are (a
        # grouped-GEMM backend may keep fp32 there, which would flatter the yardstick).
        model.set_experts_implementation("eager")
    model.train()  # dropout is 0 everywhere; as a model being trained
    return model


def peft_name(n):
    """PEFT's in-memory name as its adapter files (and our grads.safetensors) name it: the
    adapter name dropped ("...lora_A.default.weight" -> "...lora_A.weight"), nothing else
    touched. So the base_layer infix of a nested ParamWrapper's adapter stays, as in the
    files ("...mlp.experts.base_layer.lora_A.default.weight" ->
    "...mlp.experts.base_layer.lora_A.weight": the gate_up_proj adapter inside the down_proj
    wrapper); the other base_layer names PEFT makes are frozen base tensors
    ("...q_proj.base_layer.weight", "...mlp.experts.base_layer.base_layer.gate_up_proj"),
    never trainable, so never in the gradient or adapter maps, and pass unchanged."""
    return re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", n)


def names_brief(names, k=4):
    """A short view of a set of tensor names for a problem line: the count, and the first k
    distinct patterns with the layer numbers as N."""
    names = list(names)
    patterns = sorted({re.sub(r"\.layers\.\d+\.", ".layers.N.", n) for n in names})
    return f"{len(names)} {patterns[:k]}" + (" ..." if len(patterns) > k else "")


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def step_grads(model, ids, bf16):
    """Loss, aux loss and the trainable tensors' gradients (f32, by saved name) of one
    forward and backward on `ids`."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {peft_name(n): (p.grad.detach().float().clone() if p.grad is not None
                            else torch.zeros_like(p, dtype=torch.float32))
             for n, p in trainable(model)}
    aux = getattr(out, "aux_loss", None)
    model.zero_grad(set_to_none=True)
    return out.loss.item(), (aux.item() if aux is not None else None), grads


def set_attention(model, implementation):
    """Switches the transformers model (under peft, or bare) to another attention
    implementation in place (transformers 5's set_attn_implementation; the attention layers
    and the mask read config._attn_implementation at each forward). Raises where the model
    has no such implementation (GPT-OSS has no sdpa) or transformers left it unchanged (it
    only warns when a model cannot switch)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    base.set_attn_implementation(implementation)
    if base.config._attn_implementation != implementation:
        raise RuntimeError(f"attention implementation is {base.config._attn_implementation!r} "
                           f"after set_attn_implementation({implementation!r})")


def sdpa_step_grads(model, ids):
    """The second bf16 yardstick: step_grads under bf16 autocast with the model's attention
    switched to sdpa, PyTorch's flash backend forced (a flash-style bf16 attention, as ours
    is), the memory-efficient one where flash refuses (a mask); eager again afterwards.
    (gradients, the backend used), or (None, why not): reported, never checked."""
    try:
        set_attention(model, "sdpa")
    except Exception as e:
        return None, f"unavailable: {type(e).__name__}: {str(e)[:160]}"
    try:
        why = []
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    return step_grads(model, ids, bf16=True)[2], name
            except RuntimeError as e:  # no kernel of that backend for these inputs
                why.append(f"{name}: {str(e)[:100]}")
                model.zero_grad(set_to_none=True)
                free_gpu()
        return None, "failed: " + "; ".join(why)
    finally:
        set_attention(model, "eager")


def short_name(n):
    return n.removeprefix("base_model.model.model.")


def digits(x):
    """x to 4 significant digits (None stays None), for the per-tensor dumps."""
    return None if x is None else float(f"{x:.4g}")


def compare_grads(ours, ref32, ref_bf16, moe, ref_sdpa=None, sdpa_note=None):
    """Every gradient against fp32: rel L2 <= 3%, or (MoE) <= 1.5 x transformers' own bf16
    error + 0.01, its own error being the larger of the eager and the sdpa autocast runs'
    (ref_sdpa; None where it did not run, sdpa_note saying why or which backend). Returns the summary, the problems
    and each tensor's [ours, eager bf16, sdpa bf16] errors by short name (model order)."""
    problems = []
    if set(ours) != set(ref32):
        problems.append(f"gradient names differ: only ours {names_brief(set(ours) - set(ref32))}, "
                        f"only the reference's {names_brief(set(ref32) - set(ours))}")
    rows = []
    for n, g in ref32.items():
        if n not in ours:
            continue
        err = rel(ours[n].cuda(), g)
        bf16_err = rel(ref_bf16[n], g)
        sdpa_err = rel(ref_sdpa[n], g) if ref_sdpa is not None and n in ref_sdpa else None
        bound = 1.5 * max(bf16_err, sdpa_err or 0.0) + 0.01 if moe else 0.03
        rows.append((n, err, bf16_err, bound, sdpa_err))
        if not err <= bound:  # NaN fails too
            problems.append(f"gradient of {n}: rel err {err:.3e} > {bound:.3e} "
                            f"(bf16 autocast {bf16_err:.3e}, sdpa {sdpa_err})")
    errors = {short_name(n): [digits(e), digits(b), digits(s)] for n, e, b, _, s in rows}
    rows.sort(key=lambda r: -r[1] / r[3])
    errs = sorted(r[1] for r in rows)
    summary = {"count": len(rows), "max": errs[-1] if errs else None,
               "median": errs[len(errs) // 2] if errs else None,
               "max_lora_A": max([r[1] for r in rows if ".lora_A." in r[0]], default=None),
               "max_lora_B": max([r[1] for r in rows if ".lora_B." in r[0]], default=None),
               "max_experts": max([r[1] for r in rows if ".mlp.experts." in r[0]], default=None),
               "bf16_autocast_max": max([r[2] for r in rows], default=None),
               "sdpa_bf16_max": max([r[4] for r in rows if r[4] is not None], default=None),
               "sdpa_bf16_attention": sdpa_note,
               "worst": [[n, e, b, bound, s] for n, e, b, bound, s in rows[:3]],
               "ok": not problems}
    return summary, problems, errors


def step_check(model, ids, out, moe, who=None):
    """One step of `model` on ids against ours in `out` (step.json, grads.safetensors): its
    fp32 gradients, with the eager and sdpa bf16 autocast yardsticks beside (compare_grads),
    and, when `who` names the reference, our loss within 1e-4 of its fp32 loss.
    (our step.json, fp32 loss, fp32 aux loss, our loss's rel err, gradient summary,
    per-tensor errors, problems)."""
    loss32, aux32, g32 = step_grads(model, ids, bf16=False)
    loss_bf16, _, g_bf16 = step_grads(model, ids, bf16=True)
    g_sdpa, sdpa_note = sdpa_step_grads(model, ids)
    ours = json.load(open(os.path.join(out, "step.json")))
    loss_err = abs(ours["total"] - loss32) / loss32
    problems = []
    if who is not None and not loss_err <= 1e-4:
        problems.append(f"step loss {ours['total']} vs {who} {loss32}")
    grads, grad_problems, errors = compare_grads(
        load_file(os.path.join(out, "grads.safetensors")), g32, g_bf16, moe, g_sdpa, sdpa_note)
    grads["bf16_autocast_loss_rel_err"] = abs(loss_bf16 - loss32) / loss32  # the yardstick's
    del g32, g_bf16, g_sdpa
    free_gpu()
    return ours, loss32, aux32, loss_err, grads, errors, problems + grad_problems


def lr_at(step, lr):
    return lr * step / WARMUP if step < WARMUP else lr


def train(model, batches, lr, bf16):
    """STEPS AdamW steps on the trainable tensors, as gpu_reference's BATCHES.json says:
    decay on all but biases and norms (HF Trainer's rule), global-norm clipping."""
    named = trainable(model)
    decay = [p for n, p in named if "bias" not in n and "norm" not in n]
    no_decay = [p for n, p in named if "bias" in n or "norm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, foreach=False)
    losses = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr)
        ids = batches[step % len(batches)].cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], CLIP)
        opt.step()
        losses.append(loss.item())
    del opt
    model.zero_grad(set_to_none=True)
    return losses


def curves(model, batches, lr, ours):
    """fp32 and bf16-autocast curves from the model's present state (restored after each),
    and the curve criterion for ours."""
    start = {n: p.detach().clone() for n, p in trainable(model)}

    def restore():
        with torch.no_grad():
            for n, p in trainable(model):
                p.copy_(start[n])
    hf32 = train(model, batches, lr, bf16=False)
    restore()
    hf_bf16 = train(model, batches, lr, bf16=True)
    restore()
    del start
    return hf_models.curve_check(ours, hf32, hf_bf16)


def logits_of(model, ids, vocab):
    with torch.no_grad():
        hf32 = model(input_ids=ids).logits.reshape(-1, vocab).float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hf_bf16 = model(input_ids=ids).logits.reshape(-1, vocab).float()
    return hf32, rel(hf_bf16, hf32)


def run_ours(bin_path, model_dir, batches_json, out, options):
    subprocess.run([bin_path, model_dir, batches_json, out, "--backend", "cuda"] + options,
                   check=True)


def config_targets(targets):
    """What adapter_config.json should name for the case's targets: target_modules (the
    projections) and target_parameters (the experts', "mlp.experts.down_proj")."""
    return ({t for t in targets if not t.startswith("experts.")},
            {"mlp." + t for t in targets if t.startswith("experts.")})


def adapter_config_problems(folder, targets):
    """The targets `folder`'s adapter_config.json names (target_modules, target_parameters)
    against the case's."""
    lora_config = LoraConfig.from_pretrained(folder)
    modules = lora_config.target_modules  # a set, a regex string or None
    modules = {modules} if isinstance(modules, str) else set(modules or [])
    parameters = set(getattr(lora_config, "target_parameters", None) or [])
    want_modules, want_parameters = config_targets(targets)
    if (modules, parameters) == (want_modules, want_parameters):
        return []
    return [f"{folder}/adapter_config.json names target_modules {sorted(modules)}, "
            f"target_parameters {sorted(parameters)}; the case's are "
            f"{sorted(want_modules)}, {sorted(want_parameters)}"]


def adapter_key_problems(config, folder):
    """Before peft loads `folder`: its adapter_model.safetensors against the adapter tensors
    peft creates from its adapter_config.json on this model (names and shapes, as
    get_peft_model_state_dict names them, i.e. as PEFT saves them). The model and peft's
    adapters are built on the meta device (no memory, no draws). PeftModel.from_pretrained
    only warns about the keys it misses (those adapters keep peft's own draws) and ignores
    unexpected ones, so a naming error would otherwise show as a puzzling gradient or curve
    failure. Returns (problems, note): the note says why the check could not run, when it
    could not (loaded_adapter_problems still compares the names after loading)."""
    with safe_open(os.path.join(folder, "adapter_model.safetensors"), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    lora_config = LoraConfig.from_pretrained(folder)
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
            created = get_peft_model(skeleton, lora_config)
            made = {k: tuple(v.shape) for k, v in
                    get_peft_model_state_dict(created, save_embedding_layers=False).items()}
        del skeleton, created
    except Exception as e:  # the check's own failure: say so, and let the load go on
        traceback.print_exc()
        return [], (f"could not build peft's adapter on the meta device: "
                    f"{type(e).__name__}: {str(e)[:200]}")
    gc.collect()
    problems = []
    if set(saved) != set(made):
        problems.append(f"{folder}'s tensors are not those peft creates from its "
                        f"adapter_config.json: only the folder's "
                        f"{names_brief(set(saved) - set(made))}; only peft's "
                        f"{names_brief(set(made) - set(saved))}")
    shapes = [f"{n}: folder {saved[n]}, peft {made[n]}" for n in sorted(set(saved) & set(made))
              if saved[n] != made[n]]
    if shapes:
        problems.append(f"{folder}'s tensors have other shapes than peft's ({len(shapes)}): "
                        + "; ".join(shapes[:3]))
    return problems, None


def loaded_adapter_problems(model, folder):
    """After PeftModel.from_pretrained(..., is_trainable=True): peft holds exactly the
    folder's adapters (names and values, by peft's get_peft_model_state_dict), our
    peft_name maps peft's adapter parameters onto the same names (those our gradients
    carry), and the trainable tensors are exactly those adapters (the experts' included:
    the curves train every trainable tensor)."""
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    problems = []
    if set(saved) != set(state):
        problems.append(f"peft's adapters differ from {folder}'s: only peft's "
                        f"{names_brief(set(state) - set(saved))}, only the folder's "
                        f"{names_brief(set(saved) - set(state))}")
    live = {peft_name(n): p for n, p in model.named_parameters() if ".lora_" in n}
    if set(live) != set(state):
        problems.append(f"peft_name maps peft's adapter parameters to other names than "
                        f"get_peft_model_state_dict's: only peft_name's "
                        f"{names_brief(set(live) - set(state))}, only peft's "
                        f"{names_brief(set(state) - set(live))}")
    frozen = [n for n, p in live.items() if not p.requires_grad]
    if frozen:
        problems.append(f"adapters peft left frozen: {names_brief(frozen)}")
    others = [n for n, _ in trainable(model) if ".lora_" not in n]
    if others:
        problems.append(f"trainable tensors besides the adapters: {names_brief(others)}")
    bad = [n for n, t in saved.items()
           if n in state and not torch.equal(state[n].detach().float().cpu(), t.float())]
    if bad:
        problems.append(f"peft loaded other values than {folder} holds for {names_brief(bad)}")
    return problems


def load_adapter(model_dir, config, folder, targets):
    """peft over a fresh base with `folder`'s adapter (trainable, in train mode), after the
    checks of its config and its tensors' names; (the model, or None when the folder's
    tensors are not those peft makes, the problems, the key check's note)."""
    problems = adapter_config_problems(folder, targets)
    key_problems, note = adapter_key_problems(config, folder)
    if key_problems:
        return None, problems + key_problems, note
    model = PeftModel.from_pretrained(load_base(model_dir, config), folder, is_trainable=True)
    model.train()
    return model, problems + loaded_adapter_problems(model, folder), note


def lora_case(bin_path, d, config, batches, targets):
    out = os.path.join(d, "ours-" + "_".join(targets))
    trained_out = out + "-trained"
    lora_opts = ["--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
                 "--lora-targets", ",".join(targets)]
    model_dir, batches_json = os.path.join(d, "model"), os.path.join(d, "batches-lora.json")
    run_ours(bin_path, model_dir, batches_json, out, lora_opts + ["--steps", str(STEPS)])
    ck = os.path.join(out, f"checkpoint-{STEPS}")
    run_ours(bin_path, model_dir, batches_json, trained_out,
             lora_opts + ["--steps", "0", "--lora-adapter", ck])
    moe, vocab = is_moe(config), config.vocab_size
    ids = batches[0].cuda()
    body = {"targets": targets, "rank": RANK, "alpha": ALPHA, "lr": LORA_LR}

    # Step 1 from our initial adapter.
    model, problems, note = load_adapter(model_dir, config, os.path.join(out, "adapter-0"),
                                         targets)
    body["adapter_key_check"] = note or ("ok" if model is not None else "mismatch")
    if model is None:  # the names are wrong: nothing below would mean anything
        return body, problems
    ours, loss32, aux32, loss_err, grads, grad_errors, step_problems = step_check(
        model, ids, out, moe, "peft")
    problems += step_problems

    # 50 AdamW steps from the same adapter.
    our_losses = json.load(open(os.path.join(out, "curve.json")))["losses"]
    curve, curve_problems = curves(model, batches, LORA_LR, our_losses)
    problems += curve_problems
    body.update({"trainable_params": sum(p.numel() for _, p in trainable(model)),
                 "step_loss_ours": ours["total"], "step_loss_peft": loss32,
                 "step_loss_rel_err": loss_err, "step_loss_ok": loss_err <= 1e-4,
                 "aux_loss_ours": ours["aux_loss"] if aux32 is not None else None,
                 "aux_loss_peft": aux32,
                 "grads": grads, "grads_ok": grads["ok"], "grad_errors": grad_errors,
                 **curve})
    del model
    free_gpu()

    # Our trained adapter in peft: our logits; and both gradients there (A's too).
    model, trained_problems, note = load_adapter(model_dir, config, ck, targets)
    problems += trained_problems
    body["trained_adapter_key_check"] = note or ("ok" if model is not None else "mismatch")
    if model is None:
        return body, problems
    hf_logits, bf16_logit_err = logits_of(model, ids, vocab)
    our_logits = load_file(os.path.join(out, "logits.safetensors"))["logits"].cuda()
    logit_err = rel(our_logits, hf_logits)
    if not logit_err <= 1e-2:
        problems.append(f"logits of our trained adapter: rel err {logit_err:.3e}")
    del hf_logits, our_logits
    tr_ours, tr_loss32, _, tr_loss_err, trained_grads, trained_grad_errors, tr_problems = \
        step_check(model, ids, trained_out, moe)
    problems += [p.replace("gradient of", "trained adapter's gradient of") for p in tr_problems]
    del model
    free_gpu()

    body.update({"logits_rel_err": logit_err, "logits_bf16_autocast_rel_err": bf16_logit_err,
                 "logits_ok": logit_err <= 1e-2,
                 "trained_adapter_step_loss_ours": tr_ours["total"],
                 "trained_adapter_step_loss_peft": tr_loss32,
                 "trained_adapter_step_loss_rel_err": tr_loss_err,
                 "trained_adapter_grads": trained_grads,
                 "trained_adapter_grads_ok": trained_grads["ok"],
                 "trained_adapter_grad_errors": trained_grad_errors})
    return body, problems


def full_case(bin_path, d, config, batches, freeze):
    out = os.path.join(d, "ours-full")
    model_dir = os.path.join(d, "model")
    run_ours(bin_path, model_dir, os.path.join(d, "batches-full.json"), out,
             ["--steps", str(STEPS), "--freeze", ",".join(freeze)])
    moe, vocab, problems = is_moe(config), config.vocab_size, []
    ids = batches[0].cuda()

    model = load_base(model_dir, config)
    model.model.embed_tokens.weight.requires_grad_(False)
    ours, loss32, _, loss_err, grads, _, step_problems = step_check(
        model, ids, out, moe, "transformers")
    problems += step_problems

    our_losses = json.load(open(os.path.join(out, "curve.json")))["losses"]
    curve, curve_problems = curves(model, batches, FULL_LR, our_losses)
    problems += curve_problems
    trainable_params = sum(p.numel() for _, p in trainable(model))
    base_embed = model.model.embed_tokens.weight.detach().clone()
    del model
    free_gpu()

    loaded = load_base(os.path.join(out, f"checkpoint-{STEPS}"), config)
    embed_kept = bool(torch.equal(loaded.model.embed_tokens.weight.detach(), base_embed))
    if not embed_kept:
        problems.append("the frozen embedding of our checkpoint differs from the base's")
    hf_logits, bf16_logit_err = logits_of(loaded, ids, vocab)
    our_logits = load_file(os.path.join(out, "logits.safetensors"))["logits"].cuda()
    logit_err = rel(our_logits, hf_logits)
    if not logit_err <= 1e-2:
        problems.append(f"logits of our checkpoint: rel err {logit_err:.3e}")
    del loaded, hf_logits, our_logits, base_embed
    free_gpu()
    return {"targets": None, "freeze": freeze, "lr": FULL_LR,
            "trainable_params": trainable_params,
            "step_loss_ours": ours["total"], "step_loss_transformers": loss32,
            "step_loss_rel_err": loss_err, "step_loss_ok": loss_err <= 1e-4,
            "grads": grads, "grads_ok": grads["ok"], **curve,
            "frozen_embedding_kept": embed_kept,
            "logits_rel_err": logit_err, "logits_bf16_autocast_rel_err": bf16_logit_err,
            "logits_ok": logit_err <= 1e-2}, problems


def record(result):
    hf_models.record(RESULTS, result)


def check_family(bin_path, work, family, make_config):
    d = os.path.join(work, family)
    os.makedirs(d, exist_ok=True)
    try:
        config = make_config()
        make_model(config, os.path.join(d, "model"))
        batches = make_batches(config.vocab_size, "text")
        for name, lr in (("batches-lora.json", LORA_LR), ("batches-full.json", FULL_LR)):
            with open(os.path.join(d, name), "w") as f:
                json.dump({"rows": [b.tolist() for b in batches], "lr": lr, "warmup": WARMUP,
                           "weight_decay": WD, "max_grad_norm": CLIP}, f)
        family_cases, setup_error = cases(family, config), None
    except Exception as e:  # the family's every case fails; the other families still run
        traceback.print_exc()
        family_cases = [("setup", None, None)]
        setup_error = f"setting up {family}: {type(e).__name__}: {e}"
        free_gpu()
    results = []
    for case, targets, freeze in family_cases:
        head = {"case": f"{family}/{case}", "family": family}
        try:
            if setup_error is not None:
                body, problems = {}, [setup_error]
            elif targets is not None:
                head["tokens_per_step"] = int(batches[0].numel())
                body, problems = lora_case(bin_path, d, config, batches, targets)
            else:
                head["tokens_per_step"] = int(batches[0].numel())
                body, problems = full_case(bin_path, d, config, batches, freeze)
        except Exception as e:  # a crash of either side fails the case, not the run
            traceback.print_exc()
            body, problems = {}, [f"{type(e).__name__}: {e}"]
            free_gpu()
        result = {**head, **body, "problems": problems, "passed": not problems}
        print(json.dumps(result), flush=True)
        record(result)
        results.append(result)
    if os.environ.get("MEGATRAIN_CMP_KEEP") != "1":
        shutil.rmtree(d, ignore_errors=True)
    return results


def grads_line(label, grads):
    """Ours, eager bf16's and sdpa bf16's errors at the worst tensor of a gradient check."""
    if not isinstance(grads, dict) or not grads.get("worst"):
        return None
    worst = grads["worst"][0]
    sdpa = worst[4] if len(worst) > 4 else None

    def fmt(x):
        return "n/a" if x is None else f"{x:.3e}"
    return (f"{label}: ours {fmt(worst[1])} vs eager-bf16 {fmt(worst[2])} vs sdpa-bf16 "
            f"{fmt(sdpa)} (worst tensor {short_name(worst[0])})")


def summary(results):
    print("\ncase                                  loss    grads   curve   logits  trained-grads")
    for r in results:
        def mark(key):
            return "-" if key not in r else ("ok" if r[key] else "FAIL")
        print(f"{r['case']:<36}  {mark('step_loss_ok'):<6}  {mark('grads_ok'):<6}  "
              f"{mark('curve_ok'):<6}  {mark('logits_ok'):<6}  {mark('trained_adapter_grads_ok')}"
              + ("" if r["passed"] else "   <- " + "; ".join(r["problems"])[:300]))
        grad_checks = (("grads", "grads"), ("trained_adapter_grads", "trained-adapter grads"))
        failed_checks = [k for k in ("step_loss_ok", "grads_ok", "curve_ok", "logits_ok",
                                     "trained_adapter_grads_ok") if k in r and not r[k]]
        if (not r["passed"] and failed_checks
                and set(failed_checks) <= {key + "_ok" for key, _ in grad_checks}
                and all(p.startswith(("gradient", "trained adapter's gradient"))
                        for p in r["problems"])):  # a case failing on gradients alone
            for key, label in grad_checks:
                line = grads_line(label, r.get(key)) if not r.get(key + "_ok", True) else None
                if line:
                    print("    " + line)
    failed = [r["case"] for r in results if not r["passed"]]
    print(f"\n{len(results) - len(failed)} of {len(results)} cases passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return not failed


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    hf_models.run_families(sys.argv[1], sys.argv[2], sys.argv[3:],
                           hf_models.full_width_configs(), check_family, summary)


if __name__ == "__main__":
    main()
