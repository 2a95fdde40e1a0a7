//! The `pigeon.v1.proto` subprotocol, from a client that knows only `proto/pigeon.proto`:
//! it compiles the file itself and builds and reads frames field by field.

use super::*;
use futures_util::{SinkExt, StreamExt};
use prost::Message as _;
use prost_reflect::ReflectMessage as _;
use prost_reflect::{DynamicMessage, MapKey, MessageDescriptor, Value as PValue};
use tokio_tungstenite::tungstenite::Message as Ws;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

fn schema() -> (MessageDescriptor, MessageDescriptor) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let pool = protox::compile([dir.join("pigeon.proto")], [dir])
        .map(|set| prost_reflect::DescriptorPool::from_file_descriptor_set(set).unwrap())
        .expect("proto/pigeon.proto compiles");
    (
        pool.get_message_by_name("pigeon.v1.ClientFrame").unwrap(),
        pool.get_message_by_name("pigeon.v1.ServerFrame").unwrap(),
    )
}

struct ProtoClient {
    ws: Socket,
    client: MessageDescriptor,
    server: MessageDescriptor,
}

impl ProtoClient {
    async fn connect(s: &TestServer, token: &str, device: &str) -> (ProtoClient, Option<String>) {
        let mut req = format!("{}/v1/ws?device_id={device}", s.ws_base)
            .into_client_request()
            .unwrap();
        req.headers_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        req.headers_mut().insert(
            "sec-websocket-protocol",
            "pigeon.v1.proto, pigeon.v1.json".parse().unwrap(),
        );
        let (ws, resp) = tokio_tungstenite::connect_async(req).await.unwrap();
        let chosen = resp
            .headers()
            .get("sec-websocket-protocol")
            .map(|v| v.to_str().unwrap().to_owned());
        let (client, server) = schema();
        (ProtoClient { ws, client, server }, chosen)
    }

    /// A `ClientFrame` with `req` and the oneof member `kind` set to `body`.
    fn frame(&self, req: Option<i64>, kind: &str, body: DynamicMessage) -> Vec<u8> {
        let mut f = DynamicMessage::new(self.client.clone());
        if let Some(r) = req {
            f.set_field_by_name("req", PValue::I64(r));
        }
        f.set_field_by_name(kind, PValue::Message(body));
        f.encode_to_vec()
    }

    /// An empty message of the type of `kind`'s member of the `ClientFrame` oneof.
    fn body(&self, kind: &str) -> DynamicMessage {
        let field = self.client.get_field_by_name(kind).unwrap();
        DynamicMessage::new(field.kind().as_message().unwrap().clone())
    }

    async fn send(&mut self, bytes: Vec<u8>) {
        self.ws.send(Ws::Binary(bytes.into())).await.unwrap();
    }

    /// The next server frame: (its kind, the envelope).
    async fn recv(&mut self) -> (String, DynamicMessage) {
        loop {
            let m = tokio::time::timeout(WAIT, self.ws.next())
                .await
                .expect("a frame in time")
                .expect("open")
                .expect("a frame");
            match m {
                Ws::Binary(b) => {
                    let f = DynamicMessage::decode(self.server.clone(), b.as_ref())
                        .expect("a ServerFrame");
                    let kind = f
                        .fields()
                        .map(|(d, _)| d.name().to_owned())
                        .find(|n| n != "req")
                        .expect("a frame kind");
                    return (kind, f);
                }
                Ws::Ping(_) | Ws::Pong(_) => continue,
                other => panic!("a binary frame, not {other:?}"),
            }
        }
    }

    /// A ping, answered by a pong with its req.
    async fn ping(&mut self, req: i64) {
        self.send(self.frame(Some(req), "ping", self.body("ping")))
            .await;
        let pong = self.recv_kind("pong").await;
        assert_eq!(pong.get_field_by_name("req").unwrap().as_i64(), Some(req));
    }

    /// Waits for a frame of `kind`, skipping others.
    async fn recv_kind(&mut self, kind: &str) -> DynamicMessage {
        loop {
            let (k, f) = self.recv().await;
            if k == kind {
                return f;
            }
        }
    }
}

