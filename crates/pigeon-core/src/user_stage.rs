//! The user stage: each user's inbox chain. It owns `user_seq` (one owner per user), puts
//! every message of a write fan-out conversation into its members' inboxes, and says who
//! is told of it once it is durable. It never does I/O: the inbox heads come loaded with
//! the conversations they belong to, or on their own ([`UserStage::lacks_head`]).

use crate::changes::{Changes, Event, InboxRow};
use crate::command::CursorChain;
use crate::handoff::FanOut;
use pigeon_proto::views::Fanout;
use pigeon_proto::{DeviceId, UserId};
use std::collections::HashMap;

#[derive(Debug, Default)]
pub struct UserStage {
    /// The newest `user_seq` of each user's inbox. Every member of a conversation the
    /// conversation stage holds has one: the store gives them with the conversation, a user
    /// added to one is loaded first, a user registered in the batch starts at 0, and heads
    /// are dropped only with the conversations. So [`UserStage::deliver`] never has to
    /// guess one.
    inbox_heads: HashMap<UserId, u64>,
}

impl UserStage {
    pub fn lacks_head(&self, user: UserId) -> bool {
        !self.inbox_heads.contains_key(&user)
    }

    pub fn head(&self, user: UserId) -> Option<u64> {
        self.inbox_heads.get(&user).copied()
    }

    /// Takes a head the store gave, unless this stage holds a newer one of its own.
    pub fn absorb_head(&mut self, user: UserId, head: u64) {
        self.inbox_heads.entry(user).or_insert(head);
    }

    /// Records a device's acknowledged position in its inbox, clamped to the inbox's newest
    /// `user_seq`: stored as given, a position past it would make the device skip what
    /// comes next when it resumes. Nothing is recorded for a user without a head (not
    /// registered).
    pub fn inbox_cursor(&self, user: UserId, device: DeviceId, seq: u64, ch: &mut Changes) {
        if let Some(newest) = self.head(user) {
            ch.cursors.push((
                user,
                device,
                CursorChain::Inbox.key().to_owned(),
                seq.min(newest),
            ));
        }
    }

    /// The users whose inbox heads this stage must have before it can take `handoffs`
    /// (the members of write fan-out messages) and `cursors` (devices' inbox positions).
    pub fn lacking_heads<'a>(
        &self,
        handoffs: impl IntoIterator<Item = &'a FanOut>,
        cursors: impl IntoIterator<Item = UserId>,
    ) -> std::collections::HashSet<UserId> {
        let mut lacking = std::collections::HashSet::new();
        for f in handoffs {
            if f.fanout == Fanout::Write {
                lacking.extend(
                    f.recipients
                        .iter()
                        .map(|r| r.user)
                        .filter(|u| self.lacks_head(*u)),
                );
            }
        }
        lacking.extend(cursors.into_iter().filter(|u| self.lacks_head(*u)));
        lacking
    }

    /// Takes the heads the store loaded for `asked` (see [`UserStage::lacking_heads`]): a
    /// user the store holds no inbox row of starts at 0.
    pub fn absorb_heads(
        &mut self,
        loaded: HashMap<UserId, u64>,
        asked: &std::collections::HashSet<UserId>,
    ) {
        for (u, head) in loaded {
            self.absorb_head(u, head);
        }
        for u in asked {
            self.absorb_head(*u, 0);
        }
    }

    /// How many users' heads are held.
    pub fn len(&self) -> usize {
        self.inbox_heads.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inbox_heads.is_empty()
    }

    /// Appends `f`'s message to its members' inboxes (write fan-out) and announces it to
    /// them, after the commit.
    pub fn deliver(&mut self, f: FanOut, ch: &mut Changes, ev: &mut Vec<Event>) {
        let msg_id = f.message.msg_id;
        let mut recipients = f.recipients;
        if f.fanout == Fanout::Write {
            for r in &mut recipients {
                // Guessing here would give a `user_seq` twice, which the tables refuse after
                // the sender had its `send_ack`: stopping the decisions (no ack for this
                // batch) is the lesser harm.
                let head = self
                    .inbox_heads
                    .get_mut(&r.user)
                    .expect("every member's inbox head is loaded before an append");
                *head += 1;
                ch.inbox.push(InboxRow {
                    user: r.user,
                    user_seq: *head,
                    msg_id,
                });
                r.user_seq = Some(*head);
            }
        }
        ev.push(Event::Message {
            message: f.message,
            recipients,
        });
    }

    #[cfg(test)]
    pub(crate) fn heads(&self) -> &HashMap<UserId, u64> {
        &self.inbox_heads
    }

    pub fn clear(&mut self) {
        self.inbox_heads.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::changes::Recipient;
    use pigeon_proto::{Message, MessageKind, MessageStatus, MsgId};
    use std::sync::Arc;

    fn uid(n: u64) -> UserId {
        UserId::new(n).unwrap()
    }

    fn fan_out(fanout: Fanout) -> FanOut {
        FanOut {
            message: Arc::new(Message {
                msg_id: MsgId::new(42).unwrap(),
                conversation_id: "g1".into(),
                seq: 7,
                sender: uid(1),
                client_msg_id: None,
                kind: MessageKind::Text,
                content: "hi".into(),
                extra: serde_json::Value::Null,
                reply_to: None,
                mentions: Vec::new(),
                status: MessageStatus::Normal,
                version: 1,
                created_at: 0,
                edited_at: None,
            }),
            recipients: [(1, false), (2, true)]
                .into_iter()
                .map(|(u, muted)| Recipient {
                    user: uid(u),
                    user_seq: None,
                    muted,
                })
                .collect(),
            fanout,
        }
    }

    /// A write fan-out hand-off puts the message into every member's inbox at its next
    /// `user_seq`; a read fan-out one only says who to push it to.
    #[test]
    fn a_hand_off_is_put_into_the_inboxes_of_write_fan_out_members_only() {
        let mut users = UserStage::default();
        users.absorb_head(uid(1), 10);
        users.absorb_head(uid(2), 0);
        // A head the store gives later does not overwrite one this stage moved.
        let (mut ch, mut ev) = (Changes::default(), Vec::new());
        users.deliver(fan_out(Fanout::Write), &mut ch, &mut ev);
        users.absorb_head(uid(1), 3);
        assert_eq!(
            (users.head(uid(1)), users.head(uid(2))),
            (Some(11), Some(1))
        );
        let rows: Vec<(u64, u64)> = ch
            .inbox
            .iter()
            .map(|r| (r.user.get(), r.user_seq))
            .collect();
        assert_eq!(rows, vec![(1, 11), (2, 1)]);
        let Some(Event::Message { recipients, .. }) = ev.pop() else {
            panic!("announced");
        };
        assert_eq!(recipients[1].user_seq, Some(1));
        assert!(recipients[1].muted);

        let (mut ch, mut ev) = (Changes::default(), Vec::new());
        users.deliver(fan_out(Fanout::Read), &mut ch, &mut ev);
        assert!(ch.inbox.is_empty());
        assert_eq!(users.head(uid(1)), Some(11));
        let Some(Event::Message { recipients, .. }) = ev.pop() else {
            panic!("announced");
        };
        assert!(recipients.iter().all(|r| r.user_seq.is_none()));
    }
}
