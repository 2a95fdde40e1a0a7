//! The store port's contract as one test suite, stamped onto every adapter with
//! [`store_suite!`](crate::store_suite!): the embedded store and any other pass the same
//! tests, so the pipeline and the read paths may rely on what they check, whichever store
//! is behind them.
//!
//! The batches are the engine's own, decided through [`Writer`] as the pipeline decides
//! them (needs, load, absorb, apply, seal, commit), so what is checked is what a server
//! writes. Each test gets a fresh, empty store.

use crate::changes::Changes;
use crate::command::{Command, CursorChain, Reply, SendCommand, SendTo};
use crate::engine::{Engine, EngineConfig};
use crate::error::DomainError;
use crate::store::{HistoryAnchor, HistoryQuery, Needs, Store};
use pigeon_proto::views::{Fanout, Role, SendAck};
use pigeon_proto::{ClientMsgId, ConversationId, DeviceId, MessageStatus, MsgId, UserId};

/// Stamps the store suite onto an adapter: in the adapter's tests,
/// `pigeon_core::store_suite!(fresh);`, where `async fn fresh() -> T` answers a fresh,
/// empty store that lives as long as `T` (a value that derefs to a [`Store`]: the store
/// with what removes its files, a database to drop, ...). Needs `tokio` with its test
/// macro in the adapter's dev-dependencies.
#[macro_export]
macro_rules! store_suite {
    ($fresh:path) => {
        $crate::store_suite!(@each $fresh;
            a_commit_is_read_back_at_once,
            a_conversation_is_loaded_with_its_members_and_their_inbox_heads,
            a_duplicate_is_found_right_after_its_commit,
            idempotency_keys_are_counted_and_paged_in_key_order,
            a_registration_that_leaves_a_field_out_keeps_it,
            recall_edit_and_deletion_are_kept_for_the_audit_as_they_say,
            acknowledged_positions_move_forward_and_only_for_members,
            settings_are_kept,
            history_pages_by_seq_and_by_time,
            read_marks_make_receipts_and_unread_counts,
            the_conversation_list_shows_the_newest_activity_first,
            a_group_over_the_threshold_is_followed_by_its_own_chain,
            members_page_by_user_and_a_removal_ends_a_membership,
            a_commit_after_close_is_refused,
        );
    };
    (@each $fresh:path; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $name() {
                let store = $fresh().await;
                $crate::store_suite::$name(&*store).await;
            }
        )*
    };
}

/// The wall-clock time the suite's batches are stamped with.
const T0: i64 = 1_800_000_000_000;

fn uid(n: u64) -> UserId {
    UserId::new(n).expect("a valid user id")
}

fn key(sender: u64, cmid: &str) -> (UserId, ClientMsgId) {
    (uid(sender), ClientMsgId::parse(cmid).expect("a valid key"))
}

/// Decides commands as the pipeline does, one batch at a time, and commits each batch.
pub struct Writer<'a> {
    store: &'a dyn Store,
    engine: Engine,
    now: i64,
}

