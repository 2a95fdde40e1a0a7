//! Serves the router over HTTP/1.1, WebSocket upgrades included, as `axum::serve` does, with
//! what that leaves unset: a timer, so that a request's head must arrive within
//! [`HEADER_READ_TIMEOUT`]. `axum::serve` gives hyper no timer, and hyper's header timeout
//! then never fires: a client could hold a connection, and the buffers of its half-sent
//! request, for ever (a review held 560 MB with a thousand of them). And a bound on the
//! connections open at once (`max-open-connections`, see `open_files.rs`), so that sockets
//! cannot take the file descriptors the store needs: past it a few more (up to 32) are
//! accepted only to be answered 503 `unavailable` with a `retry_after_ms` (a client told to come back,
//! rather than left waiting), and past those new clients wait in the listen backlog until
//! a connection closes.

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

/// How long a client may take to send a request's head (the request line and headers),
/// counted from the connection's accept, or, on a kept-alive connection, from the end of
/// the answer before: so also how long an idle kept-alive connection stays open. Hyper's
/// own default (nginx waits 60 s for a head, and keeps idle connections 75 s).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// The most a request head may hold (`api::head_within_limit` refuses more), and the most a
/// connection buffers of one (hyper's default is ~400 KiB; its buffer may take in up to
/// about twice this before the head is parsed): Pigeon's heads are small, and slow heads
/// should not each hold that much.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// The least time a connection's socket may refuse every byte written to it before the
/// connection is dropped (see [`write_stall_limit`]).
const MIN_WRITE_STALL: Duration = Duration::from_secs(30);
/// How often a server whose connection places are all taken says so in its log.
const FULL_WARNING_EVERY: Duration = Duration::from_secs(60);
/// The most connections accepted at once while every place is taken, only to be refused:
/// each holds a descriptor of the store's reserve for at most [`REFUSAL_HEAD_TIMEOUT`].
const MAX_REFUSING_AT_ONCE: usize = 32;
/// How long a refused connection may take to send its request's head.
const REFUSAL_HEAD_TIMEOUT: Duration = Duration::from_secs(2);

/// How many connections are refused at once with `max_open` places: one for every 64
/// places, between 1 and 32, so that a small server (a low open-file limit, a small
/// reserve) keeps its few spare descriptors.
pub fn refusing_at_once(max_open: usize) -> usize {
    (max_open / 64).clamp(1, MAX_REFUSING_AT_ONCE)
}

/// How long a connection's socket may take no byte of a write before the connection is
/// dropped: a client that asks for a large answer (a range of 200 messages of 64 KiB is
/// ~13 MB) and never reads it would otherwise hold the answer in memory for ever. At least
/// [`MIN_WRITE_STALL`], and longer than a WebSocket's own limit (`heartbeat_ms` twice), so
/// that a stalled WebSocket is closed as too slow (1013) by its own task first.
pub fn write_stall_limit(heartbeat: Duration) -> Duration {
    MIN_WRITE_STALL.max(heartbeat.saturating_mul(2) + Duration::from_secs(5))
}

/// What an accepted connection's place lets it have.
enum Place {
    Served(OwnedSemaphorePermit),
    Refused(OwnedSemaphorePermit),
}

