//! The offline hook: when a message reaches a user with no connected device (and they have
//! not muted the conversation), POST a notification to the configured URL, where the app's
//! back end forwards it to APNs/FCM. Batched, retried, bounded in time, and never in the way
//! of the pipeline: the hub hands notices over without waiting, and drops them (counted)
//! when the queue is full.

use pigeon_core::store::Store;
use pigeon_proto::{Message, UserId};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Notices waiting to be posted before new ones are dropped.
const QUEUE: usize = 10_000;
/// Most notices in one POST.
const BATCH: usize = 100;
/// Characters of content in a preview.
const PREVIEW_CHARS: usize = 100;
/// Sends of one batch before it is given up.
const TRIES: u32 = 3;

/// One notification, as posted (inside `{"notifications":[...]}`).
#[derive(Debug, Clone, Serialize)]
pub struct Notice {
    pub recipient: UserId,
    pub conversation_id: String,
    pub sender: UserId,
    pub msg_id: String,
    pub seq: u64,
    pub kind: &'static str,
    pub preview: String,
    /// Unread messages over all the recipient's unmuted conversations; filled when posting.
    pub unread_total: u64,
}

impl Notice {
    pub fn of(message: &Message, recipient: UserId) -> Notice {
        let preview = if message.kind == pigeon_proto::MessageKind::Text {
            message.content.chars().take(PREVIEW_CHARS).collect()
        } else {
            format!("[{}]", message.kind.as_str())
        };
        Notice {
            recipient,
            conversation_id: message.conversation_id.clone(),
            sender: message.sender,
            msg_id: message.msg_id.to_string(),
            seq: message.seq,
            kind: message.kind.as_str(),
            preview,
            unread_total: 0,
        }
    }
}

/// The hub's handle on the hook.
#[derive(Clone)]
pub struct OfflineHook {
    tx: mpsc::Sender<Notice>,
}

impl OfflineHook {
    /// Starts the posting task.
    pub fn start(url: String, timeout: Duration, store: Arc<dyn Store>) -> OfflineHook {
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(post_loop(url, timeout, store, rx));
        OfflineHook { tx }
    }

    /// Queues without waiting.
    pub fn notify(&self, notice: Notice) {
        if self.tx.try_send(notice).is_err() {
            metrics::counter!("pigeon_offline_notices_dropped_total").increment(1);
        }
    }
}

async fn post_loop(
    url: String,
    timeout: Duration,
    store: Arc<dyn Store>,
    mut rx: mpsc::Receiver<Notice>,
) {
    let client = match reqwest::Client::builder().timeout(timeout).build() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "offline hook disabled: cannot build an HTTP client");
            return;
        }
    };
    let mut batch = Vec::with_capacity(BATCH);
    while rx.recv_many(&mut batch, BATCH).await > 0 {
        let mut totals: HashMap<UserId, u64> = HashMap::new();
        for n in batch.iter_mut() {
            let total = match totals.get(&n.recipient) {
                Some(t) => *t,
                None => {
                    let t = match store.unread(n.recipient).await {
                        Ok(rows) => rows
                            .iter()
                            .filter(|(_, _, muted)| !muted)
                            .map(|(_, c, _)| c)
                            .sum(),
                        Err(e) => {
                            tracing::warn!(error = %e, "unread total for the offline hook failed");
                            0
                        }
                    };
                    totals.insert(n.recipient, t);
                    t
                }
            };
            n.unread_total = total;
        }
        let body = serde_json::json!({ "notifications": batch });
        let mut delivered = false;
        for attempt in 0..TRIES {
            match client.post(&url).json(&body).send().await {
                Ok(resp) if resp.status().is_success() => {
                    delivered = true;
                    break;
                }
                Ok(resp) => {
                    tracing::warn!(status = %resp.status(), attempt, "offline hook refused a batch")
                }
                Err(e) => tracing::warn!(error = %e, attempt, "offline hook call failed"),
            }
            tokio::time::sleep(Duration::from_millis(200 * 4u64.pow(attempt))).await;
        }
        let n = batch.len() as u64;
        if delivered {
            metrics::counter!("pigeon_offline_notices_sent_total").increment(n);
        } else {
            metrics::counter!("pigeon_offline_notices_failed_total").increment(n);
        }
        batch.clear();
    }
}