impl<'a> Writer<'a> {
    /// A writer that knows nothing yet, as a server that just started: what it loads must
    /// see every commit acknowledged before (`Store::load` reads the tables as they are,
    /// and a caller with no memory first waits for them, as the pipeline does).
    pub async fn new(store: &'a dyn Store) -> Writer<'a> {
        Writer::with_config(store, EngineConfig::default()).await
    }

    /// [`Writer::new`] with the engine's settings given (a small read fan-out threshold).
    pub async fn with_config(store: &'a dyn Store, cfg: EngineConfig) -> Writer<'a> {
        store.caught_up().await.expect("caught_up");
        let max = store.max_msg_id().await.expect("max_msg_id");
        Writer {
            store,
            engine: Engine::new(cfg, max),
            now: T0,
        }
    }

    /// Decides `cmds` in one batch, commits it, and answers each command's result.
    pub async fn run(&mut self, cmds: Vec<Command>) -> Vec<Result<Reply, DomainError>> {
        // At most a few rounds, as the pipeline's `load` (a recall needs its message before
        // its conversation).
        let mut asked: Option<Needs> = None;
        for _ in 0..4 {
            let needs = self.engine.needs(&cmds);
            if needs.is_empty() || asked.as_ref() == Some(&needs) {
                break;
            }
            if !needs.messages.is_empty() {
                self.store.caught_up().await.expect("caught_up");
            }
            let loaded = self.store.load(needs.clone()).await.expect("load");
            self.engine.absorb(loaded, &needs);
            asked = Some(needs);
        }
        let (mut changes, mut events) = (Changes::default(), Vec::new());
        let results = cmds
            .into_iter()
            .map(|c| self.engine.apply(c, self.now, &mut changes, &mut events))
            .collect();
        let batch = self.engine.seal(&mut changes);
        self.store.commit(changes).await.expect("commit");
        self.engine.committed(batch);
        self.now += 1_000;
        results
    }

    /// One command, which must succeed.
    pub async fn one(&mut self, cmd: Command) -> Reply {
        let mut results = self.run(vec![cmd]).await;
        results
            .pop()
            .expect("one result")
            .expect("the command is taken")
    }

    pub async fn register(&mut self, users: &[u64]) {
        let cmds = users
            .iter()
            .map(|u| Command::UpsertUser {
                user: uid(*u),
                name: Some(format!("user {u}")),
                avatar: None,
            })
            .collect();
        for r in self.run(cmds).await {
            r.expect("registered");
        }
    }

    /// A text from `sender` to `to`; answers its acknowledgement.
    pub async fn send(&mut self, sender: u64, to: SendTo, cmid: &str, text: &str) -> SendAck {
        let send = SendCommand::text(
            uid(sender),
            to,
            ClientMsgId::parse(cmid).expect("a valid key"),
            text,
        );
        match self.one(Command::Send(send)).await {
            Reply::SendAck(ack) => ack,
            other => panic!("a send answered {other:?}"),
        }
    }

    pub async fn group(&mut self, owner: u64, members: &[u64]) -> ConversationId {
        let cmd = Command::CreateGroup {
            id: None,
            owner: uid(owner),
            name: "team".into(),
            members: members.iter().map(|u| uid(*u)).collect(),
        };
        match self.one(cmd).await {
            Reply::Conversation(id) => id,
            other => panic!("a group creation answered {other:?}"),
        }
    }
}

fn newest(limit: u32) -> HistoryQuery {
    HistoryQuery {
        anchor: HistoryAnchor::Newest,
        limit,
        from_time: None,
        to_time: None,
    }
}

/// A committed message reads back at once, by every read that shows it: history, the
/// message by id, both inboxes, the conversation and its list entry, the newest id.
pub async fn a_commit_is_read_back_at_once(store: &dyn Store) {
    let mut w = Writer::new(store).await;
    w.register(&[1, 2]).await;
    let ack = w.send(1, SendTo::User(uid(2)), "m-1", "hello").await;
    assert_eq!((ack.seq, ack.duplicate), (1, false));
    let conv = ack.conversation_id.clone();
    let (page, more) = store
        .history(&conv, uid(2), (1, 1), newest(20))
        .await
        .unwrap();
    assert!(!more);
    assert_eq!(page.len(), 1);
    assert_eq!(
        (page[0].msg_id, page[0].content.as_str()),
        (ack.msg_id, "hello")
    );
    let audited = store.message(ack.msg_id).await.unwrap().expect("stored");
    assert_eq!(audited.message.seq, 1);
    for user in [1, 2] {
        assert_eq!(store.inbox_head(uid(user)).await.unwrap(), 1);
        let (items, more) = store.pull_inbox(uid(user), 1, 10, 10).await.unwrap();
        assert!(!more);
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].message.msg_id, ack.msg_id);
    }
    assert!(store.conversation_exists(&conv).await.unwrap());
    let list = store
        .conversations(uid(1), None, None, 10, false)
        .await
        .unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!((list[0].seq, list[0].fanout), (1, Fanout::Write));
    assert_eq!(store.max_msg_id().await.unwrap(), ack.msg_id.get());
    let member = store
        .membership(&conv, uid(2))
        .await
        .unwrap()
        .expect("member");
    assert_eq!((member.conversation_seq, member.left_seq), (1, None));
}

