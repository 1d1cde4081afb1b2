# Sourced by the serving bench scripts. start_server NAME PORT LOG ARGS...: start `serve.launch_server --port PORT
# ARGS...` in the background (its output in LOG; its pid in $pid) and wait for /health, at most 300 s.
# start_command NAME PORT LOG CMD...: the same for any command that serves on PORT (e.g. a timed server:
# bench/serve_host_overhead.py --serve).
start_server() {
  local name=$1 port=$2 log=$3; shift 3
  start_command "$name" "$port" "$log" python3 -m serve.launch_server --port "$port" "$@"
}
start_command() {
  local name=$1 port=$2 log=$3; shift 3
  "$@" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && { echo "server $name ready after ${SECONDS}s"; return 0; }
    kill -0 $pid 2> /dev/null || { echo "server $name died"; tail -20 "$log"; return 1; }
    sleep 0.5
  done
  echo "server $name not ready"; return 1
}
