//! The OpenAPI 3 description served at `/openapi.json`, built from [`ENDPOINTS`], the table
//! a test checks against the router so that the two cannot drift apart, and from the
//! configuration, whose bounds (token lifetimes, content size) are part of what a request
//! may carry. Tools generate requests from it (schemathesis, in `scripts/api-fuzz.sh`), so
//! every schema says what the handlers take: a request it calls valid is not refused as
//! malformed, except by the few rules across fields that JSON Schema cannot state (each
//! said in its `description`).

use crate::config::Config;
use pigeon_core::rules;
use pigeon_proto::ids::MAX_USER_ID;
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
        "recall a message of a user (text ... custom: a command message answers 400)",
    ),
    (
        "patch",
        "/v1/messages/{msg_id}",
        Caller::User,
        "edit a text message (another kind answers 400)",
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
    ("431", "payload_too_large: the request head is over 64 KiB"),
    ("500", "internal"),
    ("503", "unavailable"),
];

/// The largest group (and message) snowflake: ids are positive 63-bit integers.
const MAX_SNOWFLAKE: u64 = i64::MAX as u64;

/// One digit class (`lo..=hi`) repeated `min..=max` times: the pieces the patterns of
/// decimal ranges are made of, kept as values so that a test can match them without a
/// regex engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Digits {
    lo: u8,
    hi: u8,
    min: usize,
    max: usize,
}

impl Digits {
    fn one(lo: u8, hi: u8) -> Self {
        Digits {
            lo,
            hi,
            min: 1,
            max: 1,
        }
    }

    fn render(self, out: &mut String) {
        if self.max == 0 {
            return;
        }
        match (self.lo, self.hi) {
            (d, h) if d == h => out.push(char::from(b'0' + d)),
            (0, 9) => out.push_str("[0-9]"),
            (l, h) => out.push_str(&format!("[{l}-{h}]")),
        }
        match (self.min, self.max) {
            (1, 1) => {}
            (n, m) if n == m => out.push_str(&format!("{{{n}}}")),
            (n, m) => out.push_str(&format!("{{{n},{m}}}")),
        }
    }
}

/// The decimal spellings, without a leading zero, of every integer in `1..=max`, as
/// alternatives: every shorter number, then, digit by digit, the numbers of `max`'s length
/// that are below it from that digit on, then `max` itself.
fn decimal_range(max: u64) -> Vec<Vec<Digits>> {
    assert!(max >= 1);
    let digits: Vec<u8> = max.to_string().bytes().map(|b| b - b'0').collect();
    let len = digits.len();
    let mut alternatives = Vec::new();
    if len > 1 {
        alternatives.push(vec![
            Digits::one(1, 9),
            Digits {
                lo: 0,
                hi: 9,
                min: 0,
                max: len - 2,
            },
        ]);
    }
    for (i, &d) in digits.iter().enumerate() {
        let lowest = if i == 0 { 1 } else { 0 };
        if d > lowest {
            let mut alternative: Vec<Digits> =
                digits[..i].iter().map(|&p| Digits::one(p, p)).collect();
            alternative.push(Digits::one(lowest, d - 1));
            let rest = len - i - 1;
            alternative.push(Digits {
                lo: 0,
                hi: 9,
                min: rest,
                max: rest,
            });
            alternatives.push(alternative);
        }
    }
    alternatives.push(digits.iter().map(|&d| Digits::one(d, d)).collect());
    alternatives
}

/// [`decimal_range`] as a regular expression group (unanchored).
fn decimal_pattern(max: u64) -> String {
    let mut out = String::from("(?:");
    for (i, alternative) in decimal_range(max).into_iter().enumerate() {
        if i > 0 {
            out.push('|');
        }
        for piece in alternative {
            piece.render(&mut out);
        }
    }
    out.push(')');
    out
}

/// The patterns of the protocol's ids (PROTOCOL.md 1), as path segments and JSON strings.
struct IdPatterns {
    user: String,
    group: String,
    single: String,
    conversation: String,
    msg: String,
    room: &'static str,
    token: &'static str,
}

