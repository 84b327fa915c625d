#!/usr/bin/env python3
"""DPO on the CUDA backend against a reference written from the DPO paper (Rafailov et al.
2023, arXiv 2305.18290) in PyTorch + transformers (fp32; TRL is not needed), on the 4-layer
full-width models of compare_lora_with_peft.py (every vocabulary cut to 16384):
  qwen2      Qwen2.5-7B's width (hidden 3584, intermediate 18944, 28 heads, 4 KV heads)
  llama3     Llama-3.1-8B's (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, llama3 RoPE)
  qwen3_moe  Qwen3-30B-A3B's (hidden 2048, 128 experts top-8, moe_intermediate 768), with
             its load-balancing loss (output_router_logits, router_aux_loss_coef 0.001)

Protocol, per family:
  1. transformers draws the model (torch.manual_seed(0)), its weights are rounded to bf16
     values and saved (make_bf16_exact, as compare_lora_with_peft.py);
  2. megatrain trains it briefly: gpu_reference BASE BATCHES OUT --backend cuda --steps 20
     on the text batches of compare_gpu_with_transformers.py (a bigram chain over 256 ids;
     lr MEGATRAIN_SFT_LR, default 1e-4, warmup 10, decay 0.01, clipping 1.0); its
     checkpoint-20 (bf16 weights) is the DPO starting policy and the reference;
  3. a synthetic preference set (seeded; make_pairs): 800 pairs, 16 a step for 50 steps,
     each seen once. The prompt (60..68 tokens) and the chosen completion (100..128) are one
     walk of the text data's bigram chain (the chosen one continues the prompt as the SFT
     data would); the rejected completion (100..128) is uniformly random ids. They differ
     learnably: the chain is learnable, noise is not. The lengths make every pair fill one
     row of seq_len 400 alone (2 x 60 + 2 x 100 = 320 <= a pair <= 2 x 68 + 2 x 128 = 392,
     and no next chosen sequence, >= 160 tokens, fits beside it), so each step packs into
     the same 16 / 8 = 2 micro-batches of 8 rows x 400 (pack_micro_batches checks it, as
     dpo_reference refuses a step that packs otherwise);
  4. for each loss in MEGATRAIN_DPO_LOSSES (default "sigmoid,ipo"; beta 0.1, no label
     smoothing, rpo_alpha 0, lr MEGATRAIN_DPO_LR, default 5e-7, warmup 10, decay 0.01,
     clipping 1.0; a usual DPO rate: the chain-vs-noise pairs are easy, and a much larger
     one would drive the sigmoid loss towards 0, where relative curve distances mean
     little) dpo_reference (our engine, CUDA backend) writes the reference pass's
     values, step 1's metrics and gradients, a 50-step AdamW curve, the trained weights'
     per-pair values and the trained checkpoint; the torch reference then runs:
       - step 1 (fp32): loss and every TRL metric (rewards/chosen, rewards/rejected,
         rewards/accuracies, rewards/margins, logps/chosen, logps/rejected) within 1e-4
         relative of ours; where the reference's value is 0 (the rewards at step 1: the
         reference is the starting policy) ours must be 0 too. The same errors of the torch
         model under bf16 autocast (the yardstick) are reported beside;
       - step-1 gradients: rel L2 <= 3% per tensor (dense); qwen3_moe: <= 1.5 x transformers'
         own bf16-autocast-vs-fp32 error of that tensor + 0.01, its own error the larger of
         the eager attention's and the sdpa attention's (PyTorch's efficient kernel: the
         padding mask rules flash out), as compare_lora_with_peft.py;
       - 50 AdamW steps (torch.optim.AdamW, decay on all but biases and norms, clipping),
         fp32 and under bf16 autocast, from the same start: with d(t) = |L - L_fp32| / L_fp32
         on the DPO loss, mean d_ours <= 1.5 x mean d_bf16 + 0.005 and the mean of our last
         10 losses within 2% of fp32's;
       - our rewards/accuracies, the mean of the last 5 steps, > 0.9;
       - per-pair log-probabilities (a vector of 2 x 800) against torch fp32, rel L2 <=
         1.5 x the bf16 yardstick's + 1e-4: of our trained checkpoint (loaded by
         transformers) against our policy_logps_final.json, and of the starting policy
         against our reference_logps.json (the reference pass).
One JSON line per (family, loss) goes to tests/hf/results/cuda-dpo.jsonl (a case run again
replaces its line); a summary is printed; the exit status is 1 when any check fails.

The torch reference, as TRL's DPOTrainer computes (trl/trainer/dpo_trainer.py), with
  delta = (pi_c - ref_c) - (pi_r - ref_r), pi / ref a completion's summed log-probability:
  a step's 2P sequences (every chosen, then every rejected: prompt + completion) run as one
  batch, right-padded with an attention mask (no attention across sequences), the logits
  in fp32 (.float(), as transformers' own loss upcasts them), log p of each completion
  token = log_softmax(logits)[next token] summed over the completion; the reference's
  values come from the same batches at the starting weights (no_grad, before training;
  fp32 for the fp32 run, bf16 autocast for the yardstick); at step 1 they are the
  policy's own values (detached), so delta is exactly 0, as it is on our side;
  sigmoid: -(1 - eps) logsigmoid(beta delta) - eps logsigmoid(-beta delta) (cDPO; eps = 0);
  ipo:     ((pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r - 1 / (2 beta))^2, n the
           completion's token count (TRL's length normalisation);
  hinge:   relu(1 - beta delta);
  averaged over the step's pairs, + rpo_alpha x the mean -log p over the step's chosen
  completion tokens; + router_aux_loss_coef x transformers' aux_loss (MoE, what TRL adds:
  over the batch's real tokens, the attention mask excluding padding);
  rewards/chosen = mean beta (pi_c - ref_c), rewards/rejected alike, rewards/accuracies =
  the share of pairs with beta (pi_c - ref_c) > beta (pi_r - ref_r), rewards/margins = their
  mean difference, logps/chosen = mean pi_c, logps/rejected = mean pi_r (summed, not
  length-normalised, under ipo too, as TRL logs them).
The metrics are computed in float64 from the per-sequence values (step_metrics, the same
function --self-test checks against hand values); the torch loss that is differentiated
is checked against it (1e-4 relative) at every step.

Assumptions, named:
  - transformers' aux_loss counts only unpadded tokens; our engine's counts every row
    token of the step's micro-batches, padding included (about 11% here). The aux loss is
    reported, not checked (ours, torch's, and torch's over our rows: the padding tokens'
    router logits added, for the diagnosis of a qwen3_moe gradient failure);
  - eager experts (set_experts_implementation("eager")) for the torch MoE, as
    compare_lora_with_peft.py: bf16 under autocast, as ours are;
  - checkpoint-20's config.json says what the engine trains (router_aux_loss_coef only when
    output_router_logits): the torch side takes the coefficient from it alike, and a
    difference from ours (step.json's aux_loss_coef) is a problem;
  - the engine's forward-only pass gives a micro-batch's values bit for bit as a step's
    forward does (Pipeline::Evaluate's contract), and the reference pass packs the pairs as
    the steps do (one pair a row, 8 a micro-batch), so our step-1 rewards are exactly 0.

Memory: the largest model (qwen3_moe, ~2.5 B parameters) takes ~10 GB in fp32, ~50 GB with
AdamW's state, a copy of the starting weights and gradients; every torch run frees the GPU
before the next (free_gpu). Disk: checkpoints' optimizer/ folders and gradient files are
deleted once read; each family's folder is deleted when it is done (MEGATRAIN_CMP_KEEP=1
keeps it, and a later run reuses its SFT checkpoint: a family, or one loss of it, can run
per command; MEGATRAIN_DPO_LOSSES= (empty) with MEGATRAIN_CMP_KEEP=1 only makes the
family's SFT policy).

Usage: compare_dpo_with_torch.py BIN_DIR WORKDIR [FAMILIES...]
  BIN_DIR holds gpu_reference and dpo_reference; FAMILIES: any of qwen2 llama3 qwen3_moe
  (default: all).
       compare_dpo_with_torch.py --self-test [BIN_DIR]
  checks the pure-python parts (losses and metrics against hand values, the pair set, the
  packing, the checks' rules) without torch; with BIN_DIR, also runs dpo_reference on the
  CPU backend on a tiny random Llama written here (step 1 at ln 2 with every reward 0, the
  engine's metrics equal to step_metrics' from its own per-pair values, with a reference
  model of its own too, and a rising accuracy).
"""
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402
from hf_models import curve_check, free_gpu, is_moe  # noqa: E402

