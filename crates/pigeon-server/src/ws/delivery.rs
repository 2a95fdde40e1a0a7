//! Pushes and acknowledgements on one connection (PROTOCOL.md 5.2): each push is kept until
//! it is acknowledged and resent `push-retry-ms` after its last send; acks move the
//! device's positions, which are saved to the store every second, before the connection's
//! own reads, and as it ends.

use super::Connection;
use crate::error::ApiError;
use crate::outbox::{Frame, MIN_SHARE, Outgoing, PushChain};
use crate::pipeline::ReplyTo;
use axum::extract::ws::Utf8Bytes;
use pigeon_core::command::{Command, CursorChain};
use pigeon_proto::ConversationId;
use pigeon_proto::frames::AckFrame;
use std::collections::BTreeMap;
use std::time::Instant;

/// Pushes kept for resending per connection, and their bytes; past either the oldest are
/// left to pull.
const MAX_UNACKED: usize = 8192;
const MAX_UNACKED_BYTES: usize = 1 << 20;
/// Sends of one push before leaving it to the client's pull.
const MAX_PUSH_TRIES: u8 = 4;

/// A push waiting for its acknowledgement.
pub(super) struct Pending {
    frame: Frame,
    sent_at: Instant,
    tries: u8,
}

/// The pushes a connection keeps until they are acknowledged, and their bytes: at most
/// [`MAX_UNACKED`] and [`MAX_UNACKED_BYTES`] (while its user or the server holds more
/// than their bound, a tenth of [`MIN_SHARE`]); past that the oldest are let go, left to
/// the client's pull, which finds the hole. (They count in the user's and the server's
/// budgets as long as they are kept.)
#[derive(Default)]
pub(super) struct Unacked {
    pushes: BTreeMap<PushChain, Pending>,
    bytes: usize,
}

impl Unacked {
    pub(super) fn is_empty(&self) -> bool {
        self.pushes.is_empty()
    }

    pub(super) fn clear(&mut self) {
        self.pushes = BTreeMap::new();
        self.bytes = 0;
    }

    fn insert(&mut self, chain: PushChain, frame: Frame, bytes_at_most: usize) {
        while !self.pushes.is_empty()
            && (self.pushes.len() >= MAX_UNACKED || self.bytes + frame.len() > bytes_at_most)
        {
            if let Some((_, gone)) = self.pushes.pop_first() {
                self.bytes -= gone.frame.len();
            }
        }
        self.bytes += frame.len();
        let pending = Pending {
            frame,
            sent_at: Instant::now(),
            tries: 1,
        };
        if let Some(replaced) = self.pushes.insert(chain, pending) {
            self.bytes -= replaced.frame.len();
        }
    }

    fn retain(&mut self, mut keep: impl FnMut(&PushChain, &mut Pending) -> bool) {
        let bytes = &mut self.bytes;
        self.pushes.retain(|k, p| {
            let kept = keep(k, p);
            if !kept {
                *bytes -= p.frame.len();
            }
            kept
        });
    }
}

