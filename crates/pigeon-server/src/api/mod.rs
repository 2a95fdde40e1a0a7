//! The HTTP API of PROTOCOL.md section 6: the router, the extractors that authenticate and
//! parse (turning every rejection into the protocol's error body), and one module per area.

mod admin;
mod conversations;
mod groups;
mod messages;
mod ops;
mod rooms;
pub mod unread;

use crate::app::AppRef;
use crate::auth::bearer;
use crate::error::ApiError;
use axum::Router;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use pigeon_proto::{ErrorCode, UserId};
use serde::de::DeserializeOwned;

/// Largest HTTP body accepted (a content of 1 MiB plus its JSON envelope).
pub const MAX_BODY_BYTES: usize = (1 << 20) + 64 * 1024;

pub fn router(app: AppRef) -> Router {
    Router::new()
        .route("/", get(ops::chat_page))
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/openapi.json", get(ops::openapi))
        .route("/v1/ws", get(crate::ws::upgrade))
        .route("/v1/admin/users", post(admin::upsert_user))
        .route("/v1/admin/tokens", post(admin::mint_token))
        .route("/v1/admin/users/{id}/logout", post(admin::logout))
        .route(
            "/v1/admin/messages/{msg_id}",
            get(admin::get_message).delete(admin::delete_message),
        )
        .route("/v1/admin/rooms", post(rooms::create))
        .route("/v1/admin/rooms/{id}", axum::routing::delete(rooms::close))
        .route("/v1/rooms/{id}", get(rooms::info))
        .route("/v1/messages", post(messages::send))
        .route("/v1/messages/{msg_id}/recall", post(messages::recall))
        .route(
            "/v1/messages/{msg_id}",
            axum::routing::patch(messages::edit).delete(messages::hide),
        )
        .route("/v1/messages/{msg_id}/versions", get(messages::versions))
        .route("/v1/conversations", get(conversations::list))
        .route("/v1/conversations/{id}", get(conversations::one))
        .route(
            "/v1/conversations/{id}/messages",
            get(conversations::history),
        )
        .route(
            "/v1/conversations/{id}/messages/range",
            get(conversations::range),
        )
        .route("/v1/conversations/{id}/read", post(conversations::read))
        .route(
            "/v1/conversations/{id}/receipts",
            get(conversations::receipts),
        )
        .route(
            "/v1/conversations/{id}/settings",
            put(conversations::settings),
        )
        .route("/v1/unread", get(conversations::unread))
        .route("/v1/sync", get(conversations::sync))
        .route("/v1/groups", post(groups::create))
        .route(
            "/v1/groups/{id}",
            axum::routing::patch(groups::update).delete(groups::dismiss),
        )
        .route(
            "/v1/groups/{id}/members",
            post(groups::invite).get(groups::members),
        )
        .route(
            "/v1/groups/{id}/members/{uid}",
            axum::routing::delete(groups::remove),
        )
        .route(
            "/v1/groups/{id}/admins/{uid}",
            put(groups::add_admin).delete(groups::remove_admin),
        )
        .route("/v1/groups/{id}/mutes", post(groups::mute))
        .route(
            "/v1/groups/{id}/mutes/{uid}",
            axum::routing::delete(groups::unmute),
        )
        .fallback(ops::not_found)
        .method_not_allowed_fallback(ops::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            unread::bounded,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        // A body must come within as long as a head may (`serve::HEADER_READ_TIMEOUT`): a
        // client cannot hold a handler with a half-sent body either. This bounds each wait
        // for more of it; `ApiJson` bounds the whole body (a byte a second never stalls).
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            crate::serve::HEADER_READ_TIMEOUT,
        ))
        .layer(axum::middleware::from_fn(declared_body_within_limit))
        .layer(axum::middleware::from_fn(head_within_limit))
        .layer(axum::middleware::from_fn(host_given))
        .layer(catch_panics())
        .with_state(app)
}

