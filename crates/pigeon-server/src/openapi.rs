//! The OpenAPI 3 description served at `/openapi.json`, built from [`ENDPOINTS`], the table
//! a test checks against the router so that the two cannot drift apart.

use pigeon_core::rules;
use serde_json::{Map, Value, json};

/// Who may call an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    Public,
    User,
    Admin,
}

/// (method, path, caller, summary) of every HTTP endpoint.
pub const ENDPOINTS: &[(&str, &str, Caller, &str)] = &[
    ("get", "/", Caller::Public, "the chat page (HTML)"),
    (
        "get",
        "/healthz",
        Caller::Public,
        "200 when the process is up, 503 once its pipeline stopped (restart it)",
    ),
    (
        "get",
        "/readyz",
        Caller::Public,
        "200 when the server can serve, 503 otherwise",
    ),
    ("get", "/metrics", Caller::Public, "Prometheus text metrics"),
    ("get", "/openapi.json", Caller::Public, "this document"),
    (
        "get",
        "/v1/ws",
        Caller::User,
        "WebSocket upgrade (PROTOCOL.md section 5); subprotocols pigeon.v1.json (text, the default) and pigeon.v1.proto (binary, proto/pigeon.proto)",
    ),
    (
        "post",
        "/v1/admin/users",
        Caller::Admin,
        "register or update a user",
    ),
    (
        "post",
        "/v1/admin/tokens",
        Caller::Admin,
        "mint a user token",
    ),
    (
        "post",
        "/v1/admin/users/{id}/logout",
        Caller::Admin,
        "revoke a user's tokens and close their connections",
    ),
    (
        "get",
        "/v1/admin/messages/{msg_id}",
        Caller::Admin,
        "a message with its original content and versions",
    ),
    (
        "delete",
        "/v1/admin/messages/{msg_id}",
        Caller::Admin,
        "delete a message for everyone",
    ),
    ("post", "/v1/admin/rooms", Caller::Admin, "open a live room"),
    (
        "delete",
        "/v1/admin/rooms/{id}",
        Caller::Admin,
        "close a live room",
    ),
    (
        "get",
        "/v1/rooms/{id}",
        Caller::User,
        "a live room's viewers and recent messages",
    ),
    ("post", "/v1/messages", Caller::User, "send a message"),
    (
        "post",
        "/v1/messages/{msg_id}/recall",
        Caller::User,
        "recall a message",
    ),
    (
        "patch",
        "/v1/messages/{msg_id}",
        Caller::User,
        "edit a text message",
    ),
    (
        "delete",
        "/v1/messages/{msg_id}",
        Caller::User,
        "delete a message for the caller only",
    ),
    (
        "get",
        "/v1/messages/{msg_id}/versions",
        Caller::User,
        "the edit history of a message",
    ),
    (
        "get",
        "/v1/conversations",
        Caller::User,
        "the caller's conversation list",
    ),
    (
        "get",
        "/v1/conversations/{id}",
        Caller::User,
        "one conversation",
    ),
    (
        "get",
        "/v1/conversations/{id}/messages",
        Caller::User,
        "a page of history",
    ),
    (
        "get",
        "/v1/conversations/{id}/messages/range",
        Caller::User,
        "messages from..=to",
    ),
    (
        "post",
        "/v1/conversations/{id}/read",
        Caller::User,
        "mark read up to a seq",
    ),
    (
        "get",
        "/v1/conversations/{id}/receipts",
        Caller::User,
        "who read a message",
    ),
    (
        "put",
        "/v1/conversations/{id}/settings",
        Caller::User,
        "pin, mute or hide",
    ),
    ("get", "/v1/unread", Caller::User, "unread counts"),
    (
        "get",
        "/v1/sync",
        Caller::User,
        "pull-mode sync with long polling",
    ),
    ("post", "/v1/groups", Caller::User, "create a group"),
    (
        "patch",
        "/v1/groups/{id}",
        Caller::User,
        "update name, notice, avatar",
    ),
    ("delete", "/v1/groups/{id}", Caller::User, "dismiss a group"),
    (
        "post",
        "/v1/groups/{id}/members",
        Caller::User,
        "invite members",
    ),
    (
        "get",
        "/v1/groups/{id}/members",
        Caller::User,
        "list members",
    ),
    (
        "delete",
        "/v1/groups/{id}/members/{uid}",
        Caller::User,
        "kick a member, or quit",
    ),
    (
        "put",
        "/v1/groups/{id}/admins/{uid}",
        Caller::User,
        "appoint an admin",
    ),
    (
        "delete",
        "/v1/groups/{id}/admins/{uid}",
        Caller::User,
        "remove an admin",
    ),
    (
        "post",
        "/v1/groups/{id}/mutes",
        Caller::User,
        "mute a member for a time",
    ),
    (
        "delete",
        "/v1/groups/{id}/mutes/{uid}",
        Caller::User,
        "unmute a member",
    ),
];

