//! The Pigeon server: configuration, the write pipeline, the push hub, and the HTTP and
//! WebSocket edges. Only this crate knows HTTP, WebSocket and the wire encodings; below it
//! the domain and the stores see commands and rows.

pub mod api;
pub mod app;
pub mod auth;
pub mod config;
pub mod error;
pub mod hub;
pub mod limits;
pub mod open_files;
pub mod openapi;
pub mod outbox;
pub mod pipeline;
pub mod protobuf;
pub mod rooms;
pub mod serve;
pub mod server;
pub mod webhook;
pub mod ws;

pub use config::{Config, ServeArgs};
pub use server::{Running, start, start_with_store};