/// What the engine loads before it decides: a conversation with its members and their
/// inbox heads, a user with theirs, and `None` for a conversation that does not exist.
pub async fn a_conversation_is_loaded_with_its_members_and_their_inbox_heads(store: &dyn Store) {
    let mut w = Writer::new(store).await;
    w.register(&[1, 2, 3]).await;
    let g = w.group(1, &[2]).await;
    w.send(2, SendTo::Conversation(g.clone()), "g-1", "hi")
        .await;
    store.caught_up().await.unwrap();
    let missing = ConversationId::parse("g999").unwrap();
    let needs = Needs {
        conversations: [g.clone(), missing.clone()].into(),
        users: [uid(3), uid(4)].into(),
        ..Needs::default()
    };
    let loaded = store.load(needs).await.unwrap();
    let state = loaded.conversations[&g].as_ref().expect("the group");
    assert_eq!(state.seq, 2);
    assert_eq!(state.members.len(), 2);
    assert_eq!(state.members[&uid(1)].role, Role::Owner);
    assert!(loaded.conversations[&missing].is_none());
    assert_eq!(loaded.inbox_heads[&uid(1)], 2);
    assert_eq!(loaded.inbox_heads[&uid(2)], 2);
    assert!(loaded.users.contains(&uid(3)));
    assert!(!loaded.users.contains(&uid(4)), "not registered");
}

/// An idempotency key is answered with its send's acknowledgement as soon as the commit
/// that holds it returns, applied to the tables or not; a key never sent is not.
pub async fn a_duplicate_is_found_right_after_its_commit(store: &dyn Store) {
    let mut w = Writer::new(store).await;
    w.register(&[1, 2]).await;
    let ack = w.send(1, SendTo::User(uid(2)), "once", "hi").await;
    let needs = Needs {
        dedupe: [key(1, "once"), key(1, "never")].into(),
        ..Needs::default()
    };
    let loaded = store.load(needs).await.unwrap();
    let found = &loaded.dedupe[&key(1, "once")];
    assert_eq!((found.msg_id, found.seq), (ack.msg_id, ack.seq));
    assert_eq!(found.conversation_id, ack.conversation_id);
    assert!(!loaded.dedupe.contains_key(&key(1, "never")));
    // A retry, decided by an engine that knows nothing (a restart), is answered as the
    // first and stores nothing new.
    let mut after_restart = Writer::new(store).await;
    for (sender, cmid) in store.idempotency_keys(None, 100).await.unwrap().0 {
        after_restart.engine.remember_key(sender, &cmid);
    }
    let again = after_restart
        .send(1, SendTo::User(uid(2)), "once", "changed")
        .await;
    assert_eq!((again.msg_id, again.duplicate), (ack.msg_id, true));
    assert_eq!(store.inbox_head(uid(2)).await.unwrap(), 1);
}

/// Every stored idempotency key, counted and walked page by page in key order, as a
/// server learns them at start.
pub async fn idempotency_keys_are_counted_and_paged_in_key_order(store: &dyn Store) {
    let mut w = Writer::new(store).await;
    w.register(&[1, 2, 3]).await;
    for (sender, to, cmid) in [
        (2, 1, "b"),
        (1, 2, "c"),
        (1, 3, "a"),
        (3, 1, "a"),
        (2, 3, "a"),
    ] {
        w.send(sender, SendTo::User(uid(to)), cmid, "x").await;
    }
    assert_eq!(store.idempotency_key_count().await.unwrap(), 5);
    let mut all = Vec::new();
    let mut after = None;
    for _ in 0..10 {
        let (page, next) = store.idempotency_keys(after, 2).await.unwrap();
        assert!(page.len() <= 2);
        all.extend(page);
        match next {
            Some(c) => after = Some(c),
            None => break,
        }
    }
    let keys: Vec<(u64, &str)> = all.iter().map(|(u, c)| (u.get(), c.as_str())).collect();
    assert_eq!(keys, vec![(1, "a"), (1, "c"), (2, "a"), (2, "b"), (3, "a")]);
}

