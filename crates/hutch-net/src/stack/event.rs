//! What the stack's helper tasks (dials, UDP relays, frames made off its task) hand
//! back to its loop.

use std::net::SocketAddrV4;

/// Results the stack's helper tasks hand back to its loop.
pub(super) enum Event {
    Dialed { key: FlowKey, result: Result<tokio::net::TcpStream, String> },
    Datagram { from: SocketAddrV4, to: SocketAddrV4, payload: Vec<u8> },
    /// A frame the stack wrote for the guest off its own task (an echo's reply, or the
    /// refusal of one the host could not send).
    Frame(Vec<u8>),
}

/// A connection: (guest end, far end).
pub(super) type FlowKey = (SocketAddrV4, SocketAddrV4);
