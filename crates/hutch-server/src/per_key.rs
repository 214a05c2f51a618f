//! A cap on the REST requests one API key has in flight, so one tenant cannot take
//! every slot of the server (its creates, exports and imports queue on the same VMs
//! and disk as everyone's).

use crate::error::ApiError;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// In-flight REST requests per key at most.
pub const MAX_IN_FLIGHT_PER_KEY: usize = 32;

#[derive(Clone, Default)]
pub struct InFlight(Arc<Mutex<HashMap<String, usize>>>);

/// Counts one request of a key until dropped.
struct Ticket {
    table: InFlight,
    key: String,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut table = self.table.0.lock();
        if let Some(n) = table.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                table.remove(&self.key);
            }
        }
    }
}

impl InFlight {
    fn enter(&self, key: &str, max: usize) -> Option<Ticket> {
        let mut table = self.0.lock();
        let n = table.entry(key.to_string()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Ticket { table: self.clone(), key: key.to_string() })
    }
}

pub async fn limit(table: InFlight, req: Request, next: Next) -> Response {
    // Requests without a key are refused by authentication and hold nothing for long.
    let Some(key) = req.headers().get("x-api-key").and_then(|v| v.to_str().ok()).map(str::to_string) else {
        return next.run(req).await;
    };
    let Some(ticket) = table.enter(&key, MAX_IN_FLIGHT_PER_KEY) else {
        return ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("this API key already has {MAX_IN_FLIGHT_PER_KEY} requests in flight; wait for some to finish"),
        )
        .into_response();
    };
    let resp = next.run(req).await;
    drop(ticket);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_gets_its_slots_back_and_others_are_not_affected() {
        let t = InFlight::default();
        let held: Vec<_> = (0..3).map(|_| t.enter("a", 3).expect("under the cap")).collect();
        assert!(t.enter("a", 3).is_none());
        assert!(t.enter("b", 3).is_some());
        drop(held);
        assert!(t.enter("a", 3).is_some());
        assert!(t.0.lock().is_empty());
    }
}
