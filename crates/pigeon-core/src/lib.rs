//! Pigeon's domain: the rules of conversations, `seq`, inboxes and fan-out, and the ports
//! (traits) that storage adapters implement. Nothing here does I/O: the engine is a state
//! machine fed with commands and loaded state, in two stages (the conversation stage, which
//! owns `seq`, hands each message to the user stage, which owns `user_seq`), and it answers
//! with the rows to commit and the events to publish once they are durable.

pub mod changes;
pub mod command;
pub mod conversation_stage;
pub mod engine;
pub mod error;
pub mod handoff;
pub mod known_keys;
pub mod node;
pub mod presence;
pub mod rate_limit;
pub mod revocation;
#[cfg(any(test, feature = "port-suites"))]
pub mod rigged_store;
pub mod routing;
pub mod rules;
pub mod snowflake;
pub mod state;
pub mod store;
#[cfg(any(test, feature = "port-suites"))]
pub mod store_suite;
pub mod until_committed;
pub mod user_stage;

pub use changes::{Changes, Event};
pub use command::{Command, Reply};
pub use engine::{Engine, EngineConfig};
pub use error::DomainError;
pub use store::{Store, StoreError};
