//! `process.Process` messages (envd `process.proto`) in proto3 JSON form.

use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessConfig {
    pub cmd: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub envs: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    #[serde(default)]
    pub cols: u32,
    #[serde(default)]
    pub rows: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pty {
    #[serde(default)]
    pub size: PtySize,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartRequest {
    pub process: ProcessConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<Pty>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessSelector {
    Pid(u32),
    Tag(String),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConnectRequest {
    pub process: ProcessSelector,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessInput {
    #[serde(with = "crate::b64")]
    Stdin(Bytes),
    #[serde(with = "crate::b64")]
    Pty(Bytes),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SendInputRequest {
    pub process: ProcessSelector,
    pub input: ProcessInput,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CloseStdinRequest {
    pub process: ProcessSelector,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UpdateRequest {
    pub process: ProcessSelector,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<Pty>,
}

/// `StreamInputRequest`: the first message selects the process, then data and keepalives.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StreamInputRequest {
    Start { process: ProcessSelector },
    Data { input: ProcessInput },
    Keepalive {},
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Signal {
    #[serde(rename = "SIGNAL_UNSPECIFIED")]
    Unspecified,
    #[serde(rename = "SIGNAL_SIGTERM")]
    Term,
    #[serde(rename = "SIGNAL_SIGKILL")]
    Kill,
}

impl Signal {
    pub fn number(self) -> Option<i32> {
        match self {
            Signal::Unspecified => None,
            Signal::Term => Some(15),
            Signal::Kill => Some(9),
        }
    }
}

/// Enums arrive by name or by number; unknown names become the default (proto3 JSON).
impl<'de> Deserialize<'de> for Signal {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = serde_json::Value::deserialize(d)?;
        Ok(match (v.as_str(), v.as_i64()) {
            (Some("SIGNAL_SIGTERM"), _) | (_, Some(15)) => Signal::Term,
            (Some("SIGNAL_SIGKILL"), _) | (_, Some(9)) => Signal::Kill,
            _ => Signal::Unspecified,
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SendSignalRequest {
    pub process: ProcessSelector,
    #[serde(default = "unspecified")]
    pub signal: Signal,
}

fn unspecified() -> Signal {
    Signal::Unspecified
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum DataEvent {
    #[serde(with = "crate::b64")]
    Stdout(Bytes),
    #[serde(with = "crate::b64")]
    Stderr(Bytes),
    #[serde(with = "crate::b64")]
    Pty(Bytes),
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    #[serde(default)]
    pub exit_code: i32,
    #[serde(default)]
    pub exited: bool,
    #[serde(default)]
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl EndEvent {
    /// The signal that killed the process, if it died by one.
    pub fn signal(&self) -> Option<i32> {
        if self.exited {
            None
        } else {
            crate::signal::signal_of_status(&self.status)
        }
    }

    /// Shell convention: the exit code, or 128 + N for death by signal N.
    pub fn shell_code(&self) -> i32 {
        match self.signal() {
            Some(sig) => 128 + sig,
            None if self.exited => self.exit_code,
            None => 255,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessEvent {
    Start { pid: u32 },
    Data(DataEvent),
    End(EndEvent),
    Keepalive {},
}

/// `StartResponse` and `ConnectResponse` share this shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventResponse {
    pub event: ProcessEvent,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessInfo {
    pub config: ProcessConfig,
    pub pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ListResponse {
    #[serde(default)]
    pub processes: Vec<ProcessInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_sdk_wire_format() {
        let req: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","env"],"envs":{"A":"1"},"cwd":"/tmp"},"stdin":false}"#,
        )
        .expect("parse");
        assert_eq!(req.process.args, ["-l", "-c", "env"]);
        assert_eq!(req.stdin, Some(false));

        let ev = EventResponse { event: ProcessEvent::Data(DataEvent::Stdout(Bytes::from_static(b"hi\n"))) };
        assert_eq!(serde_json::to_string(&ev).expect("ser"), r#"{"event":{"data":{"stdout":"aGkK"}}}"#);
        let ev = EventResponse { event: ProcessEvent::Start { pid: 4242 } };
        assert_eq!(serde_json::to_string(&ev).expect("ser"), r#"{"event":{"start":{"pid":4242}}}"#);

        let sig: SendSignalRequest =
            serde_json::from_str(r#"{"process":{"pid":4242},"signal":"SIGNAL_SIGKILL"}"#).expect("parse");
        assert_eq!(sig.signal, Signal::Kill);
        let input: SendInputRequest =
            serde_json::from_str(r#"{"process":{"pid":1},"input":{"stdin":"ZGF0YQo"}}"#).expect("parse");
        assert_eq!(input.input, ProcessInput::Stdin(Bytes::from_static(b"data\n")));
        let end: EventResponse = serde_json::from_str(r#"{"event":{"end":{"exited":true}}}"#).expect("parse");
        assert_eq!(end.event, ProcessEvent::End(EndEvent { exited: true, ..Default::default() }));
    }

    #[test]
    fn shell_codes() {
        let killed = EndEvent { exit_code: -1, exited: false, status: "signal: killed".into(), error: None };
        assert_eq!(killed.shell_code(), 137);
        let seven = EndEvent { exit_code: 7, exited: true, status: "exit status 7".into(), error: None };
        assert_eq!(seven.shell_code(), 7);
    }
}
