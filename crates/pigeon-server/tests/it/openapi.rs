//! `/openapi.json` against the handlers (PROTOCOL.md 2): tools generate requests from it,
//! so a request it calls valid must not be refused as malformed.

use crate::*;
use pigeon_proto::ConversationId;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::TestRunner;

/// `schema` with a `$ref` to the document's components followed.
fn resolved<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"]
        .as_str()
        .and_then(|r| r.strip_prefix("#/components/schemas/"))
    {
        Some(name) => &doc["components"]["schemas"][name],
        None => schema,
    }
}

/// Every (method, path, operation) of the document.
fn operations(doc: &Value) -> Vec<(String, String, Value)> {
    let mut all = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            all.push((method.clone(), path.clone(), op.clone()));
        }
    }
    all
}

/// `count` strings the anchored `pattern` allows.
fn samples(pattern: &str, count: usize) -> Vec<String> {
    let inner = pattern
        .strip_prefix('^')
        .and_then(|p| p.strip_suffix('$'))
        .unwrap_or_else(|| panic!("not anchored: {pattern}"));
    let strategy = proptest::string::string_regex(inner).expect("a pattern proptest reads");
    let mut runner = TestRunner::deterministic();
    (0..count)
        .map(|_| strategy.new_tree(&mut runner).unwrap().current())
        .collect()
}

/// A group's paths take only group ids: every id their `{id}` allows is one, and a user id
/// or a single chat's id is not among them (as the handlers refuse those with 400).
#[tokio::test]
async fn openapi_group_paths_allow_only_group_ids() {
    let s = spawn_server().await;
    let doc = s.anon().get("/openapi.json").await.unwrap();
    let mut checked = 0;
    for (method, path, op) in operations(&doc) {
        if !path.starts_with("/v1/groups/{id}") {
            continue;
        }
        let id = op["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "id" && p["in"] == "path")
            .unwrap_or_else(|| panic!("{method} {path} has no {{id}}"));
        let schema = resolved(&doc, &id["schema"]);
        let pattern = schema["pattern"]
            .as_str()
            .unwrap_or_else(|| panic!("{method} {path}: {{id}} has no pattern"));
        for sample in samples(pattern, 300) {
            assert!(
                ConversationId::parse(&sample).is_ok_and(|c| c.is_group()),
                "{method} {path} allows {sample:?}, which is not a group id"
            );
        }
        checked += 1;
    }
    assert!(checked >= 9, "only {checked} group operations");
    // Other ids on a group path are refused as malformed (a single chat's too, once it
    // exists: before, it is not found), which is why no pattern may allow them.
    let alice = s.user(1).await;
    let _ = s.user(2).await;
    alice
        .post("/v1/messages", &text_to_user("m1", 2, "hi"))
        .await
        .unwrap();
    for id in ["1-2", "1", "r00"] {
        let (status, body) = alice
            .raw(reqwest::Method::DELETE, &format!("/v1/groups/{id}"), None)
            .await
            .unwrap();
        assert_eq!(
            (status, &body["code"]),
            (400, &json!("invalid_argument")),
            "{id}"
        );
    }
}

/// The path of `path` with an id of each kind where its parameters are.
fn concrete(path: &str) -> String {
    let id = if path.starts_with("/v1/groups/") {
        "g1"
    } else if path.starts_with("/v1/conversations/") {
        "1-2"
    } else if path.starts_with("/v1/admin/users/") {
        // Not the caller's own user, whose logout would end the test's token.
        "9"
    } else {
        "r00"
    };
    path.replace("{id}", id)
        .replace("{uid}", "2")
        .replace("{msg_id}", "1")
}

/// Every handler that reads a body refuses an empty one (400: it is not JSON), so every
/// request body the document describes is required, and no operation that refuses an empty
/// body lacks one.
#[tokio::test]
async fn openapi_request_bodies_are_required_where_the_handler_reads_one() {
    let s = spawn_server().await;
    let doc = s.anon().get("/openapi.json").await.unwrap();
    let user = s.user(1).await;
    let _ = s.user(2).await;
    let mut bodies = 0;
    for (method, path, op) in operations(&doc) {
        if !matches!(method.as_str(), "post" | "put" | "patch") {
            continue;
        }
        let caller = if path.starts_with("/v1/admin") {
            &s.admin
        } else {
            &user
        };
        let m = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
        let (status, answer) = caller.raw(m, &concrete(&path), None).await.unwrap();
        let refused_empty = status == 400
            && answer["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("the body is not JSON"));
        let body = &op["requestBody"];
        assert_eq!(
            refused_empty,
            body.is_object(),
            "{method} {path}: an empty body answers {status} {answer}, the document says {body}"
        );
        if body.is_object() {
            assert_eq!(body["required"], json!(true), "{method} {path}: {body}");
            bodies += 1;
        }
    }
    assert!(bodies >= 10, "only {bodies} bodies");
}

/// `ttl_secs` is described with the range the server takes: `0..=--max-token-ttl-secs`.
#[tokio::test]
async fn openapi_token_ttl_has_the_configured_range() {
    let s = spawn_with(|cfg| cfg.max_token_ttl_secs = 600).await;
    let doc = s.anon().get("/openapi.json").await.unwrap();
    let body = &doc["paths"]["/v1/admin/tokens"]["post"]["requestBody"]["content"]["application/json"]
        ["schema"];
    let ttl = &body["properties"]["ttl_secs"];
    assert_eq!(
        (&ttl["type"], &ttl["minimum"], &ttl["maximum"]),
        (&json!("integer"), &json!(0), &json!(600)),
        "{ttl}"
    );
    s.admin.upsert_user(1, "a").await.unwrap();
    s.admin.mint_token(1, 0).await.unwrap();
    s.admin.mint_token(1, 600).await.unwrap();
    assert_eq!(
        code_of(s.admin.mint_token(1, 601).await),
        "invalid_argument"
    );
}
