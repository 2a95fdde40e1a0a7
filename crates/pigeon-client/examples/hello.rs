//! Sends one message with the reliable client and prints what arrives for a few seconds.
//!
//! ```sh
//! pigeon serve &                     # note the admin key it prints
//! cargo run -p pigeon-client --example hello -- http://127.0.0.1:8080 ADMIN_KEY 111 222 "hello"
//! ```

use pigeon_client::{Client, ClientConfig, Event, Http, Outgoing};
use pigeon_proto::UserId;
use pigeon_proto::views::SendTarget;
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [server, admin_key, me, peer, text] = args.as_slice() else {
        eprintln!("usage: hello SERVER ADMIN_KEY MY_USER_ID PEER_USER_ID TEXT");
        std::process::exit(2);
    };
    let (me, peer): (u64, u64) = (me.parse()?, peer.parse()?);
    // The application's back end registers users and mints their tokens.
    let admin = Http::new(server.clone()).with_bearer(admin_key.clone());
    admin.upsert_user(me, "me").await?;
    admin.upsert_user(peer, "peer").await?;
    let token = admin.mint_token(me, 3600).await?;

    let ws_base = server.replacen("http", "ws", 1);
    let (client, mut events) = Client::start(ClientConfig::new(ws_base, token, "example"));
    let to = SendTarget {
        user: Some(UserId::new(peer)?),
        conversation: None,
    };
    let ack = client.send(Outgoing::text(to, text.clone())).await?;
    println!(
        "stored in {} at seq {} (msg_id {})",
        ack.conversation_id, ack.seq, ack.msg_id
    );

    let deadline = tokio::time::sleep(Duration::from_secs(3));
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => break,
            ev = events.recv() => match ev {
                Some(Event::Message(m)) => println!("[{} #{}] {}: {}", m.conversation_id, m.seq, m.sender, m.content),
                Some(other) => println!("{other:?}"),
                None => break,
            },
        }
    }
    client.shutdown().await;
    Ok(())
}
