//! The engine alone, without a store: what it decides for sequences of commands.

use super::*;
use crate::command::{SendCommand, SendTo};
use crate::state::ConversationState;
use crate::store::{Loaded, Needs};
use pigeon_proto::views::SendAck;
use pigeon_proto::{ClientMsgId, ConversationId, DeviceId, MessageKind, MessageStatus};
use std::collections::{HashMap, HashSet};

fn uid(n: u64) -> UserId {
    UserId::new(n).unwrap()
}

const T0: i64 = 1_800_000_000_000;

/// An engine that knows users 1..=n (registered, empty inboxes).
fn engine(n: u64, write_max: u64) -> Engine {
    let cfg = EngineConfig {
        fanout_write_max_members: write_max,
        recall_window_ms: 1000,
        ..EngineConfig::default()
    };
    let mut e = Engine::new(cfg, 0);
    let users: HashSet<UserId> = (1..=n).map(uid).collect();
    let needs = Needs {
        users: users.clone(),
        ..Needs::default()
    };
    e.absorb(
        Loaded {
            users,
            ..Loaded::default()
        },
        &needs,
    );
    e
}

/// A text send of "x".
fn send_cmd(from: u64, to: SendTo, cmid: &str) -> Command {
    Command::Send(SendCommand::text(
        uid(from),
        to,
        ClientMsgId::parse(cmid).unwrap(),
        "x",
    ))
}

fn send(
    e: &mut Engine,
    from: u64,
    to: SendTo,
    cmid: &str,
    ch: &mut Changes,
    ev: &mut Vec<Event>,
) -> Result<Reply, DomainError> {
    let cmd = send_cmd(from, to, cmid);
    // A fresh conversation in this test is known to be absent.
    for c in e.needs(std::slice::from_ref(&cmd)).conversations {
        let needs = Needs {
            conversations: [c.clone()].into(),
            ..Needs::default()
        };
        e.absorb(
            Loaded {
                conversations: [(c, None)].into(),
                ..Loaded::default()
            },
            &needs,
        );
    }
    let needs = e.needs(std::slice::from_ref(&cmd));
    e.absorb(Loaded::default(), &needs);
    e.apply(cmd, T0, ch, ev)
}

fn group(
    e: &mut Engine,
    owner: u64,
    members: &[u64],
    ch: &mut Changes,
    ev: &mut Vec<Event>,
) -> ConversationId {
    let cmd = Command::CreateGroup {
        id: None,
        owner: uid(owner),
        name: "g".into(),
        members: members.iter().map(|m| uid(*m)).collect(),
    };
    match e.apply(cmd, T0, ch, ev).unwrap() {
        Reply::Conversation(c) => c,
        other => panic!("{other:?}"),
    }
}

/// A text send from `from` into `group`, its message then loaded into the engine as the
/// store would give it to a later command (a recall or an edit asks for the message).
fn send_and_load(
    e: &mut Engine,
    from: u64,
    group: ConversationId,
    cmid: &str,
    ch: &mut Changes,
    ev: &mut Vec<Event>,
) -> SendAck {
    let a = ack(send(e, from, SendTo::Conversation(group), cmid, ch, ev));
    let msg = ch
        .messages
        .iter()
        .find(|m| m.msg_id == a.msg_id)
        .unwrap()
        .clone();
    let needs = Needs {
        messages: [a.msg_id].into(),
        ..Needs::default()
    };
    e.absorb(
        Loaded {
            messages: [(a.msg_id, msg)].into(),
            ..Loaded::default()
        },
        &needs,
    );
    a
}

fn ack(r: Result<Reply, DomainError>) -> SendAck {
    match r.unwrap() {
        Reply::SendAck(a) => a,
        other => panic!("{other:?}"),
    }
}