const ERROR_STATUSES: &[(&str, &str)] = &[
    ("400", "invalid_argument"),
    ("401", "unauthorized"),
    ("403", "forbidden, not_member or muted"),
    ("404", "not_found"),
    ("409", "conflict or window_expired"),
    ("413", "payload_too_large"),
    ("429", "rate_limited"),
    ("503", "unavailable"),
];

/// What a path parameter looks like. A single chat's id must also name its lower user id
/// first, which a pattern cannot say: such ids are refused with `invalid_argument`.
fn path_param_schema(name: &str) -> Value {
    match name {
        "msg_id" => json!({"type": "string", "pattern": "^[1-9][0-9]{0,17}$"}),
        "uid" => json!({"type": "string", "pattern": "^[1-9][0-9]{0,14}$"}),
        "id" => {
            json!({"type": "string", "pattern": "^(g[1-9][0-9]{0,17}|r[0-9]{1,30}|[1-9][0-9]{0,14}-[1-9][0-9]{0,14})$"})
        }
        _ => json!({"type": "string"}),
    }
}

/// The query parameters an endpoint reads.
fn query_params(method: &str, path: &str) -> Vec<Value> {
    let q = |name: &str, required: bool, schema: Value| json!({"name": name, "in": "query", "required": required, "schema": schema});
    let int = |min: u64| json!({"type": "integer", "minimum": min});
    match (method, path) {
        ("get", "/v1/ws") => vec![
            q(
                "device_id",
                true,
                json!({"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}),
            ),
            q(
                "platform",
                false,
                json!({"type": "string", "enum": ["ios", "android", "web", "desktop"]}),
            ),
            q("token", false, json!({"type": "string"})),
        ],
        ("get", "/v1/conversations") => vec![
            q(
                "limit",
                false,
                json!({"type": "integer", "minimum": 1, "description": "capped at 200"}),
            ),
            q("cursor", false, json!({"type": "string"})),
        ],
        ("get", "/v1/conversations/{id}/messages") => vec![
            q(
                "limit",
                false,
                json!({"type": "integer", "minimum": 1, "description": "capped at 100"}),
            ),
            q("before", false, int(0)),
            q("after", false, int(0)),
            q("from_time", false, json!({"type": "integer"})),
            q("to_time", false, json!({"type": "integer"})),
        ],
        ("get", "/v1/conversations/{id}/messages/range") => {
            // `from=0` is the chain's start (seqs start at 1), as in a `pull`.
            vec![q("from", true, int(0)), q("to", true, int(0))]
        }
        ("get", "/v1/conversations/{id}/receipts") => vec![q("seq", true, int(0))],
        ("get", "/v1/groups/{id}/members") => vec![
            q("cursor", false, json!({"type": "string"})),
            q(
                "limit",
                false,
                json!({"type": "integer", "minimum": 1, "description": "capped at 1000"}),
            ),
        ],
        ("get", "/v1/sync") => vec![
            q("user_seq", false, int(0)),
            q(
                "limit",
                false,
                json!({"type": "integer", "minimum": 1, "description": "capped at 200"}),
            ),
            q(
                "wait_ms",
                false,
                json!({"type": "integer", "minimum": 0, "maximum": 30000}),
            ),
        ],
        _ => Vec::new(),
    }
}

/// The body schema of the requests whose shape is worth spelling out (tools generate valid
/// bodies from it); the others take any object.
fn request_schema(method: &str, path: &str) -> Option<Value> {
    let uid = json!({"type": "integer", "minimum": 1, "maximum": 9007199254740991u64});
    let ids = json!({"type": "array", "items": uid});
    Some(match (method, path) {
        ("post", "/v1/admin/users") => json!({"type": "object", "required": ["user_id"],
            // Left out or null: kept as the user has it (PROTOCOL-EXTENSIONS.md).
            "properties": {"user_id": uid,
                "name": {"type": "string", "nullable": true, "maxLength": rules::MAX_USER_NAME_CHARS},
                "avatar": {"type": "string", "nullable": true, "maxLength": rules::MAX_AVATAR_CHARS}}}),
        ("post", "/v1/admin/tokens") => json!({"type": "object", "required": ["user_id"],
            "properties": {"user_id": uid, "ttl_secs": {"type": "integer", "minimum": 0, "nullable": true}}}),
        ("post", "/v1/messages") => {
            json!({"type": "object", "required": ["client_msg_id", "to", "kind", "content"],
            "properties": {
                "client_msg_id": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "to": {"type": "object", "properties": {"user": uid, "conversation": {"type": "string"}}},
                "kind": {"type": "string", "enum": ["text", "image", "voice", "video", "file", "custom"]},
                "content": {"type": "string", "minLength": 1},
                "extra": {},
                "reply_to": {"type": "string"},
                "mentions": ids
            }})
        }
        ("patch", "/v1/messages/{msg_id}") => {
            json!({"type": "object", "required": ["content"], "properties": {"content": {"type": "string", "minLength": 1}}})
        }
        ("post", "/v1/conversations/{id}/read") => {
            json!({"type": "object", "required": ["seq"], "properties": {"seq": {"type": "integer", "minimum": 0}}})
        }
        ("put", "/v1/conversations/{id}/settings") => json!({"type": "object",
            "properties": {"pinned": {"type": "boolean", "nullable": true}, "muted": {"type": "boolean", "nullable": true}, "hidden": {"type": "boolean", "nullable": true}}}),
        ("post", "/v1/groups") => {
            json!({"type": "object", "properties": {"name": {"type": "string"}, "members": ids}})
        }
        ("patch", "/v1/groups/{id}") => json!({"type": "object",
            "properties": {"name": {"type": "string", "nullable": true}, "notice": {"type": "string", "nullable": true}, "avatar": {"type": "string", "nullable": true}}}),
        ("post", "/v1/groups/{id}/members") => {
            json!({"type": "object", "required": ["user_ids"], "properties": {"user_ids": {"type": "array", "items": uid, "minItems": 1, "maxItems": 1000}}})
        }
        ("post", "/v1/groups/{id}/mutes") => {
            json!({"type": "object", "required": ["user_id", "duration_secs"],
            "properties": {"user_id": uid, "duration_secs": {"type": "integer", "minimum": 1}}})
        }
        _ => return None,
    })
}

fn schema_ref(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

/// The success body of each endpoint whose shape is the protocol's; the others are objects.
fn response_schema(method: &str, path: &str) -> Value {
    let list = |key: &str, item: &str| json!({"type": "object", "required": [key], "properties": {key: {"type": "array", "items": schema_ref(item)}}});
    match (method, path) {
        ("post", "/v1/messages") => schema_ref("SendAck"),
        ("post", "/v1/messages/{msg_id}/recall")
        | ("patch", "/v1/messages/{msg_id}")
        | ("delete", "/v1/messages/{msg_id}")
        | ("delete", "/v1/admin/messages/{msg_id}") => schema_ref("Message"),
        ("get", "/v1/conversations/{id}")
        | ("put", "/v1/conversations/{id}/settings")
        | ("post", "/v1/groups")
        | ("patch", "/v1/groups/{id}")
        | ("post", "/v1/groups/{id}/members") => schema_ref("Conversation"),
        ("get", "/v1/conversations") => {
            json!({"type": "object", "required": ["conversations", "next_cursor"], "properties": {
            "conversations": {"type": "array", "items": schema_ref("Conversation")},
            "next_cursor": {"type": "string", "nullable": true}}})
        }
        ("get", "/v1/conversations/{id}/messages") => {
            json!({"type": "object", "required": ["messages", "has_more"], "properties": {
            "messages": {"type": "array", "items": schema_ref("Message")},
            "has_more": {"type": "boolean"}}})
        }
        ("get", "/v1/conversations/{id}/messages/range") => list("messages", "Message"),
        _ => json!({"type": "object"}),
    }
}

/// The protocol's objects (PROTOCOL.md section 1 and 6), for the response descriptions.
fn component_schemas() -> Value {
    let int = json!({"type": "integer"});
    let nullable_int = json!({"type": "integer", "nullable": true});
    let nullable_str = json!({"type": "string", "nullable": true});
    json!({
        "Error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string", "enum": ["invalid_argument", "unauthorized", "forbidden", "not_member", "muted",
                    "not_found", "conflict", "window_expired", "payload_too_large", "rate_limited", "unavailable", "internal"]},
                "message": {"type": "string"},
                "retry_after_ms": int
            }
        },
        "Message": {
            "type": "object",
            "required": ["msg_id", "conversation_id", "seq", "sender", "client_msg_id", "kind", "content", "extra",
                "reply_to", "mentions", "status", "version", "created_at", "edited_at"],
            "properties": {
                "msg_id": {"type": "string", "pattern": "^[0-9]+$"},
                "conversation_id": {"type": "string"},
                "seq": {"type": "integer", "minimum": 1},
                "sender": {"type": "integer", "minimum": 1},
                "client_msg_id": nullable_str,
                "kind": {"type": "string", "enum": ["text", "image", "voice", "video", "file", "custom", "group_created",
                    "member_invited", "member_kicked", "member_quit", "member_muted", "member_unmuted", "group_updated",
                    "group_dismissed", "recall", "edit"]},
                "content": {"type": "string"},
                "extra": {"nullable": true},
                "reply_to": {"type": "string", "nullable": true, "pattern": "^[0-9]+$"},
                "mentions": {"type": "array", "items": int},
                "status": {"type": "string", "enum": ["normal", "recalled", "deleted"]},
                "version": {"type": "integer", "minimum": 1},
                "created_at": int,
                "edited_at": nullable_int
            }
        },
        "SendAck": {
            "type": "object",
            "required": ["client_msg_id", "msg_id", "conversation_id", "seq", "created_at", "duplicate"],
            "properties": {
                "client_msg_id": {"type": "string"},
                "msg_id": {"type": "string", "pattern": "^[0-9]+$"},
                "conversation_id": {"type": "string"},
                "seq": {"type": "integer", "minimum": 1},
                "created_at": int,
                "duplicate": {"type": "boolean"}
            }
        },
        "Conversation": {
            "type": "object",
            "required": ["conversation_id", "type", "name", "member_count", "seq", "fanout", "last_message", "unread",
                "last_read_seq", "pinned", "muted", "updated_at"],
            "properties": {
                "conversation_id": {"type": "string"},
                "type": {"type": "string", "enum": ["single", "group"]},
                "peer": int,
                "name": nullable_str,
                "member_count": int,
                "seq": int,
                "fanout": {"type": "string", "enum": ["write", "read"]},
                "last_message": {"allOf": [schema_ref("Message")], "nullable": true},
                "unread": int,
                "last_read_seq": int,
                "pinned": {"type": "boolean"},
                "muted": {"type": "boolean"},
                "updated_at": int,
                "hidden": {"type": "boolean"},
                "notice": nullable_str,
                "avatar": nullable_str,
                "owner": nullable_int,
                "dismissed": {"type": "boolean"}
            }
        }
    })
}