/// A registration repeated with a field left out keeps what the user had; a new user left
/// without one has it empty.
pub async fn a_registration_that_leaves_a_field_out_keeps_it(store: &dyn Store) {
    let mut w = Writer::new(store).await;
    let upsert = |user, name: Option<&str>, avatar: Option<&str>| Command::UpsertUser {
        user: uid(user),
        name: name.map(str::to_owned),
        avatar: avatar.map(str::to_owned),
    };
    w.one(upsert(1, Some("ann"), Some("a.png"))).await;
    w.one(upsert(1, None, Some("b.png"))).await;
    w.one(upsert(1, Some("anne"), None)).await;
    w.one(upsert(2, None, None)).await;
    let ann = store.user(uid(1)).await.unwrap().expect("registered");
    assert_eq!((ann.name.as_str(), ann.avatar.as_str()), ("anne", "b.png"));
    let two = store.user(uid(2)).await.unwrap().expect("registered");
    assert_eq!((two.name.as_str(), two.avatar.as_str()), ("", ""));
    assert!(store.user(uid(3)).await.unwrap().is_none());
}

/// The audit keeps what PROTOCOL.md 6 says: an edit's versions, a recalled message's
/// original and who recalled it; a deletion for everyone wipes the content and the
/// versions, an edit of the same batch included; "delete for me" hides it for one reader.
pub async fn recall_edit_and_deletion_are_kept_for_the_audit_as_they_say(store: &dyn Store) {
    let mut w = Writer::new(store).await;
    w.register(&[1, 2]).await;
    let a = w.send(1, SendTo::User(uid(2)), "a", "first").await;
    let b = w.send(1, SendTo::User(uid(2)), "b", "to recall").await;
    let c = w.send(1, SendTo::User(uid(2)), "c", "to delete").await;
    w.one(Command::Edit {
        actor: uid(1),
        msg_id: a.msg_id,
        content: "second".into(),
    })
    .await;
    assert_eq!(
        versions_of(store, a.msg_id).await,
        vec![(1, "first".to_owned()), (2, "second".to_owned())]
    );
    w.one(Command::Recall {
        actor: uid(1),
        msg_id: b.msg_id,
    })
    .await;
    let recalled = store.message(b.msg_id).await.unwrap().expect("kept");
    assert_eq!(recalled.message.status, MessageStatus::Recalled);
    assert_eq!(
        recalled.message.content, "to recall",
        "the original, for the audit"
    );
    assert_eq!(recalled.recalled_by, Some(uid(1)));
    // Registered at T0, three sends and an edit a second apart: the recall's batch is
    // stamped T0 + 5 s.
    assert_eq!(recalled.recalled_at, Some(T0 + 5_000));
    // Edited and deleted for everyone in one batch.
    let results = w
        .run(vec![
            Command::Edit {
                actor: uid(1),
                msg_id: c.msg_id,
                content: "edited".into(),
            },
            Command::AdminDelete { msg_id: c.msg_id },
        ])
        .await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let deleted = store.message(c.msg_id).await.unwrap().expect("kept");
    assert_eq!(
        (deleted.message.status, deleted.message.content.as_str()),
        (MessageStatus::Deleted, "")
    );
    assert_eq!(
        versions_of(store, c.msg_id).await,
        vec![(1, String::new()), (2, String::new())],
        "the deletion wipes the versions the edit wrote"
    );
    w.one(Command::HideMessage {
        user: uid(2),
        msg_id: a.msg_id,
    })
    .await;
    assert!(store.is_hidden_for(uid(2), a.msg_id).await.unwrap());
    assert!(!store.is_hidden_for(uid(1), a.msg_id).await.unwrap());
    let missing = MsgId::new(1).unwrap();
    assert!(store.message(missing).await.unwrap().is_none());
}