#[test]
fn seqs_and_user_seqs_are_contiguous_and_dedupe_holds_within_a_batch() {
    let mut e = engine(3, 500);
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    let a1 = ack(send(&mut e, 1, SendTo::User(uid(2)), "a", &mut ch, &mut ev));
    let a2 = ack(send(&mut e, 2, SendTo::User(uid(1)), "b", &mut ch, &mut ev));
    let again = ack(send(&mut e, 1, SendTo::User(uid(2)), "a", &mut ch, &mut ev));
    assert_eq!((a1.seq, a2.seq), (1, 2));
    assert_eq!(a1.conversation_id, a2.conversation_id);
    assert!(again.duplicate && again.msg_id == a1.msg_id && again.seq == 1);
    assert_eq!(ch.messages.len(), 2, "the retry stores nothing");
    let mut user1: Vec<u64> = ch
        .inbox
        .iter()
        .filter(|i| i.user == uid(1))
        .map(|i| i.user_seq)
        .collect();
    user1.sort();
    assert_eq!(user1, vec![1, 2]);
    assert!(a1.msg_id < a2.msg_id, "ids grow");
}

#[test]
fn groups_over_the_threshold_use_read_fanout() {
    let mut e = engine(4, 2);
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    let g = group(&mut e, 1, &[2, 3], &mut ch, &mut ev);
    ev.clear();
    ack(send(
        &mut e,
        2,
        SendTo::Conversation(g.clone()),
        "m",
        &mut ch,
        &mut ev,
    ));
    let Event::Message {
        recipients,
        message,
    } = &ev[0]
    else {
        panic!()
    };
    assert_eq!(message.seq, 2);
    assert_eq!(recipients.len(), 3);
    assert!(
        recipients.iter().all(|r| r.user_seq.is_none()),
        "no inbox copies above the threshold"
    );
    assert!(
        ch.inbox.is_empty(),
        "no inbox rows at all above the threshold"
    );
}

#[test]
fn a_refused_command_changes_nothing() {
    let mut e = engine(3, 500);
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    let g = group(&mut e, 1, &[2], &mut ch, &mut ev);
    // End of that batch; the refusals below come in the next one.
    let batch = e.seal(&mut ch);
    e.committed(batch);
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    let err = send(
        &mut e,
        3,
        SendTo::Conversation(g.clone()),
        "x",
        &mut ch,
        &mut ev,
    )
    .unwrap_err();
    assert_eq!(err, DomainError::NotMember);
    let err = e
        .apply(
            Command::RemoveMember {
                actor: uid(2),
                conversation: g.clone(),
                user: uid(1),
            },
            T0,
            &mut ch,
            &mut ev,
        )
        .unwrap_err();
    assert!(matches!(err, DomainError::Forbidden(_)));
    e.seal(&mut ch);
    assert!(ch.is_empty() && ev.is_empty(), "{ch:?}");
    // And the next message still gets the next seq.
    assert_eq!(
        ack(send(
            &mut e,
            2,
            SendTo::Conversation(g),
            "y",
            &mut ch,
            &mut ev
        ))
        .seq,
        2
    );
}

#[test]
fn a_kicked_member_gets_the_kick_and_nothing_after() {
    let mut e = engine(3, 500);
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    let g = group(&mut e, 1, &[2, 3], &mut ch, &mut ev);
    ev.clear();
    e.apply(
        Command::RemoveMember {
            actor: uid(1),
            conversation: g.clone(),
            user: uid(3),
        },
        T0,
        &mut ch,
        &mut ev,
    )
    .unwrap();
    let Event::Message {
        recipients,
        message,
    } = &ev[0]
    else {
        panic!()
    };
    assert_eq!(message.kind, MessageKind::MemberKicked);
    assert!(
        recipients.iter().any(|r| r.user == uid(3)),
        "the kicked member hears of it"
    );
    let row = &ch.members[&(g.clone(), uid(3))];
    assert_eq!(row.left_seq, Some(message.seq));
    ev.clear();
    ack(send(
        &mut e,
        1,
        SendTo::Conversation(g.clone()),
        "after",
        &mut ch,
        &mut ev,
    ));
    let Event::Message { recipients, .. } = &ev[0] else {
        panic!()
    };
    assert!(recipients.iter().all(|r| r.user != uid(3)));
    assert_eq!(
        send(&mut e, 3, SendTo::Conversation(g), "z", &mut ch, &mut ev).unwrap_err(),
        DomainError::NotMember
    );
}