impl Connection {
    /// The text to write for an outbox entry; pushes are remembered until acknowledged.
    pub(super) fn frame_to_write(&mut self, out: Outgoing) -> Option<Utf8Bytes> {
        match out {
            Outgoing::Frame(f) => Some(f.text()),
            // Handled where the outbox is read (`feed_queued`): not a frame.
            Outgoing::SaveCursors(_) => None,
            Outgoing::Forget(id) => {
                // A push's frame starts with its message's id (`msg_frame`).
                let head = format!(r#"{{"type":"msg","message":{{"msg_id":"{id}","#);
                self.unacked
                    .retain(|_, p| !p.frame.as_str().starts_with(&head));
                None
            }
            Outgoing::Push { chain, frame } => {
                if let PushChain::Inbox(us) = chain {
                    self.inbox_seen = self.inbox_seen.max(us);
                }
                let text = frame.text();
                let bytes_at_most = if self.outbox.under_pressure() {
                    MIN_SHARE / 10
                } else {
                    MAX_UNACKED_BYTES
                };
                self.unacked.insert(chain, frame, bytes_at_most);
                Some(text)
            }
        }
    }

    /// Pushes unacknowledged for `retry` or longer, to send again (those tried enough are
    /// dropped: the client finds the hole and pulls), and when the next of the others comes
    /// due, so that each is sent again `retry` after it was sent, not at a later tick.
    pub(super) fn due_resends(&mut self) -> (Vec<Utf8Bytes>, Option<Instant>) {
        let retry = self.push_retry();
        let now = Instant::now();
        let mut out = Vec::new();
        let mut next_due: Option<Instant> = None;
        self.unacked.retain(|_, p| {
            if now.duration_since(p.sent_at) >= retry {
                if p.tries >= MAX_PUSH_TRIES {
                    return false;
                }
                p.tries += 1;
                p.sent_at = now;
                out.push(p.frame.text());
            }
            let due = p.sent_at + retry;
            next_due = Some(next_due.map_or(due, |d| d.min(due)));
            true
        });
        if !out.is_empty() {
            metrics::counter!("pigeon_push_resends_total").increment(out.len() as u64);
        }
        (out, next_due)
    }

    /// A cumulative acknowledgement: forget the pushes it covers, move the cursor forward.
    pub(super) fn ack(&mut self, a: AckFrame) -> Result<(), ApiError> {
        let mut any = false;
        if let Some(us) = a.user_seq {
            self.unacked
                .retain(|k, _| !matches!(k, PushChain::Inbox(s) if *s <= us));
            self.advance("user", us.min(self.inbox_seen));
            any = true;
        }
        match (a.conversation_id, a.seq) {
            (Some(conv), Some(seq)) => {
                self.unacked.retain(
                    |k, _| !matches!(k, PushChain::Conversation(c, s) if *c == conv && *s <= seq),
                );
                self.advance(conv.as_str(), seq);
                any = true;
            }
            (None, None) => {}
            _ => {
                return Err(ApiError::invalid(
                    "ack by conversation needs both conversation_id and seq",
                ));
            }
        }
        if !any {
            return Err(ApiError::invalid(
                "ack needs user_seq, or conversation_id and seq",
            ));
        }
        Ok(())
    }

    fn advance(&mut self, chain: &str, seq: u64) {
        // Nothing to move (and no entry, which would stay unsaved in the map).
        if seq == 0 {
            return;
        }
        let e = self.cursors.entry(chain.to_owned()).or_insert(0);
        if seq > *e {
            *e = seq;
            self.cursors_dirty = true;
        }
    }

    /// Writes acknowledged positions to the store; `wait` when a read follows that must see
    /// them, or the connection ends: then the commands this connection queued before
    /// (`wait_for_own_sends`) are committed first too.
    pub(super) async fn flush_cursors(&mut self, wait: bool) {
        if self.cursors_dirty {
            self.last_cursor_flush = Instant::now();
            // Each position leaves the map once it is queued, not before: a flush cut short
            // (its connection killed while it waits on a full pipeline) leaves the rest to
            // the next one, which the connection's end makes.
            let mut cmds = Vec::with_capacity(self.cursors.len());
            self.cursors.retain(|chain, seq| {
                let chain = if chain == "user" {
                    CursorChain::Inbox
                } else {
                    match ConversationId::parse(chain) {
                        Ok(c) => CursorChain::Conversation(c),
                        Err(_) => return false,
                    }
                };
                cmds.push(Command::AdvanceCursor {
                    user: self.user,
                    device: self.device.clone(),
                    chain,
                    seq: *seq,
                });
                true
            });
            // A group's position costs the store a journaled row and two lookups whatever
            // id an ack names (`Changes::member_cursors`): each takes one write from the
            // user's allowance, as a read mark does. Past it they are not saved (the device
            // gets those messages again when it resumes); the inbox's always is.
            let groups = cmds.iter().filter(|c| is_group_cursor(c)).count();
            if groups > 0 && !self.app.limits.take_writes(self.user, groups) {
                metrics::counter!("pigeon_cursor_saves_dropped_total").increment(groups as u64);
                cmds.retain(|c| !is_group_cursor(c));
                self.cursors.retain(|chain, _| chain == "user");
            }
            // Committed by the next barrier: a read's, the close's, or the one below.
            for cmd in cmds {
                let key = match &cmd {
                    Command::AdvanceCursor { chain, .. } => chain.key().to_owned(),
                    _ => unreachable!("only cursor moves are queued here"),
                };
                match self.app.pipeline.submit(cmd, ReplyTo::Nobody).await {
                    Ok(route) => self.sent_on(route),
                    Err(e) => tracing::warn!(error = %e, user = %self.user, "cursor not saved"),
                }
                self.cursors.remove(&key);
            }
            self.cursors_dirty = !self.cursors.is_empty();
        }
        if wait {
            // Queued first, waited for after: the pipeline is FIFO, so one barrier covers
            // these saves and whatever this connection queued before them (a connection
            // that ends unregisters after this, and a new one of the device then trusts the
            // store).
            self.wait_for_own_sends().await;
        }
    }
}

/// Whether `cmd` saves a position in a conversation's chain (not the inbox's).
fn is_group_cursor(cmd: &Command) -> bool {
    matches!(
        cmd,
        Command::AdvanceCursor {
            chain: CursorChain::Conversation(_),
            ..
        }
    )
}