pub fn document() -> Value {
    let mut paths = Map::new();
    for (method, path, caller, summary) in ENDPOINTS {
        let mut responses = Map::new();
        let content = match *path {
            "/" => json!({"text/html": {"schema": {"type": "string"}}}),
            "/metrics" => json!({"text/plain": {"schema": {"type": "string"}}}),
            _ => json!({"application/json": {"schema": response_schema(method, path)}}),
        };
        let ok = if *path == "/v1/ws" { "101" } else { "200" };
        responses.insert(
            ok.into(),
            json!({"description": "success", "content": content}),
        );
        if *path == "/readyz" || *path == "/healthz" {
            responses.insert("503".into(), json!({"description": "not ready (readyz), or the pipeline stopped (both)", "content": {"application/json": {"schema": {"type": "object"}}}}));
        }
        if *caller != Caller::Public {
            for (status, codes) in ERROR_STATUSES {
                responses.insert(
                    (*status).into(),
                    json!({"description": codes, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}),
                );
            }
        }
        let mut params: Vec<Value> = path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(|name| json!({"name": name, "in": "path", "required": true, "schema": path_param_schema(name)}))
            .collect();
        params.extend(query_params(method, path));
        let mut op = json!({"summary": summary, "parameters": params, "responses": responses});
        match caller {
            Caller::Public => {}
            Caller::User => op["security"] = json!([{"userToken": []}]),
            Caller::Admin => op["security"] = json!([{"adminKey": []}]),
        }
        let takes_body = !matches!(
            *path,
            "/v1/admin/rooms" | "/v1/admin/users/{id}/logout" | "/v1/messages/{msg_id}/recall"
        ) && !path.ends_with("/admins/{uid}");
        if matches!(*method, "post" | "put" | "patch") && takes_body {
            let schema = request_schema(method, path).unwrap_or_else(|| json!({"type": "object"}));
            op["requestBody"] =
                json!({"required": false, "content": {"application/json": {"schema": schema}}});
        }
        let entry = paths.entry((*path).to_owned()).or_insert_with(|| json!({}));
        entry[*method] = op;
    }
    json!({
        "openapi": "3.0.3",
        "info": {"title": "Pigeon", "version": env!("CARGO_PKG_VERSION"), "description": "Instant-messaging back end. The wire contract is PROTOCOL.md."},
        "paths": paths,
        "components": {
            "securitySchemes": {
                "userToken": {"type": "http", "scheme": "bearer"},
                "adminKey": {"type": "http", "scheme": "bearer"}
            },
            "schemas": component_schemas()
        }
    })
}