try:  # --self-test runs without torch
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForCausalLM

    from compare_gpu_with_transformers import (  # noqa: E402
        make_batches, make_bf16_exact, our_tensor, rel)
except ImportError:
    torch = None

STEPS, SFT_STEPS = 50, 20
PAIRS_PER_STEP, ROWS, SEQ_LEN, PAD_ID = 16, 8, 400, 0
PROMPT_TOKENS, COMPLETION_TOKENS = (60, 68), (100, 128)
BETA, WARMUP, WD, CLIP = 0.1, 10, 0.01, 1.0
SFT_LR = float(os.environ.get("MEGATRAIN_SFT_LR", "1e-4"))
DPO_LR = float(os.environ.get("MEGATRAIN_DPO_LR", "5e-7"))
LOSSES = [x for x in os.environ.get("MEGATRAIN_DPO_LOSSES", "sigmoid,ipo").split(",") if x]
METRICS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
           "rewards/margins", "logps/chosen", "logps/rejected"]
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cuda-dpo.jsonl")


# ---------------------------------------------------------------------------------------
# The pure-python parts: the losses and metrics, the pair set, the packing, the checks.

def log_sigmoid(x):
    return -(max(-x, 0.0) + math.log1p(math.exp(-abs(x))))


def pair_loss(kind, beta, eps, chosen_ratio, rejected_ratio, chosen_tokens, rejected_tokens):
    """One pair's loss from its log-ratios pi - ref (see the docstring)."""
    delta = chosen_ratio - rejected_ratio
    if kind == "sigmoid":
        return -(1 - eps) * log_sigmoid(beta * delta) - eps * log_sigmoid(-beta * delta)
    if kind == "ipo":
        gap = (chosen_ratio / max(chosen_tokens, 1) - rejected_ratio / max(rejected_tokens, 1)
               - 1 / (2 * beta))
        return gap * gap
    if kind == "hinge":
        return max(0.0, 1 - beta * delta)
    raise ValueError(f"unknown loss {kind}")


def step_metrics(opts, pi_c, pi_r, ref_c, ref_r, n_c, n_r):
    """A step's loss and TRL's metrics (float64) from per-pair lists: the policy's and the
    reference's summed log-probabilities and the completions' token counts."""
    beta, P = opts["beta"], len(pi_c)
    loss = sum(pair_loss(opts["loss"], beta, opts["label_smoothing"], pi_c[k] - ref_c[k],
                         pi_r[k] - ref_r[k], n_c[k], n_r[k]) for k in range(P)) / P
    if opts["rpo_alpha"] > 0:
        loss += opts["rpo_alpha"] * -sum(pi_c) / sum(n_c)
    rc = [beta * (pi_c[k] - ref_c[k]) for k in range(P)]
    rr = [beta * (pi_r[k] - ref_r[k]) for k in range(P)]
    return {"loss": loss, "rewards/chosen": sum(rc) / P, "rewards/rejected": sum(rr) / P,
            "rewards/accuracies": sum(1.0 for a, b in zip(rc, rr) if a > b) / P,
            "rewards/margins": sum(a - b for a, b in zip(rc, rr)) / P,
            "logps/chosen": sum(pi_c) / P, "logps/rejected": sum(pi_r) / P}


def dpo_options(loss):
    return {"beta": BETA, "loss": loss, "label_smoothing": 0.0, "rpo_alpha": 0.0}


def make_pairs(chain, vocab, count, seed=0, prompt_tokens=PROMPT_TOKENS,
               completion_tokens=COMPLETION_TOKENS):
    """`count` pairs {"prompt", "chosen", "rejected"} (ids). chain = (live ids, successors:
    per live index its 4 next live indices, their weights): the prompt and the chosen
    completion are one walk of it; the rejected completion is uniformly random ids."""
    live, succ, weights = chain
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        lp, lc = rng.randint(*prompt_tokens), rng.randint(*completion_tokens)
        lr = rng.randint(*completion_tokens)
        state = rng.randrange(len(live))
        walk = [state]
        for _ in range(lp + lc - 1):
            state = succ[state][rng.choices(range(len(weights)), weights)[0]]
            walk.append(state)
        ids = [live[s] for s in walk]
        pairs.append({"prompt": ids[:lp], "chosen": ids[lp:],
                      "rejected": [rng.randrange(vocab) for _ in range(lr)]})
    return pairs


