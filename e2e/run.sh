#!/usr/bin/env bash
# End-to-end browser test of the chat page (`GET /`): starts `pigeon serve` on a free port with a
# fresh data dir, runs `node --test e2e/chat.test.mjs` against it in headless Chromium, and
# always stops the server. Builds nothing: it runs $PIGEON_BIN, or ./target/debug/pigeon.
# Needs: Debian's `chromium` (/usr/bin/chromium, or $CHROMIUM_PATH) and `npm ci` run in e2e/.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
source "$root/scripts/listen-url.sh"
bin="${PIGEON_BIN:-$root/target/debug/pigeon}"
chromium="${CHROMIUM_PATH:-/usr/bin/chromium}"

[ -x "$bin" ] || { echo "FATAL: no pigeon binary at $bin (cargo build -p pigeon, or set PIGEON_BIN)" >&2; exit 1; }
[ -x "$chromium" ] || { echo "FATAL: no Chromium at $chromium (apt-get install chromium, or set CHROMIUM_PATH)" >&2; exit 1; }
[ -d "$here/node_modules/playwright-core" ] || { echo "FATAL: e2e/node_modules is missing (cd e2e && npm ci)" >&2; exit 1; }

data="$(mktemp -d)"
key="e2e-admin-key-$RANDOM$RANDOM-0123456789"
pid=""
cleanup() {
  local rc=$?
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  if [ "$rc" -ne 0 ] && [ -f "$data/server.log" ]; then
    echo "== last lines of the server's log" >&2
    tail -n 40 "$data/server.log" >&2 || true
  fi
  rm -rf "$data"
  exit "$rc"
}
trap cleanup EXIT INT TERM

# --fanout-write-max-members 2: groups of three or more use read fan-out (pushes without
# user_seq, followed by conversation seq), so the test covers both delivery paths.
# Port 0: the server picks a free port and prints "pigeon: listening on http://ADDR".
"$bin" serve --data-dir "$data/store" --listen 127.0.0.1:0 --admin-key "$key" \
  --send-rate-per-sec 0 --fanout-write-max-members 2 >"$data/server.out" 2>"$data/server.log" &
pid=$!

url="$(pigeon_listen_url "$pid" "$data/server.out")"

ready=""
for _ in $(seq 1 200); do
  if node -e "fetch(process.argv[1] + '/readyz').then(r => process.exit(r.ok ? 0 : 1), () => process.exit(1))" "$url"; then
    ready=1; break
  fi
  sleep 0.1
done
[ -n "$ready" ] || { echo "FATAL: $url/readyz never answered 200" >&2; exit 1; }
echo "pigeon serve is ready at $url"

cd "$root"
PIGEON_URL="$url" PIGEON_ADMIN_KEY="$key" CHROMIUM_PATH="$chromium" \
  node --test --test-concurrency=1 e2e/chat.test.mjs
