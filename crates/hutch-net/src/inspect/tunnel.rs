//! A connection upgrade (a WebSocket) on an inspected flow: the request went through
//! the rule like any other; once the server and then the guest have switched protocols,
//! their bytes are copied both ways until either side ends, as a relayed flow's are.
//! The flow's relay waits for the copy, so it ends with the flow.

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

/// The flow's one upgraded connection, once there is one.
#[derive(Default)]
pub struct Tunnel(parking_lot::Mutex<Option<tokio::task::JoinHandle<()>>>);

impl Drop for Tunnel {
    fn drop(&mut self) {
        if let Some(copy) = self.0.get_mut().take() {
            copy.abort();
        }
    }
}

impl Tunnel {
    /// Starts copying between the two sides once both have upgraded.
    pub fn open(&self, guest: OnUpgrade, server: OnUpgrade) {
        let copy = tokio::spawn(async move {
            let (Ok(guest), Ok(server)) = tokio::join!(guest, server) else { return };
            let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(guest), &mut TokioIo::new(server)).await;
        });
        *self.0.lock() = Some(copy);
    }

    /// Whether the flow has upgraded: its HTTP connections are done, not dead.
    pub fn is_open(&self) -> bool {
        self.0.lock().is_some()
    }

    /// Waits until the upgraded connection ends (at once when there is none). Dropped
    /// while waiting (its flow ended: a kill, a pause), it ends the copy too.
    pub async fn closed(&self) {
        let copy = self.0.lock().take();
        if let Some(copy) = copy {
            let mut copy = AbortOnDrop(copy);
            let _ = (&mut copy.0).await;
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
