use super::*;
use crate::outbox::Outgoing;
use pigeon_core::command::{SendCommand, SendTo};
use pigeon_proto::views::SendAck;
use pigeon_proto::{ClientMsgId, ConversationId, UserId};
use std::time::Duration;

fn fresh_shared(max_msg_id: u64) -> Arc<NodeShared> {
    Arc::new(NodeShared::new(0, max_msg_id))
}

fn start(
    store: Arc<dyn Store>,
    cfg: EngineConfig,
    shared: Arc<NodeShared>,
    partitions_per_tier: usize,
) -> (Pipeline, tokio::task::JoinHandle<()>) {
    Pipeline::start(
        store,
        cfg,
        shared,
        Arc::new(Hub::default()),
        partitions_per_tier,
    )
}

/// A pipeline over a real store in a fresh directory, whose partitions each cache at most
/// `max_cached` conversations, with users 1..=12 registered.
async fn pipeline_over_store(name: &str, max_cached: usize) -> (Arc<dyn Store>, Pipeline, TempDir) {
    let cfg = EngineConfig {
        max_cached_conversations: max_cached,
        ..Default::default()
    };
    pipeline_with(name, cfg, fresh_shared(0), 12).await
}

fn temp_store(name: &str) -> (Arc<dyn Store>, TempDir) {
    let dir = TempDir(std::env::temp_dir().join(format!(
        "pigeon-pipeline-{name}-{}-{}",
        std::process::id(),
        now_ms()
    )));
    let store: Arc<dyn Store> = Arc::new(
        pigeon_store_sqlite::SqliteStore::open(&dir.0, pigeon_store_sqlite::Durability::Os)
            .unwrap(),
    );
    (store, dir)
}

/// A pipeline (two partitions a tier) over a real store in a fresh directory, with users
/// 1..=`users` registered.
async fn pipeline_with(
    name: &str,
    cfg: EngineConfig,
    shared: Arc<NodeShared>,
    users: u64,
) -> (Arc<dyn Store>, Pipeline, TempDir) {
    let (store, dir) = temp_store(name);
    let (pipeline, _task) = start(store.clone(), cfg, shared, 2);
    register(&pipeline, 1..=users).await;
    (store, pipeline, dir)
}

async fn register(pipeline: &Pipeline, users: impl IntoIterator<Item = u64>) {
    for n in users {
        pipeline
            .call(Command::UpsertUser {
                user: user(n),
                name: Some(format!("u{n}")),
                avatar: Some(String::new()),
            })
            .await
            .unwrap();
    }
}

/// A rig for the real store: its tables may never catch up with what it acknowledged
/// (`caught_up` never returns), and the loads that ask for one message may be held until
/// let go.
struct Lagging {
    never_caught_up: bool,
    held: std::sync::Mutex<Option<pigeon_proto::MsgId>>,
    open: tokio::sync::watch::Receiver<bool>,
}

type Rigged = pigeon_core::rigged_store::Rigged<Lagging>;

fn tables_never_catch_up(inner: Arc<dyn Store>) -> Rigged {
    holding(inner, true).0
}

/// A store whose loads of the message [`hold`] names wait until the switch answered is set.
fn holding(
    inner: Arc<dyn Store>,
    never_caught_up: bool,
) -> (Rigged, tokio::sync::watch::Sender<bool>) {
    let (switch, open) = tokio::sync::watch::channel(false);
    let rig = Lagging {
        never_caught_up,
        held: std::sync::Mutex::new(None),
        open,
    };
    (Rigged { inner, rig }, switch)
}

fn hold(store: &Rigged, message: pigeon_proto::MsgId) {
    *store.rig.held.lock().unwrap() = Some(message);
}

#[async_trait::async_trait]
impl pigeon_core::rigged_store::Rig for Lagging {
    async fn before_load(&self, needs: &pigeon_core::store::Needs) {
        let held = *self.held.lock().unwrap();
        if held.is_some_and(|m| needs.messages.contains(&m)) {
            let _ = self.open.clone().wait_for(|open| *open).await;
        }
    }

    async fn caught_up(&self, inner: &dyn Store) -> Result<(), pigeon_core::StoreError> {
        if self.never_caught_up {
            std::future::pending::<()>().await;
        }
        inner.caught_up().await
    }
}