#[test]
fn recall_respects_the_window_except_for_group_managers() {
    let mut e = engine(2, 500);
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    let g = group(&mut e, 1, &[2], &mut ch, &mut ev);
    let a = send_and_load(&mut e, 2, g, "r", &mut ch, &mut ev);
    let late = T0 + 5000;
    let err = e
        .apply(
            Command::Recall {
                actor: uid(2),
                msg_id: a.msg_id,
            },
            late,
            &mut ch,
            &mut ev,
        )
        .unwrap_err();
    assert_eq!(err, DomainError::WindowExpired);
    let Reply::Message(m) = e
        .apply(
            Command::Recall {
                actor: uid(1),
                msg_id: a.msg_id,
            },
            late,
            &mut ch,
            &mut ev,
        )
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(m.status, MessageStatus::Recalled);
    assert_eq!(
        m.content, "",
        "recalled content is gone from what is returned"
    );
    assert!(
        ch.message_updates
            .iter()
            .any(|u| u.msg_id == a.msg_id && u.recalled.is_some() && u.content.is_none()),
        "the original is kept in the store"
    );
}

#[test]
fn an_edit_in_a_dismissed_group_answers_conflict_even_past_its_window() {
    let mut e = engine(2, 500);
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    let g = group(&mut e, 1, &[2], &mut ch, &mut ev);
    let a = send_and_load(&mut e, 2, g.clone(), "e", &mut ch, &mut ev);
    let dismiss = Command::Dismiss {
        actor: uid(1),
        conversation: g,
    };
    e.apply(dismiss, T0, &mut ch, &mut ev).unwrap();
    let edit = |content: &str| Command::Edit {
        actor: uid(2),
        msg_id: a.msg_id,
        content: content.into(),
    };
    // PROTOCOL.md 6 (extension): a dismissed group answers `conflict` to every change,
    // whatever else the change would meet.
    let within = e.apply(edit("in time"), T0 + 1, &mut ch, &mut ev);
    assert!(
        matches!(within, Err(DomainError::Conflict(_))),
        "{within:?}"
    );
    let late = T0 + e.config().edit_window_ms + 1;
    let past = e.apply(edit("too late"), late, &mut ch, &mut ev);
    assert!(matches!(past, Err(DomainError::Conflict(_))), "{past:?}");
}

#[test]
fn a_batch_decided_while_the_previous_commits_sees_its_sends() {
    // Batch 1 is sealed but not committed (the store does not show it yet) while batch 2 is
    // decided: a retry of batch 1's send must be answered from memory as a duplicate, and
    // the conversation's seq must go on from batch 1's.
    let mut e = engine(2, 500);
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    let first = ack(send(
        &mut e,
        1,
        SendTo::User(uid(2)),
        "k1",
        &mut ch,
        &mut ev,
    ));
    let b1 = e.seal(&mut ch);
    let (mut ch2, mut ev2) = (Changes::default(), Vec::new());
    let retry = ack(send(
        &mut e,
        1,
        SendTo::User(uid(2)),
        "k1",
        &mut ch2,
        &mut ev2,
    ));
    assert!(retry.duplicate);
    assert_eq!((retry.msg_id, retry.seq), (first.msg_id, first.seq));
    let next = ack(send(
        &mut e,
        1,
        SendTo::User(uid(2)),
        "k2",
        &mut ch2,
        &mut ev2,
    ));
    assert_eq!(next.seq, first.seq + 1);
    let retry_cmd = send_cmd(1, SendTo::User(uid(2)), "k1");
    assert!(
        e.needs(std::slice::from_ref(&retry_cmd)).dedupe.is_empty(),
        "batch 1's key is still known from memory"
    );
    let b2 = e.seal(&mut ch2);
    assert_eq!(b2, b1 + 1);
    // Once batch 1 is durable its memory goes (the store answers now); batch 2's stays.
    e.committed(b1);
    assert_eq!(e.needs(std::slice::from_ref(&retry_cmd)).dedupe.len(), 1);
    let k2 = send_cmd(1, SendTo::User(uid(2)), "k2");
    assert!(e.needs(std::slice::from_ref(&k2)).dedupe.is_empty());
    e.committed(b2);
    assert_eq!(e.needs(std::slice::from_ref(&k2)).dedupe.len(), 1);
}

