//! History pages by cursor in both directions and by time, and ranges (PROTOCOL.md 6).

use crate::*;
use serde_json::json;

async fn conversation_with(n: u64) -> (TestServer, Http) {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let _ = s.user(222).await;
    for i in 1..=n {
        alice
            .post(
                "/v1/messages",
                &text_to_user(&format!("h{i}"), 222, &format!("m{i}")),
            )
            .await
            .unwrap();
    }
    (s, alice)
}

#[tokio::test]
async fn pages_by_cursor_in_both_directions() {
    let (_s, alice) = conversation_with(45).await;
    let base = "/v1/conversations/111-222/messages";
    let first = alice.get(base).await.unwrap();
    assert_eq!(page_seqs(&first), (26..=45).collect::<Vec<_>>());
    assert_eq!(first["has_more"], true);
    let older = alice.get(&format!("{base}?before=26")).await.unwrap();
    assert_eq!(page_seqs(&older), (6..=25).collect::<Vec<_>>());
    assert_eq!(older["has_more"], true);
    let oldest = alice.get(&format!("{base}?before=6")).await.unwrap();
    assert_eq!(page_seqs(&oldest), (1..=5).collect::<Vec<_>>());
    assert_eq!(oldest["has_more"], false);
    let newer = alice
        .get(&format!("{base}?after=40&limit=3"))
        .await
        .unwrap();
    assert_eq!(page_seqs(&newer), vec![41, 42, 43]);
    assert_eq!(newer["has_more"], true);
    let newest = alice
        .get(&format!("{base}?after=43&limit=3"))
        .await
        .unwrap();
    assert_eq!(page_seqs(&newest), vec![44, 45]);
    assert_eq!(newest["has_more"], false);
    let big = alice.get(&format!("{base}?limit=1000")).await.unwrap();
    assert_eq!(page_seqs(&big), (1..=45).collect::<Vec<_>>());
    // "At most 100": a limit past u32 is cut to the cap, not refused.
    let huge = alice
        .get(&format!("{base}?limit=99999999999"))
        .await
        .unwrap();
    assert_eq!(page_seqs(&huge), (1..=45).collect::<Vec<_>>());
    assert_eq!(
        code_of(alice.get(&format!("{base}?before=5&after=2")).await),
        "invalid_argument"
    );
    assert_eq!(
        code_of(alice.get(&format!("{base}?limit=0")).await),
        "invalid_argument"
    );
}

#[tokio::test]
async fn ranges_are_inclusive_and_bounded() {
    let (_s, alice) = conversation_with(12).await;
    let base = "/v1/conversations/111-222/messages/range";
    let r = alice.get(&format!("{base}?from=3&to=7")).await.unwrap();
    assert_eq!(page_seqs(&r), vec![3, 4, 5, 6, 7]);
    let r = alice.get(&format!("{base}?from=10&to=50")).await.unwrap();
    assert_eq!(page_seqs(&r), vec![10, 11, 12]);
    assert_eq!(
        code_of(alice.get(&format!("{base}?from=1&to=201")).await),
        "invalid_argument"
    );
    assert_eq!(
        code_of(alice.get(&format!("{base}?from=5&to=4")).await),
        "invalid_argument"
    );
    // Seqs start at 1: `from=0` is the chain's start, as in a WebSocket `pull`, and the
    // width counts from there.
    let r = alice.get(&format!("{base}?from=0&to=3")).await.unwrap();
    assert_eq!(page_seqs(&r), vec![1, 2, 3]);
    let r = alice.get(&format!("{base}?from=0&to=200")).await.unwrap();
    assert_eq!(page_seqs(&r), (1..=12).collect::<Vec<_>>());
    assert_eq!(
        code_of(alice.get(&format!("{base}?from=5")).await),
        "invalid_argument"
    );
}

#[tokio::test]
async fn pages_by_time() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    let _ = s.user(222).await;
    let mut times = Vec::new();
    for i in 1..=6 {
        let ack = alice
            .post("/v1/messages", &text_to_user(&format!("t{i}"), 222, "x"))
            .await
            .unwrap();
        times.push(ack["created_at"].as_i64().unwrap());
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    let base = "/v1/conversations/111-222/messages";
    let page = alice
        .get(&format!(
            "{base}?from_time={}&to_time={}",
            times[1], times[3]
        ))
        .await
        .unwrap();
    assert_eq!(page_seqs(&page), vec![2, 3, 4]);
    let page = alice
        .get(&format!("{base}?from_time={}", times[4]))
        .await
        .unwrap();
    assert_eq!(page_seqs(&page), vec![5, 6]);
    let page = alice
        .get(&format!("{base}?to_time={}&limit=1", times[2]))
        .await
        .unwrap();
    assert_eq!(page_seqs(&page), vec![3]);
    assert_eq!(page["has_more"], true);
}

