//! A bound on the memory a user's HTTP answers hold while their clients do not read them.
//!
//! An answer is made whole before it is written (a history page of 100 messages of 64 KiB
//! is ~6.5 MB of JSON, up to six times that when the content is control characters, each
//! escaped as `\u00XX`), and a client that stops reading keeps it in memory until the write
//! stall limit closes its connection (30 s or more, `serve::write_stall_limit`). Without a
//! bound per user, one account with a few hundred connections that never read could hold
//! gigabytes. So each authenticated answer counts its bytes against its user until its body
//! is written (or dropped with its connection); a read (`GET`) whose answer would take a
//! user past [`MAX_UNREAD_BYTES_PER_USER`] while others are still unread is answered `429
//! rate_limited` instead, safe to retry. The answer of a write is small and always goes
//! (counted all the same), so that no client is told a write failed that was done. One
//! answer alone always goes, however large.

use crate::app::AppRef;
use crate::error::ApiError;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use pigeon_proto::{ErrorCode, UserId};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

/// Bytes of answers one user's clients may leave unread at once.
pub const MAX_UNREAD_BYTES_PER_USER: usize = 64 << 20;

/// How long a refused client is told to wait: its earlier answers must be read first.
const RETRY_AFTER_MS: u64 = 1_000;

/// Bytes of answers each user's clients have not read yet.
#[derive(Default)]
pub struct UnreadAnswers {
    held: Mutex<HashMap<UserId, usize>>,
}

impl UnreadAnswers {
    /// Counts `bytes` against `user`, unless `may_refuse` and that would take them past the
    /// bound while other answers of theirs are still unread.
    fn take(self: &Arc<Self>, user: UserId, bytes: usize, may_refuse: bool) -> Option<Ticket> {
        let mut held = self.held.lock().expect("unread answers lock");
        let now = held.entry(user).or_default();
        if may_refuse && *now > 0 && *now + bytes > MAX_UNREAD_BYTES_PER_USER {
            return None;
        }
        *now += bytes;
        Some(Ticket {
            answers: self.clone(),
            user,
            bytes,
        })
    }

    /// Bytes `user`'s clients have not read yet (for tests).
    pub fn held_by(&self, user: UserId) -> usize {
        let held = self.held.lock().expect("unread answers lock");
        held.get(&user).copied().unwrap_or(0)
    }
}

/// One answer's bytes, counted until its body is written or dropped.
struct Ticket {
    answers: Arc<UnreadAnswers>,
    user: UserId,
    bytes: usize,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut held = self.answers.held.lock().expect("unread answers lock");
        if let Some(now) = held.get_mut(&self.user) {
            *now = now.saturating_sub(self.bytes);
            if *now == 0 {
                held.remove(&self.user);
            }
        }
    }
}

/// Put in a request's extensions before its handler runs; the extractors that
/// authenticate a user write them into it, so that their answer is counted against them.
#[derive(Clone, Default)]
pub struct Caller(Arc<OnceLock<UserId>>);

impl Caller {
    pub fn set(&self, user: UserId) {
        let _ = self.0.set(user);
    }
}

/// The middleware: counts every authenticated answer against its user (see the module doc).
pub async fn bounded(
    State(app): State<AppRef>,
    mut req: Request,
    next: axum::middleware::Next,
) -> Response {
    let caller = Caller::default();
    req.extensions_mut().insert(caller.clone());
    let reads_only = req.method() == Method::GET || req.method() == Method::HEAD;
    let response = next.run(req).await;
    let Some(&user) = caller.0.get() else {
        return response;
    };
    let bytes = usize::try_from(response.body().size_hint().lower()).unwrap_or(usize::MAX);
    match app.unread_answers.take(user, bytes, reads_only) {
        Some(ticket) => response.map(|body| {
            Body::new(Counted {
                body,
                rest: Bytes::new(),
                _ticket: ticket,
            })
        }),
        None => {
            metrics::counter!("pigeon_answers_refused_unread_total").increment(1);
            ApiError {
                code: ErrorCode::RateLimited,
                message: "too many answers left unread: read the ones sent before asking for more"
                    .into(),
                retry_after_ms: Some(RETRY_AFTER_MS),
            }
            .into_response()
        }
    }
}