/// A device's acknowledged positions: the inbox's and a group's, saved as given up to the
/// newest seq, never moved back; a group position only for a member (a former member's up
/// to their removal), none for anyone else or for a conversation that does not exist.
pub async fn acknowledged_positions_move_forward_and_only_for_members(store: &dyn Store) {
    let mut w = Writer::new(store).await;
    w.register(&[1, 2, 3]).await;
    let g = w.group(1, &[2]).await;
    for i in 0..3 {
        w.send(1, SendTo::Conversation(g.clone()), &format!("g{i}"), "x")
            .await;
    }
    let device = DeviceId::parse("phone").unwrap();
    let ack = |user: u64, chain: CursorChain, seq: u64| Command::AdvanceCursor {
        user: uid(user),
        device: device.clone(),
        chain,
        seq,
    };
    w.run(vec![
        ack(2, CursorChain::Inbox, 2),
        ack(2, CursorChain::Conversation(g.clone()), 3),
        ack(3, CursorChain::Conversation(g.clone()), 3),
        ack(
            2,
            CursorChain::Conversation(ConversationId::parse("g999").unwrap()),
            3,
        ),
    ])
    .await;
    // A fresh engine holds no conversation: its group acks go to the store as given.
    let mut cold = Writer::new(store).await;
    cold.run(vec![
        ack(2, CursorChain::Inbox, 1),
        ack(2, CursorChain::Conversation(g.clone()), 100),
    ])
    .await;
    assert_eq!(saved(store, 2, "user").await, 2, "never back");
    let gid = g.as_str();
    assert_eq!(saved(store, 2, gid).await, 4, "up to the newest");
    assert_eq!(saved(store, 3, gid).await, 0, "not a member");
    assert_eq!(saved(store, 2, "g999").await, 0, "no such conversation");
    // Removed at seq 5: a later position is saved up to the removal.
    w.one(Command::RemoveMember {
        actor: uid(2),
        conversation: g.clone(),
        user: uid(2),
    })
    .await;
    w.send(1, SendTo::Conversation(g.clone()), "after", "x")
        .await;
    let mut cold = Writer::new(store).await;
    cold.run(vec![ack(2, CursorChain::Conversation(g.clone()), 100)])
        .await;
    assert_eq!(saved(store, 2, gid).await, 5);
}

/// A message's stored versions, as (version, content).
async fn versions_of(store: &dyn Store, msg_id: MsgId) -> Vec<(u32, String)> {
    store
        .versions(msg_id)
        .await
        .expect("versions")
        .into_iter()
        .map(|v| (v.version, v.content))
        .collect()
}

/// The position `user`'s device "phone" saved in `chain`.
async fn saved(store: &dyn Store, user: u64, chain: &str) -> u64 {
    store
        .cursor(uid(user), "phone", chain)
        .await
        .expect("cursor")
}

/// What the server keeps in the store's settings (its admin key, its token secret).
pub async fn settings_are_kept(store: &dyn Store) {
    assert_eq!(store.meta_get("k").await.unwrap(), None);
    store.meta_set("k", "one").await.unwrap();
    store.meta_set("k", "two").await.unwrap();
    assert_eq!(store.meta_get("k").await.unwrap().as_deref(), Some("two"));
}