def step_pairs(pairs, step, per_step=PAIRS_PER_STEP):
    """The pairs of step `step` (0-based), as dpo_reference takes them (wrapping around)."""
    return [pairs[(step * per_step + k) % len(pairs)] for k in range(per_step)]


def pack_micro_batches(pairs, rows=ROWS, seq_len=SEQ_LEN):
    """PackPairs (engine/data/pair_packer.cc) as dpo_reference packs a step's pairs: the
    micro-batch count, and per micro-batch the rows each pair starts in."""
    lengths = [(len(p["prompt"]) + len(p["chosen"]), len(p["prompt"]) + len(p["rejected"]))
               for p in pairs]

    def place(length, row, column):
        if length > seq_len:
            return None
        if column + length > seq_len:
            row, column = row + 1, 0
        return (row, column) if row < rows else None

    batches, k = [], 0
    while k < len(lengths):
        at, starts = (0, 0), []
        while k < len(lengths) and 2 * len(starts) < 4096:
            chosen, rejected = lengths[k]
            c = place(chosen, *at)
            r = c and place(rejected, c[0], c[1] + chosen)
            if r is None:
                break
            starts.append(c[0])
            at, k = (r[0], r[1] + rejected), k + 1
        if not starts:
            raise ValueError(f"pair {k} does not fit a micro-batch of {rows} x {seq_len}")
        batches.append(starts)
    return batches


def check_packing(pairs, steps=STEPS):
    """Problems with the set's steps as dpo_reference packs them: every step in the same
    micro-batch count, one pair a row."""
    problems, counts = [], set()
    for step in range(steps):
        batches = pack_micro_batches(step_pairs(pairs, step))
        counts.add(len(batches))
        if any(starts != list(range(len(starts))) for starts in batches):
            problems.append(f"step {step + 1}: a row holds more than one pair")
    if len(counts) != 1:
        problems.append(f"steps pack into {sorted(counts)} micro-batches")
    return problems


def pairs_spec(pairs, loss, lr=DPO_LR):
    """dpo_reference's PAIRS_JSON."""
    return {"seq_len": SEQ_LEN, "rows": ROWS, "pairs_per_step": PAIRS_PER_STEP,
            "pad_id": PAD_ID, **dpo_options(loss), "lr": lr, "warmup": WARMUP,
            "weight_decay": WD, "max_grad_norm": CLIP, "pairs": pairs}


def metric_errors(ours, ref):
    """Relative error of each metric; where the reference's value is 0, 0 when ours is 0
    too, else infinite."""
    out = {}
    for key in METRICS:
        a, b = ours[key], ref[key]
        out[key] = (0.0 if a == b else math.inf) if b == 0 else abs(a - b) / abs(b)
    return out


def metric_problems(errors, tol=1e-4):
    return [f"step 1 {key}: rel err {e:.3e} > {tol:g}" for key, e in errors.items()
            if not e <= tol]


def rel_l2(a, b):
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    return num / max(math.sqrt(sum(y * y for y in b)), 1e-30)


def logps_check(label, ours, fp32, bf16):
    """Per-pair values (flat lists) against fp32: rel L2 <= 1.5 x bf16's + 1e-4."""
    err, bf16_err = rel_l2(ours, fp32), rel_l2(bf16, fp32)
    bound = 1.5 * bf16_err + 1e-4
    stats = {f"{label}_rel_err": err, f"{label}_bf16_autocast_rel_err": bf16_err,
             f"{label}_ok": err <= bound}
    return stats, ([] if err <= bound else
                   [f"{label}: rel err {err:.3e} > {bound:.3e} (bf16 autocast {bf16_err:.3e})"])


def flat_logps(entries):
    """[{"chosen", "rejected"}, ...] -> [c0, r0, c1, r1, ...]."""
    return [x for e in entries for x in (e["chosen"], e["rejected"])]


def accuracy_check(curve_steps):
    accs = [s["rewards/accuracies"] for s in curve_steps]
    last5 = sum(accs[-5:]) / max(len(accs[-5:]), 1)
    stats = {"accuracies_ours": accs, "accuracy_last5_ours": last5, "accuracy_ok": last5 > 0.9}
    return stats, ([] if last5 > 0.9 else
                   [f"rewards/accuracies: last-5 mean {last5:.3f} <= 0.9"])


# ---------------------------------------------------------------------------------------
# The torch side.

def configs():
    """The families compared (hf_models.py's), made when called."""
    return {k: v for k, v in hf_models.full_width_configs().items()
            if k in ("qwen2", "llama3", "qwen3_moe")}


def text_chain(vocab):
    """The bigram chain of make_batches(vocab, "text"): its first two draws (live ids,
    successors), checked against the batches it makes."""
    g = torch.Generator().manual_seed(0)
    live = torch.randperm(vocab, generator=g)[:256].tolist()
    succ = torch.randint(0, 256, (256, 4), generator=g).tolist()
    index = {t: i for i, t in enumerate(live)}
    batch = make_batches(vocab, "text")[0].tolist()
    for row in batch:
        for a, b in zip(row, row[1:]):
            if index[b] not in succ[index[a]]:
                raise RuntimeError("make_batches' chain is not the one text_chain replays")
    return live, succ, [1.0 / (k + 1) for k in range(4)]