/// How much of an answer is handed to hyper at a time. Hyper takes another piece only
/// once what it holds is under ~400 KB (its write buffer's bound), so an answer's last
/// piece, and the end that gives its ticket back, are taken once nearly all of it is
/// written; a body handed over whole would end at once, while its bytes still wait in
/// hyper's queue.
const PIECE_BYTES: usize = 256 << 10;

/// An answer's body, holding its ticket until hyper has taken all of it (or dropped it).
struct Counted {
    body: Body,
    /// What the inner body gave and hyper has not taken yet.
    rest: Bytes,
    _ticket: Ticket,
}

impl HttpBody for Counted {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        loop {
            if !self.rest.is_empty() {
                let n = self.rest.len().min(PIECE_BYTES);
                let piece = self.rest.split_to(n);
                return Poll::Ready(Some(Ok(http_body::Frame::data(piece))));
            }
            match std::task::ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => self.rest = data,
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                other => return Poll::Ready(other),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let inner = self.body.size_hint();
        let rest = self.rest.len() as u64;
        // The upper bound first: a lower bound above the current upper one panics.
        let mut hint = http_body::SizeHint::new();
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + rest);
        }
        hint.set_lower(inner.lower() + rest);
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_past_the_bound_is_refused_until_an_answer_is_read() {
        let answers = Arc::new(UnreadAnswers::default());
        let (alice, bob) = (UserId::new(1).unwrap(), UserId::new(2).unwrap());
        let half = MAX_UNREAD_BYTES_PER_USER / 2;
        let first = answers.take(alice, half, true).expect("under the bound");
        let second = answers.take(alice, half, true).expect("at the bound");
        assert!(answers.take(alice, 1, true).is_none(), "past the bound");
        assert!(
            answers.take(bob, 1, true).is_some(),
            "another user's bound is theirs"
        );
        drop(first);
        assert_eq!(answers.held_by(alice), half);
        let third = answers
            .take(alice, half, true)
            .expect("room again once one is read");
        drop((second, third));
        assert_eq!(answers.held_by(alice), 0, "nothing left counted");
        let huge = answers
            .take(alice, 4 * MAX_UNREAD_BYTES_PER_USER, true)
            .expect("one answer alone always goes");
        assert!(answers.take(alice, 1, true).is_none());
        let write = answers
            .take(alice, 100, false)
            .expect("a write's answer always goes");
        drop((huge, write));
        assert!(answers.held.lock().unwrap().is_empty(), "no entry kept");
    }

    /// An answer goes to hyper in pieces, whole and in order, its length known up front,
    /// and its bytes stay counted until its end is taken.
    #[tokio::test]
    async fn an_answer_is_handed_over_in_pieces_and_counted_to_its_end() {
        let answers = Arc::new(UnreadAnswers::default());
        let user = UserId::new(1).unwrap();
        let data: Vec<u8> = (0..3 * PIECE_BYTES + 7).map(|i| i as u8).collect();
        let mut body = Counted {
            body: Body::from(data.clone()),
            rest: Bytes::new(),
            _ticket: answers.take(user, data.len(), true).unwrap(),
        };
        assert_eq!(body.size_hint().exact(), Some(data.len() as u64));
        let mut got = Vec::new();
        let mut pieces = 0;
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
        {
            let piece = frame.unwrap().into_data().unwrap();
            assert!(piece.len() <= PIECE_BYTES);
            got.extend_from_slice(&piece);
            pieces += 1;
            if got.len() < data.len() {
                assert!(!body.is_end_stream(), "ended early");
                assert_eq!(
                    body.size_hint().exact(),
                    Some((data.len() - got.len()) as u64)
                );
                assert_eq!(answers.held_by(user), data.len(), "counted until its end");
            }
        }
        assert_eq!((got == data, pieces), (true, 4));
        drop(body);
        assert_eq!(answers.held_by(user), 0);
    }
}
