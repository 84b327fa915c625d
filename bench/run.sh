#!/usr/bin/env bash
# The benchmark runner: runs named suites on this machine and writes each suite's result to
# bench/results/<hardware>/<suite>.json, replacing the one there (the history is git's).
#
#   bench/run.sh [--list] SUITE...
#
# Run it from the repository root (or an unpacked bundle beside the repository's bench/ and
# tests/), with the bundle's bin/ (deploy/bundle.sh) on PATH. <hardware> comes from
# nvidia-smi's GPU name (e.g. h200; "h200x2" for the suites that use every GPU), else "cpu".
# Environment:
#   WORK                 raw outputs, logs and timelines of the runs (default ./bench-work)
#   RESULTS              where the suites' results go (default bench/results beside this file)
#   MEGATRAIN_PROFILE    the planner's machine profile; measured once into WORK if unset
#   SCRATCH              a folder on a disk with ~45 GB free (checkpoint, nvme; default
#                        ./bench-scratch, never under WORK)
# A suite's result holds, per run: the command, its exit status, its JSON (or its output's
# JSON lines, or its text lines) and the last lines of its log.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")

SUITES=(
  "machine      machine_bench: GEMM, attention, grouped-GEMM, AdamW and PCIe rates (saved as the profile)"
  "attention    machine_bench --attention-only: the mma, Hopper and fused-backward attention kernels"
  "dense        train_bench steps: Qwen2.5-1.5B 4K/64K, Qwen2.5-7B 64K (all and 24 GiB), Llama-3.1-8B 64K and seq 8K 128K"
  "depth        train_bench: the 1.5B width at 28 and 84 layers on one fixed plan"
  "generate     train_bench --eval (the forward-only pass), generate_bench (Qwen2.5-7B resident and streamed, a GPT-OSS-120B cut streamed) and transformers' generate on the 7B work"
  "long         train_bench: Qwen2.5-7B one 128K sequence; 2 layers of one 512K sequence"
  "lora         train_bench: LoRA r16 beside the full fine-tune on the same shape and tokens (Llama-3.1-8B 4K and 8K, Qwen2.5-7B 4K, GPT-OSS-120B 2 layers), and GPT-OSS-120B cut to 16 layers with LoRA on its attention and experts (its floors, host bytes a parameter)"
  "dpo          train_bench: Qwen2.5-7B DPO steps (a 4K-token pair a row) beside SFT steps on the same shape, and the forward-only pass (the reference's)"
  "dpo-numerics tests/hf/compare_dpo_with_torch.py: DPO (sigmoid, IPO) on qwen2, llama3, qwen3_moe against a PyTorch reference from the paper"
  "clip         train_bench: clipped steps (fp32 and fp16 clip stores) beside unclipped ones: Qwen2.5-7B 4K 64K, Llama-3.1-8B 8K 128K, Qwen2.5-1.5B 64K, a GPT-OSS-120B layer at 256K"
  "lora-numerics tests/hf/compare_lora_with_peft.py: LoRA (attention, MLP, experts) and a frozen embedding against peft + transformers"
  "moe          train_bench: Qwen3-30B-A3B, Mixtral-8x7B and GPT-OSS-120B cuts at 64K and 256K tokens"
  "moe-floors   train_bench --no-optimizer on the MoE cuts: the step without the CPU optimizer"
  "host-bytes   train_bench: Qwen2.5-7B and Llama-3.1-8B with and without the bf16 copy, int8 moments, the auto plan"
  "nvme         train_bench: Qwen2.5-7B with a third of its layers' moments on disk (SCRATCH)"
  "power        nvidia-smi's clock and power over two whole steps and 12 s of sustained GEMMs"
  "gemm         gemm_probe.py: the step's GEMM shapes through cuBLAS, cuBLASLt and torch"
  "kernels      ncu: every kernel's time in 2-layer cuts of Llama-3.1-8B (8K) and Qwen2.5-7B (4K)"
  "attention-ncu ncu: the Hopper attention passes' pipes and stalls at 8K (forward, dq, dk/dv)"
  "checkpoint   checkpoint_bench: a checkpoint written while training runs (1.5B, 64K and 4K; SCRATCH)"
  "pytorch      the reference: PyTorch eager 1.5B training (hf_train_reference.py) and torch's CPU AdamW"
  "numerics     tests/hf/compare_gpu_with_transformers.py: every family against transformers on text"
  "moments      moment_dtype_curves.py: 200-step loss curves with fp32, bf16 and int8 moments (CPU)"
  "tokenizer    tokenizer_bench on TOKENIZER (tokenizer.json), TOKENIZER_CONFIG and INPUT (a text file)"
  "daemon       daemon_vs_bench.py: a job's step through megatraind against train_bench's"
  "daemon-load  daemon_load: 1000 queued jobs, 200 watchers, submit/get/list latencies"
  "metrics      metrics_vs_bench.py: megatraind's exported rates against train_bench's"
  "data-parallel data_parallel.py: one job on 1 and on every GPU (needs 2 or more)"
  "lanes        lanes.py: one lane per GPU, two users' jobs side by side, then a gang (root)"
  "ab           two train_bench builds (TRAIN_BENCH_A, TRAIN_BENCH_B) on one plan: losses and step times"
)