def make_model(config, path):
    """The family's base: drawn by transformers, every weight a bf16 value, saved in bf16
    (written under a temporary name, then renamed: a later run reuses a whole one)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    make_bf16_exact(model, config)
    model.to(torch.bfloat16)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    os.rename(tmp, path)
    del model
    free_gpu()


def load_model(path, config):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").cuda()
    if is_moe(config) and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # bf16 under autocast, as ours
    model.train()  # dropout is 0 everywhere; as a model being trained
    return model


def aux_coef(model):
    """The load-balancing loss's weight as the engine reads config.json (0 without
    output_router_logits)."""
    c = model.config
    return float(getattr(c, "router_aux_loss_coef", 0.0)) if getattr(
        c, "output_router_logits", False) else 0.0


def padded_batch(pairs):
    """The pairs' 2P sequences as TRL batches them: every chosen, then every rejected, each
    prompt + completion, right-padded to the longest; (ids, attention mask, completion
    mask) on the GPU."""
    seqs = ([(p["prompt"], p["chosen"]) for p in pairs]
            + [(p["prompt"], p["rejected"]) for p in pairs])
    width = max(len(a) + len(b) for a, b in seqs)
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    completion = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (prompt, answer) in enumerate(seqs):
        n = len(prompt) + len(answer)
        ids[i, :n] = torch.tensor(prompt + answer)
        mask[i, :n] = 1
        completion[i, len(prompt):n] = 1
    return ids.cuda(), mask.cuda(), completion.cuda()


def sequence_logps(model, batch, bf16, router_logits=False):
    """Each sequence's summed log p of its completion tokens (fp32, with autograd as the
    caller's mode), the completions' token counts, the aux loss (None without) and, when
    asked, the router logits."""
    ids, mask, completion = batch
    kwargs = {"output_router_logits": True} if aux_coef(model) > 0 else {}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        out = model(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs)
    logits = out.logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    target = completion[:, 1:].to(logp.dtype)
    routers = out.router_logits if router_logits and kwargs else None
    return (logp * target).sum(1), target.sum(1), getattr(out, "aux_loss", None), routers


def dpo_loss(opts, pi, ref, n):
    """The differentiated DPO loss (torch) over a step's 2P values (chosen first)."""
    P = pi.shape[0] // 2
    cr, rr = pi[:P] - ref[:P], pi[P:] - ref[P:]
    beta, eps = opts["beta"], opts["label_smoothing"]
    if opts["loss"] == "sigmoid":
        per = -(1 - eps) * F.logsigmoid(beta * (cr - rr)) - eps * F.logsigmoid(-beta * (cr - rr))
    elif opts["loss"] == "ipo":
        per = (cr / n[:P].clamp(min=1) - rr / n[P:].clamp(min=1) - 1 / (2 * beta)) ** 2
    else:
        per = torch.relu(1 - beta * (cr - rr))
    loss = per.mean()
    if opts["rpo_alpha"] > 0:
        loss = loss + opts["rpo_alpha"] * -pi[:P].sum() / n[:P].sum()
    return loss


def checked_metrics(opts, pi, ref, n, loss):
    """step_metrics of the step's values; the torch loss must agree with it."""
    P = len(pi) // 2
    pi, ref, n = pi.tolist(), ref.tolist(), n.tolist()
    m = step_metrics(opts, pi[:P], pi[P:], ref[:P], ref[P:], n[:P], n[P:])
    if not abs(loss.item() - m["loss"]) <= 1e-4 * max(1.0, abs(m["loss"])):
        raise RuntimeError(f"torch's DPO loss {loss.item()} disagrees with step_metrics' "
                           f"{m['loss']}")
    return m


