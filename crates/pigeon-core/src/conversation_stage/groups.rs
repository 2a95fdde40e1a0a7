//! The conversation stage's group commands: creating a chat or a group, members coming
//! and going, roles, mutes, the group's own fields, and its end.

use super::*;

impl ConversationStage {
    pub(super) fn create_single(&mut self, id: &ConversationId, a: UserId, b: UserId, now: i64) {
        let member = || MemberState::joined(Role::Member, 1, 0, now);
        let members = [(a, member()), (b, member())].into_iter().collect();
        self.absent.remove(id);
        self.conversations.insert(
            id.clone(),
            new_conversation(id.clone(), false, None, None, members, now),
        );
    }

    pub(super) fn create_group(
        &mut self,
        id: Option<ConversationId>,
        owner: UserId,
        name: String,
        members: Vec<UserId>,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        rules::validate_text_field("name", &name, rules::MAX_GROUP_NAME_CHARS)?;
        let mut all = vec![owner];
        for m in members {
            if !all.contains(&m) {
                all.push(m);
            }
        }
        if all.len() > rules::MAX_USERS_PER_REQUEST + 1 {
            return Err(DomainError::invalid(format!(
                "at most {} members at creation",
                rules::MAX_USERS_PER_REQUEST
            )));
        }
        // `not_found`: "no such ... user" (PROTOCOL.md 1), as for a send to one.
        if all.iter().any(|u| !self.knows(*u)) {
            return Err(DomainError::NotFound("user"));
        }
        let id = match id {
            Some(id) if id.is_group() => id,
            Some(_) => return Err(DomainError::invalid("a group's id names no users")),
            None => ConversationId::group(self.shared.next_id(now)),
        };
        if self.conversations.contains_key(&id) {
            return Err(DomainError::Conflict("the group exists".into()));
        }
        let members = all
            .iter()
            .map(|u| {
                let role = if *u == owner {
                    Role::Owner
                } else {
                    Role::Member
                };
                // Joined with the creation message (seq 1), which each has read: "a member
                // who joins a group has read everything sent before they joined".
                (*u, MemberState::joined(role, 1, 1, now))
            })
            .collect();
        self.absent.remove(&id);
        self.conversations.insert(
            id.clone(),
            new_conversation(id.clone(), true, Some(name), Some(owner), members, now),
        );
        for u in &all {
            self.write_member(&id, *u, None, ch);
        }
        let extra = json!({ "members": all });
        self.append(&id, owner, MessageKind::GroupCreated, extra, now, ch);
        Ok(Reply::Conversation(id))
    }

    pub(super) fn invite(
        &mut self,
        actor: UserId,
        conv_id: &ConversationId,
        users: Vec<UserId>,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        rules::validate_invitees(&users)?;
        // Looked up before the group is borrowed: at most a thousand, not a copy of every
        // known user.
        let unknown: HashSet<UserId> = users.iter().filter(|u| !self.knows(**u)).copied().collect();
        let conv = self.member_group_mut(conv_id, actor)?;
        role_of(conv, actor)?;
        still_open(conv)?;
        let mut fresh: Vec<UserId> = Vec::new();
        for u in users {
            if conv.members.contains_key(&u) {
                return Err(DomainError::Conflict(format!(
                    "user {u} is already a member"
                )));
            }
            if unknown.contains(&u) {
                return Err(DomainError::NotFound("user"));
            }
            if !fresh.contains(&u) {
                fresh.push(u);
            }
        }
        if conv.members.len() + fresh.len() > rules::MAX_GROUP_MEMBERS {
            return Err(DomainError::Conflict(format!(
                "a group holds at most {} members",
                rules::MAX_GROUP_MEMBERS
            )));
        }
        // New members see the invitation itself; their read mark starts at the newest seq, the
        // invitation (PROTOCOL.md: a joiner has read everything sent before they joined).
        let invite_seq = conv.seq + 1;
        for u in &fresh {
            conv.members.insert(
                *u,
                MemberState::joined(Role::Member, invite_seq, invite_seq, now),
            );
        }
        for u in &fresh {
            self.write_member(conv_id, *u, None, ch);
        }
        let extra = json!({"from_user": actor, "to_users": fresh});
        self.append(conv_id, actor, MessageKind::MemberInvited, extra, now, ch);
        Ok(Reply::Done)
    }

    pub(super) fn remove(
        &mut self,
        actor: UserId,
        conv_id: &ConversationId,
        user: UserId,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        let conv = self.member_group_mut(conv_id, actor)?;
        let actor_role = role_of(conv, actor)?;
        // A dismissed group is read-only: nobody is kicked from it or quits it (a member who
        // no longer wants to see it hides it).
        still_open(conv)?;
        // Rights before the target, as for mutes: a plain member who names someone else is
        // refused (`forbidden`) whether or not that user is in the group.
        if actor != user && !actor_role.manages() {
            return Err(DomainError::Forbidden(
                "only the owner and admins remove members".into(),
            ));
        }
        let target_role = conv
            .members
            .get(&user)
            .map(|m| m.role)
            .ok_or(DomainError::NotFound("member"))?;
        let (kind, extra) = if actor == user {
            if actor_role == Role::Owner {
                return Err(DomainError::Forbidden(
                    "the owner cannot quit; dismiss the group instead".into(),
                ));
            }
            (MessageKind::MemberQuit, json!({"user": user}))
        } else {
            if !outranks(actor_role, target_role) {
                return Err(DomainError::Forbidden(
                    "cannot remove a member of equal or higher role".into(),
                ));
            }
            (
                MessageKind::MemberKicked,
                json!({"from_user": actor, "to_users": [user]}),
            )
        };
        // The removal is the last message the removed member receives.
        let msg = self.append(conv_id, actor, kind, extra, now, ch);
        self.write_member(conv_id, user, Some(msg.seq), ch);
        self.conv_mut(conv_id).members.remove(&user);
        self.touched.insert(conv_id.clone());
        Ok(Reply::Done)
    }

