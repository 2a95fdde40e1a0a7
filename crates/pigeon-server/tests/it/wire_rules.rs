//! What HTTP/1.1 and RFC 6455 do not allow is refused as they ask, on raw sockets: a body
//! declared too large, a request without `Host`, an upgrade with a bad key, a WebSocket
//! frame that breaks the framing.

use crate::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn addr_of(s: &TestServer) -> String {
    s.base.trim_start_matches("http://").to_owned()
}

/// What the server wrote within `wait` of now, until it stops writing for 300 ms (or
/// closes); lossy UTF-8.
async fn read_for(tcp: &mut TcpStream, wait: Duration) -> String {
    let deadline = tokio::time::Instant::now() + wait;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let quiet = if got.is_empty() {
            deadline
        } else {
            (tokio::time::Instant::now() + Duration::from_millis(300)).min(deadline)
        };
        match tokio::time::timeout_at(quiet, tcp.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// PROTOCOL.md 1's `payload_too_large`: a body declared over the limit is answered `413`
/// at once, not read (one byte of it sent) until a timeout.
#[tokio::test]
async fn a_body_declared_over_the_limit_is_refused_at_once() {
    let s = spawn_server().await;
    let token = s.token(111).await;
    let mut tcp = TcpStream::connect(addr_of(&s)).await.unwrap();
    let head = format!(
        "POST /v1/messages HTTP/1.1\r\nHost: pigeon\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n{{"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let started = std::time::Instant::now();
    let answer = read_for(&mut tcp, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains(r#""code":"payload_too_large""#), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

/// A client that asks whether to send a body (`Expect: 100-continue`) too large is told
/// `413`, never `100 Continue`; one within the limit is told to go on, and is served.
#[tokio::test]
async fn a_client_asking_to_send_too_large_a_body_is_not_told_to_continue() {
    let s = spawn_server().await;
    let token = s.token(111).await;
    s.token(222).await;
    let ask = |length: usize| {
        format!(
            "POST /v1/messages HTTP/1.1\r\nHost: pigeon\r\nAuthorization: Bearer {token}\r\n\
             Content-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: {length}\r\n\r\n"
        )
    };
    let mut tcp = TcpStream::connect(addr_of(&s)).await.unwrap();
    tcp.write_all(ask(50_000_000).as_bytes()).await.unwrap();
    let answer = read_for(&mut tcp, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(!answer.contains("100 Continue"), "{answer}");

    let body = text_to_user("expect-1", 222, "hi").to_string();
    let mut tcp = TcpStream::connect(addr_of(&s)).await.unwrap();
    tcp.write_all(ask(body.len()).as_bytes()).await.unwrap();
    let go_on = read_for(&mut tcp, Duration::from_secs(10)).await;
    assert!(go_on.starts_with("HTTP/1.1 100 Continue"), "{go_on}");
    tcp.write_all(body.as_bytes()).await.unwrap();
    let answer = read_for(&mut tcp, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#""seq":1"#), "{answer}");
}

/// RFC 9112 3.2: "A server MUST respond with a 400 (Bad Request) status code to any
/// HTTP/1.1 request message that lacks a Host header field". HTTP/1.0 has none to lack.
#[tokio::test]
async fn an_http_1_1_request_without_host_is_refused() {
    let s = spawn_server().await;
    let mut tcp = TcpStream::connect(addr_of(&s)).await.unwrap();
    tcp.write_all(b"GET /healthz HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    let answer = read_for(&mut tcp, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains(r#""code":"invalid_argument""#), "{answer}");
    let mut tcp = TcpStream::connect(addr_of(&s)).await.unwrap();
    tcp.write_all(b"GET /healthz HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let answer = read_for(&mut tcp, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
}

/// The head of a WebSocket upgrade of `token`'s user with `key` as its
/// `Sec-WebSocket-Key`.
fn upgrade_head(token: &str, key: &str) -> String {
    format!(
        "GET /v1/ws?device_id=raw&token={token} HTTP/1.1\r\nHost: pigeon\r\nUpgrade: websocket\r\n\
         Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n\r\n"
    )
}

/// RFC 6455 4.2.1: the key is "a base64-encoded value that, when decoded, is 16 bytes in
/// length"; an upgrade with any other is refused with 400.
#[tokio::test]
async fn an_upgrade_whose_key_is_not_16_bytes_in_base64_is_refused() {
    let s = spawn_server().await;
    let token = s.token(111).await;
    // Not base64; base64 of 15 bytes; base64 of 17.
    for key in ["!!", "AAAAAAAAAAAAAAAAAAAA", "AAAAAAAAAAAAAAAAAAAAAAA="] {
        let mut tcp = TcpStream::connect(addr_of(&s)).await.unwrap();
        tcp.write_all(upgrade_head(&token, key).as_bytes())
            .await
            .unwrap();
        let answer = read_for(&mut tcp, Duration::from_secs(10)).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{key}: {answer}");
        assert!(answer.contains(r#""code":"invalid_argument""#), "{answer}");
    }
    let mut tcp = TcpStream::connect(addr_of(&s)).await.unwrap();
    tcp.write_all(upgrade_head(&token, "dGhlIHNhbXBsZSBub25jZQ==").as_bytes())
        .await
        .unwrap();
    let answer = read_for(&mut tcp, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 101"), "{answer}");
}

/// Reads server frames (never masked) until a close frame; answers its code.
async fn close_code(tcp: &mut TcpStream) -> Option<u16> {
    let read = async {
        loop {
            let mut head = [0u8; 2];
            tcp.read_exact(&mut head).await.ok()?;
            let len = match head[1] & 0x7f {
                126 => {
                    let mut l = [0u8; 2];
                    tcp.read_exact(&mut l).await.ok()?;
                    u64::from(u16::from_be_bytes(l))
                }
                127 => {
                    let mut l = [0u8; 8];
                    tcp.read_exact(&mut l).await.ok()?;
                    u64::from_be_bytes(l)
                }
                n => u64::from(n),
            };
            let mut payload = vec![0u8; len as usize];
            tcp.read_exact(&mut payload).await.ok()?;
            if head[0] & 0x0f == 0x8 {
                return Some(u16::from_be_bytes([payload[0], payload[1]]));
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .ok()
        .flatten()
}

/// RFC 6455 7.4.1: 1002 "indicates that an endpoint is terminating the connection due to a
/// protocol error". A client frame that is not masked (5.1: the server "MUST close the
/// connection"), or that sets reserved bits no extension gave a meaning (5.2), is answered
/// with a close frame of 1002, not a bare TCP close.
#[tokio::test]
async fn a_frame_that_breaks_the_framing_is_answered_with_1002() {
    let s = spawn_server().await;
    let token = s.token(111).await;
    // A text frame `{}` unmasked; and one masked (key 0) with RSV1 set.
    let unmasked: &[u8] = &[0x81, 0x02, b'{', b'}'];
    let reserved_bits: &[u8] = &[0xC1, 0x82, 0, 0, 0, 0, b'{', b'}'];
    for bad in [unmasked, reserved_bits] {
        let mut tcp = TcpStream::connect(addr_of(&s)).await.unwrap();
        tcp.write_all(upgrade_head(&token, "dGhlIHNhbXBsZSBub25jZQ==").as_bytes())
            .await
            .unwrap();
        // The 101's head, byte by byte up to its end: the frames follow it.
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut b = [0u8; 1];
            tcp.read_exact(&mut b).await.unwrap();
            head.push(b[0]);
        }
        assert!(head.starts_with(b"HTTP/1.1 101"));
        tcp.write_all(bad).await.unwrap();
        assert_eq!(close_code(&mut tcp).await, Some(1002), "{bad:?}");
    }
}
