//! The OpenAPI 3 description served at `/openapi.json`, built from [`ENDPOINTS`], the table
//! a test checks against the router so that the two cannot drift apart.

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
        "200 when the process is up",
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
        "WebSocket upgrade (PROTOCOL.md section 5)",
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

pub fn document() -> Value {
    let mut paths = Map::new();
    for (method, path, caller, summary) in ENDPOINTS {
        let mut responses = Map::new();
        responses.insert("200".into(), json!({"description": "success", "content": {"application/json": {"schema": {"type": "object"}}}}));
        if *caller != Caller::Public {
            for (status, codes) in ERROR_STATUSES {
                responses.insert(
                    (*status).into(),
                    json!({"description": codes, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}),
                );
            }
        }
        let params: Vec<Value> = path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(|name| json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}))
            .collect();
        let mut op = json!({"summary": summary, "parameters": params, "responses": responses});
        match caller {
            Caller::Public => {}
            Caller::User => op["security"] = json!([{"userToken": []}]),
            Caller::Admin => op["security"] = json!([{"adminKey": []}]),
        }
        if matches!(*method, "post" | "put" | "patch") {
            op["requestBody"] = json!({"required": false, "content": {"application/json": {"schema": {"type": "object"}}}});
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
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["code", "message"],
                    "properties": {
                        "code": {"type": "string"},
                        "message": {"type": "string"},
                        "retry_after_ms": {"type": "integer"}
                    }
                }
            }
        }
    })
}
