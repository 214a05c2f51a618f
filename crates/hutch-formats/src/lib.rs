//! What hutch reads from bytes its users send, before anything runs: Dockerfiles (with
//! heredocs) and their build contexts, planned as template build steps, the COPY files
//! the template build API uploads, and portable snapshot archives. A crate of its own, on a few small dependencies, so the fuzz
//! targets (`fuzz/`) build what they exercise without the server, the database and the
//! registry client around it.
//!
//! Must not know about sandboxes, VMs or the server: hutch-core runs what it plans.

pub mod archive;
pub mod budget;
pub mod context;
pub mod dockerfile;
mod run_heredoc;
mod step;
pub mod upload;

pub use step::{shell_join, Step, StepKind};
