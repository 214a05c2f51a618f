//! Instants as hutch stores and shows them: RFC 3339 in UTC with milliseconds
//! (`2026-12-06T02:03:43.123Z`), parsed with any offset a client sends. A stored time
//! that does not parse is an error where it is read, never a made-up instant: a
//! sandbox's end taken as the epoch would have it killed at the reaper's next tick.

use std::fmt;
use std::time::{Duration, SystemTime};

/// One instant, to the millisecond (what it is written with).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(SystemTime);

/// Text that is not an RFC 3339 date-time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{text}' is not an RFC 3339 date-time (like 2026-12-06T02:03:43.123Z)")]
pub struct BadTime {
    pub text: String,
}

/// 9999-12-31T23:59:59Z, in seconds since the epoch: four-digit years end there.
const LAST_SECOND: u64 = 253_402_300_799;

/// `t` to the millisecond: what is written is what is held, so a time read back
/// equals the one that was written.
fn to_millis(t: SystemTime) -> SystemTime {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        Err(_) => SystemTime::UNIX_EPOCH,
    }
}

impl Timestamp {
    pub fn now() -> Timestamp {
        Timestamp::from(SystemTime::now())
    }

    /// RFC 3339 with any offset (`Z`, `+02:00`, `-04:30`) and any fraction.
    pub fn parse(text: &str) -> Result<Timestamp, BadTime> {
        let bad = || BadTime { text: text.to_string() };
        let parsed = chrono::DateTime::parse_from_rfc3339(text.trim()).map_err(|_| bad())?;
        let utc = parsed.with_timezone(&chrono::Utc);
        let nanos = utc.timestamp_nanos_opt().ok_or_else(bad)?;
        let since_epoch = u64::try_from(nanos).map_err(|_| bad())?;
        Ok(Timestamp::from(SystemTime::UNIX_EPOCH + Duration::from_nanos(since_epoch)))
    }

    pub fn system_time(self) -> SystemTime {
        self.0
    }

    /// `self + d`, or the last instant RFC 3339 can write (9999-12-31T23:59:59Z) if that
    /// is later or overflows.
    pub fn after(self, d: Duration) -> Timestamp {
        let last = SystemTime::UNIX_EPOCH + Duration::from_secs(LAST_SECOND);
        Timestamp::from(self.0.checked_add(d).map_or(last, |t| t.min(last)))
    }
}

impl From<SystemTime> for Timestamp {
    fn from(t: SystemTime) -> Timestamp {
        Timestamp(to_millis(t))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_rfc3339_millis(self.0))
    }
}

/// As JSON: the text form.
impl serde::Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_as_utc_millis_and_read_back_with_any_offset() {
        let utc = Timestamp::parse("2025-06-01T12:00:00.123Z").expect("utc");
        assert_eq!(utc.to_string(), "2025-06-01T12:00:00.123Z");
        assert_eq!(Timestamp::parse("2025-06-01T14:00:00.123000+02:00"), Ok(utc));
        assert_eq!(Timestamp::parse("2025-06-01T07:30:00.123-04:30"), Ok(utc));
        assert_eq!(Timestamp::parse(&utc.to_string()), Ok(utc));
    }

    #[test]
    fn a_time_far_ahead_stops_at_the_last_one_rfc_3339_writes() {
        let now = Timestamp::now();
        assert_eq!(now.after(Duration::MAX).to_string(), "9999-12-31T23:59:59.000Z");
        assert!(now.after(Duration::from_secs(60)) > now);
    }

    #[test]
    fn a_malformed_time_is_an_error_not_the_epoch() {
        for bad in ["", "yesterday", "2025-06-01", "2025-13-01T00:00:00Z", "1969-12-31T23:59:59Z"] {
            let e = Timestamp::parse(bad).expect_err(bad);
            assert!(e.to_string().contains("RFC 3339"), "{e}");
        }
    }
}
