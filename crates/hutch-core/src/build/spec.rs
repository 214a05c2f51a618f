//! What a build is asked (`BuildSpec`, its base and steps) and how it answers: its log
//! lines, where it failed and why, and what it built.

use hutch_formats::Step;
use hutch_image::template::Template;
use hutch_oci::pull::RegistryOptions;
use hutch_vmm::Accel;
use std::sync::Arc;

/// What a build starts from.
#[derive(Debug, Clone)]
pub enum Base {
    /// An image in a registry.
    Image { reference: String, registry: RegistryOptions },
    /// A template on this machine (built first if it is one of hutch's recipes).
    Template(String),
}

pub struct BuildSpec {
    pub name: String,
    /// The tags the new build gets (checked, normal form); none means `default`, and a
    /// template's first build is also its `default`.
    pub tags: Vec<String>,
    /// The id the template API gave this build (a UUID), kept in its manifest.
    pub api_build: Option<String>,
    /// The vCPUs and memory its sandboxes get (checked by the caller).
    pub shape: hutch_image::template::Shape,
    pub base: Base,
    pub steps: Vec<Step>,
    /// Started when a sandbox of the template starts (before its memory snapshot).
    pub start_cmd: Option<String>,
    /// Must exit 0 before the started sandbox counts as ready.
    pub ready_cmd: Option<String>,
    /// Rebuild everything, the base included.
    pub force: bool,
    /// Dockerfile rules: steps run as the image's user (root when it names none) in its
    /// workdir (`/`), and the template keeps the image's user and workdir unless a step
    /// set them. Otherwise E2B's: steps run as `user` in `/home/user`.
    pub docker_rules: bool,
    /// The builder VM's network (RUN steps download packages).
    pub network: hutch_net::Settings,
    pub net_env: Arc<hutch_net::Environment>,
    pub accel: Accel,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Debug => "debug",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Error => "error",
        }
    }
}

/// Where a build's log lines go (a terminal, or a build record the API serves).
pub trait BuildLog: Send + Sync {
    /// `step`: `base`, the 1-based step number, or `finalize`.
    fn log(&self, level: Level, step: Option<&str>, message: &str);
}

/// Where a build failed, as E2B's `reason.step` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailedAt {
    Base,
    Step(usize),
    Finalize,
}

impl FailedAt {
    pub fn step_name(&self) -> String {
        match self {
            FailedAt::Base => "base".into(),
            FailedAt::Step(n) => n.to_string(),
            FailedAt::Finalize => "finalize".into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct BuildError {
    pub at: FailedAt,
    pub message: String,
    /// The request or its inputs are at fault (a 4xx), not hutch or the host.
    pub caller_fault: bool,
}

impl BuildError {
    pub(crate) fn at(at: FailedAt, caller_fault: bool, message: impl Into<String>) -> BuildError {
        BuildError { at, message: message.into(), caller_fault }
    }
}

pub struct Built {
    pub template: Template,
    pub cached_steps: usize,
    pub built_steps: usize,
}