/// Refuses a request whose head (its request line and headers, as sent) is over
/// [`crate::serve::MAX_HEAD_BYTES`], as hyper refuses one whose first 64 KiB it reads
/// without finding the head's end: `431`, here with the JSON body of `payload_too_large`
/// (hyper's has none). Hyper's bound is its read buffer's, which may take in a larger head
/// whole when it arrives at once.
async fn head_within_limit(req: Request, next: axum::middleware::Next) -> Response {
    let line = req.method().as_str().len()
        + req.uri().path_and_query().map_or(1, |p| p.as_str().len())
        + " HTTP/1.1\r\n".len();
    let headers: usize = req
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + ": \r\n".len() + value.len())
        .sum();
    if line + headers > crate::serve::MAX_HEAD_BYTES {
        let mut refused = ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!(
                "the request head is over {} KiB",
                crate::serve::MAX_HEAD_BYTES / 1024
            ),
        )
        .into_response();
        *refused.status_mut() = StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE;
        return refused;
    }
    next.run(req).await
}

/// Refuses, before any of it is read, a body whose declared `Content-Length` is over
/// [`MAX_BODY_BYTES`]: `413` at once, and no `100 Continue` to a client that asked
/// whether to send it (hyper sends that only when the body is first read). Reading such a
/// body up to the limit would wait for as long as the body timeout on a client that sent a
/// byte of it.
async fn declared_body_within_limit(req: Request, next: axum::middleware::Next) -> Response {
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("the request body is over {} KiB", MAX_BODY_BYTES / 1024),
        )
        .into_response();
    }
    next.run(req).await
}

/// Refuses an HTTP/1.1 request without a `Host` header, as RFC 9112 (3.2) asks of a server:
/// `400 invalid_argument`.
async fn host_given(req: Request, next: axum::middleware::Next) -> Response {
    if req.version() == axum::http::Version::HTTP_11
        && !req.headers().contains_key(axum::http::header::HOST)
    {
        return ApiError::invalid("an HTTP/1.1 request needs a Host header").into_response();
    }
    next.run(req).await
}

/// A handler that panics (a bug) answers `500 internal` with the protocol's error body,
/// its message logged and never sent, instead of dropping the connection.
fn catch_panics() -> tower_http::catch_panic::CatchPanicLayer<fn(PanicPayload) -> Response> {
    tower_http::catch_panic::CatchPanicLayer::custom(internal_error as fn(_) -> _)
}

type PanicPayload = Box<dyn std::any::Any + Send + 'static>;

fn internal_error(panic: PanicPayload) -> Response {
    let what = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("(not a string)");
    tracing::error!(panic = what, "a request handler panicked");
    ApiError::new(ErrorCode::Internal, "internal error").into_response()
}

/// The authenticated user of a request (`Authorization: Bearer <user token>`).
pub struct AuthUser(pub UserId);

impl FromRequestParts<AppRef> for AuthUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, app: &AppRef) -> Result<Self, Self::Rejection> {
        let user = app.authenticate(bearer_token(parts)?).await?;
        answered_to(parts, user);
        Ok(AuthUser(user))
    }
}

/// Counts the request's answer against `user` (`unread::bounded`).
fn answered_to(parts: &Parts, user: UserId) {
    if let Some(caller) = parts.extensions.get::<unread::Caller>() {
        caller.set(user);
    }
}

/// The bearer token of a request, or `unauthorized`.
fn bearer_token(parts: &Parts) -> Result<&str, ApiError> {
    parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
        .ok_or_else(ApiError::unauthorized)
}

/// The authenticated user of a request that may wait (a long poll), with its token: a
/// logout while it waits must end it, since revoked tokens "stop working at once"
/// (PROTOCOL.md 3), and a waiting poll is as open as a connection.
pub struct AuthSession {
    pub user: UserId,
    token: String,
}

impl AuthSession {
    /// `unauthorized` once the token was revoked (or expired) since the request came.
    pub async fn still_valid(&self, app: &AppRef) -> Result<(), ApiError> {
        app.authenticate(&self.token).await.map(|_| ())
    }
}

