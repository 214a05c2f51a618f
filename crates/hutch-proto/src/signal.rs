//! Exit statuses in the words of Go's `os.ProcessState.String()`, which envd reports
//! ("exit status 3", "signal: killed") and the E2B SDKs show to users.

const NAMES: &[(i32, &str)] = &[
    (1, "hangup"),
    (2, "interrupt"),
    (3, "quit"),
    (4, "illegal instruction"),
    (5, "trace/breakpoint trap"),
    (6, "aborted"),
    (7, "bus error"),
    (8, "floating point exception"),
    (9, "killed"),
    (10, "user defined signal 1"),
    (11, "segmentation fault"),
    (12, "user defined signal 2"),
    (13, "broken pipe"),
    (14, "alarm clock"),
    (15, "terminated"),
];

pub fn status_for_exit(code: i32) -> String {
    format!("exit status {code}")
}

pub fn status_for_signal(signal: i32) -> String {
    match NAMES.iter().find(|(n, _)| *n == signal) {
        Some((_, name)) => format!("signal: {name}"),
        None => format!("signal: signal {signal}"),
    }
}

/// The signal number a status string names, if the process died by a signal.
pub fn signal_of_status(status: &str) -> Option<i32> {
    let name = status.strip_prefix("signal: ")?;
    if let Some(n) = name.strip_prefix("signal ") {
        return n.parse().ok();
    }
    NAMES.iter().find(|(_, s)| *s == name).map(|(n, _)| *n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_round_trip() {
        for sig in 1..=40 {
            assert_eq!(signal_of_status(&status_for_signal(sig)), Some(sig));
        }
        assert_eq!(status_for_signal(9), "signal: killed");
        assert_eq!(signal_of_status(&status_for_exit(3)), None);
    }
}