/// Accepts until `stop` turns true, then lets every open connection finish its request in
/// flight (hyper's graceful shutdown) and returns once all have closed. Upgraded
/// connections (WebSocket) are the WebSocket tasks' own by then, and end on the same signal.
/// At most `max_open` connections are open at once, upgraded ones included: each socket
/// holds its place until it closes.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    max_open: usize,
    write_stall: Duration,
    mut stop: watch::Receiver<bool>,
) {
    // Every connection task holds a receiver: once all are dropped, all have closed.
    let (open_tx, open_rx) = watch::channel(());
    let places = Arc::new(Semaphore::new(max_open.min(Semaphore::MAX_PERMITS)));
    let refusing = Arc::new(Semaphore::new(refusing_at_once(max_open)));
    let refusal = Router::new().fallback(|| async { full() });
    let mut warned_full: Option<Instant> = None;
    // Shown from the start, not from the first refusal.
    metrics::counter!("pigeon_connections_refused_total").increment(0);
    metrics::gauge!("pigeon_tcp_connections").increment(0.0);
    metrics::gauge!("pigeon_connections").increment(0.0);
    loop {
        let place = if let Ok(place) = places.clone().try_acquire_owned() {
            Place::Served(place)
        } else {
            if warned_full.is_none_or(|at| at.elapsed() >= FULL_WARNING_EVERY) {
                warned_full = Some(Instant::now());
                tracing::warn!(
                    max_open_connections = max_open,
                    "every connection place is taken: new clients are refused (503) or wait \
                     to be accepted until a connection closes (see --max-open-connections)"
                );
            }
            match refusing.clone().try_acquire_owned() {
                Ok(place) => Place::Refused(place),
                Err(_) => tokio::select! {
                    biased;
                    _ = stop.wait_for(|s| *s) => break,
                    place = places.clone().acquire_owned() => Place::Served(place.expect("never closed")),
                    place = refusing.clone().acquire_owned() => Place::Refused(place.expect("never closed")),
                },
            }
        };
        let accepted = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => break,
            accepted = listener.accept() => accepted,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            // The client went before it was accepted: nothing to wait for.
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                // Out of file descriptors, or the like: as axum::serve, wait, so the loop
                // does not spin (and fill the log) until some are given back.
                tracing::error!(error = %e, "cannot accept a connection");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        // Pushes are small frames: without TCP_NODELAY, Nagle and delayed ACKs hold them
        // ~40 ms.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let place = match place {
            Place::Served(place) => place,
            Place::Refused(refusal_place) => match places.clone().try_acquire_owned() {
                // A place came free while the accept waited: serve, not refuse.
                Ok(place) => place,
                Err(_) => {
                    let socket = Placed::refused(tcp, refusal_place, write_stall);
                    tokio::spawn(refuse(socket, refusal.clone()));
                    continue;
                }
            },
        };
        let service = TowerToHyperService::new(router.clone());
        let (mut stop, open) = (stop.clone(), open_rx.clone());
        tokio::spawn(async move {
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES);
            let conn = builder
                .serve_connection(
                    TokioIo::new(Placed::served(tcp, place, write_stall)),
                    service,
                )
                .with_upgrades();
            tokio::pin!(conn);
            let mut stopping = false;
            loop {
                tokio::select! {
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            tracing::trace!(error = %e, "connection ended with an error");
                        }
                        break;
                    }
                    _ = stop.wait_for(|s| *s), if !stopping => {
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(open);
        });
    }
    // New clients are refused from here on, not left in the backlog while the open
    // connections finish.
    drop(listener);
    drop(open_rx);
    open_tx.closed().await;
}

/// The answer to every request of a connection accepted while every place is taken.
fn full() -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut e = crate::error::ApiError::server_full();
    // As a user past their own connections is told.
    e.retry_after_ms = Some(crate::ws::RETRY_AFTER_TOO_MANY_MS);
    e.into_response()
}

/// Reads a request's head, answers it [`full`] and closes, all within a few seconds.
async fn refuse(socket: Placed, refusal: Router) {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(REFUSAL_HEAD_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES)
        .keep_alive(false);
    let conn = builder.serve_connection(TokioIo::new(socket), TowerToHyperService::new(refusal));
    // The answer is small; a client that does not read it is not waited for.
    let _ = tokio::time::timeout(2 * REFUSAL_HEAD_TIMEOUT, conn).await;
}

