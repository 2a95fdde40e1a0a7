# Sourced by the scripts that start `pigeon serve --listen 127.0.0.1:0` (a port picked by the
# script could be taken before the server binds it): `pigeon_listen_url PID FILE` waits for
# the server's "pigeon: listening on http://ADDR" line in FILE (its stdout) and prints the
# URL; it fails loudly if the server exits first or says nothing for 20 s.
pigeon_listen_url() {
  local pid=$1 out=$2 url=""
  for _ in $(seq 1 200); do
    url="$(sed -n 's/^pigeon: listening on \(http:\/\/[^ ]*\).*/\1/p' "$out" | head -n 1)"
    if [ -n "$url" ]; then
      echo "$url"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { echo "FATAL: pigeon serve exited at start" >&2; cat "$out" >&2; return 1; }
    sleep 0.1
  done
  echo "FATAL: pigeon serve did not say where it listens" >&2
  return 1
}