#[test]
fn only_keys_the_store_may_hold_are_looked_up() {
    let mut e = engine(2, 500);
    let cmd = |cmid: &str| send_cmd(1, SendTo::User(uid(2)), cmid);
    // A key never stored and never decided is new for sure: no look-up.
    assert!(e.needs(&[cmd("fresh")]).dedupe.is_empty());
    // A key the store holds (told at start) is looked up.
    e.remember_key(uid(1), &ClientMsgId::parse("stored").unwrap());
    assert_eq!(e.needs(&[cmd("stored")]).dedupe.len(), 1);
    // A key decided here is remembered: once its batch is committed (its ack leaves memory),
    // a retry is looked up in the store, which then holds it.
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    ack(send(
        &mut e,
        1,
        SendTo::User(uid(2)),
        "sent",
        &mut ch,
        &mut ev,
    ));
    assert!(
        e.needs(&[cmd("sent")]).dedupe.is_empty(),
        "answered from memory"
    );
    let b = e.seal(&mut ch);
    e.committed(b);
    assert_eq!(e.needs(&[cmd("sent")]).dedupe.len(), 1);
}

/// An acknowledged position is saved up to the chain's newest seq: an inbox's head, a
/// cached conversation's seq; a conversation known not to exist is not saved, and one not
/// cached goes to the store as given, which clamps it and checks membership (nothing is
/// loaded for an ack, which can name any id).
#[test]
fn acknowledged_positions_are_clamped_to_the_newest_seq() {
    let mut e = engine(3, 500);
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    send(&mut e, 1, SendTo::User(uid(2)), "a", &mut ch, &mut ev).unwrap();
    let g = group(&mut e, 1, &[2, 3], &mut ch, &mut ev);
    let g_seq = e.conversations.cached()[&g].seq;
    let device = DeviceId::parse("d").unwrap();
    let advance = |chain: CursorChain, seq: u64| Command::AdvanceCursor {
        user: uid(2),
        device: device.clone(),
        chain,
        seq,
    };
    let missing = ConversationId::parse("g999").unwrap();
    e.conversations.mark_absent(missing.clone());
    let uncached = ConversationId::parse("g998").unwrap();
    let mut saved = Changes::default();
    for cmd in [
        advance(CursorChain::Inbox, 1_000),
        advance(CursorChain::Conversation(g.clone()), 1_000),
        advance(CursorChain::Conversation(missing), 5),
        advance(CursorChain::Conversation(uncached.clone()), 7),
    ] {
        assert!(e.needs(std::slice::from_ref(&cmd)).conversations.is_empty());
        e.apply(cmd, T0, &mut saved, &mut ev).unwrap();
    }
    let head = e.users.heads()[&uid(2)];
    assert_eq!(
        saved.cursors,
        vec![
            (uid(2), device.clone(), "user".to_owned(), head),
            (uid(2), device.clone(), g.as_str().to_owned(), g_seq),
        ]
    );
    // Not cached: left to the store to clamp and check (a conversation known not to exist
    // is dropped here).
    assert_eq!(
        saved.member_cursors,
        vec![(uid(2), device.clone(), uncached, 7)]
    );
    // Cached, but acknowledged by someone not in it: the store checks too (a former member
    // may save a position up to their removal; anyone else saves nothing).
    let mut saved = Changes::default();
    let stranger = Command::AdvanceCursor {
        user: uid(9),
        device: device.clone(),
        chain: CursorChain::Conversation(g.clone()),
        seq: 1_000,
    };
    e.apply(stranger, T0, &mut saved, &mut ev).unwrap();
    assert!(saved.cursors.is_empty());
    assert_eq!(saved.member_cursors, vec![(uid(9), device, g, 1_000)]);
}