impl FromRequestParts<AppRef> for AuthSession {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, app: &AppRef) -> Result<Self, Self::Rejection> {
        let token = bearer_token(parts)?;
        let user = app.authenticate(token).await?;
        answered_to(parts, user);
        Ok(AuthSession {
            user,
            token: token.to_owned(),
        })
    }
}

/// The authenticated user of a request that writes (a send, or any change that appends to
/// a chain or tells other members): one write is taken from their allowance
/// (`RateLimits::check_send`) before the body is read, so no write is a way around the send
/// limit.
pub struct WritingUser(pub UserId);

impl FromRequestParts<AppRef> for WritingUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, app: &AppRef) -> Result<Self, Self::Rejection> {
        let AuthUser(me) = AuthUser::from_request_parts(parts, app).await?;
        app.limits.check_send(me)?;
        Ok(WritingUser(me))
    }
}

/// A request made with the admin key.
pub struct Admin;

impl FromRequestParts<AppRef> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, app: &AppRef) -> Result<Self, Self::Rejection> {
        match bearer_token(parts) {
            Ok(k) if app.is_admin_key(k) => Ok(Admin),
            _ => Err(ApiError::new(ErrorCode::Unauthorized, "admin key required")),
        }
    }
}

/// A JSON body whose rejections are protocol errors. Every body is JSON (PROTOCOL.md 1),
/// so it is read as JSON whatever `Content-Type` says: a client that left the header out
/// (`curl -d`, a bare `fetch`) is answered, not refused.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let body = body_within(req, state, crate::serve::HEADER_READ_TIMEOUT).await?;
        match serde_json::from_slice::<serde_json::Value>(&body) {
            Ok(v) if !v.is_object() => Err(ApiError::invalid("the body must be a JSON object")),
            Ok(v) => serde_json::from_value(v)
                .map(ApiJson)
                .map_err(|e| ApiError::unparsable("bad body", &e.to_string())),
            Err(e) => Err(ApiError::unparsable("the body is not JSON", &e.to_string())),
        }
    }
}

/// A request's whole body, if it arrives within `limit` of now (right after its head): a
/// body dribbled a byte at a time would otherwise hold the handler, its connection and its
/// buffer for as long as the client likes (the body timeout layer bounds only each wait).
async fn body_within<S: Send + Sync>(
    req: Request,
    state: &S,
    limit: std::time::Duration,
) -> Result<axum::body::Bytes, ApiError> {
    let read = axum::body::Bytes::from_request(req, state);
    let Ok(read) = tokio::time::timeout(limit, read).await else {
        return Err(ApiError::invalid(format!(
            "the request body did not arrive within {} s",
            limit.as_secs_f64()
        )));
    };
    match read {
        Ok(b) => Ok(b),
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError::new(
            ErrorCode::PayloadTooLarge,
            "request body too large",
        )),
        // The body stopped coming, or came apart: said in the protocol's words, not the
        // HTTP library's (which name its own timeouts and buffers).
        Err(e) => {
            tracing::debug!(error = %e.body_text(), "a request body could not be read");
            Err(ApiError::invalid(format!(
                "the request body could not be read: it stopped, was malformed, or did not \
                 arrive whole within {} s",
                limit.as_secs_f64()
            )))
        }
    }
}

/// Query parameters whose rejections are protocol errors.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        // A parameter given empty (`?cursor=&limit=`, as PROTOCOL.md writes the members
        // query, or a bare `?limit`) is one not given: a number's default, not "cannot
        // parse ''".
        let given = parts.uri.query().unwrap_or("");
        let query: Vec<&str> = given
            .split('&')
            .filter(|pair| {
                pair.split_once('=')
                    .is_some_and(|(_, value)| !value.is_empty())
            })
            .collect();
        let uri: axum::http::Uri = format!("/?{}", query.join("&"))
            .parse()
            .map_err(|_| ApiError::invalid("malformed query string"))?;
        match axum::extract::Query::<T>::try_from_uri(&uri) {
            Ok(axum::extract::Query(v)) => Ok(ApiQuery(v)),
            Err(e) => Err(ApiError::unparsable("bad query", &e.body_text())),
        }
    }
}

