//! The `pigeon.v1.proto` subprotocol: the JSON frames, carried as the protobuf messages of
//! `proto/pigeon.proto` in binary WebSocket frames. A connection that chose it is handled as
//! any other: its binary frames are transcoded to JSON text on the way in, and the JSON
//! frames the server writes (many shared by every recipient) to protobuf on the way out.
//! The schema is compiled once, at first use, from the file embedded in the binary, so the
//! `.proto` that clients generate code from is the one the server reads.
//!
//! The mapping: `{"type":T,"req":R,...fields}` is the envelope (`ClientFrame` or
//! `ServerFrame`) with `req` = R and its `frame` oneof's member T holding the fields, under
//! the names they have in JSON.

use prost::Message as _;
use prost_reflect::{
    DescriptorPool, DeserializeOptions, DynamicMessage, MessageDescriptor, SerializeOptions,
};
use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver};
use serde_json::{Map, Value};
use std::sync::OnceLock;

/// The subprotocol's name in `Sec-WebSocket-Protocol`.
pub const SUBPROTOCOL: &str = "pigeon.v1.proto";
/// The other one, the default: JSON text frames.
pub const JSON_SUBPROTOCOL: &str = "pigeon.v1.json";

const SCHEMA_NAME: &str = "pigeon.proto";
const SCHEMA: &str = include_str!("../../../proto/pigeon.proto");

/// The two envelopes of the compiled schema.
pub struct Schema {
    client: MessageDescriptor,
    server: MessageDescriptor,
}

struct Embedded;

impl FileResolver for Embedded {
    fn open_file(&self, name: &str) -> Result<File, protox::Error> {
        if name == SCHEMA_NAME {
            File::from_source(name, SCHEMA)
        } else {
            Err(protox::Error::file_not_found(name))
        }
    }
}

impl Schema {
    fn compile() -> Result<Schema, String> {
        let mut files = ChainFileResolver::new();
        files.add(Embedded);
        files.add(GoogleFileResolver::new());
        let mut compiler = protox::Compiler::with_file_resolver(files);
        compiler
            .open_file(SCHEMA_NAME)
            .map_err(|e| format!("proto/pigeon.proto does not compile: {e}"))?;
        let pool: DescriptorPool = compiler.descriptor_pool();
        let get = |name: &str| {
            pool.get_message_by_name(name)
                .ok_or_else(|| format!("proto/pigeon.proto has no {name}"))
        };
        Ok(Schema {
            client: get("pigeon.v1.ClientFrame")?,
            server: get("pigeon.v1.ServerFrame")?,
        })
    }

