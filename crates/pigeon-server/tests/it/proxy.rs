//! A WebSocket proxy that sits between clients and the server and misbehaves on purpose:
//! it drops, duplicates, delays and reorders frames, and cuts connections at random (seeded,
//! so a failure can be replayed).

use futures_util::{SinkExt, StreamExt};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};

/// Probabilities per frame, and the longest delay.
#[derive(Debug, Clone, Copy)]
pub struct Faults {
    pub drop: f64,
    pub duplicate: f64,
    pub reorder: f64,
    pub cut: f64,
    pub max_delay_ms: u64,
    pub seed: u64,
}

pub struct FaultyProxy {
    pub ws_base: String,
    pub cuts: Arc<AtomicU64>,
    pub dropped: Arc<AtomicU64>,
}

pub async fn start(upstream_ws_base: String, faults: Faults) -> FaultyProxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let cuts = Arc::new(AtomicU64::new(0));
    let dropped = Arc::new(AtomicU64::new(0));
    let (c, d) = (cuts.clone(), dropped.clone());
    tokio::spawn(async move {
        let mut n = 0u64;
        while let Ok((stream, _)) = listener.accept().await {
            n += 1;
            let seed = faults.seed.wrapping_mul(1_000_003).wrapping_add(n);
            tokio::spawn(relay(
                stream,
                upstream_ws_base.clone(),
                faults,
                seed,
                c.clone(),
                d.clone(),
            ));
        }
    });
    FaultyProxy {
        ws_base: format!("ws://{addr}"),
        cuts,
        dropped,
    }
}

// The handshake callback's error type is tungstenite's own HTTP response.
#[allow(clippy::result_large_err)]
async fn relay(
    stream: TcpStream,
    upstream: String,
    faults: Faults,
    seed: u64,
    cuts: Arc<AtomicU64>,
    dropped: Arc<AtomicU64>,
) {
    let mut path = String::new();
    let mut auth = None;
    let client = tokio_tungstenite::accept_hdr_async(stream, |req: &Request, resp: Response| {
        path = req
            .uri()
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default();
        auth = req.headers().get("authorization").cloned();
        Ok(resp)
    })
    .await;
    let Ok(client) = client else { return };
    let mut req = format!("{upstream}{path}").into_client_request().unwrap();
    if let Some(a) = auth {
        req.headers_mut().insert("authorization", a);
    }
    let Ok((server, _)) = tokio_tungstenite::connect_async(req).await else {
        return;
    };
    let (mut c_tx, mut c_rx) = client.split();
    let (mut s_tx, mut s_rx) = server.split();
    let mut down_rng = StdRng::seed_from_u64(seed);
    let mut up_rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let (cuts2, dropped2) = (cuts.clone(), dropped.clone());
    // Server to client: the first frame (hello) passes untouched.
    let down = async move {
        let mut first = true;
        let mut held: Option<Message> = None;
        while let Some(Ok(m)) = s_rx.next().await {
            if !matches!(m, Message::Text(_)) {
                continue;
            }
            if first {
                first = false;
                if c_tx.send(m).await.is_err() {
                    return;
                }
                continue;
            }
            if down_rng.random_bool(faults.cut) {
                cuts2.fetch_add(1, Ordering::Relaxed);
                return;
            }
            if down_rng.random_bool(faults.drop) {
                dropped2.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if faults.max_delay_ms > 0 {
                tokio::time::sleep(Duration::from_millis(
                    down_rng.random_range(0..=faults.max_delay_ms),
                ))
                .await;
            }
            if held.is_none() && down_rng.random_bool(faults.reorder) {
                held = Some(m);
                continue;
            }
            let twice = down_rng.random_bool(faults.duplicate);
            if c_tx.send(m.clone()).await.is_err() || (twice && c_tx.send(m).await.is_err()) {
                return;
            }
            if let Some(h) = held.take()
                && c_tx.send(h).await.is_err()
            {
                return;
            }
        }
    };
    let up = async move {
        while let Some(Ok(m)) = c_rx.next().await {
            if !matches!(m, Message::Text(_)) {
                continue;
            }
            if up_rng.random_bool(faults.cut) {
                cuts.fetch_add(1, Ordering::Relaxed);
                return;
            }
            if up_rng.random_bool(faults.drop) {
                dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let twice = up_rng.random_bool(faults.duplicate);
            if s_tx.send(m.clone()).await.is_err() || (twice && s_tx.send(m).await.is_err()) {
                return;
            }
        }
    };
    // Either side ending (or a cut) drops both connections.
    tokio::select! {
        _ = down => {}
        _ = up => {}
    }
}