    pub(super) fn set_admin(
        &mut self,
        actor: UserId,
        conversation: ConversationId,
        user: UserId,
        admin: bool,
        ch: &mut Changes,
    ) -> Outcome {
        let conv = self.member_group_mut(&conversation, actor)?;
        let actor_role = role_of(conv, actor)?;
        if actor_role != Role::Owner {
            return Err(DomainError::Forbidden(
                "only the owner appoints admins".into(),
            ));
        }
        still_open(conv)?;
        let target = conv
            .members
            .get_mut(&user)
            .ok_or(DomainError::NotFound("member"))?;
        if target.role == Role::Owner {
            return Err(DomainError::Conflict(
                "the owner's role cannot change".into(),
            ));
        }
        target.role = if admin { Role::Admin } else { Role::Member };
        self.write_member(&conversation, user, None, ch);
        self.touched.insert(conversation);
        Ok(Reply::Done)
    }

    pub(super) fn mute(
        &mut self,
        actor: UserId,
        conversation: &ConversationId,
        user: UserId,
        duration_secs: u64,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        if duration_secs == 0 || duration_secs > rules::MAX_MUTE_SECS {
            return Err(DomainError::invalid(format!(
                "duration_secs must be 1..={}",
                rules::MAX_MUTE_SECS
            )));
        }
        let until = now + (duration_secs as i64) * 1000;
        self.check_manage_member(actor, conversation, user)?;
        self.conv_mut(conversation)
            .members
            .get_mut(&user)
            .expect("checked")
            .mute_until = Some(until);
        self.write_member(conversation, user, None, ch);
        let extra = json!({"from_user": actor, "to_user": user, "until": until});
        self.append(
            conversation,
            actor,
            MessageKind::MemberMuted,
            extra,
            now,
            ch,
        );
        Ok(Reply::Done)
    }

    pub(super) fn unmute(
        &mut self,
        actor: UserId,
        conversation: &ConversationId,
        user: UserId,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        self.check_manage_member(actor, conversation, user)?;
        self.conv_mut(conversation)
            .members
            .get_mut(&user)
            .expect("checked")
            .mute_until = None;
        self.write_member(conversation, user, None, ch);
        let extra = json!({"from_user": actor, "to_user": user});
        self.append(
            conversation,
            actor,
            MessageKind::MemberUnmuted,
            extra,
            now,
            ch,
        );
        Ok(Reply::Done)
    }

    pub(super) fn update_group(
        &mut self,
        actor: UserId,
        conversation: ConversationId,
        patch: GroupPatch,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        let conv = self.member_group_mut(&conversation, actor)?;
        if !role_of(conv, actor)?.manages() {
            return Err(DomainError::Forbidden(
                "only the owner and admins update the group".into(),
            ));
        }
        still_open(conv)?;
        let mut changed = serde_json::Map::new();
        if let Some(name) = patch.name {
            changed.insert("name".into(), json!(name));
            conv.name = Some(name);
        }
        if let Some(notice) = patch.notice {
            changed.insert("notice".into(), json!(notice));
            conv.notice = Some(notice);
        }
        if let Some(avatar) = patch.avatar {
            changed.insert("avatar".into(), json!(avatar));
            conv.avatar = Some(avatar);
        }
        if changed.is_empty() {
            return Err(DomainError::invalid(
                "nothing to update: give name, notice or avatar",
            ));
        }
        let extra = serde_json::Value::Object(changed);
        self.append(
            &conversation,
            actor,
            MessageKind::GroupUpdated,
            extra,
            now,
            ch,
        );
        Ok(Reply::Conversation(conversation))
    }

    pub(super) fn dismiss(
        &mut self,
        actor: UserId,
        conversation: &ConversationId,
        now: i64,
        ch: &mut Changes,
    ) -> Outcome {
        let conv = self.member_group_mut(conversation, actor)?;
        if role_of(conv, actor)? != Role::Owner {
            return Err(DomainError::Forbidden(
                "only the owner dismisses the group".into(),
            ));
        }
        if conv.dismissed {
            return Err(DomainError::Conflict(
                "the group was dismissed already".into(),
            ));
        }
        self.append(
            conversation,
            actor,
            MessageKind::GroupDismissed,
            json!({}),
            now,
            ch,
        );
        self.conv_mut(conversation).dismissed = true;
        Ok(Reply::Done)
    }

    pub(super) fn check_manage_member(
        &mut self,
        actor: UserId,
        conv_id: &ConversationId,
        user: UserId,
    ) -> Result<(), DomainError> {
        let conv = self.member_group_mut(conv_id, actor)?;
        let actor_role = role_of(conv, actor)?;
        if !actor_role.manages() {
            return Err(DomainError::Forbidden(
                "only the owner and admins mute members".into(),
            ));
        }
        still_open(conv)?;
        let target = conv
            .members
            .get(&user)
            .ok_or(DomainError::NotFound("member"))?;
        if !outranks(actor_role, target.role) {
            return Err(DomainError::Forbidden(
                "cannot mute a member of equal or higher role".into(),
            ));
        }
        Ok(())
    }
}