    /// The schema, compiled at the first call (the server calls it at start, so a broken
    /// schema stops it there rather than at a client's first frame).
    pub fn get() -> Result<&'static Schema, String> {
        static SCHEMA: OnceLock<Result<Schema, String>> = OnceLock::new();
        SCHEMA
            .get_or_init(Schema::compile)
            .as_ref()
            .map_err(Clone::clone)
    }

    /// A client's binary frame as the JSON frame it stands for. Every field without
    /// presence is written, with its default when unset: a protobuf client cannot leave
    /// such a field out, so `"seq":0` is what it sent, not a missing field. On an error,
    /// the frame's `req` when it could be read.
    pub fn client_frame_to_json(&self, bytes: &[u8]) -> Result<String, (Option<i64>, String)> {
        let envelope = DynamicMessage::decode(self.client.clone(), bytes).map_err(|e| {
            (
                req_of_client_frame(bytes),
                format!("not a pigeon.v1.ClientFrame: {e}"),
            )
        })?;
        let req = envelope.get_field_by_name("req").and_then(|r| {
            envelope
                .has_field_by_name("req")
                .then(|| r.as_i64())
                .flatten()
        });
        let mut json = envelope_to_json(&envelope, false).map_err(|e| (req, e))?;
        whole_numbers_as_integers(&mut json);
        Ok(json.to_string())
    }

    /// A server frame (JSON text) as the protobuf `ServerFrame` that carries it. A field the
    /// schema lacks is left out (a test checks that none is: `to_proto_strict`).
    pub fn server_frame_to_proto(&self, json: &str) -> Result<Vec<u8>, String> {
        json_to_envelope(&self.server, json, false).map(|m| m.encode_to_vec())
    }

    /// [`Schema::server_frame_to_proto`] for a connection, which gets a binary frame
    /// whatever happens. Only a message whose `extra` nests deeper than protobuf decoders
    /// go (stored before sends were limited to `MAX_EXTRA_DEPTH`) fails: it goes without
    /// its `extra` rather than not at all. A frame kind the schema lacks (a test checks
    /// every kind) goes as an empty envelope, which a client skips as an unknown frame.
    pub fn server_frame_for_client(&self, json: &str) -> Vec<u8> {
        self.server_frame_to_proto(json).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "a server frame does not fit protobuf; sent without extra");
            let mut v: Value = serde_json::from_str(json).unwrap_or_default();
            drop_extra(&mut v);
            self.server_frame_to_proto(&v.to_string())
                .unwrap_or_else(|e| {
                    tracing::error!(error = %e, "a server frame has no protobuf form");
                    Vec::new()
                })
        })
    }

    /// A client frame (JSON text) as protobuf: what a client of this subprotocol sends
    /// (tests).
    #[cfg(test)]
    fn client_frame_to_proto(&self, json: &str) -> Result<Vec<u8>, String> {
        json_to_envelope(&self.client, json, true).map(|m| m.encode_to_vec())
    }

    /// A server's binary frame as JSON text: what a client of this subprotocol reads
    /// (tests). Unset fields are left out.
    #[cfg(test)]
    fn server_frame_to_json(&self, bytes: &[u8]) -> Result<String, String> {
        let envelope = DynamicMessage::decode(self.server.clone(), bytes)
            .map_err(|e| format!("not a pigeon.v1.ServerFrame: {e}"))?;
        Ok(envelope_to_json(&envelope, true)?.to_string())
    }

    /// [`Schema::server_frame_to_proto`], refusing a field the schema lacks (tests).
    #[cfg(test)]
    fn to_proto_strict(&self, json: &str) -> Result<Vec<u8>, String> {
        json_to_envelope(&self.server, json, true).map(|m| m.encode_to_vec())
    }
}

