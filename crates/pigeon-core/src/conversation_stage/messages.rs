//! The conversation stage's message commands: sends (deduplicated before a seq is
//! given), recalls, edits, deletions for everyone and for one reader.

use super::*;

impl ConversationStage {
    pub(super) fn send(&mut self, s: SendCommand, now: i64, ch: &mut Changes) -> Outcome {
        let key = (s.sender, s.client_msg_id.clone());
        if let Some(ack) = self.dedupe.get(&key) {
            return Ok(Reply::SendAck(SendAck {
                duplicate: true,
                ..ack.clone()
            }));
        }
        let conv_id = match target(&s) {
            Target::Peer(peer) => {
                let id = ConversationId::single(s.sender, peer)
                    .map_err(|e| DomainError::invalid(e.0))?;
                if !self.conversations.contains_key(&id) {
                    if !self.knows(peer) {
                        return Err(DomainError::NotFound("user"));
                    }
                    self.create_single(&id, s.sender, peer, now);
                    self.write_member(&id, peer, None, ch);
                }
                id
            }
            Target::Group(id) => id.clone(),
        };
        let conv = self.member_conv_mut(&conv_id, s.sender)?;
        still_open(conv)?;
        let me = conv.members.get(&s.sender).expect("member checked");
        if me.mute_until.is_some_and(|until| until > now) {
            return Err(DomainError::Muted);
        }
        let content = Content {
            kind: s.kind,
            content: s.content,
            extra: s.extra,
            reply_to: s.reply_to,
            mentions: s.mentions,
        };
        let msg = self.append_full(
            &conv_id,
            s.sender,
            Some(s.client_msg_id.clone()),
            content,
            now,
            ch,
        );
        // Sending reads everything up to the new message for the sender.
        if let Some(m) = self.conv_mut(&conv_id).members.get_mut(&s.sender) {
            m.last_read_seq = msg.seq;
        }
        self.write_member(&conv_id, s.sender, None, ch);
        let ack = SendAck {
            client_msg_id: s.client_msg_id.to_string(),
            msg_id: msg.msg_id,
            conversation_id: conv_id,
            seq: msg.seq,
            created_at: msg.created_at,
            duplicate: false,
        };
        self.shared.remember_key(key.0, &key.1);
        self.dedupe.insert(self.batch, key, ack.clone());
        Ok(Reply::SendAck(ack))
    }

    pub(super) fn recall(
        &mut self,
        actor: UserId,
        msg_id: MsgId,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        let msg = self.existing_message(msg_id)?;
        let conv_id = self.recallable_conversation_of(&msg, actor)?;
        // A manager may recall what was sent before they joined, which they cannot read:
        // what cannot be recalled of it answers as if it did not exist.
        let readable = self.visible_conversation_of(&msg, actor).is_ok();
        if !readable && (!msg.kind.is_user_content() || msg.status == MessageStatus::Deleted) {
            return Err(DomainError::NotFound("message"));
        }
        if !msg.kind.is_user_content() {
            return Err(DomainError::invalid("only user messages can be recalled"));
        }
        let conv = self.conversations.get(&conv_id).expect("visible checked");
        let manager = conv.is_group && conv.members.get(&actor).is_some_and(|m| m.role.manages());
        if msg.sender != actor && !manager {
            return Err(DomainError::Forbidden(
                "only the sender or a group admin may recall".into(),
            ));
        }
        // A retry of a recall that was done answers as the first did, dismissed or not.
        if msg.status == MessageStatus::Recalled {
            return Ok(Reply::Message(Box::new(msg.redacted(false))));
        }
        still_open(conv)?;
        if msg.status == MessageStatus::Deleted {
            return Err(DomainError::Conflict("the message was deleted".into()));
        }
        if !manager && now - msg.created_at > self.cfg.recall_window_ms {
            return Err(DomainError::WindowExpired);
        }
        let mut updated = msg.clone();
        updated.status = MessageStatus::Recalled;
        ch.message_updates.push(MessageUpdate {
            msg_id,
            status: MessageStatus::Recalled,
            version: msg.version,
            content: None,
            edited_at: msg.edited_at,
            recalled: Some((now, actor)),
        });
        self.messages
            .insert(self.batch, msg_id, Some(updated.clone()));
        let extra = json!({"msg_id": msg_id});
        self.append(&conv_id, actor, MessageKind::Recall, extra, now, ch);
        Ok(Reply::Message(Box::new(updated.redacted(false))))
    }