/// History pages never use offsets: the newest page, pages before and after a seq, pages
/// bounded by time (inclusive), each ascending, with `has_more` in the direction asked.
pub async fn history_pages_by_seq_and_by_time(store: &dyn Store) {
    let mut w = Writer::new(store).await;
    w.register(&[1, 2]).await;
    let mut conv = None;
    for i in 1..=10 {
        conv = Some(
            w.send(1, SendTo::User(uid(2)), &format!("h{i}"), &format!("{i}"))
                .await
                .conversation_id,
        );
    }
    let conv = conv.unwrap();
    let page = |anchor, limit, from_time, to_time| {
        store.history(
            &conv,
            uid(2),
            (1, 10),
            HistoryQuery {
                anchor,
                limit,
                from_time,
                to_time,
            },
        )
    };
    let seqs = |p: &(Vec<pigeon_proto::Message>, bool)| {
        (p.0.iter().map(|m| m.seq).collect::<Vec<_>>(), p.1)
    };
    assert_eq!(
        seqs(&page(HistoryAnchor::Newest, 3, None, None).await.unwrap()),
        (vec![8, 9, 10], true)
    );
    assert_eq!(
        seqs(&page(HistoryAnchor::Before(3), 5, None, None).await.unwrap()),
        (vec![1, 2], false)
    );
    assert_eq!(
        seqs(&page(HistoryAnchor::After(6), 2, None, None).await.unwrap()),
        (vec![7, 8], true)
    );
    // The batches are a second apart, the first registered the users: seq `n` was made at
    // T0 + n s.
    let at = |seq: i64| T0 + seq * 1_000;
    assert_eq!(
        seqs(
            &page(HistoryAnchor::Newest, 20, Some(at(3)), Some(at(5)))
                .await
                .unwrap()
        ),
        (vec![3, 4, 5], false)
    );
    // The visible range bounds every page (a member who joined later reads from there).
    let (late, _) = store
        .history(&conv, uid(2), (6, 10), newest(20))
        .await
        .unwrap();
    assert_eq!(late.first().map(|m| m.seq), Some(6));
}

/// A read mark moves forward only; receipts split the members other than the sender by it,
/// and unread counts what others sent after it.
pub async fn read_marks_make_receipts_and_unread_counts(store: &dyn Store) {
    let mut w = Writer::new(store).await;
    w.register(&[1, 2, 3]).await;
    let g = w.group(1, &[2, 3]).await;
    for i in 0..3 {
        w.send(1, SendTo::Conversation(g.clone()), &format!("r{i}"), "x")
            .await;
    }
    let read = |user: u64, seq: u64| Command::Read {
        user: uid(user),
        conversation: g.clone(),
        seq,
        from_device: None,
    };
    assert_eq!(w.one(read(2, 3)).await, Reply::LastRead(3));
    assert_eq!(w.one(read(2, 2)).await, Reply::LastRead(3), "never back");
    let (read_by, unread_by) = store.receipts(&g, 3).await.unwrap();
    assert_eq!((read_by, unread_by), (vec![uid(2)], vec![uid(3)]));
    let unread = store.unread(uid(3)).await.unwrap();
    assert_eq!(unread, vec![(g.clone(), 3, false)]);
    assert_eq!(
        store.unread(uid(2)).await.unwrap(),
        vec![(g.clone(), 1, false)]
    );
    assert!(
        store.unread(uid(1)).await.unwrap().is_empty(),
        "the sender's own"
    );
}

/// The list is ordered by newest activity, pinned first, and pages by cursor.
pub async fn the_conversation_list_shows_the_newest_activity_first(store: &dyn Store) {
    let mut w = Writer::new(store).await;
    w.register(&[1, 2, 3, 4]).await;
    let with = |peer: u64| ConversationId::single(uid(1), uid(peer)).unwrap();
    for peer in [2, 3, 4] {
        w.send(1, SendTo::User(uid(peer)), &format!("to-{peer}"), "x")
            .await;
    }
    w.send(2, SendTo::User(uid(1)), "back", "x").await;
    w.one(Command::Settings {
        user: uid(1),
        conversation: with(3),
        patch: crate::command::SettingsPatch {
            pinned: Some(true),
            ..Default::default()
        },
    })
    .await;
    let list = store
        .conversations(uid(1), None, None, 10, false)
        .await
        .unwrap();
    let ids: Vec<&str> = list.iter().map(|c| c.conversation_id.as_str()).collect();
    assert_eq!(
        ids,
        vec![with(3).as_str(), with(2).as_str(), with(4).as_str()]
    );
    let first = store
        .conversations(uid(1), None, None, 2, false)
        .await
        .unwrap();
    let last = first.last().unwrap();
    let cursor = crate::store::ListCursor {
        pinned: last.pinned,
        updated_at: last.updated_at,
        last_msg_id: last.last_message.as_ref().map_or(0, |m| m.msg_id.get()),
        conversation_id: last.conversation_id.clone(),
    };
    let rest = store
        .conversations(uid(1), None, Some(cursor), 10, false)
        .await
        .unwrap();
    assert_eq!(
        rest.iter()
            .map(|c| c.conversation_id.as_str())
            .collect::<Vec<_>>(),
        vec![with(4).as_str()]
    );
}