/// A `SendTarget` to `user`, for a `send` body.
fn to_user(send: &DynamicMessage, user: u64) -> DynamicMessage {
    let desc = send
        .descriptor()
        .get_field_by_name("to")
        .unwrap()
        .kind()
        .as_message()
        .unwrap()
        .clone();
    let mut to = DynamicMessage::new(desc);
    to.set_field_by_name("user", PValue::U64(user));
    to
}

fn member(f: &DynamicMessage, name: &str) -> DynamicMessage {
    f.get_field_by_name(name)
        .unwrap_or_else(|| panic!("no {name}"))
        .as_message()
        .unwrap_or_else(|| panic!("{name} is a message"))
        .clone()
}

fn u64_of(f: &DynamicMessage, name: &str) -> u64 {
    f.get_field_by_name(name).unwrap().as_u64().unwrap()
}

fn str_of(f: &DynamicMessage, name: &str) -> String {
    f.get_field_by_name(name)
        .unwrap()
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn a_protobuf_client_sends_receives_syncs_and_pulls() {
    let s = spawn_server().await;
    let (ann, bob) = (s.token(501).await, s.token(502).await);
    let (mut p, chosen) = ProtoClient::connect(&s, &ann, "pb").await;
    assert_eq!(
        chosen.as_deref(),
        Some("pigeon.v1.proto"),
        "the server chose it"
    );

    // hello, as protobuf.
    let hello = p.recv_kind("hello").await;
    let h = member(&hello, "hello");
    assert_eq!(u64_of(&h, "user_id"), 501);
    assert_eq!(str_of(&h, "device_id"), "pb");
    assert!(
        h.get_field_by_name("server_time")
            .unwrap()
            .as_i64()
            .unwrap()
            > 0
    );

    // A JSON client in the same chat.
    let mut b = s.ws(&bob, "json").await;

    // send → send_ack with the same req; the JSON peer gets the message.
    let mut send = p.body("send");
    send.set_field_by_name("client_msg_id", PValue::String("pb-1".into()));
    send.set_field_by_name("to", PValue::Message(to_user(&send, 502)));
    send.set_field_by_name("kind", PValue::String("text".into()));
    send.set_field_by_name("content", PValue::String("over protobuf".into()));
    p.send(p.frame(Some(7), "send", send)).await;
    let acked = p.recv_kind("send_ack").await;
    assert_eq!(acked.get_field_by_name("req").unwrap().as_i64(), Some(7));
    let ack = member(&acked, "send_ack");
    assert_eq!(str_of(&ack, "conversation_id"), "501-502");
    assert_eq!(u64_of(&ack, "seq"), 1);
    assert!(
        !ack.get_field_by_name("duplicate")
            .unwrap()
            .as_bool()
            .unwrap()
    );
    let pushed = next_msg(&mut b).await;
    assert_eq!(pushed["message"]["content"], "over protobuf");
    assert_eq!(
        pushed["message"]["msg_id"].as_str(),
        Some(str_of(&ack, "msg_id").as_str())
    );

    // The sender's own push comes too, after its ack.
    let own = member(&p.recv_kind("msg").await, "msg");
    assert_eq!(str_of(&member(&own, "message"), "content"), "over protobuf");

    // A JSON sender's message reaches the protobuf client whole, extra included.
    let frame = send_frame(
        json!({"client_msg_id": "j-1", "to": {"user": 501}, "kind": "custom",
        "content": "c", "extra": {"card": "x", "ok": true}, "mentions": [501]}),
    );
    request(&mut b, frame, 3).await;
    let msg = member(&p.recv_kind("msg").await, "msg");
    assert_eq!(u64_of(&msg, "user_seq"), 2);
    let m = member(&msg, "message");
    assert_eq!(str_of(&m, "kind"), "custom");
    assert_eq!(u64_of(&m, "sender"), 502);
    assert_eq!(u64_of(&m, "seq"), 2);
    assert_eq!(str_of(&m, "client_msg_id"), "j-1");
    let mentions = m.get_field_by_name("mentions").unwrap();
    assert_eq!(mentions.as_list().unwrap(), &[PValue::U64(501)]);
    let extra = member(&m, "extra");
    let fields = member(&extra, "struct_value");
    let map = fields.get_field_by_name("fields").unwrap();
    let map = map.as_map().unwrap();
    let card = map.get(&MapKey::String("card".into())).unwrap();
    assert_eq!(
        card.as_message()
            .unwrap()
            .get_field_by_name("string_value")
            .unwrap()
            .as_str(),
        Some("x")
    );

    // ack, then sync from 0 and pull the user chain.
    let mut ack = p.body("ack");
    ack.set_field_by_name("user_seq", PValue::U64(2));
    p.send(p.frame(None, "ack", ack)).await;
    let mut sync = p.body("sync");
    sync.set_field_by_name("user_seq", PValue::U64(0));
    p.send(p.frame(Some(8), "sync", sync)).await;
    let synced = p.recv_kind("sync_result").await;
    assert_eq!(synced.get_field_by_name("req").unwrap().as_i64(), Some(8));
    assert_eq!(u64_of(&member(&synced, "sync_result"), "user_seq"), 2);
    let mut pull = p.body("pull");
    pull.set_field_by_name("chain", PValue::String("user".into()));
    pull.set_field_by_name("from", PValue::U64(1));
    p.send(p.frame(Some(9), "pull", pull)).await;
    let pulled = member(&p.recv_kind("pull_result").await, "pull_result");
    let items = pulled.get_field_by_name("items").unwrap();
    let seqs: Vec<u64> = items
        .as_list()
        .unwrap()
        .iter()
        .map(|i| u64_of(i.as_message().unwrap(), "seq"))
        .collect();
    assert_eq!(seqs, vec![1, 2]);

    // ping → pong with its req.
    p.ping(10).await;
}

#[tokio::test]
async fn bad_protobuf_frames_get_an_error_and_the_connection_stays() {
    let s = spawn_server().await;
    let token = s.token(511).await;
    let (mut p, _) = ProtoClient::connect(&s, &token, "pb").await;
    p.recv_kind("hello").await;

    // Not protobuf at all.
    p.send(vec![0xff, 0xff, 0xff]).await;
    let (kind, e) = p.recv().await;
    assert_eq!(kind, "error");
    assert_eq!(str_of(&member(&e, "error"), "code"), "invalid_argument");

    // Its req first (field 1, varint 7), then bytes that do not decode: the error carries
    // the req all the same.
    p.send(vec![0x08, 0x07, 0xff, 0xff, 0xff]).await;
    let (kind, e) = p.recv().await;
    assert_eq!(kind, "error");
    assert_eq!(e.get_field_by_name("req").unwrap().as_i64(), Some(7));
    assert_eq!(str_of(&member(&e, "error"), "code"), "invalid_argument");

    // An envelope with no frame in its oneof.
    let mut empty = DynamicMessage::new(p.client.clone());
    empty.set_field_by_name("req", PValue::I64(4));
    p.send(empty.encode_to_vec()).await;
    let (kind, e) = p.recv().await;
    assert_eq!(kind, "error");
    assert_eq!(e.get_field_by_name("req").unwrap().as_i64(), Some(4));
    assert_eq!(str_of(&member(&e, "error"), "code"), "invalid_argument");

    // A well-formed frame with a wrong field: the same error as in JSON, with its req.
    let mut send = p.body("send");
    send.set_field_by_name("to", PValue::Message(to_user(&send, 512)));
    send.set_field_by_name("client_msg_id", PValue::String("bad id!".into()));
    send.set_field_by_name("kind", PValue::String("text".into()));
    send.set_field_by_name("content", PValue::String("x".into()));
    p.send(p.frame(Some(5), "send", send)).await;
    let e = p.recv_kind("error").await;
    assert_eq!(e.get_field_by_name("req").unwrap().as_i64(), Some(5));
    let e = member(&e, "error");
    assert_eq!(str_of(&e, "code"), "invalid_argument");
    assert!(str_of(&e, "message").contains("client_msg_id"), "{e:?}");

    // A binary frame over 1 MiB is refused before it is decoded.
    p.send(vec![0x0a; (1 << 20) + 1]).await;
    let e = p.recv_kind("error").await;
    assert_eq!(str_of(&member(&e, "error"), "code"), "payload_too_large");
    // Its req is read all the same (PROTOCOL.md 5: "the reply to it carries the same req"):
    // a send of 1.1 MiB of content with req 42.
    let mut big = p.body("send");
    big.set_field_by_name("to", PValue::Message(to_user(&big, 512)));
    big.set_field_by_name("client_msg_id", PValue::String("big".into()));
    big.set_field_by_name("kind", PValue::String("text".into()));
    big.set_field_by_name("content", PValue::String("x".repeat(1_100_000)));
    p.send(p.frame(Some(42), "send", big)).await;
    let e = p.recv_kind("error").await;
    assert_eq!(e.get_field_by_name("req").unwrap().as_i64(), Some(42));
    assert_eq!(str_of(&member(&e, "error"), "code"), "payload_too_large");

    // A JSON text frame on a protobuf connection is read, and answered in protobuf.
    p.ws.send(Ws::Text(r#"{"type":"ping","req":11}"#.into()))
        .await
        .unwrap();
    let pong = p.recv_kind("pong").await;
    assert_eq!(pong.get_field_by_name("req").unwrap().as_i64(), Some(11));

    // Still open.
    p.ping(6).await;
}

#[tokio::test]
async fn a_client_asking_for_json_or_nothing_gets_json_text() {
    let s = spawn_server().await;
    let token = s.token(521).await;
    for (asked, chosen) in [
        (Some("pigeon.v1.json"), Some("pigeon.v1.json")),
        (
            Some("pigeon.v1.json, pigeon.v1.proto"),
            Some("pigeon.v1.json"),
        ),
        (None, None),
    ] {
        let mut req = format!("{}/v1/ws?device_id=d", s.ws_base)
            .into_client_request()
            .unwrap();
        req.headers_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        if let Some(p) = asked {
            req.headers_mut()
                .insert("sec-websocket-protocol", p.parse().unwrap());
        }
        let (mut ws, resp) = tokio_tungstenite::connect_async(req).await.unwrap();
        assert_eq!(
            resp.headers()
                .get("sec-websocket-protocol")
                .map(|v| v.to_str().unwrap()),
            chosen
        );
        let first = tokio::time::timeout(WAIT, ws.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let Ws::Text(t) = first else {
            panic!("a text hello, not {first:?}")
        };
        assert_eq!(serde_json::from_str::<Value>(&t).unwrap()["type"], "hello");
    }
}

/// A map field (`sync.conversations`) crosses as JSON's object of positions.
#[tokio::test]
async fn sync_positions_of_read_fanout_groups_cross_as_a_map() {
    let s = spawn_with(|c| c.fanout_write_max_members = 2).await;
    let owner = s.user(531).await;
    let token = s.token(531).await;
    s.token(532).await;
    s.token(533).await;
    let group = new_group(&owner, &[532, 533]).await;
    for i in 0..3 {
        owner
            .post(
                "/v1/messages",
                &text_to_conv(&format!("g-{i}"), &group, "x"),
            )
            .await
            .unwrap();
    }
    let (mut p, _) = ProtoClient::connect(&s, &token, "pb").await;
    p.recv_kind("hello").await;
    let mut sync = p.body("sync");
    sync.set_field_by_name("user_seq", PValue::U64(0));
    let mut positions = std::collections::HashMap::new();
    positions.insert(MapKey::String(group.clone()), PValue::U64(1));
    sync.set_field_by_name("conversations", PValue::Map(positions));
    p.send(p.frame(Some(1), "sync", sync)).await;
    let r = member(&p.recv_kind("sync_result").await, "sync_result");
    let convs = r.get_field_by_name("conversations").unwrap();
    let convs = convs.as_list().unwrap();
    assert_eq!(convs.len(), 1, "{convs:?}");
    let c = convs[0].as_message().unwrap();
    assert_eq!(str_of(c, "conversation_id"), group);
    assert_eq!(u64_of(c, "cursor"), 1, "the position given in the map");
    assert_eq!(u64_of(c, "seq"), 4, "group_created and three sends");
}

/// `extra` from a protobuf client (numbers are doubles there) reaches a JSON peer as the
/// JSON it stands for, whole numbers as integers; a read's receipt and typing reach a
/// protobuf device.
#[tokio::test]
async fn extra_receipts_and_typing_cross_between_the_two_subprotocols() {
    let s = spawn_server().await;
    let (ann, bob) = (s.token(541).await, s.token(542).await);
    let (mut p, _) = ProtoClient::connect(&s, &ann, "pb").await;
    p.recv_kind("hello").await;
    let mut b = s.ws(&bob, "json").await;

    let extra: Value = json!({"n": 42, "half": 0.5, "list": ["a", true, null], "deep": {"x": -3}});
    let mut send = p.body("send");
    send.set_field_by_name("to", PValue::Message(to_user(&send, 542)));
    send.set_field_by_name("client_msg_id", PValue::String("pb-x".into()));
    send.set_field_by_name("kind", PValue::String("custom".into()));
    send.set_field_by_name("content", PValue::String("card".into()));
    let extra_field = send.descriptor().get_field_by_name("extra").unwrap();
    let value_desc = extra_field.kind().as_message().unwrap().clone();
    let value = DynamicMessage::deserialize(value_desc, extra.clone()).unwrap();
    send.set_field_by_name("extra", PValue::Message(value));
    p.send(p.frame(Some(1), "send", send)).await;
    p.recv_kind("send_ack").await;
    let pushed = next_msg(&mut b).await;
    assert_eq!(pushed["message"]["extra"], extra);
    assert_eq!(pushed["message"]["extra"]["n"].to_string(), "42");

    // Bob reads and types; Ann's protobuf device hears both.
    b.send(&json!({"type": "read", "conversation_id": "541-542", "seq": 1}))
        .await
        .unwrap();
    let r = member(&p.recv_kind("receipt").await, "receipt");
    assert_eq!(u64_of(&r, "user_id"), 542);
    assert_eq!(u64_of(&r, "last_read_seq"), 1);
    b.send(&json!({"type": "typing", "conversation_id": "541-542"}))
        .await
        .unwrap();
    let t = member(&p.recv_kind("typing").await, "typing");
    assert_eq!(u64_of(&t, "user_id"), 542);
}

/// `extra` that nests deeper than protobuf decoders go is refused at the send, over JSON
/// too, so no stored message is one a protobuf client cannot read.
#[tokio::test]
async fn extra_nesting_is_bounded() {
    let s = spawn_server().await;
    let ann = s.user(551).await;
    let bob = s.token(552).await;
    let (mut p, _) = ProtoClient::connect(&s, &bob, "pb").await;
    p.recv_kind("hello").await;
    let mut deep = json!("leaf");
    for _ in 0..21 {
        deep = json!({"k": deep});
    }
    let mut body = text_to_user("deep", 552, "x");
    body["extra"] = deep;
    assert_eq!(
        code_of(ann.post("/v1/messages", &body).await),
        "invalid_argument"
    );
    let mut ok = json!("leaf");
    for _ in 0..20 {
        ok = json!({"k": ok});
    }
    body["extra"] = ok;
    body["client_msg_id"] = json!("ok");
    ann.post("/v1/messages", &body).await.unwrap();
    // The deepest allowed reaches a protobuf device whole, as a binary frame.
    let m = member(&member(&p.recv_kind("msg").await, "msg"), "message");
    let mut level = member(&m, "extra");
    for _ in 0..20 {
        let fields = member(&level, "struct_value");
        let map = fields.get_field_by_name("fields").unwrap();
        let inner = map
            .as_map()
            .unwrap()
            .get(&MapKey::String("k".into()))
            .unwrap();
        level = inner.as_message().unwrap().clone();
    }
    assert_eq!(str_of(&level, "string_value"), "leaf");
}

/// PROTOCOL.md 5.2 over `pigeon.v1.proto`: a push of a read fan-out group's message leaves
/// `user_seq` out (the optional field unset, as JSON leaves the key out), while a single
/// chat's push carries it.
#[tokio::test]
async fn a_read_fanout_push_carries_no_user_seq_over_protobuf() {
    let s = spawn_with(|c| c.fanout_write_max_members = 2).await;
    let owner = s.user(561).await;
    let token = s.token(562).await;
    let _ = s.user(563).await;
    let group = new_group(&owner, &[562, 563]).await;
    let (mut p, _) = ProtoClient::connect(&s, &token, "pb").await;
    p.recv_kind("hello").await;
    owner
        .post("/v1/messages", &text_to_conv("rf", &group, "to many"))
        .await
        .unwrap();
    let msg = member(&p.recv_kind("msg").await, "msg");
    let m = member(&msg, "message");
    assert_eq!(str_of(&m, "conversation_id"), group);
    assert_eq!(str_of(&m, "content"), "to many");
    assert!(
        !msg.has_field_by_name("user_seq"),
        "a read fan-out push has no user_seq: {msg:?}"
    );
    owner
        .post("/v1/messages", &text_to_user("single", 562, "just you"))
        .await
        .unwrap();
    let msg = member(&p.recv_kind("msg").await, "msg");
    assert_eq!(str_of(&member(&msg, "message"), "content"), "just you");
    assert!(msg.has_field_by_name("user_seq"), "{msg:?}");
    assert_eq!(u64_of(&msg, "user_seq"), 1);
}

/// PROTOCOL.md 3 over `pigeon.v1.proto`: a logout's `kicked` (reason `token_revoked`) comes
/// as a protobuf frame, and then the connection is closed with 1008 (PROTOCOL.md 5, extension).
#[tokio::test]
async fn a_logout_kicks_a_protobuf_connection_and_closes_it_with_1008() {
    let s = spawn_server().await;
    let token = s.token(571).await;
    let (mut p, _) = ProtoClient::connect(&s, &token, "pb").await;
    p.recv_kind("hello").await;
    s.admin
        .post("/v1/admin/users/571/logout", &json!({}))
        .await
        .unwrap();
    let kicked = member(&p.recv_kind("kicked").await, "kicked");
    assert_eq!(str_of(&kicked, "reason"), "token_revoked");
    let close = loop {
        let frame = tokio::time::timeout(WAIT, p.ws.next())
            .await
            .expect("closed in time");
        match frame {
            Some(Ok(Ws::Close(c))) => break c.map(|c| u16::from(c.code)),
            Some(Ok(Ws::Ping(_) | Ws::Pong(_))) => continue,
            other => panic!("a close frame after kicked, not {other:?}"),
        }
    };
    assert_eq!(close, Some(1008));
}

/// Over `pigeon.v1.proto`: a frame with no reply of its own (here `ack`) that carries a `req`
/// is answered `Ok` with that `req` (PROTOCOL.md 5, extension), and the `ack` moves the device's
/// cursor (PROTOCOL.md 5.2): a `sync` without `user_seq` then starts from it ("Omitted numbers
/// mean from my device's server-side cursor", PROTOCOL.md 5.3).
#[tokio::test]
async fn an_ack_with_req_is_answered_ok_and_a_sync_without_user_seq_starts_from_it() {
    let s = spawn_server().await;
    let token = s.token(581).await;
    let peer = s.user(582).await;
    post_texts(&peer, "pb-ack-", 581, 3, "x").await;
    let (mut p, _) = ProtoClient::connect(&s, &token, "pb").await;
    p.recv_kind("hello").await;
    let mut ack = p.body("ack");
    ack.set_field_by_name("user_seq", PValue::U64(2));
    p.send(p.frame(Some(5), "ack", ack)).await;
    let ok = p.recv_kind("ok").await;
    assert_eq!(ok.get_field_by_name("req").unwrap().as_i64(), Some(5));
    // No user_seq: the device's cursor, 2, is used.
    p.send(p.frame(Some(6), "sync", p.body("sync"))).await;
    let synced = p.recv_kind("sync_result").await;
    assert_eq!(synced.get_field_by_name("req").unwrap().as_i64(), Some(6));
    let r = member(&synced, "sync_result");
    assert_eq!(
        (u64_of(&r, "cursor"), u64_of(&r, "user_seq")),
        (2, 3),
        "{r:?}"
    );
}