/// The store answers an inbox head for every user asked about; the engine keeps heads only
/// of users that exist, so an invitation of made-up ids does not grow its map.
#[test]
fn inbox_heads_are_kept_only_for_users_that_exist() {
    let mut e = engine(2, 500);
    let made_up: HashSet<UserId> = (1_000..1_100).map(uid).collect();
    let needs = Needs {
        users: made_up.clone(),
        ..Needs::default()
    };
    e.absorb(
        Loaded {
            inbox_heads: made_up.iter().map(|u| (*u, 0)).collect(),
            ..Loaded::default()
        },
        &needs,
    );
    assert!(made_up.iter().all(|u| !e.users.heads().contains_key(u)));
    assert!(e.users.heads().contains_key(&uid(1)));
}

/// What the tables hold once everything `e` decided is applied: its conversations and its
/// users' inbox heads (the store's side of [`load_from`]).
fn stored(
    e: &Engine,
) -> (
    HashMap<ConversationId, ConversationState>,
    HashMap<UserId, u64>,
) {
    let convs = e
        .conversations
        .cached()
        .iter()
        .map(|(id, c)| (id.clone(), c.clone()))
        .collect();
    (convs, e.users.heads().clone())
}

/// Gives `e` what [`Engine::needs`] asks for from what the tables hold (`convs`, `heads`),
/// as the store does: a conversation with its members' inbox heads, a user with theirs;
/// as the pipeline does, at most four rounds, and none that asks what the last one did (a
/// user who is not registered stays asked for: the commands naming them decide without).
fn load_from(
    e: &mut Engine,
    cmds: &[Command],
    convs: &HashMap<ConversationId, ConversationState>,
    heads: &HashMap<UserId, u64>,
) {
    let mut asked: Option<Needs> = None;
    for _ in 0..4 {
        let n = e.needs(cmds);
        if n.is_empty() || asked.as_ref() == Some(&n) {
            return;
        }
        let conversations: HashMap<_, _> = n
            .conversations
            .iter()
            .map(|c| (c.clone(), convs.get(c).cloned()))
            .collect();
        let members = conversations
            .values()
            .flatten()
            .flat_map(|c| c.members.keys().copied());
        let loaded = Loaded {
            inbox_heads: members
                .chain(n.users.iter().copied())
                .map(|u| (u, heads.get(&u).copied().unwrap_or(0)))
                .collect(),
            conversations,
            // Registered: those with an inbox head in the tables.
            users: n
                .users
                .iter()
                .copied()
                .filter(|u| heads.contains_key(u))
                .collect(),
            ..Loaded::default()
        };
        e.absorb(loaded, &n.clone());
        asked = Some(n);
    }
}

/// After a restart (an engine that knows no user yet), a command that appends to a write
/// fan-out conversation needs the inbox head of every member: the store gives them with the
/// conversation, but the engine keeps heads only of users it knows, and a head then taken
/// for 0 gave the message a `user_seq` the member's inbox already held; the tables refused
/// the journaled batch, and a message the sender had its `send_ack` for was lost (found by
/// a black-box check: a group send as the first write after a restart). A single chat
/// loaded by a read, then sent to, is the same case.
#[test]
fn appending_after_the_caches_were_dropped_continues_every_members_inbox() {
    let mut e = engine(4, 10);
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    let gid = group(&mut e, 1, &[2, 3], &mut ch, &mut ev);
    ack(send(
        &mut e,
        1,
        SendTo::User(uid(4)),
        "s1",
        &mut ch,
        &mut ev,
    ));
    let single = ConversationId::single(uid(1), uid(4)).unwrap();
    // Batches, each decided on cold caches but the third: the second loads the single chat
    // for a read (no inbox heads needed), and the third sends to it.
    let batches: Vec<Vec<Command>> = vec![
        vec![send_cmd(2, SendTo::Conversation(gid.clone()), "g-send")],
        vec![Command::Read {
            user: uid(1),
            conversation: single.clone(),
            seq: 1,
            from_device: None,
        }],
        vec![send_cmd(1, SendTo::User(uid(4)), "s-send")],
        vec![Command::Mute {
            actor: uid(1),
            conversation: gid.clone(),
            user: uid(3),
            duration_secs: 60,
        }],
        vec![Command::RemoveMember {
            actor: uid(1),
            conversation: gid.clone(),
            user: uid(3),
        }],
        vec![Command::Dismiss {
            actor: uid(1),
            conversation: gid.clone(),
        }],
    ];
    // What the store holds once everything so far is applied.
    let mut convs: HashMap<ConversationId, ConversationState> = HashMap::new();
    let mut heads: HashMap<UserId, u64> = HashMap::new();
    for (i, batch) in batches.into_iter().enumerate() {
        // Added to: a cold load caches only what it asked for.
        let (now_convs, now_heads) = stored(&e);
        convs.extend(now_convs);
        heads.extend(now_heads);
        if i != 2 {
            // As after a restart: nothing cached, no user known.
            e.reset();
        }
        // The batch's needs, as the pipeline asks them: before its first command.
        load_from(&mut e, &batch, &convs, &heads);
        for cmd in batch {
            let mut step = Changes::default();
            e.apply(cmd.clone(), T0, &mut step, &mut ev)
                .unwrap_or_else(|err| panic!("{cmd:?}: {err:?}"));
            let appends = !matches!(cmd, Command::Read { .. });
            assert_eq!(!step.inbox.is_empty(), appends, "{cmd:?}");
            for row in &step.inbox {
                assert_eq!(
                    row.user_seq,
                    heads.get(&row.user).copied().unwrap_or(0) + 1,
                    "{cmd:?}: user {} continues their inbox",
                    row.user
                );
            }
        }
    }
}

