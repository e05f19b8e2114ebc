# Sourced by the benchmark scripts of bench/gpu: one way to start a benchmark server and to run
# the client against it. Reads BIN, CLIENT, PORT, MAX_BATCH_TOKENS (their defaults below, where
# the script sourcing this set none), DTYPE (server compute dtype, default bf16) and ANSWER_DTYPE
# (default bfloat16).
BIN="${BIN:-.gpu/layertap}"
CLIENT="${CLIENT:-.gpu/bench_http}"
PORT="${PORT:-18080}"
MAX_BATCH_TOKENS="${MAX_BATCH_TOKENS:-32768}"

# start_server MODEL DEVICES LOG [FLAGS...]: serves MODEL in the background ($server is its pid,
# killed on exit) and waits until it is ready.
start_server() {
  local model="$1" devices="$2" log="$3"
  shift 3
  "$BIN" serve --model "$model" --device "$devices" --dtype "${DTYPE:-bf16}" --host 127.0.0.1 --port "$PORT" \
    --max-batch-tokens "${MAX_BATCH_TOKENS:-32768}" --max-input-tokens 4096 --max-queue-tokens 1000000 "$@" 2>"$log" &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  for _ in $(seq 1 1200); do curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break; sleep 0.25; done
}

# clients WORKLOAD CONCURRENCY ENCODING: the HTTP client against the running server, every answer
# decoded; its JSON line gains the server's CPU seconds per thread name (bench/gpu/thread_cpu.py).
clients() {
  python3 bench/gpu/thread_cpu.py --pid "$server" -- "$CLIENT" --url "http://127.0.0.1:$PORT" --workload "$1" \
    --dtype "${ANSWER_DTYPE:-bfloat16}" --concurrency "$2" --encoding "$3"
}

# online_workloads SEQUENCES: online_8b.sh's default workload (300 sequences) and one of
# SEQUENCES in WORK; sets $w and $long to their descriptions.
online_workloads() {
  SEQUENCES=300 WORKLOAD_ONLY=1 bench/gpu/online_8b.sh
  SEQUENCES=$1 WORKLOAD_ONLY=1 bench/gpu/online_8b.sh
  w="$WORK/workload.json"
  long="$WORK/workload-$1.json"
}

# label TEXT: a JSON line on stdin with "contender": TEXT first.
label() { sed "s|^{|{\"contender\":\"$1\",|"; }