    pub(super) fn edit(
        &mut self,
        actor: UserId,
        msg_id: MsgId,
        content: String,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        let msg = self.existing_message(msg_id)?;
        let conv_id = self.visible_conversation_of(&msg, actor)?;
        if msg.sender != actor {
            return Err(DomainError::Forbidden(
                "only the sender may edit a message".into(),
            ));
        }
        if msg.kind != MessageKind::Text {
            return Err(DomainError::invalid("only text messages can be edited"));
        }
        let conv = self.conversations.get(&conv_id).expect("visible checked");
        // A dismissed group is read-only: that answers before the message's own state.
        still_open(conv)?;
        // An edit reaches every member, as a send does: not while muted.
        let me = conv.members.get(&actor).expect("visible: a member");
        let muted = me.mute_until.is_some_and(|until| until > now);
        if msg.status != MessageStatus::Normal {
            return Err(DomainError::Conflict(format!(
                "the message is {}",
                msg.status.as_str()
            )));
        }
        if now - msg.created_at > self.cfg.edit_window_ms {
            return Err(DomainError::WindowExpired);
        }
        if msg.version >= rules::MAX_MESSAGE_VERSIONS {
            return Err(DomainError::Conflict(format!(
                "a message keeps at most {} versions",
                rules::MAX_MESSAGE_VERSIONS
            )));
        }
        if muted {
            return Err(DomainError::Muted);
        }
        let mut updated = msg.clone();
        updated.version += 1;
        updated.content = content.clone();
        updated.edited_at = Some(now);
        if msg.version == 1 {
            ch.versions
                .push((msg_id, 1, msg.content.clone(), msg.created_at));
        }
        ch.versions
            .push((msg_id, updated.version, content.clone(), now));
        ch.message_updates.push(MessageUpdate {
            msg_id,
            status: MessageStatus::Normal,
            version: updated.version,
            content: Some(content),
            edited_at: Some(now),
            recalled: None,
        });
        self.messages
            .insert(self.batch, msg_id, Some(updated.clone()));
        let extra = json!({"msg_id": msg_id, "version": updated.version});
        self.append(&conv_id, actor, MessageKind::Edit, extra, now, ch);
        Ok(Reply::Message(Box::new(updated)))
    }

    pub(super) fn admin_delete(&mut self, msg_id: MsgId, ch: &mut Changes) -> Outcome {
        let mut msg = self.existing_message(msg_id)?;
        if msg.status != MessageStatus::Deleted {
            // "Content gone" (PROTOCOL.md 6): its payload, mentions and earlier versions
            // too, even from the admin audit.
            msg.status = MessageStatus::Deleted;
            msg.content.clear();
            msg.extra = serde_json::Value::Null;
            msg.mentions.clear();
            ch.message_updates.push(MessageUpdate {
                msg_id,
                status: MessageStatus::Deleted,
                version: msg.version,
                content: Some(String::new()),
                edited_at: msg.edited_at,
                recalled: None,
            });
            self.messages.insert(self.batch, msg_id, Some(msg.clone()));
        }
        Ok(Reply::Message(Box::new(msg)))
    }

    pub(super) fn hide_message(
        &mut self,
        user: UserId,
        msg_id: MsgId,
        ch: &mut Changes,
    ) -> Outcome {
        let msg = self.existing_message(msg_id)?;
        let conv_id = ConversationId::parse(&msg.conversation_id)
            .map_err(|_| DomainError::NotFound("message"))?;
        let conv = self
            .conversations
            .get(&conv_id)
            .ok_or(DomainError::NotFound("message"))?;
        let m = conv
            .members
            .get(&user)
            .ok_or(DomainError::NotFound("message"))?;
        if msg.seq < m.joined_seq {
            return Err(DomainError::NotFound("message"));
        }
        ch.hidden_messages.push((user, msg_id));
        Ok(Reply::Done)
    }

    /// The conversation of `msg`, if `user` may see the message (a current member who joined
    /// at or before it); `not_found` otherwise, so nothing leaks.
    pub(super) fn visible_conversation_of(
        &self,
        msg: &Message,
        user: UserId,
    ) -> Result<ConversationId, DomainError> {
        let conv_id = ConversationId::parse(&msg.conversation_id)
            .map_err(|_| DomainError::NotFound("message"))?;
        let conv = self
            .conversations
            .get(&conv_id)
            .ok_or(DomainError::NotFound("message"))?;
        match conv.members.get(&user) {
            Some(m) if msg.seq >= m.joined_seq => Ok(conv_id),
            _ => Err(DomainError::NotFound("message")),
        }
    }

    /// The conversation of a message `actor` may recall: one they see, or any message of a
    /// group they own or administer, sent before they joined too (PROTOCOL.md 6: "a group's
    /// owner and admins may recall any message of the group at any time").
    pub(super) fn recallable_conversation_of(
        &self,
        msg: &Message,
        actor: UserId,
    ) -> Result<ConversationId, DomainError> {
        if let Ok(conv_id) = ConversationId::parse(&msg.conversation_id)
            && let Some(conv) = self.conversations.get(&conv_id)
            && conv.is_group
            && conv.members.get(&actor).is_some_and(|m| m.role.manages())
        {
            return Ok(conv_id);
        }
        self.visible_conversation_of(msg, actor)
    }

    pub(super) fn existing_message(&self, msg_id: MsgId) -> Result<Message, DomainError> {
        match self.messages.get(&msg_id) {
            Some(Some(m)) => Ok(m.clone()),
            _ => Err(DomainError::NotFound("message")),
        }
    }
}
