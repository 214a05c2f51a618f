//! Templates from images for a hutch that is not root, as rootless Podman and Buildah do
//! it: hutch runs itself again (with `HELPER` as its first argument) under `unshare`, in a
//! user namespace where this user is root and 1-65535 are its subordinate ids (the same
//! shape the unprivileged recipe build uses). There the layers keep their owners, modes
//! and setuid bits, and `mkfs.ext4 -d` reads them back as the guest needs them. Device
//! nodes cannot be made in a user namespace; they are skipped (the guest's /dev is a
//! devtmpfs). Owners above 65535 cannot be mapped and fail the build with what to do.
//!
//! The helper reports progress on stderr as `step`/`detail`/`done` lines, which the
//! parent turns back into its own progress, and its outcome in a file in the work
//! directory, so a failure keeps its sentence and whether the image was at fault.

use crate::file_error::at;
use crate::from_image::{make_image_here, FromImageError, ImageJob};
use crate::rootfs::BuildMode;
use crate::run::run;
use crate::Progress;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The first argument that makes `hutch` the namespace's helper (see the CLI's `main`).
pub const HELPER: &str = "__hutch-make-image-in-namespace";

/// The helper's outcome, in the work directory.
const OUTCOME: &str = "outcome.json";

#[derive(Debug, Serialize, Deserialize)]
struct Outcome {
    image: Option<PathBuf>,
    error: Option<String>,
    /// The image's own contents failed (too large, a bad layer), not the host.
    image_fault: bool,
}

/// `make_image` for a hutch that is not root: the helper does the work in the namespace.
pub(crate) fn make_image(mode: &BuildMode, job: &ImageJob, progress: &dyn Progress) -> Result<PathBuf, FromImageError> {
    let exe = std::env::current_exe().map_err(at("finding hutch's own program at", Path::new("/proc/self/exe")))?;
    let outcome_file = job.work.join(OUTCOME);
    let request = serde_json::to_string(job).map_err(std::io::Error::other).map_err(at("writing the request in", &job.work))?;
    let mut cmd = mode.unshare();
    cmd.arg("--").arg(&exe).arg(HELPER).arg(request);
    let ran = run(cmd, None, &Relay(progress));
    // The tree's files belong to subordinate ids: only the namespace can remove what a
    // helper that died left of it.
    let tree = job.tree();
    if std::fs::symlink_metadata(&tree).is_ok() {
        mode.remove(&tree);
    }
    ran.map_err(crate::rootfs::TemplateError::from)?;
    let text = std::fs::read(&outcome_file).map_err(at("reading the unprivileged unpack's outcome", &outcome_file))?;
    let _ = std::fs::remove_file(&outcome_file);
    let outcome: Outcome = serde_json::from_slice(&text).map_err(std::io::Error::other).map_err(at("reading", &outcome_file))?;
    match (outcome.image, outcome.error) {
        (Some(image), None) => Ok(image),
        (_, error) => Err(FromImageError::InNamespace {
            message: error.unwrap_or_else(|| "the unprivileged unpack reported neither an image nor an error".into()),
            image: outcome.image_fault,
        }),
    }
}

/// The helper's body: `args` are what followed `HELPER`. Returns the exit code: 0 once
/// the outcome is written (success or not), else 1.
pub fn helper_main(args: &[String]) -> i32 {
    let Some(job) = args.first().and_then(|a| serde_json::from_str::<ImageJob>(a).ok()) else {
        eprintln!("hutch: {HELPER} is hutch's own helper for unprivileged image builds and takes a request only hutch writes");
        return 1;
    };
    let outcome = match make_image_here(&job, &Lines) {
        Ok(image) => Outcome { image: Some(image), error: None, image_fault: false },
        Err(e) => {
            let _ = std::fs::remove_dir_all(job.tree());
            let mut message = hutch_proto::error_chain(&e);
            if message.contains("Invalid argument") && matches!(e, FromImageError::Unpack(_)) {
                message.push_str(" (a file owned by an id above 65535, which a build without root cannot map; build it as root)");
            }
            Outcome { image: None, error: Some(message), image_fault: e.is_the_images() }
        }
    };
    let path = job.work.join(OUTCOME);
    match serde_json::to_vec(&outcome).map_err(std::io::Error::other).and_then(|bytes| std::fs::write(&path, bytes)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("hutch: writing {}: {e}", path.display());
            1
        }
    }
}

/// The helper's progress, as lines on stderr.
struct Lines;

impl Progress for Lines {
    fn step(&self, what: &str) {
        eprintln!("step\t{what}");
    }
    fn detail(&self, line: &str) {
        eprintln!("detail\t{line}");
    }
    fn done(&self, summary: &str, took: Duration) {
        eprintln!("done\t{}\t{summary}", took.as_millis());
    }
}

/// The helper's lines back as the parent's progress; any other line (unshare's own) is
/// a detail.
struct Relay<'a>(&'a dyn Progress);

impl Progress for Relay<'_> {
    fn step(&self, what: &str) {
        self.0.step(what);
    }
    fn detail(&self, line: &str) {
        match line.split_once('\t') {
            Some(("step", what)) => self.0.step(what),
            Some(("detail", text)) => self.0.detail(text),
            Some(("done", rest)) => {
                let (ms, summary) = rest.split_once('\t').unwrap_or(("0", rest));
                self.0.done(summary, Duration::from_millis(ms.parse().unwrap_or(0)));
            }
            _ => self.0.detail(line),
        }
    }
    fn done(&self, summary: &str, took: Duration) {
        self.0.done(summary, took);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Record(Mutex<Vec<String>>);

    impl Progress for Record {
        fn step(&self, what: &str) {
            self.0.lock().expect("lock").push(format!("step {what}"));
        }
        fn detail(&self, line: &str) {
            self.0.lock().expect("lock").push(format!("detail {line}"));
        }
        fn done(&self, summary: &str, took: Duration) {
            self.0.lock().expect("lock").push(format!("done {summary} {}", took.as_millis()));
        }
    }

    #[test]
    fn the_helpers_lines_become_the_parents_progress() {
        let record = Record::default();
        let relay = Relay(&record);
        for line in ["step\tunpacking 2 layer(s) of x", "detail\tabc: 3 entries\twith a tab", "done\t1500\t4 KiB unpacked", "unshare: oops"] {
            relay.detail(line);
        }
        assert_eq!(
            *record.0.lock().expect("lock"),
            ["step unpacking 2 layer(s) of x", "detail abc: 3 entries\twith a tab", "done 4 KiB unpacked 1500", "detail unshare: oops"]
        );
    }

    #[test]
    fn a_request_only_hutch_writes_is_taken() {
        assert_eq!(helper_main(&["not json".into()]), 1);
        assert_eq!(helper_main(&[]), 1);
    }
}