/// A group with more members than `fanout_write_max_members` is not copied into inboxes:
/// its members follow it by its own seq, which `sync` reports after a device's position.
pub async fn a_group_over_the_threshold_is_followed_by_its_own_chain(store: &dyn Store) {
    let cfg = EngineConfig {
        fanout_write_max_members: 2,
        ..EngineConfig::default()
    };
    let mut w = Writer::with_config(store, cfg).await;
    w.register(&[1, 2, 3]).await;
    let g = w.group(1, &[2, 3]).await;
    for i in 0..3 {
        w.send(1, SendTo::Conversation(g.clone()), &format!("big{i}"), "x")
            .await;
    }
    assert_eq!(
        store.inbox_head(uid(2)).await.unwrap(),
        0,
        "no inbox copies"
    );
    let view = &store
        .conversations(uid(2), Some(&g), None, 10, false)
        .await
        .unwrap()[0];
    assert_eq!((view.fanout, view.seq), (Fanout::Read, 4));
    let changed = store
        .read_fanout_changes(uid(2), "phone", &Default::default())
        .await
        .unwrap();
    assert_eq!(changed.len(), 1);
    assert_eq!((&changed[0].conversation_id, changed[0].seq), (&g, 4));
    let given = [(g.as_str().to_owned(), 4)].into();
    assert!(
        store
            .read_fanout_changes(uid(2), "phone", &given)
            .await
            .unwrap()
            .is_empty(),
        "nothing after the position given"
    );
}

/// Members page by user id; a member removed keeps a membership that says where it ended,
/// and is no longer listed.
pub async fn members_page_by_user_and_a_removal_ends_a_membership(store: &dyn Store) {
    let mut w = Writer::new(store).await;
    w.register(&[1, 2, 3, 4]).await;
    let g = w.group(1, &[2, 3, 4]).await;
    let first = store.members(&g, None, 2).await.unwrap();
    let ids = |m: &[pigeon_proto::views::MemberView]| {
        m.iter().map(|m| m.user_id.get()).collect::<Vec<_>>()
    };
    assert_eq!(ids(&first), vec![1, 2]);
    let rest = store.members(&g, Some(uid(2)), 10).await.unwrap();
    assert_eq!(ids(&rest), vec![3, 4]);
    w.one(Command::RemoveMember {
        actor: uid(1),
        conversation: g.clone(),
        user: uid(3),
    })
    .await;
    let gone = store.membership(&g, uid(3)).await.unwrap().expect("kept");
    assert_eq!(gone.left_seq, Some(2));
    assert_eq!(
        ids(&store.members(&g, None, 10).await.unwrap()),
        vec![1, 2, 4]
    );
    assert!(store.membership(&g, uid(9)).await.unwrap().is_none());
    let missing = ConversationId::parse("g999").unwrap();
    assert!(!store.conversation_exists(&missing).await.unwrap());
    assert_eq!(store.connect_state(uid(4)).await.unwrap(), (2, Some(0)));
    assert_eq!(store.connect_state(uid(9)).await.unwrap().1, None);
}

/// A commit after `close` is refused, not left waiting. (That what was committed before
/// it is kept is the adapter's to show, by opening its store again.)
pub async fn a_commit_after_close_is_refused(store: &dyn Store) {
    let mut w = Writer::new(store).await;
    w.register(&[1]).await;
    store.close().await;
    let late = Changes {
        users: vec![(uid(2), Some("late".into()), None, T0)],
        ..Changes::default()
    };
    assert!(
        store.commit(late).await.is_err(),
        "a commit after close is refused"
    );
}