/// A resend of an acknowledged message whose key the engine no longer holds is found a
/// duplicate by the store without waiting for its tables (here they never catch up):
/// a look-up that waited for the applier would hold its partition with it.
#[tokio::test]
async fn a_resend_is_found_a_duplicate_without_waiting_for_the_tables() {
    // Users registered by a first pipeline, which then goes; the tables hold them
    // before the second starts, as they do at a start.
    let (store, registering, dir) = pipeline_over_store("no-catch-up", 1000).await;
    drop(registering);
    store.caught_up().await.unwrap();
    let store: Arc<dyn Store> = Arc::new(tables_never_catch_up(store));
    let (pipeline, _task) = start(store, Default::default(), fresh_shared(0), 2);
    let within = |f| tokio::time::timeout(Duration::from_secs(10), f);
    let first = within(send(&pipeline, 1, 2, "k-1"))
        .await
        .expect("answered");
    // A later batch goes only once the first one's outcome is in: by then the engine
    // has let go of the first key.
    within(send(&pipeline, 3, 4, "k-2"))
        .await
        .expect("answered");
    let again = within(send(&pipeline, 1, 2, "k-1"))
        .await
        .expect("a duplicate check does not wait for the tables");
    assert!(again.duplicate, "{again:?}");
    assert_eq!((again.msg_id, again.seq), (first.msg_id, first.seq));
    drop(dir);
}

#[tokio::test]
async fn a_partition_that_panics_marks_the_pipeline_stopped() {
    let stats = Arc::new(PipelineStats::default());
    stop_flagged(async {}, stats.clone()).await;
    assert!(
        !stats.pipeline_stopped(),
        "a task that ends is not a stopped one"
    );
    stop_flagged(async { panic!("a broken invariant") }, stats.clone()).await;
    assert!(stats.pipeline_stopped());
}

#[tokio::test]
async fn a_websocket_command_dropped_by_a_panicking_partition_is_answered_unavailable() {
    let hub = Arc::new(Hub::default());
    let registered = hub.register(user(3), pigeon_proto::DeviceId::parse("d").unwrap());
    let mut reader = registered.reader;
    let to = hub.address(user(3), registered.registration.id());
    let stats = Arc::new(PipelineStats::default());
    let held = ReplyTo::Connection(ConnectionReply::new(hub.clone(), to, Some(7)));
    stop_flagged(
        async move {
            let _in_the_batch = held;
            panic!("a broken invariant")
        },
        stats,
    )
    .await;
    let Some(Outgoing::Frame(frame)) = reader.try_recv() else {
        panic!("the command was left unanswered");
    };
    let frame: serde_json::Value = serde_json::from_str(frame.as_str()).unwrap();
    assert_eq!(frame["type"], "error");
    assert_eq!(frame["req"], 7);
    assert_eq!(frame["code"], "unavailable");
    assert!(reader.try_recv().is_none(), "answered once");

    // A reply taken by whoever answers, or disarmed for a caller that answers the
    // error itself, sends nothing more.
    ReplyTo::Connection(ConnectionReply::new(hub.clone(), to, Some(8))).disarm();
    let (_, req) = ConnectionReply::new(hub.clone(), to, Some(9)).take();
    assert_eq!(req, Some(9));
    assert!(reader.try_recv().is_none());
    // A reply to another node's connection, or to one gone, goes nowhere.
    let elsewhere = crate::hub::ConnectionAddr { node: 9, ..to };
    hub.send_to_connection(elsewhere, "{}".into());
    let gone = crate::hub::ConnectionAddr {
        id: to.id + 1,
        ..to
    };
    hub.send_to_connection(gone, "{}".into());
    assert!(reader.try_recv().is_none());
    hub.send_to_connection(to, "{}".into());
    assert!(reader.try_recv().is_some());
}

/// A test's data directory, removed when the test ends, passed or not.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn user(n: u64) -> UserId {
    UserId::new(n).unwrap()
}

/// A text send of "x".
fn text_send(sender: UserId, to: SendTo, cmid: &str) -> Command {
    Command::Send(SendCommand::text(
        sender,
        to,
        ClientMsgId::parse(cmid).unwrap(),
        "x",
    ))
}

async fn send(pipeline: &Pipeline, from: u64, to: u64, cmid: &str) -> SendAck {
    let cmd = text_send(user(from), SendTo::User(user(to)), cmid);
    let reply = pipeline.call(cmd).await.unwrap();
    match reply {
        Reply::SendAck(ack) => ack,
        other => panic!("not an ack: {other:?}"),
    }
}

