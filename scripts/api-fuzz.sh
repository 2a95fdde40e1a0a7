#!/usr/bin/env bash
# Property-based fuzzing of the HTTP API against its own /openapi.json (schemathesis).
# Starts a server on a temporary data dir, registers a user, fuzzes every operation, and
# fails on any 5xx, any response that contradicts the description, any request valid by the
# description that is refused as malformed ("positive data acceptance"), and any invalid
# one that is taken. Usage:
#   scripts/api-fuzz.sh [PIGEON_BIN] [MAX_EXAMPLES]
# Two checks are left out. "Unsupported method" (405 for a method a path does not take):
# PROTOCOL.md 1 says every error has a status of its table, which has no 405, so Pigeon
# answers 404 not_found. "Use after free" (a resource deleted must then answer 404): a
# DELETE of the protocol does not remove what it names. DELETE /v1/messages/{msg_id} hides
# a message for the caller only, whose sender may still edit or recall it; the admin's
# leaves the message, deleted, in the audit; DELETE /v1/groups/{id} makes the group
# read-only (PROTOCOL.md 6).
# A few rules join two fields, or a request and what the server holds (a single chat's id
# names its lower user first; only a text message is edited), which JSON Schema cannot
# state: the description says them in words, and the hooks below (pigeon_hooks.py) keep the
# generated requests to them. They also keep long polls short, and never send a request on
# a socket that a WebSocket upgrade took.
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

cat >"$dir/schemathesis.toml" <<'EOF'
# 413 payload_too_large is the protocol's refusal of content over the limit (maxLength).
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]

# A WebSocket upgrade succeeds with 101 Switching Protocols.
[[operations]]
include-path = "/v1/ws"
checks.not_a_server_error.expected-statuses = ["101", "2xx", "3xx", "4xx"]
checks.positive_data_acceptance.expected-statuses = ["101", "401", "403", "404", "409", "429", "5xx"]
EOF

cat >"$dir/pigeon_hooks.py" <<'EOF'
"""Keeps the requests schemathesis makes to the rules that JSON Schema cannot state (the
description says them in words): without these a request valid by its schemas could still
be malformed (400). Applied just before each request is sent, in every phase."""
import re

import schemathesis
from requests.adapters import HTTPAdapter
from schemathesis import GenerationMode

MAX_USER_ID = 2**53 - 1
# The user the fuzzing token belongs to.
CALLER = 1
USER_CONTENT = {"text", "image", "voice", "video", "file", "custom"}
# A single chat's id, alone or at the end of a conversation list cursor.
SINGLE_CHAT = re.compile(r"^((?:[01]\.[0-9]+\.[0-9]+\.)?)([1-9][0-9]*)-([1-9][0-9]*)$")
# The kind of every message the server has answered with, by msg_id.
KINDS = {}

_build_response = HTTPAdapter.build_response


def build_response(self, request, response):
    """After a 101 the socket speaks WebSocket: closed here, so that it is never taken
    again from the pool for the next request (which would read the server's frames)."""
    if response.status == 101 and getattr(response, "connection", None) is not None:
        response.connection.close()
    return _build_response(self, request, response)


HTTPAdapter.build_response = build_response


def lower_user_first(value):
    """A single chat's id names its lower user first, and two different users."""
    if isinstance(value, dict):
        return {k: lower_user_first(v) for k, v in value.items()}
    if isinstance(value, list):
        return [lower_user_first(v) for v in value]
    if not isinstance(value, str):
        return value
    m = SINGLE_CHAT.match(value)
    if not m:
        return value
    a, b = int(m[2]), int(m[3])
    if a > MAX_USER_ID or b > MAX_USER_ID:
        return value
    if a == b:
        b = a + 1 if a < MAX_USER_ID else a - 1
    lo, hi = sorted((a, b))
    return f"{m[1]}{lo}-{hi}"