/// Path parameters whose rejections are protocol errors (a segment that is not UTF-8
/// answers the JSON error body, not axum's plain text).
pub struct ApiPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(ApiPath(v)),
            Err(e) => Err(ApiError::unparsable("bad path", &e.body_text())),
        }
    }
}

/// Parses a user id from a path segment.
pub fn path_user(s: &str) -> Result<UserId, ApiError> {
    let raw: u64 = s
        .parse()
        .map_err(|_| ApiError::invalid("user id must be an integer"))?;
    Ok(UserId::new(raw)?)
}

/// Parses a msg_id from a path segment.
pub fn path_msg_id(s: &str) -> Result<pigeon_proto::MsgId, ApiError> {
    Ok(pigeon_proto::MsgId::parse(s)?)
}

/// `{}`: the answer of a change that returns nothing else.
pub fn empty() -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({}))
}

/// Runs `cmd` through the pipeline and answers `{}` once it is committed.
pub async fn run(
    app: &AppRef,
    cmd: pigeon_core::Command,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    app.pipeline.call(cmd).await?;
    Ok(empty())
}

/// Runs `cmd` through the pipeline and answers `me`'s view of `conv` after it.
pub async fn run_then_view(
    app: &AppRef,
    me: UserId,
    conv: &pigeon_proto::ConversationId,
    cmd: pigeon_core::Command,
) -> Result<axum::Json<pigeon_proto::views::ConversationView>, ApiError> {
    app.pipeline.call(cmd).await?;
    Ok(axum::Json(app.conversation(me, conv).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body that keeps coming, a byte at a time, is cut off at the limit as a whole, not
    /// waited for as long as each byte comes in time.
    #[tokio::test]
    async fn a_dribbled_body_is_refused_at_its_deadline() {
        let dribble = futures_util::stream::unfold(0u32, |n| async move {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            Some((
                Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b" ")),
                n + 1,
            ))
        });
        let req = Request::builder()
            .body(axum::body::Body::from_stream(dribble))
            .unwrap();
        let started = std::time::Instant::now();
        let err = body_within(req, &(), std::time::Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidArgument);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let whole = Request::builder()
            .body(axum::body::Body::from("{}"))
            .unwrap();
        let body = body_within(whole, &(), std::time::Duration::from_millis(300))
            .await
            .unwrap();
        assert_eq!(&body[..], b"{}");
    }

    /// A body that fails as it is read (its client stopped, a layer's timeout) is answered
    /// in the protocol's words: nothing of the HTTP library's message reaches the client.
    #[tokio::test]
    async fn a_body_that_fails_is_answered_without_the_librarys_words() {
        let failing = futures_util::stream::iter([Err::<axum::body::Bytes, _>(
            std::io::Error::other("data was not received within the designated timeout"),
        )]);
        let req = Request::builder()
            .body(axum::body::Body::from_stream(failing))
            .unwrap();
        let err = body_within(req, &(), std::time::Duration::from_secs(30))
            .await
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidArgument);
        assert_eq!(
            err.message,
            "the request body could not be read: it stopped, was malformed, or did not \
             arrive whole within 30 s"
        );
    }

    /// A panicking handler answers 500 with `{"code":"internal"}` and nothing of the panic.
    #[tokio::test]
    async fn a_panicking_handler_answers_internal_without_its_message() {
        let router: Router = Router::new()
            .route(
                "/boom",
                get(|| async {
                    if std::hint::black_box(true) {
                        panic!("secret detail of a bug");
                    }
                }),
            )
            .layer(catch_panics());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        let answer = reqwest::get(format!("http://{addr}/boom")).await.unwrap();
        assert_eq!(answer.status().as_u16(), 500);
        let body: serde_json::Value = answer.json().await.unwrap();
        assert_eq!(body["code"], "internal", "{body}");
        assert!(!body.to_string().contains("secret"), "{body}");
    }
}
