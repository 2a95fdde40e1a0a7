//! The HTTP side of the protocol.

use pigeon_proto::ErrorBody;
use pigeon_proto::views::{SendAck, SendRequest};
use serde_json::{Value, json};

/// What a call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with a protocol error.
    #[error("{status} {}: {}", body.code.as_str(), body.message)]
    Api { status: u16, body: ErrorBody },
    #[error("transport: {0}")]
    Transport(String),
    #[error("unexpected answer: {0}")]
    Decode(String),
}

impl ClientError {
    /// The protocol code, when the server gave one.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            ClientError::Api { body, .. } => Some(body.code.as_str()),
            _ => None,
        }
    }
}

/// An HTTP client bound to one server and one bearer (a user token or the admin key).
#[derive(Clone)]
pub struct Http {
    base: String,
    bearer: Option<String>,
    client: reqwest::Client,
}

/// Sends `req`; answers the status and the whole body.
async fn fetch(req: reqwest::RequestBuilder) -> Result<(u16, Vec<u8>), ClientError> {
    let transport = |e: reqwest::Error| ClientError::Transport(e.to_string());
    let resp = req.send().await.map_err(transport)?;
    let status = resp.status().as_u16();
    let body = resp.bytes().await.map_err(transport)?;
    Ok((status, body.into()))
}

impl Http {
    /// `base` like `http://127.0.0.1:8080`.
    pub fn new(base: impl Into<String>) -> Self {
        Http {
            base: base.into().trim_end_matches('/').to_owned(),
            bearer: None,
            // A pooled connection is let go before the server closes it as idle (after 30 s),
            // so a request never races that close.
            client: reqwest::Client::builder()
                .pool_idle_timeout(std::time::Duration::from_secs(25))
                .build()
                .expect("a client with only a pool setting builds"),
        }
    }

    /// The same server, calling as `bearer`.
    pub fn with_bearer(&self, bearer: impl Into<String>) -> Self {
        Http {
            base: self.base.clone(),
            bearer: Some(bearer.into()),
            client: self.client.clone(),
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// `ws://host:port` of the same server.
    pub fn ws_base(&self) -> String {
        self.base.replacen("http", "ws", 1)
    }

    /// A request to `path` of this server, with the bearer if any.
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let req = self
            .client
            .request(method, format!("{}{}", self.base, path));
        match &self.bearer {
            Some(b) => req.bearer_auth(b),
            None => req,
        }
    }

    /// Any call; answers the status and the JSON body (`null` when empty).
    pub async fn raw(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), ClientError> {
        let mut req = self.request(method, path);
        if let Some(body) = body {
            req = req.json(body);
        }
        let (status, bytes) = fetch(req).await?;
        let value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).map_err(|e| {
                ClientError::Decode(format!("{e}: {}", String::from_utf8_lossy(&bytes)))
            })?
        };
        Ok((status, value))
    }

    /// A call that succeeds with a 2xx JSON body, or fails with the protocol error.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ClientError> {
        let (status, value) = self.raw(method, path, body).await?;
        if (200..300).contains(&status) {
            return Ok(value);
        }
        match serde_json::from_value::<ErrorBody>(value.clone()) {
            Ok(body) => Err(ClientError::Api { status, body }),
            Err(_) => Err(ClientError::Decode(format!("status {status}: {value}"))),
        }
    }

    /// GETs a plain-text endpoint (`/metrics`): its body on a 2xx status.
    pub async fn get_text(&self, path: &str) -> Result<String, ClientError> {
        let (status, bytes) = fetch(self.request(reqwest::Method::GET, path)).await?;
        let text = String::from_utf8_lossy(&bytes).into_owned();
        if (200..300).contains(&status) {
            Ok(text)
        } else {
            Err(ClientError::Decode(format!("status {status}: {text}")))
        }
    }

    pub async fn get(&self, path: &str) -> Result<Value, ClientError> {
        self.call(reqwest::Method::GET, path, None).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> Result<Value, ClientError> {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    pub async fn put(&self, path: &str, body: Option<&Value>) -> Result<Value, ClientError> {
        self.call(reqwest::Method::PUT, path, body).await
    }

    pub async fn patch(&self, path: &str, body: &Value) -> Result<Value, ClientError> {
        self.call(reqwest::Method::PATCH, path, Some(body)).await
    }

    pub async fn delete(&self, path: &str) -> Result<Value, ClientError> {
        self.call(reqwest::Method::DELETE, path, None).await
    }

    /// Every message of `conv` the caller may read, in seq order, read by ranges of 200.
    pub async fn whole_history(&self, conv: &str) -> Result<Vec<Value>, ClientError> {
        let head = self.get(&format!("/v1/conversations/{conv}")).await?["seq"]
            .as_u64()
            .unwrap_or(0);
        let mut out = Vec::new();
        let mut from = 1;
        while from <= head {
            let to = (from + 199).min(head);
            let page = self
                .get(&format!(
                    "/v1/conversations/{conv}/messages/range?from={from}&to={to}"
                ))
                .await?;
            out.extend(page["messages"].as_array().cloned().unwrap_or_default());
            from = to + 1;
        }
        Ok(out)
    }

    /// Admin: registers (or updates) a user.
    pub async fn upsert_user(&self, user_id: u64, name: &str) -> Result<Value, ClientError> {
        self.post(
            "/v1/admin/users",
            &json!({"user_id": user_id, "name": name, "avatar": ""}),
        )
        .await
    }

    /// Admin: mints a token for `user_id`.
    pub async fn mint_token(&self, user_id: u64, ttl_secs: u64) -> Result<String, ClientError> {
        let v = self
            .post(
                "/v1/admin/tokens",
                &json!({"user_id": user_id, "ttl_secs": ttl_secs}),
            )
            .await?;
        v["token"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| ClientError::Decode(v.to_string()))
    }

    /// Sends a message over HTTP.
    pub async fn send(&self, req: &SendRequest) -> Result<SendAck, ClientError> {
        let v = self
            .post(
                "/v1/messages",
                &serde_json::to_value(req).map_err(|e| ClientError::Decode(e.to_string()))?,
            )
            .await?;
        serde_json::from_value(v).map_err(|e| ClientError::Decode(e.to_string()))
    }
}