/// Sets every `extra` in a frame to null.
fn drop_extra(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for (k, v) in m.iter_mut() {
                if k == "extra" {
                    *v = Value::Null;
                } else {
                    drop_extra(v);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(drop_extra),
        _ => {}
    }
}

/// `google.protobuf.Value` numbers are doubles: a whole one that an integer holds exactly
/// goes on as that integer, so that `"n":42` from a protobuf client reaches JSON clients as
/// `42`, not `42.0`.
fn whole_numbers_as_integers(v: &mut Value) {
    match v {
        Value::Number(n) => {
            if let Some(f) = n.as_f64().filter(|_| n.is_f64())
                && f.fract() == 0.0
                && f.abs() <= 9_007_199_254_740_992.0
            {
                *v = Value::from(f as i64);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(whole_numbers_as_integers),
        Value::Object(m) => m.values_mut().for_each(whole_numbers_as_integers),
        _ => {}
    }
}

/// `{"type":T,"req":R,...}` → the envelope with `req` and oneof member `T` set.
fn json_to_envelope(
    desc: &MessageDescriptor,
    json: &str,
    strict: bool,
) -> Result<DynamicMessage, String> {
    let Value::Object(mut fields) =
        serde_json::from_str::<Value>(json).map_err(|e| format!("not JSON: {e}"))?
    else {
        return Err("a frame is a JSON object".into());
    };
    let Some(Value::String(kind)) = fields.remove("type") else {
        return Err("a frame has a string type".into());
    };
    if desc
        .get_field_by_name(&kind)
        .and_then(|f| f.containing_oneof())
        .is_none()
    {
        return Err(format!("{} has no frame {kind}", desc.full_name()));
    }
    let req = fields.remove("req");
    let mut envelope = Map::new();
    if let Some(req) = req {
        envelope.insert("req".into(), req);
    }
    envelope.insert(kind, Value::Object(fields));
    DynamicMessage::deserialize_with_options(
        desc.clone(),
        Value::Object(envelope),
        &DeserializeOptions::new().deny_unknown_fields(strict),
    )
    .map_err(|e| format!("does not fit {}: {e}", desc.full_name()))
}

/// The envelope → `{"type":T,"req":R,...}`, with JSON's field names and numbers as numbers;
/// fields without presence that hold their default are left out when `skip_defaults`.
fn envelope_to_json(envelope: &DynamicMessage, skip_defaults: bool) -> Result<Value, String> {
    let options = SerializeOptions::new()
        .stringify_64_bit_integers(false)
        .use_proto_field_name(true)
        .skip_default_fields(skip_defaults);
    let value = envelope
        .serialize_with_options(serde_json::value::Serializer, &options)
        .map_err(|e| e.to_string())?;
    let Value::Object(mut fields) = value else {
        return Err("an envelope is a message".into());
    };
    let req = fields.remove("req");
    let mut members = fields.into_iter();
    let (Some((kind, Value::Object(inner))), None) = (members.next(), members.next()) else {
        return Err("the frame's oneof holds no frame".into());
    };
    let mut out = Map::new();
    out.insert("type".into(), Value::String(kind));
    if let Some(req) = req {
        out.insert("req".into(), req);
    }
    out.extend(inner);
    Ok(Value::Object(out))
}

/// The `req` of a protobuf `ClientFrame` (field 1), read without decoding the frame: its
/// other top-level fields are skipped, each in constant time, not built. So a frame refused
/// unread (over the size limit) or undecodable still has its error carry its `req`
/// (PROTOCOL.md 5: "the reply to it carries the same `req`"). What comes after a malformed
/// field is not read.
pub fn req_of_client_frame(mut bytes: &[u8]) -> Option<i64> {
    use prost::encoding::{DecodeContext, WireType, decode_key, decode_varint, skip_field};
    let mut req = None;
    while !bytes.is_empty() {
        let Ok((tag, wire)) = decode_key(&mut bytes) else {
            break;
        };
        let read = if tag == 1 && wire == WireType::Varint {
            // An int64 travels as its two's complement in a varint.
            decode_varint(&mut bytes).map(|v| req = Some(v as i64))
        } else {
            skip_field(wire, tag, &mut bytes, DecodeContext::default())
        };
        if read.is_err() {
            break;
        }
    }
    req
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_req_of_a_frame_is_read_without_decoding_it() {
        // req 7 alone; after a length-delimited field (the frame) it is still found; a
        // negative req (ten varint bytes); none; a field cut short before any req.
        let negative_3 = [
            0x08, 0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
        ];
        for (bytes, req) in [
            (&[0x08, 0x07][..], Some(7)),
            (&[0x12, 0x02, 0xaa, 0xbb, 0x08, 0x05][..], Some(5)),
            (&negative_3[..], Some(-3)),
            (&[0x12, 0x00][..], None),
            (&[0x12, 0x10, 0x01, 0x08, 0x05][..], None),
        ] {
            assert_eq!(req_of_client_frame(bytes), req, "{bytes:x?}");
        }
    }
    use pigeon_proto::frames::{RoomMessage, ServerFrame, SyncConversation, msg_frame};
    use pigeon_proto::views::{ChainItem, SendAck};
    use pigeon_proto::{ConversationId, DeviceId, ErrorCode, Message, MsgId, UserId};
    use serde_json::json;

    fn message() -> Message {
        serde_json::from_value(json!({
            "msg_id": "7301234567890123456", "conversation_id": "g7", "seq": 57, "sender": 111,
            "client_msg_id": "m-1", "kind": "custom", "content": "hello",
            "extra": {"card": {"title": "t", "tags": ["a", "b"], "on": true, "off": false,
                "n": 42, "none": null}},
            "reply_to": "7301234567890123455", "mentions": [222, 333], "status": "normal",
            "version": 2, "created_at": 1764403200123i64, "edited_at": 1764403200999i64
        }))
        .unwrap()
    }

    /// One frame of every kind the server writes. The match makes a new kind of
    /// `ServerFrame` fail to compile here until it has a sample (and a place in the schema).
    fn every_server_frame() -> Vec<String> {
        let user = UserId::new(111).unwrap();
        let conv = ConversationId::parse("g7").unwrap();
        let frames = vec![
            ServerFrame::Hello {
                user_id: user,
                device_id: DeviceId::parse("d1").unwrap(),
                server_time: 1,
                heartbeat_ms: 30000,
                user_seq: 5,
            },
            ServerFrame::SendAck {
                req: Some(3),
                ack: SendAck {
                    client_msg_id: "m-1".into(),
                    msg_id: MsgId::new(7301234567890123456).unwrap(),
                    conversation_id: conv.clone(),
                    seq: 57,
                    created_at: 5,
                    duplicate: true,
                },
            },
            ServerFrame::Msg {
                message: message(),
                user_seq: Some(10001),
            },
            ServerFrame::SyncResult {
                req: Some(4),
                user_seq: 10001,
                cursor: 9990,
                conversations: vec![SyncConversation {
                    conversation_id: conv.clone(),
                    seq: 80,
                    cursor: 55,
                    unread: 12,
                    last_message: Some(message()),
                }],
            },
            ServerFrame::PullResult {
                req: Some(5),
                items: vec![ChainItem {
                    seq: 9991,
                    message: message(),
                }],
                has_more: true,
            },
            ServerFrame::Receipt {
                conversation_id: conv.clone(),
                user_id: user,
                last_read_seq: 57,
            },
            ServerFrame::Typing {
                conversation_id: conv.clone(),
                user_id: user,
            },
            ServerFrame::Pong {
                req: Some(6),
                server_time: 2,
            },
            ServerFrame::Ok { req: 8 },
            ServerFrame::Error {
                req: Some(7),
                code: ErrorCode::RateLimited,
                message: "slow down".into(),
                retry_after_ms: Some(250),
            },
            ServerFrame::Kicked {
                reason: "logged out".into(),
            },
            ServerFrame::RoomMsgs {
                room_id: "r1".into(),
                messages: vec![RoomMessage {
                    sender: user,
                    content: "666".into(),
                    at: 3,
                }],
            },
            ServerFrame::ConversationUpdated {
                conversation_id: conv,
                pinned: true,
                muted: true,
                hidden: true,
            },
        ];
        for f in &frames {
            match f {
                ServerFrame::Hello { .. }
                | ServerFrame::SendAck { .. }
                | ServerFrame::Msg { .. }
                | ServerFrame::SyncResult { .. }
                | ServerFrame::PullResult { .. }
                | ServerFrame::Receipt { .. }
                | ServerFrame::Typing { .. }
                | ServerFrame::Pong { .. }
                | ServerFrame::Ok { .. }
                | ServerFrame::Error { .. }
                | ServerFrame::Kicked { .. }
                | ServerFrame::RoomMsgs { .. }
                | ServerFrame::ConversationUpdated { .. } => {}
            }
        }
        let mut out: Vec<String> = frames.iter().map(ServerFrame::to_json).collect();
        // Frames written without `ServerFrame`.
        out.push(msg_frame(&serde_json::to_string(&message()).unwrap(), None));
        out.push(json!({"type": "room_closed", "room_id": "r1"}).to_string());
        out
    }

    /// Every server frame crosses whole: the protobuf a client reads holds every field of
    /// the JSON frame (nothing is refused or dropped), with its value.
    #[test]
    fn every_server_frame_crosses_to_protobuf_and_back_whole() {
        let schema = Schema::get().unwrap();
        for json in every_server_frame() {
            let bytes = schema
                .to_proto_strict(&json)
                .unwrap_or_else(|e| panic!("{json}: {e}"));
            let mut back: Value =
                serde_json::from_str(&schema.server_frame_to_json(&bytes).unwrap()).unwrap();
            // What a client reads as the double 42.0 was the integer 42.
            whole_numbers_as_integers(&mut back);
            let sent: Value = serde_json::from_str(&json).unwrap();
            assert_eq!(back, without_defaults(sent), "{json}");
        }
    }

    /// Every client frame the protocol has crosses from protobuf to the JSON the server
    /// reads.
    #[test]
    fn every_client_frame_crosses_from_protobuf_whole() {
        let schema = Schema::get().unwrap();
        for json in [
            json!({"type": "send", "req": 1, "client_msg_id": "m-1", "to": {"user": 222},
                "kind": "text", "content": "hi", "extra": {"k": "v"},
                "reply_to": "7301234567890123456", "mentions": [333]}),
            json!({"type": "send", "client_msg_id": "m-2", "to": {"conversation": "g7"},
                "kind": "text", "content": "hi"}),
            json!({"type": "ack", "user_seq": 10001}),
            json!({"type": "ack", "conversation_id": "g7", "seq": 57}),
            json!({"type": "sync", "req": 3, "user_seq": 0, "conversations": {"g7": 55}}),
            json!({"type": "pull", "req": 4, "chain": "conversation", "conversation_id": "g7",
                "from": 56, "to": 80, "limit": 200}),
            json!({"type": "read", "conversation_id": "111-222", "seq": 57}),
            json!({"type": "typing", "conversation_id": "111-222"}),
            json!({"type": "ping", "req": 9}),
            json!({"type": "room_join", "room_id": "r1"}),
            json!({"type": "room_leave", "room_id": "r1"}),
            json!({"type": "room_send", "room_id": "r1", "content": "666"}),
        ] {
            let bytes = schema
                .client_frame_to_proto(&json.to_string())
                .unwrap_or_else(|e| panic!("{json}: {e}"));
            let back: Value =
                serde_json::from_str(&schema.client_frame_to_json(&bytes).unwrap()).unwrap();
            assert_eq!(back["req"], json["req"]);
            // The server reads it as the frame the JSON is.
            let kind = json["type"].as_str().unwrap();
            let parse = |v: &Value| {
                pigeon_proto::frames::ClientFrame::parse_typed(kind, &v.to_string())
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{v}: {e}"))
            };
            assert_eq!(parse(&back), parse(&json), "{back}");
        }
    }

    /// Zero for an absent optional number (`user_seq` 0, `from` 0) is kept: the protocol
    /// tells "from my cursor" (absent) from "from the start" (0).
    #[test]
    fn a_zero_that_was_sent_is_not_an_absent_field() {
        let schema = Schema::get().unwrap();
        let sync = json!({"type": "sync", "user_seq": 0});
        let bytes = schema.client_frame_to_proto(&sync.to_string()).unwrap();
        let back: Value =
            serde_json::from_str(&schema.client_frame_to_json(&bytes).unwrap()).unwrap();
        assert_eq!(back["user_seq"], json!(0));
        let bare = json!({"type": "sync"});
        let bytes = schema.client_frame_to_proto(&bare.to_string()).unwrap();
        let back: Value =
            serde_json::from_str(&schema.client_frame_to_json(&bytes).unwrap()).unwrap();
        assert_eq!(back.get("user_seq"), None, "{back}");
    }

    /// A field without presence is there with its default: `read` with seq 0 is a read of
    /// seq 0 (which the server then judges), not a frame missing its seq.
    #[test]
    fn fields_without_presence_arrive_with_their_defaults() {
        let schema = Schema::get().unwrap();
        let bytes = schema
            .client_frame_to_proto(r#"{"type":"read","conversation_id":"1-2","seq":0}"#)
            .unwrap();
        let back: Value =
            serde_json::from_str(&schema.client_frame_to_json(&bytes).unwrap()).unwrap();
        assert_eq!(
            back,
            json!({"type": "read", "conversation_id": "1-2", "seq": 0})
        );
    }

    /// Numbers in `extra` are doubles in protobuf; whole ones reach JSON as integers.
    #[test]
    fn whole_numbers_in_extra_stay_integers() {
        let schema = Schema::get().unwrap();
        let send = json!({"type": "send", "client_msg_id": "m", "to": {"user": 2}, "kind": "text",
            "content": "x", "extra": {"n": 42, "big": 9007199254740992u64, "half": 0.5, "neg": -3}});
        let bytes = schema.client_frame_to_proto(&send.to_string()).unwrap();
        let back: Value =
            serde_json::from_str(&schema.client_frame_to_json(&bytes).unwrap()).unwrap();
        assert_eq!(back["extra"], send["extra"]);
        assert_eq!(back["extra"]["n"].to_string(), "42");
    }

    /// A protobuf frame whose envelope decodes but holds no frame answers with its req.
    #[test]
    fn an_empty_envelope_is_refused_with_its_req() {
        let schema = Schema::get().unwrap();
        let mut empty = DynamicMessage::new(schema.client.clone());
        empty.set_field_by_name("req", prost_reflect::Value::I64(12));
        let (req, _) = schema
            .client_frame_to_json(&empty.encode_to_vec())
            .unwrap_err();
        assert_eq!(req, Some(12));
    }

    #[test]
    fn frames_that_are_not_in_the_schema_are_refused_not_guessed() {
        let schema = Schema::get().unwrap();
        assert!(schema.server_frame_to_proto(r#"{"type":"nope"}"#).is_err());
        let pong = r#"{"type":"pong","server_time":1,"surprise":2}"#;
        assert!(
            schema.to_proto_strict(pong).is_err(),
            "a field the schema lacks is an error a test sees"
        );
        assert!(
            schema.server_frame_to_proto(pong).is_ok(),
            "and a frame that still goes out, without it, in a running server"
        );
        assert!(schema.client_frame_to_json(&[0xff, 0xff]).is_err());
    }

    /// What a protobuf connection costs per frame, beside a JSON one (which writes the
    /// shared text as it is): measured, not asserted. Run with
    /// `cargo test --release -p pigeon-server --lib transcoding_cost -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn transcoding_cost() {
        let schema = Schema::get().unwrap();
        let plain = {
            let mut m = message();
            m.extra = Value::Null;
            msg_frame(&serde_json::to_string(&m).unwrap(), Some(10001))
        };
        let started = std::time::Instant::now();
        for _ in 0..100_000 {
            std::hint::black_box(schema.server_frame_to_proto(&plain).unwrap());
        }
        println!(
            "msg push without extra to protobuf: {:.2} us",
            started.elapsed().as_secs_f64() * 10.0
        );
        let push = msg_frame(&serde_json::to_string(&message()).unwrap(), Some(10001));
        let send = json!({"type": "send", "req": 1, "client_msg_id": "m-1", "to": {"user": 222},
            "kind": "text", "content": "hello there"})
        .to_string();
        let send_bytes = schema.client_frame_to_proto(&send).unwrap();
        let n = 100_000;
        let started = std::time::Instant::now();
        for _ in 0..n {
            std::hint::black_box(schema.server_frame_to_proto(&push).unwrap());
        }
        let out = started.elapsed().as_secs_f64() * 1e6 / n as f64;
        let started = std::time::Instant::now();
        for _ in 0..n {
            std::hint::black_box(schema.client_frame_to_json(&send_bytes).unwrap());
        }
        let inbound = started.elapsed().as_secs_f64() * 1e6 / n as f64;
        println!(
            "msg push ({} bytes JSON, {} protobuf) to protobuf: {out:.2} us; send frame from protobuf: {inbound:.2} us",
            push.len(),
            schema.server_frame_to_proto(&push).unwrap().len()
        );
    }

    /// What protobuf cannot tell from a default: JSON `null`, `false`, `0`, `""` and `[]`
    /// of fields without presence, which the client then reads as their defaults.
    fn without_defaults(v: Value) -> Value {
        match v {
            Value::Object(m) => Value::Object(
                m.into_iter()
                    .filter(|(k, v)| {
                        !(v.is_null()
                            || *v == Value::Bool(false)
                            || (*v == json!(0) && k != "req")
                            || *v == json!("")
                            || *v == json!([]))
                    })
                    // `extra` is a google.protobuf.Value: inside it, nulls and defaults stay.
                    .map(|(k, v)| match k.as_str() {
                        "extra" => (k, v),
                        _ => (k, without_defaults(v)),
                    })
                    .collect(),
            ),
            Value::Array(a) => Value::Array(a.into_iter().map(without_defaults).collect()),
            other => other,
        }
    }
}
