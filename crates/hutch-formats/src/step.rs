//! A template build's steps, as E2B's template API and Dockerfiles name them: what
//! `dockerfile::plan` makes and hutch-core's builder runs.

use crate::context::CopyFiles;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
pub enum StepKind {
    Env(Vec<(String, String)>),
    /// Sets the directory later steps run in (created, owned by the current user).
    Workdir(String),
    User(String),
    /// A shell command; `user` overrides the current user for this step only;
    /// `build_args` are in its environment but not the template's (Dockerfile `ARG`).
    Run { cmd: String, user: Option<String>, build_args: BTreeMap<String, String> },
    /// Files from the build context; `owner` defaults to the current user.
    Copy { files: CopyFiles, dest: String, owner: Option<String>, mode: Option<String> },
    /// A Dockerfile's `ENTRYPOINT`/`CMD` (None: unchanged).
    Command { entrypoint: Option<Vec<String>>, cmd: Option<Vec<String>> },
}

#[derive(Debug, Clone)]
pub struct Step {
    pub kind: StepKind,
    /// Rebuild this step (and so every later one) even when cached.
    pub force: bool,
    /// How the step is shown in the log (`RUN make`).
    pub text: String,
}

/// Words as one POSIX shell command line, each quoted where it needs it.
pub fn shell_join<'a>(words: impl Iterator<Item = &'a String>) -> String {
    words
        .map(|w| {
            if !w.is_empty() && w.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:@%+,".contains(&b)) {
                w.clone()
            } else {
                format!("'{}'", w.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