/// The engine's caches hold two conversations, so nearly every send evicts them; the
/// applier waits 250 ms before writing journaled batches to the tables, so at each
/// eviction the tables lag. A conversation loaded again from lagging tables would hand
/// out a seq twice: eviction must wait for the tables first.
#[tokio::test]
async fn seqs_stay_contiguous_when_caches_are_evicted_while_the_tables_lag() {
    let (store, pipeline, _dir) = pipeline_over_store("evict", 2).await;
    for round in 1..=4u64 {
        for pair in 0..6u64 {
            let ack = send(
                &pipeline,
                2 * pair + 1,
                2 * pair + 2,
                &format!("r{round}p{pair}"),
            )
            .await;
            assert_eq!(ack.seq, round, "pair {pair}");
        }
    }
    for pair in 0..6u64 {
        let conv = ConversationId::single(user(2 * pair + 1), user(2 * pair + 2)).unwrap();
        let query = pigeon_core::store::HistoryQuery {
            anchor: pigeon_core::store::HistoryAnchor::Newest,
            limit: 10,
            from_time: None,
            to_time: None,
        };
        let (msgs, _) = store
            .history(&conv, user(2 * pair + 1), (1, u64::MAX >> 1), query)
            .await
            .unwrap();
        let seqs: Vec<u64> = msgs.iter().map(|m| m.seq).collect();
        assert_eq!(seqs, vec![1, 2, 3, 4], "pair {pair}");
    }
    store.close().await;
}

/// The caches hold two conversations, so they are dropped between nearly every batch; a
/// group send then comes to a group loaded again, whose members' inbox heads must come
/// with it. Every inbox stays contiguous and every acknowledged message is stored. (The
/// same after a restart, when the engine knows no user yet, is pinned end to end by
/// `concurrency::the_first_writes_after_a_restart_continue_every_inbox`.)
#[tokio::test]
async fn inboxes_stay_contiguous_when_group_sends_follow_evictions() {
    let (store, pipeline, _dir) = pipeline_over_store("evict-group", 2).await;
    let Reply::Conversation(group) = pipeline
        .call(Command::CreateGroup {
            id: None,
            owner: user(1),
            name: "g".into(),
            members: vec![user(2), user(3)],
        })
        .await
        .unwrap()
    else {
        panic!("not a conversation");
    };
    let mut acks = Vec::new();
    for round in 0..4u64 {
        let cmd = text_send(
            user(round % 3 + 1),
            SendTo::Conversation(group.clone()),
            &format!("g{round}"),
        );
        let Reply::SendAck(ack) = pipeline.call(cmd).await.unwrap() else {
            panic!("not an ack");
        };
        acks.push(ack);
        acks.push(send(&pipeline, 1, 4, &format!("a{round}")).await);
        acks.push(send(&pipeline, 5, 6, &format!("b{round}")).await);
    }
    pipeline.flush().await.unwrap();
    for ack in &acks {
        let conv = ack.conversation_id.clone();
        let query = pigeon_core::store::HistoryQuery {
            anchor: pigeon_core::store::HistoryAnchor::Newest,
            limit: 20,
            from_time: None,
            to_time: None,
        };
        // A member of each: the group's owner, 1 in 1-4, 6 in 5-6.
        let reader = if conv == group || conv.to_string() == "1-4" {
            user(1)
        } else {
            user(6)
        };
        let (msgs, _) = store
            .history(&conv, reader, (1, u64::MAX >> 1), query)
            .await
            .unwrap();
        let stored = msgs.iter().find(|m| m.seq == ack.seq);
        assert_eq!(stored.map(|m| m.msg_id), Some(ack.msg_id), "{ack:?}");
    }
    for u in 1..=6 {
        let (items, _) = store
            .pull_inbox(user(u), 1, u64::MAX >> 1, 200)
            .await
            .unwrap();
        let seqs: Vec<u64> = items.iter().map(|i| i.seq).collect();
        assert_eq!(
            seqs,
            (1..=seqs.len() as u64).collect::<Vec<_>>(),
            "user {u}"
        );
        let expected = match u {
            // created, and 4 group sends; with user 4: 4 more.
            1 => 9,
            2 | 3 => 5,
            _ => 4,
        };
        assert_eq!(seqs.len(), expected, "user {u}");
    }
    store.close().await;
}

