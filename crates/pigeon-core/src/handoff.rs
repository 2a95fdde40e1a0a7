//! What the conversation stage hands the user stage: a message just given its `seq`, with
//! the members it goes to and how (write fan-out: into each member's inbox, with a
//! `user_seq`; read fan-out: pushed only). A value, so that a cluster can carry it between
//! nodes on a durable queue; the embedded mode hands it over within one decision, and the
//! two stages' rows commit in one journal record.

use crate::changes::Recipient;
use pigeon_proto::Message;
use pigeon_proto::views::Fanout;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct FanOut {
    pub message: Arc<Message>,
    /// The conversation's members when the message was appended, each with whether they
    /// muted it (no offline notification); their `user_seq`s are the user stage's to give.
    pub recipients: Vec<Recipient>,
    pub fanout: Fanout,
}
