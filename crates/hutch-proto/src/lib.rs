//! Wire types shared by the hutch host and the in-guest agent.
//!
//! The agent speaks the E2B envd protocol (Connect with the JSON codec), so these types
//! follow proto3's JSON mapping: lowerCamelCase names, oneofs as a single key, bytes as
//! base64, enums by name. This crate owns the shapes and the Connect envelope framing; it
//! must do no I/O.

pub mod access;
pub mod agent;
pub mod b64;
pub mod connect;
pub mod envelope;
pub mod filesystem;
pub mod net;
pub mod process;
pub mod signal;

/// The envd version hutch's agent reports; the E2B SDKs gate features on it (spec §3.8).
pub const ENVD_VERSION: &str = "0.6.4";

/// Name of the virtio-serial port that carries the agent channel.
pub const AGENT_PORT_NAME: &str = "hutch.agent";

/// An error and its causes on one line (`what: why: deeper why`), for logs and for
/// messages that must carry the whole story.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
}