/// A send again at once: its batch is journaled (so the engine has let go of its ack)
/// but not in the tables yet (the applier waits 250 ms); the idempotency look-up must
/// wait for the tables, or the retry becomes a second message.
#[tokio::test]
async fn a_retry_of_a_send_the_tables_do_not_hold_yet_is_a_duplicate() {
    let (store, pipeline, _dir) = pipeline_over_store("retry", 1000).await;
    let first = send(&pipeline, 1, 2, "once").await;
    let again = send(&pipeline, 1, 2, "once").await;
    assert_eq!(
        (again.msg_id, again.seq, again.duplicate),
        (first.msg_id, 1, true)
    );
    assert_eq!(send(&pipeline, 1, 2, "next").await.seq, 2);
    store.close().await;
}

#[test]
fn decision_stamps_never_go_back_nor_run_ahead_of_the_clock() {
    let clock = DecisionClock::after(0);
    // Far more steps than milliseconds pass: a clock that stamps each step later than
    // the one before would end seconds ahead.
    let stamps: Vec<i64> = (0..20_000).map(|_| clock.next()).collect();
    let after = now_ms();
    assert!(stamps.windows(2).all(|w| w[1] >= w[0]));
    assert!(stamps[0] >= after - 10_000);
    assert!(
        *stamps.last().unwrap() <= after,
        "{} ms ahead of the wall clock",
        stamps.last().unwrap() - after
    );
}

#[test]
fn a_clock_set_back_across_a_restart_does_not_step_back() {
    // The store's newest message was stamped ten minutes ahead of this wall clock.
    let newest = now_ms() + 600_000;
    let shared = fresh_shared(pigeon_core::snowflake::Snowflake::new(0, 0).next(newest));
    let clock = DecisionClock::after(shared.newest_id_ms());
    assert_eq!(clock.next(), newest);
    assert_eq!(clock.next(), newest);
}

/// The pipeline's clock starts past the newest id it is given (the store's, at start),
/// so a send after a restart whose wall clock went back is stamped later than what came
/// before (or at the same millisecond: never earlier).
#[tokio::test]
async fn a_send_after_the_clock_went_back_is_not_stamped_before_the_newest_message() {
    // The store's newest message was stamped ten minutes ahead of this wall clock.
    let newest = now_ms() + 600_000;
    let floor = pigeon_core::snowflake::Snowflake::new(0, 0).next(newest);
    let (_store, pipeline, _dir) =
        pipeline_with("clock", Default::default(), fresh_shared(floor), 2).await;
    let first = send(&pipeline, 1, 2, "after-1").await;
    let second = send(&pipeline, 2, 1, "after-2").await;
    assert!(
        first.created_at >= newest,
        "{} < {newest}",
        first.created_at
    );
    assert!(second.created_at >= first.created_at);
    assert!(first.msg_id.get() > floor);
    assert!(second.msg_id.get() > first.msg_id.get());
}

/// The tier a route's partition belongs to (the tests' pipelines have two partitions a tier).
fn tier_of(route: Route) -> Tier {
    Tier::ALL[route.0 as usize / 2]
}

async fn create_group(
    pipeline: &Pipeline,
    owner: u64,
    members: impl Iterator<Item = u64>,
) -> ConversationId {
    let reply = pipeline
        .call(Command::CreateGroup {
            id: None,
            owner: user(owner),
            name: "g".into(),
            members: members.map(user).collect(),
        })
        .await
        .unwrap();
    let Reply::Conversation(group) = reply else {
        panic!("not a conversation: {reply:?}");
    };
    group
}

/// Every message of `conv` as `reader` sees it, by seq.
async fn stored(
    store: &dyn Store,
    conv: &ConversationId,
    reader: u64,
) -> Vec<pigeon_proto::Message> {
    let query = pigeon_core::store::HistoryQuery {
        anchor: pigeon_core::store::HistoryAnchor::After(0),
        limit: 1000,
        from_time: None,
        to_time: None,
    };
    store
        .history(conv, user(reader), (1, u64::MAX >> 1), query)
        .await
        .unwrap()
        .0
}

