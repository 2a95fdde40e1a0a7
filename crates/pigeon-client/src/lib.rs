//! Pigeon's client SDK.
//!
//! - [`Http`]: the HTTP API (admin and user calls) with protocol errors as values.
//! - [`WsConn`]: one raw WebSocket connection, frame by frame (tests, tools).
//! - [`Client`]: the reliable client an application uses: reconnects with backoff and
//!   jitter, resumes through `sync`, keeps a `local_seq` per chain, pulls holes, drops
//!   duplicates, batches acks, retries sends with the same `client_msg_id`, and hands out an
//!   ordered event stream.
//!
//! ```no_run
//! # async fn demo() -> Result<(), pigeon_client::ClientError> {
//! use pigeon_client::{Client, ClientConfig, Event, Outgoing};
//! use pigeon_proto::views::SendTarget;
//! let (client, mut events) = Client::start(ClientConfig::new("ws://127.0.0.1:8080", "TOKEN", "my-laptop"));
//! let to = SendTarget { user: Some(pigeon_proto::UserId::new(222).unwrap()), conversation: None };
//! let ack = client.send(Outgoing::text(to, "hello")).await?;
//! println!("stored at seq {}", ack.seq);
//! while let Some(ev) = events.recv().await {
//!     if let Event::Message(m) = ev {
//!         println!("{}: {}", m.sender, m.content);
//!     }
//! }
//! # Ok(()) }
//! ```

mod client;
mod http;
mod ws;

pub use client::{Client, ClientConfig, ConnectionState, Event, Outgoing};
pub use http::{ClientError, Http};
pub use ws::WsConn;