impl IdPatterns {
    fn new() -> Self {
        let user = decimal_pattern(MAX_USER_ID);
        let snowflake = decimal_pattern(MAX_SNOWFLAKE);
        IdPatterns {
            user: format!("^{user}$"),
            group: format!("^g{snowflake}$"),
            single: format!("^{user}-{user}$"),
            conversation: format!("^(?:g{snowflake}|{user}-{user})$"),
            msg: format!("^{snowflake}$"),
            // `r`, the creation time in ms and a counter (`rooms::Rooms::create`); any other
            // name is only a room that does not exist (404).
            room: "^r[0-9]{2,39}$",
            token: "^[A-Za-z0-9_-]{1,64}$",
        }
    }
}

/// A single chat's id must name its lower user first (`1-2`, never `2-1` or `2-2`), which no
/// pattern states; such an id is refused as malformed (`400`).
const SINGLE_CHAT_ORDER: &str = "a single chat's id names its lower user id first: `{lo}-{hi}` with lo < hi (`111-222`; `222-111` and `111-111` are refused with 400 invalid_argument)";

/// The ids' own schemas, referenced by every parameter and body field that holds one.
fn id_schemas(p: &IdPatterns) -> Value {
    json!({
        "UserId": {"type": "integer", "minimum": 1, "maximum": MAX_USER_ID,
            "description": "a user id, 1..=2^53-1"},
        "UserIdSegment": {"type": "string", "pattern": p.user,
            "description": "a user id as a path segment: decimal digits, no leading zero, 1..=2^53-1"},
        "GroupId": {"type": "string", "pattern": p.group,
            "description": "a group's conversation id: `g` and a decimal snowflake (1..=2^63-1, no leading zero)"},
        "SingleChatId": {"type": "string", "pattern": p.single,
            "description": SINGLE_CHAT_ORDER},
        "ConversationId": {"type": "string", "pattern": p.conversation,
            "description": format!("a group id (`g` and a decimal snowflake) or a single chat's id; {SINGLE_CHAT_ORDER}")},
        "MsgId": {"type": "string", "pattern": p.msg,
            "description": "a message id: a decimal snowflake, 1..=2^63-1, no leading zero"},
        "RoomId": {"type": "string", "pattern": p.room,
            "description": "a live room's id, as `POST /v1/admin/rooms` gave it"},
        "ClientMsgId": {"type": "string", "pattern": p.token,
            "description": "1-64 characters of [A-Za-z0-9_-], unique per sender"},
        "DeviceId": {"type": "string", "pattern": p.token,
            "description": "1-64 characters of [A-Za-z0-9_-], stable per install"},
    })
}

/// What a path parameter holds: the same name (`{id}`) is a user, a group, a conversation
/// or a room depending on the path, and each kind of id has its own pattern.
fn path_param_schema(path: &str, name: &str) -> Value {
    let kind = match name {
        "msg_id" => "MsgId",
        "uid" => "UserIdSegment",
        "id" if path.starts_with("/v1/admin/users/") => "UserIdSegment",
        "id" if path.starts_with("/v1/groups/") => "GroupId",
        "id" if path.starts_with("/v1/conversations/") => "ConversationId",
        "id" if path.starts_with("/v1/admin/rooms/") || path.starts_with("/v1/rooms/") => "RoomId",
        _ => return json!({"type": "string"}),
    };
    schema_ref(kind)
}

/// `pattern` without its `^` and `$`, to be part of another.
fn unanchored(pattern: &str) -> &str {
    pattern
        .strip_prefix('^')
        .and_then(|p| p.strip_suffix('$'))
        .unwrap_or(pattern)
}

/// Any unsigned number a client writes (`u64`): larger ones are not refused but cut to the
/// cap the parameter's description gives.
fn uint(min: u64, description: &str) -> Value {
    json!({"type": "integer", "minimum": min, "maximum": u64::MAX, "description": description})
}