def dpo_step(model, batch, ref, opts, bf16, router_logits=False):
    """One forward and backward of the step's loss (+ coef x aux), `ref` the reference's
    values (None: the policy's own): (metrics, aux, grads by name, router logits)."""
    model.zero_grad(set_to_none=True)
    pi, n, aux, routers = sequence_logps(model, batch, bf16, router_logits)
    ref = pi.detach() if ref is None else ref
    loss = dpo_loss(opts, pi, ref, n)
    total = loss + aux_coef(model) * aux if aux is not None else loss
    total.backward()
    m = checked_metrics(opts, pi.detach(), ref, n, loss)
    m["pair_logps"] = pi.detach().tolist()
    grads = {name: (p.grad.detach().float().clone() if p.grad is not None
                    else torch.zeros_like(p, dtype=torch.float32))
             for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    routers = tuple(r.detach() for r in routers) if routers is not None else None
    return m, (aux.item() if aux is not None else None), grads, routers


def first_step(model, batch, opts, bf16, router_logits=False):
    """Step 1 from the present weights, the reference being these weights: its values are
    the policy's own on the same batch (detached), so delta is exactly 0 (a second forward
    could differ in its last bits: the eager experts add with atomics)."""
    return dpo_step(model, batch, None, opts, bf16, router_logits)


def sdpa_first_step(model, batch, opts):
    """The second bf16 yardstick: first_step under bf16 autocast with the attention switched
    to sdpa (flash where allowed, else the efficient kernel: a flash-style bf16 attention as
    ours, where eager keeps the softmax in fp32); eager again afterwards. (grads, note)."""
    try:
        model.set_attn_implementation("sdpa")
        if model.config._attn_implementation != "sdpa":
            raise RuntimeError(f"attention is {model.config._attn_implementation!r}")
    except Exception as e:
        return None, f"unavailable: {type(e).__name__}: {str(e)[:160]}"
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return first_step(model, batch, opts, bf16=True)[2], "flash or efficient"
    except RuntimeError as e:
        return None, f"failed: {str(e)[:160]}"
    finally:
        model.set_attn_implementation("eager")


def aux_over_our_rows(model, routers, batch, padding_tokens):
    """transformers' load-balancing loss over the tokens our step routes: the batch's real
    tokens and `padding_tokens` tokens of PAD_ID, each alone at position 0 (a diagnosis:
    our engine counts padding rows; TRL's does not)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    keep = batch[1].reshape(-1).bool()
    with torch.no_grad():
        pad = model(input_ids=torch.tensor([[PAD_ID]], device="cuda"), use_cache=False,
                    output_router_logits=True).router_logits
    layers = tuple(torch.cat([r[keep], p.reshape(1, -1).expand(padding_tokens, -1)])
                   for r, p in zip(routers, pad))
    c = model.config
    return float(load_balancing_loss_func(layers, c.num_experts, c.num_experts_per_tok))


def compare_grads(ours, ref32, ref_bf16, moe, model_type, ref_sdpa=None):
    """Every gradient against fp32: rel L2 <= 3%, or (MoE) <= 1.5 x transformers' own bf16
    error (the larger of eager's and sdpa's) + 0.01. (summary, problems)."""
    problems, rows = [], []
    for name, g in ref32.items():
        try:
            mine = our_tensor(name, ours, model_type).cuda()
        except KeyError:
            problems.append(f"gradient of {name}: missing from grads.safetensors")
            continue
        err, bf16_err = rel(mine, g), rel(ref_bf16[name], g)
        sdpa_err = rel(ref_sdpa[name], g) if ref_sdpa is not None else None
        bound = 1.5 * max(bf16_err, sdpa_err or 0.0) + 0.01 if moe else 0.03
        rows.append((name, err, bf16_err, bound, sdpa_err))
        if not err <= bound:  # NaN fails too
            problems.append(f"gradient of {name}: rel err {err:.3e} > {bound:.3e} "
                            f"(bf16 autocast {bf16_err:.3e}, sdpa {sdpa_err})")
    rows.sort(key=lambda r: -r[1] / r[3])
    errs = sorted(r[1] for r in rows)
    return {"count": len(rows), "max": errs[-1] if errs else None,
            "median": errs[len(errs) // 2] if errs else None,
            "bf16_autocast_max": max([r[2] for r in rows], default=None),
            "sdpa_bf16_max": max([r[4] for r in rows if r[4] is not None], default=None),
            "worst": [list(r) for r in rows[:3]], "ok": not problems}, problems


def step_check(model, config, batch, opts, out):
    """Step 1 of torch (fp32; eager and sdpa bf16 yardsticks) against our out/step.json and
    out/grads.safetensors. (body, problems)."""
    m32, aux32, g32, routers = first_step(model, batch, opts, bf16=False, router_logits=True)
    m16, _, g16, _ = first_step(model, batch, opts, bf16=True)
    g_sdpa, sdpa_note = sdpa_first_step(model, batch, opts) if is_moe(config) else (None, None)
    ours = json.load(open(os.path.join(out, "step.json")))
    errors, bf16_errors = metric_errors(ours, m32), metric_errors(m16, m32)
    problems = metric_problems(errors)
    if ours["aux_loss_coef"] != aux_coef(model):
        problems.append(f"aux loss coef: ours {ours['aux_loss_coef']}, torch {aux_coef(model)}")
    pairs = ours["pair_logps"]
    ours_pairs = [e["chosen"] for e in pairs] + [e["rejected"] for e in pairs]
    body = {"step_ours": {k: ours[k] for k in METRICS},
            "step_fp32": {k: m32[k] for k in METRICS},
            "step_rel_err": errors, "step_bf16_autocast_rel_err": bf16_errors,
            "step_ok": not problems,
            "step_pair_logps_rel_err": rel_l2(ours_pairs, m32["pair_logps"]),
            "step_pair_logps_bf16_autocast_rel_err": rel_l2(m16["pair_logps"],
                                                            m32["pair_logps"]),
            "aux_loss_ours": ours["aux_loss"] if aux32 is not None else None,
            "aux_loss_torch": aux32, "aux_loss_coef": ours["aux_loss_coef"],
            "padding_tokens_ours": ours["padding_tokens"]}
    if routers is not None:
        try:
            body["aux_loss_torch_over_our_rows"] = aux_over_our_rows(
                model, routers, batch, ours["padding_tokens"])
        except Exception as e:  # a diagnosis only
            body["aux_loss_torch_over_our_rows"] = f"{type(e).__name__}: {str(e)[:160]}"
    grads, grad_problems = compare_grads(load_file(os.path.join(out, "grads.safetensors")),
                                         g32, g16, is_moe(config), config.model_type, g_sdpa)
    grads["sdpa_bf16_attention"] = sdpa_note
    body.update({"grads": grads, "grads_ok": grads["ok"]})
    del g32, g16, g_sdpa, routers
    free_gpu()
    return body, problems + grad_problems


def reference_values(model, batches, bf16):
    """Each step's reference values at the present weights, in that step's batch."""
    with torch.no_grad():
        return [sequence_logps(model, b, bf16)[0] for b in batches]


def train(model, batches, refs, opts, bf16):
    """STEPS AdamW steps (decay on all but biases and norms, HF Trainer's rule; global-norm
    clipping; lr warmed up linearly over WARMUP steps, as the engine's schedule). Returns
    each step's metrics."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if "bias" not in n and "norm" not in n]
    no_decay = [p for n, p in named if "bias" in n or "norm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}], lr=DPO_LR, foreach=False)
    metrics = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = DPO_LR * step / WARMUP if step < WARMUP else DPO_LR
        opt.zero_grad(set_to_none=True)
        pi, n, aux, _ = sequence_logps(model, batches[step], bf16)
        loss = dpo_loss(opts, pi, refs[step], n)
        (loss + aux_coef(model) * aux if aux is not None else loss).backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], CLIP)
        opt.step()
        metrics.append(checked_metrics(opts, pi.detach(), refs[step], n, loss))
    del opt
    model.zero_grad(set_to_none=True)
    return metrics


def curves(model, batches, opts, ours):
    """fp32 and bf16-autocast curves from the present weights (restored after each), the
    curve criterion for ours, and the per-pair starting values of both (the reference's)."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    def restore():
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
    refs32, refs16 = reference_values(model, batches, False), reference_values(model, batches,
                                                                              True)
    m32 = train(model, batches, refs32, opts, bf16=False)
    restore()
    m16 = train(model, batches, refs16, opts, bf16=True)
    restore()
    del start
    stats, problems = curve_check([s["loss"] for s in ours], [s["loss"] for s in m32],
                                  [s["loss"] for s in m16])
    stats["accuracies_fp32"] = [s["rewards/accuracies"] for s in m32]
    stats["accuracies_bf16_autocast"] = [s["rewards/accuracies"] for s in m16]
    return stats, problems, refs32, refs16


def pair_values(refs):
    """Per-step values (chosen first) -> the set's flat [c0, r0, c1, r1, ...] (the steps
    cover every pair once, in order)."""
    out = []
    for r in refs:
        r = r.tolist()
        P = len(r) // 2
        out += [x for k in range(P) for x in (r[k], r[P + k])]
    return out


def final_values(path, config, batches):
    """Per-pair values of the checkpoint at `path` in transformers: fp32 and bf16 autocast."""
    model = load_model(path, config)
    v32, v16 = (pair_values(reference_values(model, batches, bf16)) for bf16 in (False, True))
    del model
    free_gpu()
    return v32, v16


def run_tool(args):
    print("+", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def sft_policy(bin_dir, d, config):
    """The DPO starting policy: our engine's checkpoint-20 of the base on the text data
    (reused when a kept folder has it); the base, the optimizer state and the gradients
    are deleted (disk: the MoE model's are ~5, 30 and 10 GB)."""
    policy = os.path.join(d, "sft", f"checkpoint-{SFT_STEPS}")
    if not os.path.exists(os.path.join(policy, "config.json")):
        make_model(config, os.path.join(d, "model"))
        batches = os.path.join(d, "batches-sft.json")
        with open(batches, "w") as f:
            json.dump({"rows": [b.tolist() for b in make_batches(config.vocab_size, "text")],
                       "lr": SFT_LR, "warmup": WARMUP, "weight_decay": WD,
                       "max_grad_norm": CLIP}, f)
        run_tool([os.path.join(bin_dir, "gpu_reference"), os.path.join(d, "model"), batches,
                  os.path.join(d, "sft"), "--backend", "cuda", "--steps", str(SFT_STEPS)])
    shutil.rmtree(os.path.join(policy, "optimizer"), ignore_errors=True)
    shutil.rmtree(os.path.join(d, "model"), ignore_errors=True)  # the policy replaces it
    for name in ("grads.safetensors", "logits.safetensors"):
        if os.path.exists(os.path.join(d, "sft", name)):
            os.remove(os.path.join(d, "sft", name))
    return policy


def loss_case(bin_dir, d, config, policy, pairs, loss):
    out = os.path.join(d, f"dpo-{loss}")
    shutil.rmtree(out, ignore_errors=True)  # an earlier run's, kept or cut short
    spec = os.path.join(d, f"pairs-{loss}.json")
    with open(spec, "w") as f:
        json.dump(pairs_spec(pairs, loss), f)
    run_tool([os.path.join(bin_dir, "dpo_reference"), policy, spec, out, "--backend", "cuda",
              "--steps", str(STEPS)])
    trained = os.path.join(out, f"checkpoint-{STEPS}")
    shutil.rmtree(os.path.join(trained, "optimizer"), ignore_errors=True)
    opts = dpo_options(loss)
    assert len(pairs) == STEPS * PAIRS_PER_STEP  # the steps visit every pair once, in order
    batches = [padded_batch(step_pairs(pairs, s)) for s in range(STEPS)]
    body = {"loss_type": loss, "beta": BETA, "lr": DPO_LR, "pairs": len(pairs),
            "pairs_per_step": PAIRS_PER_STEP, "rows": ROWS, "seq_len": SEQ_LEN}

    model = load_model(policy, config)
    step, problems = step_check(model, config, batches[0], opts, out)
    body.update(step)
    os.remove(os.path.join(out, "grads.safetensors"))  # read; 10 GB for the MoE model
    curve = json.load(open(os.path.join(out, "curve.json")))
    stats, curve_problems, refs32, refs16 = curves(model, batches, opts, curve["steps"])
    body.update(stats)
    problems += curve_problems
    del model
    free_gpu()
    stats, acc_problems = accuracy_check(curve["steps"])
    body.update(stats)
    problems += acc_problems
    ours_ref = flat_logps(json.load(open(os.path.join(out, "reference_logps.json"))))
    stats, ref_problems = logps_check("reference_logps", ours_ref, pair_values(refs32),
                                      pair_values(refs16))
    body.update(stats)
    problems += ref_problems
    del refs32, refs16
    v32, v16 = final_values(trained, config, batches)
    ours_final = flat_logps(json.load(open(os.path.join(out, "policy_logps_final.json"))))
    stats, final_problems = logps_check("final_logps", ours_final, v32, v16)
    body.update(stats)
    problems += final_problems
    return body, problems


def record(result):
    hf_models.record(RESULTS, result)


def check_family(bin_dir, work, family, make_config):
    d = os.path.join(work, family)
    os.makedirs(d, exist_ok=True)
    try:
        config = make_config()
        policy = sft_policy(bin_dir, d, config)
        pairs = make_pairs(text_chain(config.vocab_size), config.vocab_size,
                           STEPS * PAIRS_PER_STEP)
        setup_error = "; ".join(check_packing(pairs)) or None
    except Exception as e:  # the family's every case fails; the other families still run
        traceback.print_exc()
        setup_error = f"setting up {family}: {type(e).__name__}: {e}"
        free_gpu()
    results = []
    for loss in LOSSES:
        head = {"case": f"{family}/{loss}", "family": family}
        try:
            if setup_error is not None:
                body, problems = {}, [setup_error]
            else:
                body, problems = loss_case(bin_dir, d, config, policy, pairs, loss)
        except Exception as e:  # a crash of either side fails the case, not the run
            traceback.print_exc()
            body, problems = {}, [f"{type(e).__name__}: {e}"]
            free_gpu()
        result = {**head, **body, "problems": problems, "passed": not problems}
        print(json.dumps(result), flush=True)
        record(result)
        results.append(result)
        shutil.rmtree(os.path.join(d, f"dpo-{loss}", f"checkpoint-{STEPS}"), ignore_errors=True)
    if os.environ.get("MEGATRAIN_CMP_KEEP") != "1":
        shutil.rmtree(d, ignore_errors=True)
    return results


def summary(results):
    keys = ["step_ok", "grads_ok", "curve_ok", "accuracy_ok", "reference_logps_ok",
            "final_logps_ok"]
    print("\ncase                 step    grads   curve   acc     ref     final")
    for r in results:
        marks = ["-" if k not in r else ("ok" if r[k] else "FAIL") for k in keys]
        print(f"{r['case']:<20} " + " ".join(f"{m:<7}" for m in marks)
              + ("" if r["passed"] else "  <- " + "; ".join(r["problems"])[:300]))
        if "step_rel_err" in r:
            worst = max(r["step_rel_err"], key=lambda k: r["step_rel_err"][k])
            print(f"    step 1 worst metric {worst}: ours {r['step_rel_err'][worst]:.2e}, "
                  f"bf16 autocast {r['step_bf16_autocast_rel_err'][worst]:.2e}; "
                  f"accuracy last 5: {r.get('accuracy_last5_ours')}")
    failed = [r["case"] for r in results if not r["passed"]]
    print(f"\n{len(results) - len(failed)} of {len(results)} cases passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return not failed


# ---------------------------------------------------------------------------------------
# --self-test: the pure-python parts, and dpo_reference on the CPU backend.

def expect(ok, what):
    if not ok:
        raise AssertionError(what)
    print(f"  ok  {what}")


def close(a, b, tol=1e-9):
    return abs(a - b) <= tol * max(1.0, abs(b))


def self_test_formulas():
    expect(close(pair_loss("sigmoid", 0.1, 0.0, 0.0, 0.0, 5, 5), math.log(2)),
           "sigmoid at delta 0 is ln 2")
    expect(close(pair_loss("sigmoid", 0.1, 0.0, 3.0, 1.0, 5, 5), math.log1p(math.exp(-0.2))),
           "sigmoid at beta delta 0.2 is log(1 + e^-0.2) = 0.598139")
    expect(close(pair_loss("sigmoid", 0.1, 0.1, 3.0, 1.0, 5, 5),
                 0.9 * math.log1p(math.exp(-0.2)) + 0.1 * math.log1p(math.exp(0.2))),
           "cDPO with eps 0.1: 0.9 x 0.598139 + 0.1 x 0.798139 = 0.618139")
    expect(close(pair_loss("sigmoid", 0.1, 0.0, 5000.0, 0.0, 5, 5), 0.0, 1e-12)
           and close(pair_loss("sigmoid", 0.1, 0.0, -5000.0, 0.0, 5, 5), 500.0),
           "sigmoid without overflow at |beta delta| = 500")
    expect(close(pair_loss("ipo", 0.1, 0.0, 10.0, -20.0, 100, 50), 20.25),
           "ipo: (10/100 + 20/50 - 5)^2 = 20.25")
    expect(close(pair_loss("ipo", 0.1, 0.0, 0.0, 0.0, 100, 50), 25.0), "ipo at delta 0 is 25")
    expect(close(pair_loss("hinge", 0.1, 0.0, 5.0, 0.0, 1, 1), 0.5)
           and pair_loss("hinge", 0.1, 0.0, 30.0, 0.0, 1, 1) == 0.0, "hinge 1 - beta delta, >= 0")
    # Two pairs: rewards chosen 0.1 x (-10 + 12) = 0.2 and 0.1 x (-20 + 19) = -0.1, rejected
    # 0.1 x (-30 + 29) = -0.1 and 0.1 x (-25 + 26) = 0.1.
    m = step_metrics(dpo_options("sigmoid"), [-10.0, -20.0], [-30.0, -25.0], [-12.0, -19.0],
                     [-29.0, -26.0], [4, 5], [6, 7])
    want = {"rewards/chosen": 0.05, "rewards/rejected": 0.0, "rewards/accuracies": 0.5,
            "rewards/margins": 0.05, "logps/chosen": -15.0, "logps/rejected": -27.5,
            "loss": (math.log1p(math.exp(-0.3)) + math.log1p(math.exp(0.2))) / 2}
    expect(all(close(m[k], v) for k, v in want.items()), f"TRL's metrics of two pairs: {want}")
    rpo = step_metrics({**dpo_options("sigmoid"), "rpo_alpha": 0.5}, [-10.0, -20.0],
                       [-30.0, -25.0], [-12.0, -19.0], [-29.0, -26.0], [4, 5], [6, 7])
    expect(close(rpo["loss"], want["loss"] + 0.5 * 30 / 9), "rpo adds alpha x 30 / 9 tokens")


def self_test_checks():
    ref = {k: 1.0 for k in METRICS}
    ref.update({"rewards/chosen": 0.0, "rewards/accuracies": 0.0})
    ours = dict(ref, loss=1.00005)
    e = metric_errors(ours, ref)
    expect(not metric_problems(e) and e["rewards/chosen"] == 0.0,
           "metric rule: 5e-5 relative passes, 0 against 0 is equal")
    e = metric_errors(dict(ours, **{"rewards/chosen": 1e-12}), ref)
    expect(metric_problems(e) == ["step 1 rewards/chosen: rel err inf > 0.0001"],
           "metric rule: anything but 0 against 0 fails")
    expect(metric_problems(metric_errors(dict(ours, loss=float("nan")), ref)) != [],
           "metric rule: NaN fails")
    fp32 = [1.0 - 0.01 * t for t in range(STEPS)]
    stats, problems = curve_check([x * 1.002 for x in fp32], fp32, [x * 1.001 for x in fp32])
    expect(not problems and close(stats["curve_mean_d_ours"], 0.002),
           "curve: d 0.002 against bound 1.5 x 0.001 + 0.005")
    _, problems = curve_check([x * 1.03 for x in fp32], fp32, fp32)
    expect(len(problems) == 1, "curve: 3% off everywhere fails")
    expect(logps_check("x", [1.0, 2.0], [1.0, 2.0], [1.1, 2.0])[0]["x_ok"]
           and not logps_check("x", [1.5, 2.0], [1.0, 2.0], [1.01, 2.0])[0]["x_ok"],
           "per-pair values: within 1.5 x bf16's error + 1e-4")
    expect(accuracy_check([{"rewards/accuracies": a} for a in [0.5] * 45 + [1.0] * 5])[0]
           ["accuracy_ok"] and not accuracy_check([{"rewards/accuracies": 0.9}] * 5)[0]
           ["accuracy_ok"], "accuracy: last-5 mean > 0.9")


def toy_chain(vocab, seed=5):
    rng = random.Random(seed)
    live = rng.sample(range(vocab), 64)
    succ = [[rng.randrange(64) for _ in range(4)] for _ in range(64)]
    return live, succ, [1, 1 / 2, 1 / 3, 1 / 4]


def self_test_pairs():
    chain = toy_chain(16384)
    pairs = make_pairs(chain, 16384, STEPS * PAIRS_PER_STEP)
    expect(pairs == make_pairs(chain, 16384, STEPS * PAIRS_PER_STEP), "the pair set is seeded")
    live, succ, _ = chain
    index = {t: i for i, t in enumerate(live)}
    follows = all(index[b] in succ[index[a]] for p in pairs
                  for a, b in zip(p["prompt"] + p["chosen"], (p["prompt"] + p["chosen"])[1:]))
    expect(follows, "prompt + chosen is one walk of the chain")
    outside = sum(t not in index for p in pairs for t in p["rejected"])
    total = sum(len(p["rejected"]) for p in pairs)
    expect(outside > 0.99 * total * (1 - 64 / 16384),
           f"rejected ids are uniform over the vocabulary ({outside} of {total} off the chain)")
    expect(all(PROMPT_TOKENS[0] <= len(p["prompt"]) <= PROMPT_TOKENS[1]
               and all(COMPLETION_TOKENS[0] <= len(p[c]) <= COMPLETION_TOKENS[1]
                       for c in ("chosen", "rejected")) for p in pairs), "lengths in range")
    expect(check_packing(pairs) == [] and all(
        len(pack_micro_batches(step_pairs(pairs, s))) == PAIRS_PER_STEP // ROWS
        for s in range(STEPS)), "every step packs into 2 micro-batches, one pair a row")
    short = [dict(p, chosen=p["chosen"][:40]) for p in pairs]
    expect(check_packing(short) != [], "shorter completions would share rows (refused)")
    expect(step_pairs(pairs, STEPS)[0] is pairs[0], "steps wrap around the set")
    expect(sorted(pairs_spec(pairs[:2], "ipo")) == sorted(
        ["seq_len", "rows", "pairs_per_step", "pad_id", "beta", "loss", "label_smoothing",
         "rpo_alpha", "lr", "warmup", "weight_decay", "max_grad_norm", "pairs"]),
        "PAIRS_JSON has dpo_reference's fields")


def write_tiny_llama(folder, seed, vocab=256):
    """A Hugging Face folder of a 2-layer Llama (hidden 64), random f32 weights (std 0.1)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
    rng = random.Random(seed)
    shapes = {"model.embed_tokens.weight": [vocab, 64], "model.norm.weight": [64],
              "lm_head.weight": [vocab, 64]}
    for layer in range(2):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": [64], p + "post_attention_layernorm.weight":
                       [64], p + "self_attn.q_proj.weight": [64, 64],
                       p + "self_attn.k_proj.weight": [32, 64],
                       p + "self_attn.v_proj.weight": [32, 64],
                       p + "self_attn.o_proj.weight": [64, 64], p + "mlp.gate_proj.weight":
                       [128, 64], p + "mlp.up_proj.weight": [128, 64],
                       p + "mlp.down_proj.weight": [64, 128]})
    header, data = {}, b""
    for name in sorted(shapes):
        n = math.prod(shapes[name])
        values = [1.0] * n if name.endswith("norm.weight") else [rng.gauss(0, 0.1)
                                                                 for _ in range(n)]
        raw = struct.pack(f"<{n}f", *values)
        header[name] = {"dtype": "F32", "shape": shapes[name],
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(folder)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def engine_metrics_match(out, opts, pairs):
    """step.json's metrics against step_metrics of its own per-pair values and
    reference_logps.json (the engine's formulas against this script's)."""
    step = json.load(open(os.path.join(out, "step.json")))
    ref = json.load(open(os.path.join(out, "reference_logps.json")))
    got = step["pair_logps"]
    k = [e["pair"] for e in got]
    n = lambda c: [len(pairs[i][c]) for i in k]  # noqa: E731
    m = step_metrics(opts, [e["chosen"] for e in got], [e["rejected"] for e in got],
                     [ref[i]["chosen"] for i in k], [ref[i]["rejected"] for i in k],
                     n("chosen"), n("rejected"))
    return all(close(step[key], m[key], 1e-9) for key in METRICS), step, m


def self_test_engine(bin_dir):
    tool = os.path.join(bin_dir, "dpo_reference")
    work = tempfile.mkdtemp(prefix="dpo-self-test-")
    try:
        policy, other = os.path.join(work, "policy"), os.path.join(work, "other")
        write_tiny_llama(policy, 1)
        write_tiny_llama(other, 2)
        pairs = make_pairs(toy_chain(256), 256, 8 * PAIRS_PER_STEP)  # 8 steps' worth, wrapping
        for loss in ("sigmoid", "ipo"):
            spec = os.path.join(work, f"pairs-{loss}.json")
            with open(spec, "w") as f:
                json.dump(pairs_spec(pairs, loss, lr=5e-4), f)
            out = os.path.join(work, f"out-{loss}")
            subprocess.run([tool, policy, spec, out, "--backend", "cpu", "--steps", "16"],
                           check=True, stdout=subprocess.DEVNULL)
            step = json.load(open(os.path.join(out, "step.json")))
            start = math.log(2) if loss == "sigmoid" else 25.0
            expect(close(step["loss"], start, 1e-12) and step["rewards/chosen"] == 0.0
                   and step["rewards/margins"] == 0.0 and step["rewards/accuracies"] == 0.0,
                   f"{loss}: step 1 at {start:.6f} with every reward exactly 0 "
                   f"(loss {step['loss']!r})")
            ok, _, _ = engine_metrics_match(out, dpo_options(loss), pairs)
            expect(ok, f"{loss}: the engine's step-1 metrics are step_metrics' of its values")
            accs = [s["rewards/accuracies"] for s in
                    json.load(open(os.path.join(out, "curve.json")))["steps"]]
            losses = json.load(open(os.path.join(out, "curve.json")))["losses"]
            expect(sum(accs[-5:]) / 5 > 0.9 and losses[-1] < losses[0],
                   f"{loss}: accuracy rises ({accs[0]} -> {sum(accs[-5:]) / 5:.3f} over the "
                   f"last 5), loss falls ({losses[0]:.4f} -> {losses[-1]:.4f})")
            final = json.load(open(os.path.join(out, "policy_logps_final.json")))
            expect(len(final) == len(pairs) and os.path.exists(
                os.path.join(out, "checkpoint-16", "config.json")),
                f"{loss}: final per-pair values and checkpoint-16 written")
        # A reference model of its own: rewards not 0, so every metric's formula shows; with
        # label smoothing and RPO for the sigmoid loss.
        smoothed = dict(dpo_options("sigmoid"), label_smoothing=0.1, rpo_alpha=0.5)
        for name, opts in (("ipo", dpo_options("ipo")), ("sigmoid-cdpo-rpo", smoothed)):
            spec = os.path.join(work, f"pairs-ref-{name}.json")
            with open(spec, "w") as f:
                json.dump({**pairs_spec(pairs, opts["loss"]), **opts}, f)
            out = os.path.join(work, f"out-reference-{name}")
            subprocess.run([tool, policy, spec, out, "--backend", "cpu", "--steps", "0",
                            "--reference", other], check=True, stdout=subprocess.DEVNULL)
            ok, step, m = engine_metrics_match(out, opts, pairs)
            expect(ok and step["rewards/chosen"] != 0.0 and 0 < step["rewards/accuracies"] < 1,
                   f"--reference, {name}: the engine's metrics are step_metrics' (loss "
                   f"{step['loss']:.4f}, rewards/chosen {step['rewards/chosen']:.4f}, "
                   f"accuracy {step['rewards/accuracies']})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def self_test(bin_dir):
    print("formulas:")
    self_test_formulas()
    print("checks:")
    self_test_checks()
    print("pair set:")
    self_test_pairs()
    if bin_dir:
        print("dpo_reference on the CPU backend:")
        self_test_engine(bin_dir)
    print("self-test passed")


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--self-test":
        self_test(sys.argv[2] if len(sys.argv) > 2 else None)
        return
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    if torch is None:
        sys.exit("torch, transformers and safetensors are needed (or run --self-test)")
    hf_models.run_families(sys.argv[1], sys.argv[2], sys.argv[3:], configs(), check_family,
                           summary)


if __name__ == "__main__":
    main()