/// A user registered in a batch may be written to later in the same batch (a back end
/// registering a user while a send, a group creation or an invitation names them): the new
/// user's inbox starts at 0 there, rather than the append finding no head (which stops the
/// pipeline).
#[test]
fn a_user_registered_in_a_batch_can_be_written_to_in_the_same_batch() {
    let mut e = engine(2, 10);
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    let gid = group(&mut e, 1, &[2], &mut ch, &mut ev);
    let (convs, heads) = stored(&e);
    let new = uid(9);
    let batch = vec![
        Command::UpsertUser {
            user: new,
            name: Some("new".into()),
            avatar: None,
        },
        send_cmd(1, SendTo::User(new), "to-new"),
        Command::Invite {
            actor: uid(1),
            conversation: gid,
            users: vec![new],
        },
        Command::CreateGroup {
            id: None,
            owner: uid(2),
            name: "h".into(),
            members: vec![new],
        },
    ];
    load_from(&mut e, &batch, &convs, &heads);
    let mut step = Changes::default();
    for cmd in batch {
        e.apply(cmd.clone(), T0, &mut step, &mut ev)
            .unwrap_or_else(|err| panic!("{cmd:?}: {err:?}"));
    }
    let new_rows: Vec<u64> = step
        .inbox
        .iter()
        .filter(|r| r.user == new)
        .map(|r| r.user_seq)
        .collect();
    assert_eq!(new_rows, vec![1, 2, 3]);
}

/// Registering a user the store holds but the engine does not know yet (after a restart)
/// keeps the inbox head the store gives: only a user the store does not hold starts at 0.
#[test]
fn registering_a_known_user_again_keeps_their_inbox() {
    let mut e = engine(2, 10);
    let (mut ch, mut ev) = (Changes::default(), Vec::new());
    for i in 0..3 {
        ack(send(
            &mut e,
            2,
            SendTo::User(uid(1)),
            &format!("m{i}"),
            &mut ch,
            &mut ev,
        ));
    }
    let (convs, heads) = stored(&e);
    assert_eq!(heads[&uid(1)], 3);
    e.reset();
    // The registration alone in its batch, the send in the next.
    let mut step = Changes::default();
    for batch in [
        vec![Command::UpsertUser {
            user: uid(1),
            name: Some("again".into()),
            avatar: None,
        }],
        vec![send_cmd(1, SendTo::User(uid(2)), "after")],
    ] {
        load_from(&mut e, &batch, &convs, &heads);
        for cmd in batch {
            e.apply(cmd, T0, &mut step, &mut ev).unwrap();
        }
    }
    let mut rows: Vec<(u64, u64)> = step
        .inbox
        .iter()
        .map(|r| (r.user.get(), r.user_seq))
        .collect();
    rows.sort();
    assert_eq!(rows, vec![(1, 4), (2, 4)]);
}