def as_int(value):
    """A number as the request carries it (some phases write query values as text)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value):
        return int(value)
    return None


def put(query, name, number):
    """Sets `name` to `number`, spelled as it was."""
    query[name] = str(number) if isinstance(query.get(name), str) else number


def remember_kinds(value):
    if isinstance(value, dict):
        if isinstance(value.get("msg_id"), str) and isinstance(value.get("kind"), str):
            KINDS[value["msg_id"]] = value["kind"]
        for v in value.values():
            remember_kinds(v)
    elif isinstance(value, list):
        for v in value:
            remember_kinds(v)


@schemathesis.hook
def after_call(context, case, response):
    try:
        answer = response.json()
    except Exception:
        return
    remember_kinds(answer)
    # A send's answer has no kind: the request has it (a retry keeps the first one's).
    if case.path == "/v1/messages" and isinstance(case.body, dict) and isinstance(answer, dict):
        msg_id, kind = answer.get("msg_id"), case.body.get("kind")
        if isinstance(msg_id, str) and isinstance(kind, str) and not answer.get("duplicate"):
            KINDS.setdefault(msg_id, kind)


@schemathesis.hook
def before_call(context, case, kwargs):
    case.path_parameters = lower_user_first(case.path_parameters)
    query = lower_user_first(case.query) if isinstance(case.query, dict) else {}
    if isinstance(case.body, (dict, list, str)):
        case.body = lower_user_first(case.body)
    if case.path == "/v1/sync" and (as_int(query.get("wait_ms")) or 0) > 0:
        # A long poll from the inbox's start answers at once (it holds the seeded messages)
        # instead of waiting up to 30 s; the range of wait_ms is still what is checked. In
        # either mode: a request invalid for another reason may be valid enough to wait.
        if (as_int(query.get("user_seq")) or 0) >= 0:
            query.pop("user_seq", None)
    meta = case.meta
    if meta is None or meta.generation.mode == GenerationMode.POSITIVE:
        keep_to_rules(case, query)
    case.query = query


def keep_to_rules(case, query):
    method = case.method.upper()
    if case.path == "/v1/messages" and isinstance(case.body, dict):
        to = case.body.get("to")
        # Not a single chat with oneself.
        if isinstance(to, dict) and to.get("user") == CALLER:
            to["user"] = CALLER + 1
    elif case.path == "/v1/conversations/{id}/messages":
        # At most one of before and after; from_time not after to_time.
        if query.get("before") not in (None, "") and query.get("after") not in (None, ""):
            del query["after"]
        f, t = as_int(query.get("from_time")), as_int(query.get("to_time"))
        if f is not None and t is not None and f > t:
            put(query, "from_time", t)
            put(query, "to_time", f)
    elif case.path == "/v1/conversations/{id}/messages/range":
        # max(from, 1) <= to, at most 200 seqs.
        f, t = as_int(query.get("from")), as_int(query.get("to"))
        if f is not None and t is not None:
            f, t = min(f, t), max(f, t, 1)
            put(query, "from", f)
            put(query, "to", min(t, max(f, 1) + 199))
    elif case.path.startswith("/v1/messages/{msg_id}") and isinstance(case.path_parameters, dict):
        # Only a text message is edited, only a user's message recalled: a message known to
        # be another is swapped for one that does not exist (404).
        kind = KINDS.get(case.path_parameters.get("msg_id"))
        editing = case.path == "/v1/messages/{msg_id}" and method == "PATCH"
        recalling = case.path == "/v1/messages/{msg_id}/recall"
        if kind is not None and ((editing and kind != "text") or (recalling and kind not in USER_CONTENT)):
            case.path_parameters = {**case.path_parameters, "msg_id": "1"}
EOF

run() {
  SCHEMATHESIS_HOOKS="$dir/pigeon_hooks.py" schemathesis --config-file "$dir/schemathesis.toml" \
    run "$base/openapi.json" --max-examples "$examples" --seed 42 \
    --checks all --exclude-checks unsupported_method,use_after_free "$@"
}
run -H "Authorization: Bearer $token"
# The admin operations, with the admin key.
run -H "Authorization: Bearer $key" --include-path-regex '^/v1/admin'
