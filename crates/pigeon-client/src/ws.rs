//! One raw WebSocket connection to a Pigeon server, frame by frame.

use crate::http::ClientError;
use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// A connected, authenticated WebSocket. `hello` is the server's first frame.
pub struct WsConn {
    stream: WebSocketStream<MaybeTlsStream<TcpStream>>,
    pub hello: Value,
    /// The close frame the server sent, once it closed.
    pub closed_with: Option<(u16, String)>,
}

/// Bytes asked of the socket per read. Tungstenite zero-fills the spare part of its read
/// buffer before every read, so its default (128 KiB) cost a 128 KiB `memset` per frame
/// read: 12 % of the load tool's CPU at 31 700 direct messages per second (`perf`). A
/// server frame is a few hundred bytes; a larger one (a pull page) is still read whole, in
/// more reads.
const READ_BUFFER_BYTES: usize = 8 * 1024;

fn config() -> WebSocketConfig {
    WebSocketConfig::default().read_buffer_size(READ_BUFFER_BYTES)
}

fn transport(e: impl std::fmt::Display) -> ClientError {
    ClientError::Transport(e.to_string())
}

impl WsConn {
    /// Connects to `ws_base` (like `ws://127.0.0.1:8080`) as the owner of `token`.
    pub async fn connect(
        ws_base: &str,
        token: &str,
        device_id: &str,
    ) -> Result<WsConn, ClientError> {
        let url = format!("{ws_base}/v1/ws?device_id={device_id}");
        let mut req = url.into_client_request().map_err(transport)?;
        req.headers_mut().insert(
            "authorization",
            format!("Bearer {token}").parse().map_err(transport)?,
        );
        Self::connect_request(req).await
    }

    /// Connects with a prepared request (custom headers or query).
    pub async fn connect_request(
        req: tokio_tungstenite::tungstenite::handshake::client::Request,
    ) -> Result<WsConn, ClientError> {
        let (stream, _) = tokio_tungstenite::connect_async_with_config(req, Some(config()), true)
            .await
            .map_err(|e| match e {
                tokio_tungstenite::tungstenite::Error::Http(resp) => {
                    let status = resp.status().as_u16();
                    let body = resp
                        .body()
                        .as_ref()
                        .and_then(|b| serde_json::from_slice::<pigeon_proto::ErrorBody>(b).ok())
                        .unwrap_or(pigeon_proto::ErrorBody {
                            code: pigeon_proto::ErrorCode::Unauthorized,
                            message: format!("upgrade refused with {status}"),
                            retry_after_ms: None,
                        });
                    ClientError::Api { status, body }
                }
                other => transport(other),
            })?;
        let mut conn = WsConn {
            stream,
            hello: Value::Null,
            closed_with: None,
        };
        let hello = conn
            .recv(Duration::from_secs(10))
            .await?
            .ok_or_else(|| ClientError::Transport("closed before hello".into()))?;
        if hello["type"] != "hello" {
            return Err(ClientError::Decode(format!(
                "first frame is not hello: {hello}"
            )));
        }
        conn.hello = hello;
        Ok(conn)
    }

    pub async fn send(&mut self, frame: &Value) -> Result<(), ClientError> {
        self.stream
            .send(Message::Text(frame.to_string().into()))
            .await
            .map_err(transport)
    }

    pub async fn send_text(&mut self, text: String) -> Result<(), ClientError> {
        self.stream
            .send(Message::Text(text.into()))
            .await
            .map_err(transport)
    }

    /// Writes every frame and then flushes once: a burst the server reads back to back.
    pub async fn send_burst(
        &mut self,
        frames: impl IntoIterator<Item = String>,
    ) -> Result<(), ClientError> {
        for text in frames {
            self.stream
                .feed(Message::Text(text.into()))
                .await
                .map_err(transport)?;
        }
        self.stream.flush().await.map_err(transport)
    }

    pub async fn send_binary(&mut self, data: Vec<u8>) -> Result<(), ClientError> {
        self.stream
            .send(Message::Binary(data.into()))
            .await
            .map_err(transport)
    }

    /// The next JSON frame, `None` when the connection closed or `wait` passed.
    pub async fn recv(&mut self, wait: Duration) -> Result<Option<Value>, ClientError> {
        match self.recv_text(wait).await? {
            Some(t) => serde_json::from_str(&t)
                .map(Some)
                .map_err(|e| ClientError::Decode(e.to_string())),
            None => Ok(None),
        }
    }

    /// The next text frame as it came (for callers that parse it into their own types),
    /// `None` when the connection closed or `wait` passed.
    pub async fn recv_text(&mut self, wait: Duration) -> Result<Option<String>, ClientError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let next = match tokio::time::timeout_at(deadline, self.stream.next()).await {
                Err(_) => return Ok(None),
                Ok(n) => n,
            };
            match next {
                None => return Ok(None),
                Some(Err(e)) => return Err(transport(e)),
                Some(Ok(Message::Text(t))) => return Ok(Some(t.as_str().to_owned())),
                Some(Ok(Message::Close(frame))) => {
                    self.closed_with = frame
                        .map(|CloseFrame { code, reason }| (u16::from(code), reason.to_string()));
                    return Ok(None);
                }
                Some(Ok(_)) => continue,
            }
        }
    }

    /// Frames until one satisfies `pred` (which is returned); `None` on close or timeout.
    pub async fn recv_until(
        &mut self,
        wait: Duration,
        mut pred: impl FnMut(&Value) -> bool,
    ) -> Result<Option<Value>, ClientError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.recv(left).await? {
                None => return Ok(None),
                Some(v) if pred(&v) => return Ok(Some(v)),
                Some(_) => continue,
            }
        }
    }

    /// Waits for the server to close the connection; answers its close code.
    pub async fn closed(&mut self, wait: Duration) -> Option<u16> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.recv(left).await {
                Ok(Some(_)) => continue,
                Ok(None) => return self.closed_with.as_ref().map(|c| c.0),
                Err(_) => return self.closed_with.as_ref().map(|c| c.0),
            }
        }
    }

    pub async fn close(mut self) {
        let _ = self.stream.close(None).await;
    }

    /// Closes with code 1000 and waits, at most `wait`, for the server's reply to the close
    /// handshake; answers its code. The server replies once it has saved this device's
    /// acknowledged positions, so a connection opened after this returns resumes there.
    pub async fn close_and_wait(mut self, wait: Duration) -> Option<u16> {
        let frame = CloseFrame {
            code: CloseCode::Normal,
            reason: "".into(),
        };
        if self.stream.close(Some(frame)).await.is_err() {
            return None;
        }
        self.closed(wait).await
    }
}
