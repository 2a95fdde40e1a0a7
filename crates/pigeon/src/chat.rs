//! `pigeon chat`: a terminal client on the SDK. One-shot flags for scripts (`--send`,
//! `--list`, `--history`, `--recall-last`), or, without them, a line-mode session: type to
//! send into the open conversation, `/help` for commands, live messages and receipts printed
//! as they arrive.

use pigeon_client::{Client, ClientConfig, ClientError, ConnectionState, Event, Http, Outgoing};
use pigeon_proto::views::SendTarget;
use pigeon_proto::{ConversationId, Message, UserId};
use serde_json::{Value, json};
use std::process::ExitCode;
use tokio::io::{AsyncBufReadExt, BufReader};

#[derive(Debug, clap::Args)]
pub struct ChatArgs {
    /// The server, like http://127.0.0.1:8080
    #[arg(long, env = "PIGEON_SERVER", default_value = "http://127.0.0.1:8080")]
    server: String,
    /// Who to chat as.
    #[arg(long)]
    user: u64,
    /// A token for --user (or give --admin-key to mint one; dev mode).
    #[arg(long, env = "PIGEON_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The admin key, to register --user if needed and mint a token (dev mode).
    #[arg(long, env = "PIGEON_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<String>,
    /// This device's id.
    #[arg(long, default_value = "pigeon-chat")]
    device: String,
    /// Send one message and exit: --send TO TEXT (TO is a user id or a conversation id).
    #[arg(long, num_args = 2, value_names = ["TO", "TEXT"])]
    send: Option<Vec<String>>,
    /// Print the conversation list and exit.
    #[arg(long)]
    list: bool,
    /// Print a conversation's recent history and exit.
    #[arg(long, value_name = "CONVERSATION")]
    history: Option<String>,
    /// Recall your last message in a conversation and exit.
    #[arg(long, value_name = "CONVERSATION")]
    recall_last: Option<String>,
    /// How many messages --history and /open show.
    #[arg(long, default_value_t = 20)]
    limit: u32,
    /// Print JSON lines instead of text.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: ChatArgs) -> ExitCode {
    match chat(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pigeon chat: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn token_for(args: &ChatArgs, http: &Http) -> Result<String, ClientError> {
    if let Some(t) = &args.token {
        return Ok(t.clone());
    }
    let Some(key) = &args.admin_key else {
        return Err(ClientError::Decode(
            "give --token, or --admin-key to mint one".into(),
        ));
    };
    let admin = http.with_bearer(key.clone());
    match admin.mint_token(args.user, 86_400).await {
        Err(e) if e.code() == Some("not_found") => {
            admin
                .upsert_user(args.user, &format!("user{}", args.user))
                .await?;
            admin.mint_token(args.user, 86_400).await
        }
        other => other,
    }
}

/// A user id means the single chat with them; anything else is a conversation id.
fn target(to: &str) -> Result<SendTarget, ClientError> {
    if let Ok(uid) = to.parse::<u64>() {
        let user = UserId::new(uid).map_err(|e| ClientError::Decode(e.0.into()))?;
        return Ok(SendTarget {
            user: Some(user),
            conversation: None,
        });
    }
    let conv = ConversationId::parse(to).map_err(|e| ClientError::Decode(e.0.into()))?;
    Ok(SendTarget {
        user: None,
        conversation: Some(conv),
    })
}

fn conversation_of(me: u64, to: &str) -> String {
    match to.parse::<u64>() {
        Ok(peer) => format!("{}-{}", me.min(peer), me.max(peer)),
        Err(_) => to.to_owned(),
    }
}

fn show_message(m: &Message, json_out: bool) {
    if json_out {
        println!("{}", serde_json::to_string(m).unwrap_or_default());
        return;
    }
    let body = match (m.status, m.kind.is_user_content()) {
        (pigeon_proto::MessageStatus::Recalled, _) => "(recalled)".to_owned(),
        (pigeon_proto::MessageStatus::Deleted, _) => "(deleted)".to_owned(),
        (_, true) => m.content.clone(),
        (_, false) => format!("* {} {}", m.kind.as_str(), m.extra),
    };
    let edited = if m.version > 1 { " (edited)" } else { "" };
    println!(
        "[{} #{}] {}: {}{}",
        m.conversation_id, m.seq, m.sender, body, edited
    );
}

async fn print_list(api: &Http, json_out: bool) -> Result<(), ClientError> {
    let list = api.get("/v1/conversations?limit=200").await?;
    for c in list["conversations"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        if json_out {
            println!("{c}");
            continue;
        }
        let last = c["last_message"]["content"].as_str().unwrap_or("");
        println!(
            "{:<24} {:<16} unread {:>4}  {}{}",
            c["conversation_id"].as_str().unwrap_or(""),
            c["name"].as_str().unwrap_or(""),
            c["unread"],
            if c["pinned"] == true { "[pinned] " } else { "" },
            last
        );
    }
    Ok(())
}

async fn print_history(
    api: &Http,
    conv: &str,
    limit: u32,
    json_out: bool,
) -> Result<Vec<Message>, ClientError> {
    let page = api
        .get(&format!("/v1/conversations/{conv}/messages?limit={limit}"))
        .await?;
    let msgs: Vec<Message> = serde_json::from_value(page["messages"].clone())
        .map_err(|e| ClientError::Decode(e.to_string()))?;
    for m in &msgs {
        show_message(m, json_out);
    }
    Ok(msgs)
}

async fn recall_last(api: &Http, me: u64, conv: &str) -> Result<Value, ClientError> {
    let page = api
        .get(&format!("/v1/conversations/{conv}/messages?limit=100"))
        .await?;
    let mine = page["messages"]
        .as_array()
        .and_then(|ms| {
            ms.iter()
                .rev()
                .find(|m| m["sender"] == me && m["status"] == "normal" && m["kind"] == "text")
                .cloned()
        })
        .ok_or_else(|| ClientError::Decode("you have no recent message there to recall".into()))?;
    let id = mine["msg_id"].as_str().unwrap_or_default();
    api.post(&format!("/v1/messages/{id}/recall"), &json!({}))
        .await
}

async fn chat(args: ChatArgs) -> Result<(), ClientError> {
    let http = Http::new(args.server.clone());
    let token = token_for(&args, &http).await?;
    let api = http.with_bearer(token.clone());
    if let Some(send) = &args.send {
        let out = Outgoing::text(target(&send[0])?, send[1].clone());
        let body = json!({
            "client_msg_id": format!("{}-{:x}", args.device, rand_suffix()),
            "to": out.to, "kind": "text", "content": out.content,
        });
        let ack = api.post("/v1/messages", &body).await?;
        if args.json {
            println!("{ack}");
        } else {
            println!(
                "sent to {} as #{} ({})",
                ack["conversation_id"].as_str().unwrap_or(""),
                ack["seq"],
                ack["msg_id"].as_str().unwrap_or("")
            );
        }
        return Ok(());
    }
    if args.list {
        return print_list(&api, args.json).await;
    }
    if let Some(conv) = &args.history {
        print_history(
            &api,
            &conversation_of(args.user, conv),
            args.limit,
            args.json,
        )
        .await?;
        return Ok(());
    }
    if let Some(conv) = &args.recall_last {
        let m = recall_last(&api, args.user, &conversation_of(args.user, conv)).await?;
        println!(
            "recalled #{} in {}",
            m["seq"],
            m["conversation_id"].as_str().unwrap_or("")
        );
        return Ok(());
    }
    interactive(args, api, token).await
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

const HELP: &str = "commands: /list  /open TO  /read  /receipts SEQ  /recall  /quit  (anything else is sent to the open conversation)";

async fn interactive(args: ChatArgs, api: Http, token: String) -> Result<(), ClientError> {
    let ws_base = args.server.replacen("http", "ws", 1);
    let (client, mut events) =
        Client::start(ClientConfig::new(ws_base, token, args.device.clone()));
    println!("pigeon chat as {} on {} — {HELP}", args.user, args.server);
    print_list(&api, args.json).await?;
    let mut open: Option<(String, SendTarget)> = None;
    let mut newest_seen: std::collections::HashMap<String, u64> = Default::default();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    loop {
        tokio::select! {
            line = lines.next_line() => {
                let Ok(Some(line)) = line else { break };
                let line = line.trim().to_owned();
                if line.is_empty() {
                    continue;
                }
                let (cmd, rest) = line.split_once(' ').unwrap_or((line.as_str(), ""));
                let result: Result<(), ClientError> = async {
                    match cmd {
                        "/quit" => return Err(ClientError::Transport("quit".into())),
                        "/help" => println!("{HELP}"),
                        "/list" => print_list(&api, args.json).await?,
                        "/open" => {
                            let to = rest.trim();
                            let conv = conversation_of(args.user, to);
                            match print_history(&api, &conv, args.limit, args.json).await {
                                Ok(msgs) => {
                                    if let Some(last) = msgs.last() {
                                        newest_seen.insert(conv.clone(), last.seq);
                                    }
                                }
                                // A single chat exists from its first message on.
                                Err(e) if e.code() == Some("not_found") && to.parse::<u64>().is_ok() => println!("(new chat with {to})"),
                                Err(e) => return Err(e),
                            }
                            open = Some((conv, target(to)?));
                        }
                        "/read" => {
                            let (conv, _) = open.clone().ok_or_else(|| ClientError::Decode("/open a conversation first".into()))?;
                            let seq = newest_seen.get(&conv).copied().unwrap_or(0);
                            let r = api.post(&format!("/v1/conversations/{conv}/read"), &json!({"seq": seq})).await?;
                            println!("read {conv} up to #{}", r["last_read_seq"]);
                        }
                        "/receipts" => {
                            let (conv, _) = open.clone().ok_or_else(|| ClientError::Decode("/open a conversation first".into()))?;
                            let seq: u64 = rest.trim().parse().map_err(|_| ClientError::Decode("/receipts SEQ".into()))?;
                            let r = api.get(&format!("/v1/conversations/{conv}/receipts?seq={seq}")).await?;
                            println!("#{seq} read by {} — not yet by {}", r["read"], r["unread"]);
                        }
                        "/recall" => {
                            let (conv, _) = open.clone().ok_or_else(|| ClientError::Decode("/open a conversation first".into()))?;
                            let m = recall_last(&api, args.user, &conv).await?;
                            println!("recalled #{}", m["seq"]);
                        }
                        _ if cmd.starts_with('/') => println!("unknown command; {HELP}"),
                        _ => {
                            let (_, to) = open.clone().ok_or_else(|| ClientError::Decode("/open a conversation first".into()))?;
                            let ack = client.send(Outgoing::text(to, line.clone())).await?;
                            if !args.json {
                                println!("(sent #{})", ack.seq);
                            }
                        }
                    }
                    Ok(())
                }
                .await;
                match result {
                    Err(ClientError::Transport(t)) if t == "quit" => break,
                    Err(e) => eprintln!("error: {e}"),
                    Ok(()) => {}
                }
            }
            ev = events.recv() => {
                let Some(ev) = ev else { break };
                match ev {
                    Event::Message(m) => {
                        newest_seen.insert(m.conversation_id.clone(), m.seq);
                        show_message(&m, args.json);
                    }
                    Event::Receipt { conversation_id, user_id, last_read_seq } => {
                        if user_id != args.user {
                            println!("[{conversation_id}] {user_id} read up to #{last_read_seq}");
                        }
                    }
                    Event::Typing { conversation_id, user_id } => println!("[{conversation_id}] {user_id} is typing…"),
                    Event::Kicked { reason } => {
                        eprintln!("disconnected by the server: {reason}");
                        break;
                    }
                    Event::State(ConnectionState::Disconnected) => eprintln!("(offline; reconnecting)"),
                    Event::State(_) | Event::Other(_) => {}
                }
            }
        }
    }
    client.shutdown().await;
    Ok(())
}