/// "Ordered ... by newest activity" holds within one millisecond too: a burst of sends on
/// one connection, into chats whose ids sort otherwise, lists them newest first, and
/// pages of one follow the same order.
#[tokio::test]
async fn conversations_active_in_the_same_millisecond_list_newest_first() {
    let s = spawn_server().await;
    let ta = s.token(301).await;
    let alice = s.anon().with_bearer(ta.clone());
    let order = [307u64, 303, 305, 302, 306, 304];
    for peer in order {
        let _ = s.user(peer).await;
    }
    let mut ws = s.ws(&ta, "d").await;
    let burst: Vec<String> = order
        .iter()
        .map(|peer| send_frame(text_to_user(&format!("t{peer}"), *peer, "x")).to_string())
        .collect();
    ws.send_burst(burst).await.unwrap();
    let pong = request(&mut ws, json!({"type": "ping"}), 1).await;
    assert_eq!(pong["type"], "pong");
    let expected: Vec<String> = order.iter().rev().map(|p| format!("301-{p}")).collect();
    let page = alice.get("/v1/conversations").await.unwrap();
    let ids: Vec<String> = page["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["conversation_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, expected, "{page}");
    let mut paged = Vec::new();
    let mut cursor = String::new();
    loop {
        let page = alice
            .get(&format!("/v1/conversations?limit=1&cursor={cursor}"))
            .await
            .unwrap();
        for c in page["conversations"].as_array().unwrap() {
            paged.push(c["conversation_id"].as_str().unwrap().to_owned());
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = c.to_owned(),
            None => break,
        }
    }
    assert_eq!(paged, expected);
}

#[tokio::test]
async fn conversation_list_is_ordered_by_activity_and_pages_by_cursor() {
    let s = spawn_server().await;
    let alice = s.user(111).await;
    for peer in 201..=205u64 {
        let _ = s.user(peer).await;
        alice
            .post(
                "/v1/messages",
                &text_to_user(&format!("c{peer}"), peer, "hi"),
            )
            .await
            .unwrap();
    }
    // 202 becomes the most recent.
    alice
        .post("/v1/messages", &text_to_user("again", 202, "again"))
        .await
        .unwrap();
    let page = alice.get("/v1/conversations?limit=2").await.unwrap();
    let ids: Vec<&str> = page["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["conversation_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["111-202", "111-205"]);
    let cursor = page["next_cursor"].as_str().unwrap().to_owned();
    let next = alice
        .get(&format!("/v1/conversations?limit=2&cursor={cursor}"))
        .await
        .unwrap();
    let ids: Vec<&str> = next["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["conversation_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["111-204", "111-203"]);
    let c = &page["conversations"][0];
    for field in [
        "conversation_id",
        "type",
        "peer",
        "name",
        "member_count",
        "seq",
        "fanout",
        "last_message",
        "unread",
        "last_read_seq",
        "pinned",
        "muted",
        "updated_at",
    ] {
        assert!(c.get(field).is_some(), "missing {field}");
    }
    assert_eq!(c["last_message"]["content"], "again");
    assert_eq!(c["seq"], 2);
    assert_eq!(
        code_of(alice.get("/v1/conversations?cursor=garbage").await),
        "invalid_argument"
    );
}

#[tokio::test]
async fn pull_returns_complete_ranges_with_has_more() {
    let (s, _alice) = conversation_with(250).await;
    let tb = s.token(222).await;
    let mut ws = s.ws(&tb, "b").await;
    assert_eq!(ws.hello["user_seq"], 250);
    let r = request(
        &mut ws,
        json!({"type": "pull", "chain": "user", "from": 1, "to": 250, "limit": 500}),
        1,
    )
    .await;
    let items = r["items"].as_array().unwrap();
    assert_eq!(items.len(), 200);
    assert_eq!(items[0]["seq"], 1);
    assert_eq!(items[199]["seq"], 200);
    assert_eq!(r["has_more"], true);
    let r = request(
        &mut ws,
        json!({"type": "pull", "chain": "user", "from": 201}),
        2,
    )
    .await;
    assert_eq!(r["items"].as_array().unwrap().len(), 50);
    assert_eq!(r["has_more"], false);
    let r = request(&mut ws, json!({"type": "pull", "chain": "conversation", "conversation_id": "111-222", "from": 240, "to": 245}), 3).await;
    assert_eq!(item_seqs(&r), vec![240, 241, 242, 243, 244, 245]);
    assert_eq!(r["items"][0]["message"]["seq"], 240);
    assert_eq!(r["has_more"], false);
    let r = request(
        &mut ws,
        json!({"type": "pull", "chain": "user", "from": 1, "to": 10, "limit": 3}),
        4,
    )
    .await;
    assert_eq!(r["items"].as_array().unwrap().len(), 3);
    assert_eq!(r["has_more"], true);
}

