#!/usr/bin/env bash
# Property-based fuzzing of the HTTP API against its own /openapi.json (schemathesis).
# Starts a server on a temporary data dir, registers a user, fuzzes every operation, and
# fails on any 5xx or any response that contradicts the description. Usage:
#   scripts/api-fuzz.sh [PIGEON_BIN] [MAX_EXAMPLES]
# The "positive data acceptance" check is left out: a pattern cannot say that a single
# chat's id names its lower user first, so some schema-valid ids are rightly refused. So is
# "unsupported method" (405 for a method a path does not take): PROTOCOL.md 1 says every
# error has a status of its table, which has no 405, so Pigeon answers 404 not_found.
set -euo pipefail
source "$(dirname "$0")/listen-url.sh"
bin=${1:-./target/debug/pigeon}
examples=${2:-20}
dir=$(mktemp -d)
key=fuzz-admin-key-0123456789
# Port 0: the server picks a free port and prints "pigeon: listening on http://ADDR" (a port
# picked here could be taken by something else before the server binds it).
"$bin" serve --data-dir "$dir" --listen 127.0.0.1:0 --admin-key "$key" --send-rate-per-sec 0 >"$dir/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$dir"' EXIT
base="$(pigeon_listen_url "$pid" "$dir/server.log")"
for _ in $(seq 1 100); do curl -sf "$base/readyz" >/dev/null && break; sleep 0.1; done
curl -sf "$base/readyz" >/dev/null || { echo "FATAL: $base/readyz never answered 200" >&2; exit 1; }
api() { curl -sf "$base$1" -H "Authorization: Bearer $key" -H 'content-type: application/json' -d "$2"; }
api /v1/admin/users '{"user_id":1,"name":"fuzz"}' >/dev/null
api /v1/admin/users '{"user_id":2,"name":"peer"}' >/dev/null
token=$(api /v1/admin/tokens '{"user_id":1}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
# Some data, so that reads answer real objects that the response schemas are checked against.
as_user() { curl -sf "$base$1" -H "Authorization: Bearer $token" -H 'content-type: application/json' -d "$2"; }
as_user /v1/messages '{"client_msg_id":"seed-1","to":{"user":2},"kind":"text","content":"hello"}' >/dev/null
as_user /v1/groups '{"name":"seed","members":[2]}' >/dev/null
schemathesis run "$base/openapi.json" \
  -H "Authorization: Bearer $token" \
  --max-examples "$examples" --seed 42 \
  --checks all --exclude-checks positive_data_acceptance,unsupported_method
# The admin operations, with the admin key.
schemathesis run "$base/openapi.json" \
  -H "Authorization: Bearer $key" --include-path-regex '^/v1/admin' \
  --max-examples "$examples" --seed 42 \
  --checks all --exclude-checks positive_data_acceptance,unsupported_method