/// The query parameters an endpoint reads. An optional parameter given empty (`?limit=`) is
/// one not given (`api::ApiQuery`, `ws::upgrade`): `allowEmptyValue`. A required one given
/// empty is missing (`400`).
fn query_params(method: &str, path: &str, p: &IdPatterns) -> Vec<Value> {
    let q = |name: &str, required: bool, schema: Value| {
        let mut param =
            json!({"name": name, "in": "query", "required": required, "schema": schema});
        if !required {
            param["allowEmptyValue"] = json!(true);
        }
        param
    };
    let seq = |description: &str| uint(0, description);
    match (method, path) {
        ("get", "/v1/ws") => vec![
            q("device_id", true, schema_ref("DeviceId")),
            q(
                "platform",
                false,
                json!({"type": "string", "enum": ["ios", "android", "web", "desktop"]}),
            ),
            q(
                "token",
                false,
                json!({"type": "string", "description": "the user token, for browsers; the Authorization header wins when both are given"}),
            ),
        ],
        ("get", "/v1/conversations") => {
            // `{pinned}.{updated_at}.{last msg_id or 0}.{conversation_id}`
            // (`api::conversations::encode_cursor`); both numbers fit 63 bits.
            let n = decimal_pattern(MAX_SNOWFLAKE);
            let cursor = format!(
                "^[01]\\.(?:0|{n})\\.(?:0|{n})\\.{}$",
                unanchored(&p.conversation)
            );
            vec![
                q(
                    "limit",
                    false,
                    uint(1, "default 50; a larger limit is cut to 200"),
                ),
                q(
                    "cursor",
                    false,
                    json!({"type": "string", "pattern": cursor,
                    "description": format!("a `next_cursor` this server gave; {SINGLE_CHAT_ORDER}")}),
                ),
            ]
        }
        ("get", "/v1/conversations/{id}/messages") => vec![
            q(
                "limit",
                false,
                uint(1, "default 20; a larger limit is cut to 100"),
            ),
            q(
                "before",
                false,
                seq(
                    "the page just older than this seq; at most one of before and after (both: 400)",
                ),
            ),
            q(
                "after",
                false,
                seq(
                    "the page just newer than this seq; at most one of before and after (both: 400)",
                ),
            ),
            q(
                "from_time",
                false,
                json!({"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX,
                    "description": "ms, inclusive; not after to_time (400)"}),
            ),
            q(
                "to_time",
                false,
                json!({"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX,
                    "description": "ms, inclusive; not before from_time (400)"}),
            ),
        ],
        ("get", "/v1/conversations/{id}/messages/range") => vec![
            // `from=0` is the chain's start (seqs start at 1), as in a `pull`.
            q(
                "from",
                true,
                seq(
                    "inclusive; 0 is the chain's start. max(from, 1) <= to and the range holds at most 200 seqs (otherwise 400)",
                ),
            ),
            q(
                "to",
                true,
                seq(
                    "inclusive; max(from, 1) <= to and the range holds at most 200 seqs (otherwise 400)",
                ),
            ),
        ],
        ("get", "/v1/conversations/{id}/receipts") => vec![q(
            "seq",
            true,
            seq("a seq the caller can see (otherwise 404)"),
        )],
        ("get", "/v1/groups/{id}/members") => vec![
            q(
                "cursor",
                false,
                json!({"type": "string", "pattern": p.user,
                    "description": "a `next_cursor` this server gave: the last user id of the page before"}),
            ),
            q(
                "limit",
                false,
                uint(1, "default 100; a larger limit is cut to 1000"),
            ),
        ],
        ("get", "/v1/sync") => vec![
            q(
                "user_seq",
                false,
                seq("the inbox position the client holds; default 0"),
            ),
            q(
                "limit",
                false,
                uint(1, "default 100; a larger limit is cut to 200"),
            ),
            q(
                "wait_ms",
                false,
                json!({"type": "integer", "minimum": 0, "maximum": 30000,
                    "description": "how long to wait for something new (long poll); default 0"}),
            ),
        ],
        _ => Vec::new(),
    }
}