if [ "${1:-}" = "--list" ] || [ $# -eq 0 ]; then
  for s in "${SUITES[@]}"; do
    read -r name text <<< "$s"
    printf '%-14s %s\n' "$name" "$text"
  done
  [ $# -eq 0 ] && { echo "usage: bench/run.sh [--list] SUITE..." >&2; exit 2; }
  exit 0
fi

WORK=$(mkdir -p "${WORK:-$PWD/bench-work}" && cd "${WORK:-$PWD/bench-work}" && pwd)
RESULTS=${RESULTS:-$HERE/results}
SCRATCH=${SCRATCH:-$PWD/bench-scratch}
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -c . || true)

hardware() {  # [multi]: the GPU's model (with xN for a suite on every GPU), else cpu
  local name
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  [ -n "$name" ] || { echo cpu; return; }
  name=$(echo "$name" | tr 'A-Z-' 'a-z ' | sed -E 's/nvidia//; s/\b[0-9]+gb\b|\bhbm[0-9e]*\b|\bpcie\b|\bsxm[0-9]*\b|\bnvl\b//g' |
         tr -s ' ' | sed -E 's/^ //; s/ $//; s/ /-/g')
  if [ "${1:-}" = multi ] && [ "$GPUS" -gt 1 ]; then name=${name}x$GPUS; fi
  echo "$name"
}

RUNS=()  # this suite's runs: name, in the order they ran
run() {  # name, timeout seconds, command...: stdout to DIR/name.out, stderr to DIR/name.log
  local name=$1 limit=$2; shift 2
  echo "== $SUITE/$name: $*" >&2
  printf '%q ' "$@" > "$DIR/$name.cmd"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$DIR/$name.out" 2> "$DIR/$name.log"
  local rc=$?
  echo "$rc" > "$DIR/$name.rc"
  echo "   rc=$rc in $((SECONDS - t0)) s" >&2
  RUNS+=("$name")
}
note() {  # name, a run's JSON file written by the tool itself (--json): its result instead
  cp "$2" "$DIR/$1.out" 2>/dev/null
}

save() {  # [multi]: the suite's runs into RESULTS/<hardware>/<suite>.json
  local hw
  hw=$(hardware "${1:-}")
  mkdir -p "$RESULTS/$hw"
  python3 - "$DIR" "$RESULTS/$hw/$SUITE.json" "$SUITE" "$hw" "${RUNS[@]}" <<'PY'
import datetime, json, os, subprocess, sys
folder, path, suite, hw, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
def text(name, ext):
    try:
        with open(os.path.join(folder, name + ext), errors="replace") as f:
            return f.read()
    except OSError:
        return ""
def parsed(out):
    try:
        return json.loads(out)
    except ValueError:
        pass
    rows = []
    for line in out.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows if rows else out.splitlines()
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().splitlines()
except OSError:
    gpu = []
result = {"suite": suite, "hardware": hw, "gpus": gpu, "host_cores": os.cpu_count(),
          "measured_utc": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
          "command": "bench/run.sh " + suite, "runs": {}}
for name in names:
    rc = text(name, ".rc").strip()
    result["runs"][name] = {"command": text(name, ".cmd").strip(),
                            "rc": int(rc) if rc else None,
                            "result": parsed(text(name, ".out")),
                            "log_tail": text(name, ".log").splitlines()[-5:]}
with open(path + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
os.replace(path + ".tmp", path)
bad = [n for n, r in result["runs"].items() if r["rc"] != 0]
print(f"{path}: {len(names)} runs" + (f", failed: {' '.join(bad)}" if bad else ""), file=sys.stderr)
PY
}

profile() {  # the planner's profile for the runs after it: MEGATRAIN_PROFILE, else measured once
  if [ -z "${MEGATRAIN_PROFILE:-}" ]; then export MEGATRAIN_PROFILE=$WORK/machine-profile.json; fi
  [ -f "$MEGATRAIN_PROFILE" ] && return
  echo "== the machine profile: $MEGATRAIN_PROFILE" >&2
  timeout 400 machine_bench --backend cuda --save "$MEGATRAIN_PROFILE" \
    > "$WORK/machine_bench.json" 2> "$WORK/machine_bench.log"
}
bin_dir() { dirname "$(command -v "${1:-megatraind}")"; }
train() {  # name, timeout, train_bench arguments... (with a timeline in DIR)
  local name=$1 limit=$2; shift 2
  run "$name" "$limit" train_bench "$@" --timeline "$DIR/${name}_timeline.json"
}
moe() {  # no-optimizer flag or "", shape, layers, tokens, more arguments...
  local flag=$1 shape=$2 layers=$3 tokens=$4; shift 4
  train "${shape}_${layers}l_${tokens}" 420 --shape "$shape" --layers "$layers" --seq 4096 \
    --tokens-per-step "$tokens" --steps 4 $flag "$@"
}
ncu_attention() {  # name, kernel regex, launches to skip, head_dim
  run "$1" 200 ncu --clock-control none -k "regex:$2" --launch-skip "$3" --launch-count 1 \
    --set full --page raw --csv machine_bench --backend cuda --attention-only \
    --attention-kernels hopper --attention-lengths 8192 --attention-head-dims "$4"
  mv "$DIR/$1.out" "$DIR/$1.csv"
  python3 "$HERE/ncu_pipes.py" "$DIR/$1.csv" > "$DIR/$1.out" 2>> "$DIR/$1.log"
}

suite() {
  case "$SUITE" in
    machine)
      export MEGATRAIN_PROFILE=${MEGATRAIN_PROFILE:-$WORK/machine-profile.json}
      run machine_bench 400 machine_bench --backend cuda --save "$MEGATRAIN_PROFILE"; save ;;
    attention)
      run attention_rates 300 machine_bench --backend cuda --attention-only \
        --attention-kernels mma hopper hopper-fused; save ;;
    dense)
      profile
      train qwen2.5-1.5b_4k 300 --shape qwen2.5-1.5b --seq 4096 --tokens-per-step 4096 --steps 8
      train qwen2.5-1.5b_64k 300 --shape qwen2.5-1.5b --seq 4096 --tokens-per-step 65536 --steps 7
      train qwen2.5-7b_64k 400 --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 --steps 5 \
        --warmup 2
      train qwen2.5-7b_64k_24gib 400 --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 \
        --steps 5 --device-memory-gib 24
      train llama-3.1-8b_64k 400 --shape llama-3.1-8b --seq 4096 --tokens-per-step 65536 --steps 4
      train llama-3.1-8b_seq8k_128k 400 --shape llama-3.1-8b --seq 8192 --tokens-per-step 131072 \
        --steps 3 --warmup 1
      save ;;
    generate)
      profile
      train qwen2.5-7b_64k_eval 400 --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 \
        --steps 5 --warmup 2 --eval
      run qwen2.5-7b_resident 400 generate_bench --shape qwen2.5-7b --prompts 64 \
        --prompt-len 512 --new 512
      run qwen2.5-7b_streamed 400 generate_bench --shape qwen2.5-7b --prompts 64 \
        --prompt-len 512 --new 12 --stream
      # The GPT-OSS-120B shape cut to 12 of its 36 layers (~80 GB of bf16 weights: the host
      # RAM of a 125 GiB box), streamed at the batch the planner picks.
      run gpt-oss-120b_12l_streamed 600 generate_bench --shape gpt-oss-120b --layers 12 \
        --prompts 64 --prompt-len 512 --new 6 --stream
      run transformers_qwen2.5-7b 900 python3 "$HERE/hf_generate_reference.py" \
        --shape qwen2.5-7b --prompts 64 --prompt-len 512 --new 512
      save ;;
    depth)
      profile
      for layers in 28 84; do
        run "qwen2.5-1.5b_${layers}l_fixed" 400 train_bench --shape qwen2.5-1.5b --layers "$layers" \
          --seq 4096 --tokens-per-step 65536 --checkpoints host --k 1 --kept-layers 0 \
          --weight-slots 0 --steps 6
      done
      save ;;
    long)
      profile
      train qwen2.5-7b_seq128k 400 --shape qwen2.5-7b --seq 131072 --tokens-per-step 131072 \
        --steps 2 --warmup 1
      train qwen2.5-7b_2l_seq512k 600 --shape qwen2.5-7b --layers 2 --seq 524288 \
        --tokens-per-step 524288 --mlp-tile 4096 --steps 2 --warmup 1
      save ;;
    moe|moe-floors)
      profile
      local flag=
      [ "$SUITE" = moe-floors ] && flag=--no-optimizer
      moe "$flag" qwen3-30b-a3b 4 65536
      moe "$flag" qwen3-30b-a3b 4 262144
      moe "$flag" mixtral-8x7b 4 65536
      moe "$flag" gpt-oss-120b 2 262144 --vocab 32000
      if [ "$SUITE" = moe ]; then
        moe "" qwen3-30b-a3b 12 65536 --bf16-copy no
        moe "" mixtral-8x7b 4 262144
        moe "" gpt-oss-120b 2 65536 --vocab 32000
      fi
      save ;;
    host-bytes)
      profile
      for shape in qwen2.5-7b llama-3.1-8b; do
        local common=(--shape "$shape" --seq 4096 --tokens-per-step 65536 --steps 5 --warmup 2)
        run "${shape}_copy_yes" 400 train_bench "${common[@]}" --bf16-copy yes
        run "${shape}_copy_no" 400 train_bench "${common[@]}" --bf16-copy no
        run "${shape}_int8_copy_no" 400 train_bench "${common[@]}" --bf16-copy no --state-dtype int8
        run "${shape}_auto_plan" 120 train_bench "${common[@]}" --bf16-copy auto --plan-only
      done
      save ;;
    nvme)
      mkdir -p "$SCRATCH"
      local saved=${MEGATRAIN_PROFILE:-}
      export MEGATRAIN_PROFILE=$DIR/machine-profile.json  # with the disk's rates
      run machine_bench 400 machine_bench --backend cuda --nvme-dir "$SCRATCH" \
        --save "$MEGATRAIN_PROFILE"
      # The largest host cap whose plan puts at least a third of the 28 layers on disk.
      local cap= c n
      for c in 84 82 80 78 76 74 72; do
        n=$(timeout 60 train_bench --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 \
              --bf16-copy no --nvme-dir "$SCRATCH" --host-memory-gib $c --plan-only 2>/dev/null |
            python3 -c "import json,sys; print(json.load(sys.stdin)['plan']['nvme_layers'])")
        echo "   cap $c GiB: ${n:-?} layers on disk" >&2
        if [ -n "$n" ] && [ "$n" -ge 9 ]; then cap=$c; break; fi
      done
      local common=(--shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 --steps 5 --warmup 2
                    --bf16-copy no)
      if [ -n "$cap" ]; then
        run qwen2.5-7b_copy_no_nvme 400 train_bench "${common[@]}" --nvme-dir "$SCRATCH" \
          --host-memory-gib "$cap"
      fi
      run qwen2.5-7b_copy_no 400 train_bench "${common[@]}"  # the same losses, all in RAM
      rm -rf "$SCRATCH"
      if [ -n "$saved" ]; then export MEGATRAIN_PROFILE=$saved; else unset MEGATRAIN_PROFILE; fi
      save ;;
    power)
      profile
      local fields=timestamp,utilization.gpu,clocks.sm,power.draw,temperature.gpu
      local reasons=clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown,clocks_event_reasons.sw_thermal_slowdown,clocks_event_reasons.hw_power_brake_slowdown
      nvidia-smi --query-gpu=$fields,$reasons --format=csv,noheader -c 1 > /dev/null 2>&1 &&
        fields=$fields,$reasons
      : > "$DIR/marks.txt"
      mark() { echo "$(date -u +%Y/%m/%d\ %H:%M:%S.%3N) $*" >> "$DIR/marks.txt"; }
      nvidia-smi --query-gpu=$fields --format=csv -lms 100 > "$DIR/smi.csv" 2>&1 &
      local smi=$!
      mark "start step_qwen2.5-7b_64k"
      train step_qwen2.5-7b_64k 400 --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 \
        --steps 4 --warmup 2
      mark "end step_qwen2.5-7b_64k"
      mark "start step_llama-3.1-8b_seq8k_128k"
      train step_llama-3.1-8b_seq8k_128k 400 --shape llama-3.1-8b --seq 8192 \
        --tokens-per-step 131072 --steps 3 --warmup 1
      mark "end step_llama-3.1-8b_seq8k_128k"
      mark "start sustained_gemm"
      run sustained_gemm 120 python3 "$HERE/gemm_probe.py" --sustained 12 \
        --json "$DIR/sustained_gemm.json"
      note sustained_gemm "$DIR/sustained_gemm.json"
      mark "end sustained_gemm"
      kill "$smi"
      run spans 60 python3 "$HERE/smi_spans.py" "$DIR/smi.csv" "$DIR/marks.txt" \
        --json "$DIR/spans.json"
      note spans "$DIR/spans.json"
      save ;;
    gemm)
      run gemm_probe 400 python3 "$HERE/gemm_probe.py" --json "$DIR/gemm_probe.json"
      note gemm_probe "$DIR/gemm_probe.json"; save ;;
    kernels)
      profile  # outside ncu: else train_bench measures one under ncu, and its kernels join the list
      local cut shape seq
      for cut in "llama-3.1-8b 8192" "qwen2.5-7b 4096"; do
        read -r shape seq <<< "$cut"
        run "ncu_$shape" 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
          --page raw train_bench --shape "$shape" --layers 2 --seq "$seq" --tokens-per-step "$seq" \
          --steps 2 --warmup 1
        mv "$DIR/ncu_$shape.out" "$DIR/ncu_$shape.csv"
        run "$shape" 60 python3 "$HERE/ncu_kernel_times.py" "$DIR/ncu_$shape.csv" \
          --json "$DIR/$shape.json" --top 25
        note "$shape" "$DIR/$shape.json"
      done
      save ;;
    attention-ncu)
      ncu_attention forward_d128 HopperForward 2 128
      ncu_attention forward_d64 HopperForward 2 64
      ncu_attention dq_d128 HopperDq 1 128
      ncu_attention dkdv_d128 HopperDkDv 1 128
      save ;;
    checkpoint)
      profile
      mkdir -p "$SCRATCH"
      df -h "$SCRATCH" >&2
      run qwen2.5-1.5b_64k 600 checkpoint_bench --dir "$SCRATCH" --shape qwen2.5-1.5b --seq 4096 \
        --tokens-per-step 65536 --before 4 --after 2
      run qwen2.5-1.5b_4k 600 checkpoint_bench --dir "$SCRATCH" --shape qwen2.5-1.5b --seq 4096 \
        --tokens-per-step 4096 --before 6 --after 3 --verify 0
      rm -rf "$SCRATCH"
      save ;;
    pytorch)
      run hf_qwen2.5-1.5b_64k 900 python3 "$HERE/hf_train_reference.py" --shape qwen2.5-1.5b \
        --seq 4096 --tokens-per-step 65536
      run torch_cpu_adamw 600 python3 "$HERE/torch_cpu_adamw.py"
      save ;;
    lora)
      profile
      for shape_seq in "llama-3.1-8b 4096" "llama-3.1-8b 8192" "qwen2.5-7b 4096"; do
        read -r shape seq <<< "$shape_seq"
        for how in lora full; do
          flags=(); [ "$how" = lora ] && flags=(--lora-rank 16)
          train "${shape}_seq${seq}_${how}" 400 --shape "$shape" --seq "$seq" \
            --tokens-per-step 65536 --steps 6 --warmup 2 "${flags[@]}"
        done
      done
      MOE_LORA=q_proj,k_proj,v_proj,o_proj,experts.gate_up_proj,experts.down_proj
      # GPT-OSS-120B: 2 layers both ways (a full fine-tune of more does not fit 125 GiB at
      # 12 bytes a parameter); 16 of its 36 layers with LoRA (~100 GiB of bf16 base). LoRA
      # on the attention and the experts.
      for how in lora full; do
        flags=(); [ "$how" = lora ] && flags=(--lora-rank 16 --lora-targets "$MOE_LORA")
        train "gpt-oss-120b_2l_${how}" 420 --shape gpt-oss-120b --layers 2 --seq 4096 \
          --tokens-per-step 262144 --steps 4 --warmup 2 "${flags[@]}"
      done
      train gpt-oss-120b_16l_lora 600 --shape gpt-oss-120b --layers 16 --seq 4096 \
        --tokens-per-step 262144 --steps 3 --warmup 1 --lora-rank 16 --lora-targets "$MOE_LORA"
      save ;;
    dpo)
      profile
      train qwen2.5-7b_64k_sft 400 --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 \
        --steps 5 --warmup 2 --eval
      train qwen2.5-7b_64k_dpo 400 --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 \
        --steps 5 --warmup 2 --dpo
      save ;;
    dpo-numerics)
      run compare_dpo_with_torch 5400 python3 "$ROOT/tests/hf/compare_dpo_with_torch.py" \
        "$(dirname "$(command -v dpo_reference)")" "$DIR/compare"
      save ;;
    clip)
      profile
      # Each shape unclipped, then clipped with each store (a store that does not fit this
      # box is refused by the planner: its run records the refusal).
      for shape_seq_tokens in "qwen2.5-7b 4096 65536" "llama-3.1-8b 8192 131072" \
                              "qwen2.5-1.5b 4096 65536"; do
        read -r shape seq tokens <<< "$shape_seq_tokens"
        train "${shape}_${seq}_noclip" 400 --shape "$shape" --seq "$seq" \
          --tokens-per-step "$tokens" --steps 5 --warmup 2 --max-grad-norm 0
        for store in fp32 fp16; do
          train "${shape}_${seq}_clip_${store}" 400 --shape "$shape" --seq "$seq" \
            --tokens-per-step "$tokens" --steps 5 --warmup 2 --max-grad-norm 1 \
            --clip-store "$store"
        done
      done
      for norm in 0 1; do
        train "gpt-oss-120b_1l_256k_clip${norm}" 420 --shape gpt-oss-120b --layers 1 \
          --seq 4096 --tokens-per-step 262144 --steps 4 --warmup 2 --max-grad-norm "$norm"
      done
      save ;;
    lora-numerics)
      run compare_lora_with_peft 5400 python3 "$ROOT/tests/hf/compare_lora_with_peft.py" \
        "$(command -v gpu_reference)" "$DIR/compare"
      save ;;
    numerics)
      MEGATRAIN_CMP_DATA=${MEGATRAIN_CMP_DATA:-text} run compare_with_transformers 3600 \
        python3 "$ROOT/tests/hf/compare_gpu_with_transformers.py" "$(command -v gpu_reference)" \
        "$DIR/compare"
      save ;;
    moments)
      run curves 3600 python3 "$HERE/moment_dtype_curves.py" "$(command -v megatrain-train)" \
        "$DIR/curves"
      save ;;
    tokenizer)
      run tokenizer 600 tokenizer_bench --tokenizer "${TOKENIZER:?TOKENIZER: a tokenizer.json}" \
        ${TOKENIZER_CONFIG:+--config "$TOKENIZER_CONFIG"} --input "${INPUT:?INPUT: a text file}" \
        --min_bytes 20000000 --runs 3
      save ;;
    daemon)
      profile
      run daemon_vs_bench 1800 python3 "$HERE/daemon_vs_bench.py" "$(bin_dir megatraind)"; save ;;
    daemon-load)
      run daemon_load 600 daemon_load --megatraind "$(command -v megatraind)"; save ;;
    metrics)
      profile
      run metrics_vs_bench 1200 python3 "$HERE/metrics_vs_bench.py" "$(bin_dir megatraind)"; save ;;
    data-parallel)
      [ "$GPUS" -ge 2 ] || { echo "data-parallel needs 2 GPUs or more" >&2; return; }
      run data_parallel 1800 python3 "$HERE/data_parallel.py" --bin "$(bin_dir megatrain-train)" \
        --devices "$GPUS"
      save multi ;;
    lanes)
      run lanes 1800 python3 "$HERE/lanes.py" --bin "$(bin_dir megatraind)"; save multi ;;
    ab)
      profile  # one profile, so both builds run the same plan
      local a=${TRAIN_BENCH_A:?TRAIN_BENCH_A: a train_bench} b=${TRAIN_BENCH_B:?TRAIN_BENCH_B}
      local small=(--shape qwen2.5-1.5b --seq 4096 --tokens-per-step 4096 --steps 10)
      local large=(--shape qwen2.5-7b --seq 4096 --tokens-per-step 65536 --steps 6)
      run small_A 400 "$a" "${small[@]}"; run small_B 400 "$b" "${small[@]}"
      run large_A 400 "$a" "${large[@]}"; run large_B 400 "$b" "${large[@]}"
      python3 - "$DIR" <<'PY' > "$DIR/summary.out"
import json, os, sys
def load(name):
    try:
        return json.load(open(os.path.join(sys.argv[1], name + ".out")))
    except (OSError, ValueError):
        return None
summary = {}
for size in ("small", "large"):
    a, b = load(size + "_A"), load(size + "_B")
    if not a or not b:
        continue
    la, lb = [s["loss"] for s in a["steps"]], [s["loss"] for s in b["steps"]]
    summary[size] = {"losses_equal": la == lb, "step_seconds_A": a["step_seconds"],
                     "step_seconds_B": b["step_seconds"],
                     "time_ratio_B_over_A": b["step_seconds"] / a["step_seconds"]}
print(json.dumps(summary))
PY
      echo 0 > "$DIR/summary.rc"; echo "(computed)" > "$DIR/summary.cmd"; RUNS+=(summary)
      cat "$DIR/summary.out" >&2
      save ;;
    *) echo "unknown suite $SUITE (bench/run.sh --list)" >&2; return 2 ;;
  esac
}

status=0
for SUITE in "$@"; do
  DIR=$WORK/$SUITE
  rm -rf "$DIR"; mkdir -p "$DIR"
  RUNS=()
  suite || status=$?
done
exit $status