/// A group that grows past its tier's bound moves to its partition of the next tier while
/// sends into it go on: each send is acknowledged once, its seqs stay contiguous, and its
/// commands go to the new tier once the move is done.
#[tokio::test]
async fn a_group_that_grows_into_another_tier_moves_with_its_seqs() {
    let (store, pipeline, _dir) =
        pipeline_with("move", Default::default(), fresh_shared(0), 130).await;
    let group = create_group(&pipeline, 1, 2..=60).await;
    let (tx, rx) = oneshot::channel();
    let cmd = text_send(user(1), SendTo::Conversation(group.clone()), "before");
    let route = pipeline.submit(cmd, ReplyTo::Caller(tx)).await.unwrap();
    assert_eq!(tier_of(route), Tier::Small);
    let mut acks = vec![rx.await.unwrap().unwrap()];
    let sends = futures_util::future::join_all((0..40u64).map(|i| {
        pipeline.call(text_send(
            user(1 + i % 5),
            SendTo::Conversation(group.clone()),
            &format!("s{i}"),
        ))
    }));
    let invite = pipeline.call(Command::Invite {
        actor: user(1),
        conversation: group.clone(),
        users: (61..=130).map(user).collect(),
    });
    let (sent, invited) = tokio::join!(sends, invite);
    invited.unwrap();
    acks.extend(sent.into_iter().map(|r| r.unwrap()));
    let deadline = Instant::now() + Duration::from_secs(10);
    for i in 0.. {
        let (tx, rx) = oneshot::channel();
        let cmd = text_send(
            user(1),
            SendTo::Conversation(group.clone()),
            &format!("after{i}"),
        );
        let route = pipeline.submit(cmd, ReplyTo::Caller(tx)).await.unwrap();
        acks.push(rx.await.unwrap().unwrap());
        if tier_of(route) == Tier::Medium {
            break;
        }
        assert!(Instant::now() < deadline, "the group never moved");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    pipeline.flush().await.unwrap();
    let messages = stored(&*store, &group, 1).await;
    let seqs: Vec<u64> = messages.iter().map(|m| m.seq).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
    let ids: std::collections::HashSet<_> = messages.iter().map(|m| m.msg_id).collect();
    for ack in acks {
        let Reply::SendAck(ack) = ack else {
            panic!("not an ack: {ack:?}");
        };
        assert!(!ack.duplicate);
        assert!(ids.contains(&ack.msg_id), "{ack:?}");
        assert_eq!(messages[ack.seq as usize - 1].msg_id, ack.msg_id);
    }
    store.close().await;
}

/// One idempotency key sent at once into two single chats that different partitions own
/// makes one message: the other send is its duplicate, or is told to retry, and its retry
/// finds the one message.
#[tokio::test]
async fn one_key_sent_into_two_partitions_at_once_makes_one_message() {
    let (store, pipeline, _dir) = pipeline_over_store("claims", 1000).await;
    let chat = |peer: u64| ConversationId::single(user(1), user(peer)).unwrap();
    let slot = |peer: u64| pigeon_core::routing::partition_of(&chat(peer), 2);
    let a = 2;
    let b = (3..=12)
        .find(|p| slot(*p) != slot(a))
        .expect("a peer in the other partition");
    for round in 0..20 {
        let key = format!("k{round}");
        let (x, y) = tokio::join!(
            pipeline.call(text_send(user(1), SendTo::User(user(a)), &key)),
            pipeline.call(text_send(user(1), SendTo::User(user(b)), &key)),
        );
        let acks: Vec<SendAck> = [x, y]
            .into_iter()
            .filter_map(|r| match r {
                Ok(Reply::SendAck(ack)) => Some(ack),
                Err(PipelineError::Unavailable) => None,
                other => panic!("{other:?}"),
            })
            .collect();
        assert!(!acks.is_empty(), "one of the two goes");
        assert!(
            acks.iter().all(|ack| ack.msg_id == acks[0].msg_id),
            "{acks:?}"
        );
        let again = send(&pipeline, 1, b, &key).await;
        assert!(again.duplicate);
        assert_eq!(again.msg_id, acks[0].msg_id);
    }
    pipeline.flush().await.unwrap();
    let (in_a, in_b) = (
        stored(&*store, &chat(a), 1).await,
        stored(&*store, &chat(b), 1).await,
    );
    assert_eq!(in_a.len() + in_b.len(), 20, "one message a key");
    store.close().await;
}

/// A registration, once acknowledged, is usable at once through every partition, before
/// the tables hold it (the applier writes them up to 250 ms later).
#[tokio::test]
async fn a_registration_is_usable_through_every_partition_once_acknowledged() {
    let (store, pipeline, _dir) = pipeline_over_store("registered", 1000).await;
    for n in 100..120 {
        register(&pipeline, [n]).await;
        // A chat with a user new to every partition: whichever owns it knows the user.
        let ack = send(&pipeline, 1, n, &format!("hi{n}")).await;
        assert_eq!(ack.seq, 1);
        let group = create_group(&pipeline, n, [1, 2].into_iter()).await;
        assert!(group.is_group());
    }
    store.close().await;
}

/// A partition held up by its store (here a recall's load of its message) holds up no other:
/// single chats go on being decided, committed and answered meanwhile.
#[tokio::test]
async fn a_partition_held_on_its_store_holds_no_other() {
    let (real, _dir) = temp_store("held");
    let (rigged, switch) = holding(real, false);
    let rigged = Arc::new(rigged);
    let store: Arc<dyn Store> = rigged.clone();
    let (pipeline, _task) = start(store.clone(), Default::default(), fresh_shared(0), 2);
    register(&pipeline, 1..=12).await;
    let group = create_group(&pipeline, 1, 2..=5).await;
    let Reply::SendAck(sent) = pipeline
        .call(text_send(
            user(1),
            SendTo::Conversation(group.clone()),
            "held",
        ))
        .await
        .unwrap()
    else {
        panic!("not an ack");
    };
    hold(&rigged, sent.msg_id);
    let recall = tokio::spawn({
        let pipeline = pipeline.clone();
        async move {
            pipeline
                .call(Command::Recall {
                    actor: user(1),
                    msg_id: sent.msg_id,
                })
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!recall.is_finished(), "the recall's partition is held");
    for i in 0..10u64 {
        let key = format!("c{i}");
        let within = tokio::time::timeout(
            Duration::from_secs(5),
            send(&pipeline, 7 + i % 2, 8 - i % 2, &key),
        );
        within.await.expect("single chats are not held");
    }
    assert!(!recall.is_finished());
    switch.send(true).unwrap();
    let recalled = tokio::time::timeout(Duration::from_secs(5), recall)
        .await
        .expect("answered once let go")
        .unwrap();
    assert!(recalled.is_ok(), "{recalled:?}");
    store.close().await;
}

/// A user registered in the same batch as a message to them, or in the same commit: their
/// inbox starts at 0 there (the user stage finds no head in the tables for them).
#[tokio::test]
async fn a_user_registered_beside_a_message_to_them_gets_it_at_user_seq_1() {
    let (store, pipeline, _dir) = pipeline_over_store("register-beside", 1000).await;
    let chat = |peer: u64| ConversationId::single(user(1), user(peer)).unwrap();
    // Users whose registration and chat with user 1 one partition decides.
    let same: Vec<u64> = (200..400)
        .filter(|u| {
            pigeon_core::routing::partition_of_user(user(*u), 2)
                == pigeon_core::routing::partition_of(&chat(*u), 2)
        })
        .take(5)
        .collect();
    for u in same {
        // Both queued before the partition runs: one batch.
        let (reg_tx, registered) = oneshot::channel();
        let (send_tx, sent) = oneshot::channel();
        let upsert = Command::UpsertUser {
            user: user(u),
            name: None,
            avatar: None,
        };
        pipeline
            .submit(upsert, ReplyTo::Caller(reg_tx))
            .await
            .unwrap();
        let send = text_send(user(1), SendTo::User(user(u)), &format!("first{u}"));
        pipeline
            .submit(send, ReplyTo::Caller(send_tx))
            .await
            .unwrap();
        let (registered, sent) = (registered.await.unwrap(), sent.await.unwrap());
        registered.unwrap();
        let Reply::SendAck(ack) = sent.unwrap() else {
            panic!("not an ack");
        };
        assert_eq!(ack.seq, 1);
        pipeline.flush().await.unwrap();
        let (items, _) = store.pull_inbox(user(u), 1, 10, 10).await.unwrap();
        assert_eq!(items.iter().map(|i| i.seq).collect::<Vec<_>>(), vec![1]);
    }
    assert!(!pipeline.stats().pipeline_stopped());
    store.close().await;
}