/// The headers an endpoint reads besides `Authorization`: a WebSocket upgrade's, as the
/// server checks them (axum's `WebSocketUpgrade`).
fn header_params(path: &str) -> Vec<Value> {
    let h = |name: &str, required: bool, schema: Value| json!({"name": name, "in": "header", "required": required, "schema": schema});
    if path != "/v1/ws" {
        return Vec::new();
    }
    vec![
        h(
            "Connection",
            true,
            json!({"type": "string", "pattern": "[Uu][Pp][Gg][Rr][Aa][Dd][Ee]", "description": "holds `upgrade` (any case)"}),
        ),
        h(
            "Upgrade",
            true,
            json!({"type": "string", "pattern": "^[Ww][Ee][Bb][Ss][Oo][Cc][Kk][Ee][Tt]$"}),
        ),
        h(
            "Sec-WebSocket-Version",
            true,
            json!({"type": "string", "enum": ["13"]}),
        ),
        h(
            "Sec-WebSocket-Key",
            true,
            // Base64 with its padding, and no bits set past the 16 bytes.
            json!({"type": "string", "pattern": "^[A-Za-z0-9+/]{21}[AQgw]==$", "description": "RFC 6455's nonce: 16 bytes in base64"}),
        ),
        h(
            "Sec-WebSocket-Protocol",
            false,
            json!({"type": "string", "description": "pigeon.v1.json (the default) or pigeon.v1.proto, in the client's order of preference; others are ignored"}),
        ),
    ]
}