/// A socket with its place among the connections open at once: the place is given back as
/// the socket closes, also when a WebSocket upgrade has taken the socket over. Those
/// served are counted in `pigeon_tcp_connections`, so an operator sees the bound coming
/// (refusals in `pigeon_connections_refused_total`).
///
/// A write the socket takes no byte of for `write_stall` fails (`TimedOut`), which ends
/// the connection and frees what it was writing.
struct Placed {
    tcp: TcpStream,
    _place: OwnedSemaphorePermit,
    served: bool,
    write_stall: Duration,
    /// Armed while a write waits for the socket (boxed: an idle connection keeps 8 bytes).
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Placed {
    fn served(tcp: TcpStream, place: OwnedSemaphorePermit, write_stall: Duration) -> Placed {
        metrics::gauge!("pigeon_tcp_connections").increment(1.0);
        Placed {
            tcp,
            _place: place,
            served: true,
            write_stall,
            stalled: None,
        }
    }

    fn refused(tcp: TcpStream, place: OwnedSemaphorePermit, write_stall: Duration) -> Placed {
        metrics::counter!("pigeon_connections_refused_total").increment(1);
        Placed {
            tcp,
            _place: place,
            served: false,
            write_stall,
            stalled: None,
        }
    }

    /// `write`'s outcome, unless the socket has taken nothing for `write_stall`: then an
    /// error. Any progress starts the wait over.
    fn within_stall<T>(
        &mut self,
        cx: &mut Context<'_>,
        write: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if write.is_ready() {
            self.stalled = None;
            return write;
        }
        let limit = self.write_stall;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if timer.as_mut().poll(cx).is_ready() {
            self.stalled = None;
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took nothing written to it for too long",
            )));
        }
        Poll::Pending
    }
}

impl Drop for Placed {
    fn drop(&mut self) {
        if self.served {
            metrics::gauge!("pigeon_tcp_connections").decrement(1.0);
        }
    }
}

impl AsyncRead for Placed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Placed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let write = Pin::new(&mut this.tcp).poll_write(cx, buf);
        this.within_stall(cx, write)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let write = Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs);
        this.within_stall(cx, write)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

/// An accept error that is the client's going, not the server's trouble (as axum::serve).
fn is_connection_error(e: &io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A served socket and the client's end of it.
    async fn pair(write_stall: Duration) -> (Placed, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (tcp, _) = listener.accept().await.unwrap();
        let place = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        (Placed::served(tcp, place, write_stall), client)
    }

    /// A client that reads nothing cannot hold what is written to it for ever: once the
    /// socket takes no byte for the stall limit, the write fails and the connection ends.
    #[tokio::test]
    async fn a_write_the_client_never_reads_fails_after_the_stall_limit() {
        let (mut server, _client) = pair(Duration::from_millis(300)).await;
        let chunk = vec![b'x'; 64 * 1024];
        let ended = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                if let Err(e) = server.write_all(&chunk).await {
                    return e;
                }
            }
        })
        .await
        .expect("the write fails rather than wait for ever");
        assert_eq!(ended.kind(), io::ErrorKind::TimedOut);
    }

    /// A client that keeps reading is never cut off, though the whole answer takes longer
    /// than the limit: each time the socket takes more, the wait starts over. (The socket
    /// wakes its writer only once a good part of its buffer is free, so a reader is cut
    /// off only when that part takes longer than the limit to drain: at the real limit,
    /// 30 s or more, a few tens of KB a second on loopback's largest buffers.)
    #[tokio::test]
    async fn a_reading_client_is_not_cut_off() {
        let (mut server, mut client) = pair(Duration::from_secs(2)).await;
        const TOTAL: usize = 48 << 20;
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            let mut total = 0;
            while total < TOTAL {
                tokio::time::sleep(Duration::from_millis(5)).await;
                match client.read(&mut buf).await.unwrap() {
                    0 => break,
                    n => total += n,
                }
            }
            total
        });
        let chunk = vec![b'x'; 64 * 1024];
        let started = Instant::now();
        for _ in 0..TOTAL / chunk.len() {
            server.write_all(&chunk).await.expect("a reading client");
        }
        assert_eq!(reader.await.unwrap(), TOTAL);
        assert!(
            started.elapsed() > Duration::from_secs(2),
            "the answer outlasted the limit, so the limit was started over: {:?}",
            started.elapsed()
        );
    }
}