/// PROTOCOL.md 6: `GET /v1/conversations/{id}/messages` takes "`?limit=20` (default 20, at
/// most 100)": without `limit` the newest 20 come back, and a larger `limit` is cut to 100.
#[tokio::test]
async fn history_limit_defaults_to_20_and_is_capped_at_100() {
    let (_s, alice) = conversation_with(120).await;
    let page = history_page(&alice, "111-222", "").await;
    assert_eq!(page_seqs(&page), (101..=120).collect::<Vec<_>>());
    assert_eq!(page["has_more"], true);
    for limit in [100, 101, 1000] {
        let page = history_page(&alice, "111-222", &format!("?limit={limit}")).await;
        assert_eq!(
            page_seqs(&page),
            (21..=120).collect::<Vec<_>>(),
            "limit={limit}"
        );
        assert_eq!(page["has_more"], true, "limit={limit}");
    }
    let page = history_page(&alice, "111-222", "?after=0&limit=500").await;
    assert_eq!(page_seqs(&page), (1..=100).collect::<Vec<_>>());
    assert_eq!(page["has_more"], true);
}

/// PROTOCOL.md 6: `/messages/range` is inclusive and "a wider range than 200 is
/// `invalid_argument`": exactly 200 wide is answered whole, 201 wide is refused.
#[tokio::test]
async fn a_range_of_exactly_200_is_answered_and_201_is_invalid() {
    let (_s, alice) = conversation_with(201).await;
    let base = "/v1/conversations/111-222/messages/range";
    let r = alice.get(&format!("{base}?from=1&to=200")).await.unwrap();
    assert_eq!(page_seqs(&r), (1..=200).collect::<Vec<_>>());
    let r = alice.get(&format!("{base}?from=2&to=201")).await.unwrap();
    assert_eq!(page_seqs(&r), (2..=201).collect::<Vec<_>>());
    for (from, to) in [(1, 201), (2, 202)] {
        let (status, body) = alice
            .raw(
                reqwest::Method::GET,
                &format!("{base}?from={from}&to={to}"),
                None,
            )
            .await
            .unwrap();
        assert_eq!(
            (status, body["code"].as_str()),
            (400, Some("invalid_argument")),
            "{from}..={to}"
        );
    }
}

/// PROTOCOL.md 5.3: a pull's "`limit` defaults to 100 and is capped at 200", on both chains.
#[tokio::test]
async fn pull_limit_defaults_to_100_and_is_capped_at_200() {
    let (s, _alice) = conversation_with(201).await;
    let tb = s.token(222).await;
    let mut ws = s.ws(&tb, "b").await;
    for (i, chain) in [
        json!({"chain": "user"}),
        json!({"chain": "conversation", "conversation_id": "111-222"}),
    ]
    .into_iter()
    .enumerate()
    {
        let req = i as i64 * 10;
        let mut pull = chain.clone();
        pull["type"] = json!("pull");
        pull["from"] = json!(1);
        let r = request(&mut ws, pull.clone(), req + 1).await;
        assert_eq!(item_seqs(&r), (1..=100).collect::<Vec<_>>(), "{chain}");
        assert_eq!(r["has_more"], true, "{chain}");
        for limit in [200, 201, 10_000] {
            pull["limit"] = json!(limit);
            let r = request(&mut ws, pull.clone(), req + 2).await;
            assert_eq!(
                item_seqs(&r),
                (1..=200).collect::<Vec<_>>(),
                "{chain} limit {limit}"
            );
            assert_eq!(r["has_more"], true, "{chain} limit {limit}");
        }
    }
}

/// PROTOCOL.md 5.3: "`has_more` is true when the chain holds more after the last item, up to
/// `to`": messages after `to` do not count.
#[tokio::test]
async fn pull_has_more_only_counts_what_lies_up_to_to() {
    let (s, _alice) = conversation_with(20).await;
    let tb = s.token(222).await;
    let mut ws = s.ws(&tb, "b").await;
    for (i, chain) in [
        json!({"chain": "user"}),
        json!({"chain": "conversation", "conversation_id": "111-222"}),
    ]
    .into_iter()
    .enumerate()
    {
        let req = i as i64 * 10;
        let mut pull = chain.clone();
        pull["type"] = json!("pull");
        pull["from"] = json!(1);
        pull["to"] = json!(10);
        let r = request(&mut ws, pull.clone(), req + 1).await;
        assert_eq!(item_seqs(&r), (1..=10).collect::<Vec<_>>(), "{chain}");
        assert_eq!(r["has_more"], false, "more after `to` is not more: {chain}");
        // Cut short by `limit` before `to`: there is more up to `to`.
        pull["limit"] = json!(5);
        let r = request(&mut ws, pull.clone(), req + 2).await;
        assert_eq!(item_seqs(&r), (1..=5).collect::<Vec<_>>(), "{chain}");
        assert_eq!(r["has_more"], true, "{chain}");
        // Exactly up to `to`: nothing more up to it.
        pull["limit"] = json!(10);
        let r = request(&mut ws, pull.clone(), req + 3).await;
        assert_eq!(item_seqs(&r), (1..=10).collect::<Vec<_>>(), "{chain}");
        assert_eq!(r["has_more"], false, "{chain}");
    }
}
