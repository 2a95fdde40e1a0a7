//! The conversation stage's per-member marks: read marks, settings, acknowledged
//! positions in a conversation's chain.

use super::*;

impl ConversationStage {
    pub(super) fn read(
        &mut self,
        user: UserId,
        conversation: ConversationId,
        seq: u64,
        from_device: Option<DeviceId>,
        ch: &mut Changes,
        ev: &mut Vec<Event>,
    ) -> Outcome {
        let conv = self.member_conv_mut(&conversation, user)?;
        let newest = conv.seq;
        let member = conv.members.get_mut(&user).expect("member checked");
        let target = seq.min(newest);
        if target <= member.last_read_seq {
            return Ok(Reply::LastRead(member.last_read_seq));
        }
        member.last_read_seq = target;
        let to: Vec<UserId> = conv.members.keys().copied().collect();
        self.write_member(&conversation, user, None, ch);
        ev.push(Event::Receipt {
            conversation,
            user,
            last_read_seq: target,
            to,
            except_device: from_device,
        });
        Ok(Reply::LastRead(target))
    }

    pub(super) fn settings(
        &mut self,
        user: UserId,
        conversation: ConversationId,
        patch: SettingsPatch,
        ch: &mut Changes,
        ev: &mut Vec<Event>,
    ) -> Outcome {
        let conv = self.member_conv_mut(&conversation, user)?;
        let newest = conv.seq;
        let m = conv.members.get_mut(&user).expect("member checked");
        if let Some(p) = patch.pinned {
            m.pinned = p;
        }
        if let Some(mu) = patch.muted {
            m.muted = mu;
        }
        if let Some(h) = patch.hidden {
            m.hidden_seq = h.then_some(newest);
        }
        let (pinned, muted, hidden) = (m.pinned, m.muted, m.hidden(newest));
        self.write_member(&conversation, user, None, ch);
        ev.push(Event::SettingsChanged {
            user,
            conversation: conversation.clone(),
            pinned,
            muted,
            hidden,
        });
        Ok(Reply::Conversation(conversation))
    }

    /// An acknowledgement past the chain's newest seq counts up to the newest: stored as
    /// given, the device would skip what comes next when it resumes. A conversation's is
    /// saved for its members only. One cached with the user in it is clamped here; any
    /// other is not loaded (an ack can name any id): the store checks membership and clamps
    /// (`member_cursors`), which also saves a former member's position up to their
    /// removal. One known not to exist is dropped. (The inbox's is the user stage's.)
    pub(super) fn advance_cursor(
        &mut self,
        user: UserId,
        device: DeviceId,
        chain: CursorChain,
        seq: u64,
        ch: &mut Changes,
    ) {
        let CursorChain::Conversation(c) = &chain else {
            return;
        };
        match self.conversations.get(c) {
            Some(conv) if conv.members.contains_key(&user) => {
                let newest = conv.seq;
                ch.cursors
                    .push((user, device, chain.key().to_owned(), seq.min(newest)));
            }
            None if self.absent.contains(c) => {}
            // Not cached, or not in it now (a former member's, perhaps).
            _ => ch.member_cursors.push((user, device, c.clone(), seq)),
        }
    }
}