/// Every request body is JSON that the handler reads whole (`api::ApiJson`): an empty body
/// is refused (`400`), so each is required. `None`: the endpoint reads no body.
fn request_schema(method: &str, path: &str, cfg: &Config) -> Option<Value> {
    let uid = schema_ref("UserId");
    let nullable_uid = json!({"allOf": [schema_ref("UserId")], "nullable": true});
    let text = |max: usize| json!({"type": "string", "maxLength": max, "description": format!("at most {max} characters")});
    let nullable_text = |max: usize| json!({"type": "string", "nullable": true, "maxLength": max, "description": format!("at most {max} characters")});
    let bytes = cfg.max_content_bytes;
    // JSON Schema counts characters; the server counts the UTF-8 bytes.
    let content = json!({"type": "string", "minLength": 1, "maxLength": bytes,
        "description": format!("at most {bytes} bytes of UTF-8 (413 payload_too_large past it)")});
    // At least one of `fields` given and not null: the handler refuses a change of nothing.
    let any_of = |fields: &[(&str, Value)]| -> Value {
        fields
            .iter()
            .map(|(name, schema)| json!({"required": [name], "properties": {*name: schema}}))
            .collect()
    };
    Some(match (method, path) {
        ("post", "/v1/admin/users") => json!({"type": "object", "required": ["user_id"],
            // Left out or null: kept as the user has it (PROTOCOL.md 6, Admin, extension).
            "properties": {"user_id": uid,
                "name": nullable_text(rules::MAX_USER_NAME_CHARS),
                "avatar": nullable_text(rules::MAX_AVATAR_CHARS)}}),
        ("post", "/v1/admin/tokens") => json!({"type": "object", "required": ["user_id"],
            "properties": {"user_id": uid,
                // 0 mints a token that has already expired.
                "ttl_secs": {"type": "integer", "nullable": true, "minimum": 0, "maximum": cfg.max_token_ttl_secs,
                    "description": format!("the token's lifetime; default 86400, at most {} (--max-token-ttl-secs)", cfg.max_token_ttl_secs)}}}),
        ("post", "/v1/messages") => {
            json!({"type": "object", "required": ["client_msg_id", "to", "kind", "content"],
            "properties": {
                "client_msg_id": schema_ref("ClientMsgId"),
                "to": {"type": "object",
                    "description": "exactly one of user (the single chat with that user, not the caller) and conversation",
                    "properties": {"user": nullable_uid,
                        "conversation": {"allOf": [schema_ref("ConversationId")], "nullable": true}},
                    "oneOf": [{"required": ["user"], "properties": {"user": schema_ref("UserId")}},
                        {"required": ["conversation"], "properties": {"conversation": schema_ref("ConversationId")}}]},
                "kind": {"type": "string", "enum": ["text", "image", "voice", "video", "file", "custom"]},
                "content": content,
                "extra": {"nullable": true, "description": format!("any JSON, nested at most {} levels deep and at most {bytes} bytes as JSON", rules::MAX_EXTRA_DEPTH)},
                "reply_to": {"allOf": [schema_ref("MsgId")], "nullable": true},
                "mentions": {"type": "array", "nullable": true, "items": uid, "maxItems": rules::MAX_MENTIONS}
            }})
        }
        ("patch", "/v1/messages/{msg_id}") => {
            json!({"type": "object", "required": ["content"], "properties": {"content": content}})
        }
        ("post", "/v1/conversations/{id}/read") => json!({"type": "object", "required": ["seq"],
            "properties": {"seq": uint(0, "marks read up to it; past the newest seq reads as the newest")}}),
        ("put", "/v1/conversations/{id}/settings") => {
            let flag = json!({"type": "boolean"});
            json!({"type": "object",
                "description": "at least one of pinned, muted and hidden, not null",
                "properties": {"pinned": {"type": "boolean", "nullable": true}, "muted": {"type": "boolean", "nullable": true}, "hidden": {"type": "boolean", "nullable": true}},
                "anyOf": any_of(&[("pinned", flag.clone()), ("muted", flag.clone()), ("hidden", flag)])})
        }
        ("post", "/v1/groups") => json!({"type": "object", "properties": {
            "name": text(rules::MAX_GROUP_NAME_CHARS),
            "members": {"type": "array", "items": uid, "maxItems": rules::MAX_USERS_PER_REQUEST,
                "description": "besides the caller, who is the owner"}}}),
        ("patch", "/v1/groups/{id}") => {
            let fields = [
                ("name", rules::MAX_GROUP_NAME_CHARS),
                ("notice", rules::MAX_NOTICE_CHARS),
                ("avatar", rules::MAX_AVATAR_CHARS),
            ];
            let properties: Map<String, Value> = fields
                .iter()
                .map(|(name, max)| ((*name).to_owned(), nullable_text(*max)))
                .collect();
            let given: Vec<(&str, Value)> = fields
                .iter()
                .map(|(name, max)| (*name, text(*max)))
                .collect();
            json!({"type": "object", "description": "at least one of name, notice and avatar, not null",
                "properties": properties, "anyOf": any_of(&given)})
        }
        ("post", "/v1/groups/{id}/members") => json!({"type": "object", "required": ["user_ids"],
            "properties": {"user_ids": {"type": "array", "items": uid, "minItems": 1, "maxItems": rules::MAX_USERS_PER_REQUEST}}}),
        ("post", "/v1/groups/{id}/mutes") => {
            json!({"type": "object", "required": ["user_id", "duration_secs"],
            "properties": {"user_id": uid,
                "duration_secs": {"type": "integer", "minimum": 1, "maximum": rules::MAX_MUTE_SECS}}})
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
fn component_schemas(p: &IdPatterns) -> Value {
    let int = json!({"type": "integer"});
    let nullable_int = json!({"type": "integer", "nullable": true});
    let nullable_str = json!({"type": "string", "nullable": true});
    let mut schemas = json!({
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
                "msg_id": schema_ref("MsgId"),
                "conversation_id": schema_ref("ConversationId"),
                "seq": {"type": "integer", "minimum": 1},
                "sender": schema_ref("UserId"),
                "client_msg_id": nullable_str,
                "kind": {"type": "string", "enum": ["text", "image", "voice", "video", "file", "custom", "group_created",
                    "member_invited", "member_kicked", "member_quit", "member_muted", "member_unmuted", "group_updated",
                    "group_dismissed", "recall", "edit"]},
                "content": {"type": "string"},
                "extra": {"nullable": true},
                "reply_to": {"type": "string", "nullable": true, "pattern": p.msg},
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
                "client_msg_id": schema_ref("ClientMsgId"),
                "msg_id": schema_ref("MsgId"),
                "conversation_id": schema_ref("ConversationId"),
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
                "conversation_id": schema_ref("ConversationId"),
                "type": {"type": "string", "enum": ["single", "group"]},
                "peer": schema_ref("UserId"),
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
    });
    if let (Some(all), Value::Object(ids)) = (schemas.as_object_mut(), id_schemas(p)) {
        all.extend(ids);
    }
    schemas
}

/// The description of the server `cfg` configures.
pub fn document(cfg: &Config) -> Value {
    let ids = IdPatterns::new();
    let mut paths = Map::new();
    for (method, path, caller, summary) in ENDPOINTS {
        let mut responses = Map::new();
        if *path == "/v1/ws" {
            responses.insert(
                "101".into(),
                json!({"description": "switching to the WebSocket protocol"}),
            );
        } else {
            let content = match *path {
                "/" => json!({"text/html": {"schema": {"type": "string"}}}),
                "/metrics" => json!({"text/plain": {"schema": {"type": "string"}}}),
                _ => json!({"application/json": {"schema": response_schema(method, path)}}),
            };
            responses.insert(
                "200".into(),
                json!({"description": "success", "content": content}),
            );
        }
        if *path == "/readyz" || *path == "/healthz" {
            responses.insert("503".into(), json!({"description": "not ready (readyz), or the pipeline stopped (both)", "content": {"application/json": {"schema": {"type": "object"}}}}));
        }
        if *caller != Caller::Public {
            for (status, codes) in ERROR_STATUSES {
                responses.insert(
                    (*status).into(),
                    json!({"description": codes, "content": {"application/json": {"schema": schema_ref("Error")}}}),
                );
            }
        }
        let mut params: Vec<Value> = path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(|name| json!({"name": name, "in": "path", "required": true, "schema": path_param_schema(path, name)}))
            .collect();
        params.extend(query_params(method, path, &ids));
        params.extend(header_params(path));
        let mut op = json!({"summary": summary, "parameters": params, "responses": responses});
        match caller {
            Caller::Public => {}
            Caller::User => op["security"] = json!([{"userToken": []}]),
            Caller::Admin => op["security"] = json!([{"adminKey": []}]),
        }
        if let Some(schema) = request_schema(method, path, cfg) {
            op["requestBody"] =
                json!({"required": true, "content": {"application/json": {"schema": schema}}});
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
            "schemas": component_schemas(&ids)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pigeon_proto::{ConversationId, MsgId, UserId};
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    /// Whether `s` is one of the spellings `alternatives` describe (what the rendered
    /// pattern matches, without a regex engine).
    fn matches(alternatives: &[Vec<Digits>], s: &str) -> bool {
        fn rest_matches(pieces: &[Digits], s: &[u8]) -> bool {
            let Some((first, rest)) = pieces.split_first() else {
                return s.is_empty();
            };
            (first.min..=first.max.min(s.len())).any(|n| {
                s[..n]
                    .iter()
                    .all(|&b| b.is_ascii_digit() && (first.lo..=first.hi).contains(&(b - b'0')))
                    && rest_matches(rest, &s[n..])
            })
        }
        alternatives.iter().any(|a| rest_matches(a, s.as_bytes()))
    }

    const MAXES: &[u64] = &[
        1,
        9,
        10,
        99,
        100,
        1009,
        5000,
        MAX_USER_ID,
        MAX_SNOWFLAKE,
        u64::MAX,
    ];

    #[test]
    fn a_decimal_range_is_every_number_up_to_its_max_in_one_spelling() {
        for &max in MAXES {
            let range = decimal_range(max);
            let mut edges = vec![0, 1, 2, 9, 10, 11, 99, 100, 101, max - 1, max];
            edges.extend(max.checked_add(1));
            for n in edges {
                assert_eq!(
                    matches(&range, &n.to_string()),
                    (1..=max).contains(&n),
                    "{n} against 1..={max}"
                );
            }
            for spelling in ["", "01", "+1", "1 ", "-1", "1.0"] {
                assert!(!matches(&range, spelling), "{spelling:?} against 1..={max}");
            }
            assert!(!matches(&range, &format!("{max}0")));
        }
    }

    proptest! {
        #[test]
        fn a_decimal_range_holds_what_it_should(n in any::<u64>(), cut in 0u32..20) {
            for &max in MAXES {
                let m = n / 10u64.pow(cut);
                prop_assert_eq!(matches(&decimal_range(max), &m.to_string()), (1..=max).contains(&m));
            }
        }
    }

    /// `count` strings of `pattern` (anchored with `^...$`, which proptest's generator leaves
    /// implied).
    fn samples(pattern: &str, count: usize) -> Vec<String> {
        let inner = pattern
            .strip_prefix('^')
            .and_then(|p| p.strip_suffix('$'))
            .expect("an anchored pattern");
        let strategy = proptest::string::string_regex(inner).expect("a pattern proptest reads");
        let mut runner = TestRunner::deterministic();
        (0..count)
            .map(|_| strategy.new_tree(&mut runner).unwrap().current())
            .collect()
    }

    fn schema<'a>(doc: &'a Value, name: &str) -> &'a Value {
        &doc["components"]["schemas"][name]
    }

    /// Every id a pattern allows is one the server's own parser takes, of its kind.
    #[test]
    fn each_kind_of_id_allows_only_its_own() {
        let doc = document(&Config::default());
        let pattern = |name: &str| schema(&doc, name)["pattern"].as_str().unwrap().to_owned();
        for s in samples(&pattern("UserIdSegment"), 500) {
            let n: u64 = s.parse().unwrap();
            assert!(UserId::new(n).is_ok() && n.to_string() == s, "{s}");
        }
        for s in samples(&pattern("GroupId"), 500) {
            assert!(ConversationId::parse(&s).is_ok_and(|c| c.is_group()), "{s}");
        }
        for s in samples(&pattern("MsgId"), 500) {
            assert!(MsgId::parse(&s).is_ok_and(|m| m.to_string() == s), "{s}");
        }
        // A single chat's pattern allows both orders (SINGLE_CHAT_ORDER); one of them is
        // the id.
        let single_chat = |s: &str| {
            let (a, b) = s.split_once('-').unwrap();
            ConversationId::parse(s).is_ok()
                || ConversationId::parse(&format!("{b}-{a}")).is_ok()
                || a == b
        };
        for s in samples(&pattern("SingleChatId"), 500) {
            assert!(!s.starts_with('g') && single_chat(&s), "{s}");
        }
        for s in samples(&pattern("ConversationId"), 500) {
            let group = ConversationId::parse(&s).is_ok_and(|c| c.is_group());
            assert!(group || single_chat(&s), "{s}");
        }
        for s in samples(&pattern("RoomId"), 100) {
            assert!(
                s.starts_with('r') && ConversationId::parse(&s).is_err(),
                "{s}"
            );
        }
    }

    /// The configured bounds are the described ones.
    #[test]
    fn configured_bounds_are_described() {
        let cfg = Config {
            max_token_ttl_secs: 600,
            max_content_bytes: 1000,
            ..Config::default()
        };
        let doc = document(&cfg);
        let body = |path: &str, method: &str| {
            doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
                .clone()
        };
        let ttl = &body("/v1/admin/tokens", "post")["properties"]["ttl_secs"];
        assert_eq!((&ttl["minimum"], &ttl["maximum"]), (&json!(0), &json!(600)));
        for (path, method) in [("/v1/messages", "post"), ("/v1/messages/{msg_id}", "patch")] {
            let content = &body(path, method)["properties"]["content"];
            assert_eq!(
                (&content["minLength"], &content["maxLength"]),
                (&json!(1), &json!(1000))
            );
        }
    }
}
