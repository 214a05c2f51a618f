//! Templates from images for a hutch that is not root, as rootless Podman and Buildah do
//! it: hutch runs itself again (with `HELPER` as its first argument) under `unshare`, in a
//! user namespace where this user is root and 1-65535 are its subordinate ids (the same
//! shape the unprivileged recipe build uses). There the layers keep their owners, modes
//! and setuid bits, and `mkfs.ext4 -d` reads them back as the guest needs them. Device
//! nodes cannot be made in a user namespace; they are skipped (the guest's /dev is a
//! devtmpfs). Owners above 65535 cannot be mapped and fail the build with what to do.
//!
//! The helper reads its request from a file in the work directory (mode 0600: the
//! image's Env may hold secrets, and a command line is anyone's to read and has a size
//! limit), reports progress on stderr as `step`/`detail`/`done` lines, which the parent
//! turns back into its own progress, and writes its outcome to another file there, so
//! a failure keeps its sentence and whether the image was at fault. It dies with the
//! thread that started it (`PR_SET_PDEATHSIG`); what a killed helper leaves of the tree
//! belongs to subordinate ids, which `remove_tree` removes through the namespace.

use crate::file_error::at;
use crate::image_tree::{make_image_here, FromImageError, ImageJob};
use crate::rootfs::BuildMode;
use crate::run::run;
use crate::Progress;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The first argument that makes `hutch` the namespace's helper (see the CLI's `main`).
pub const HELPER: &str = "__hutch-make-image-in-namespace";

/// The helper's request and outcome, in the work directory.
const REQUEST: &str = "request.json";
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
    // This process's own program, even if its file was replaced since it started
    // (`current_exe` would name the new file, or a deleted path): opened here, handed to
    // the child as EXE_FD and executed through it. (`/proc/<this pid>/exe` cannot be
    // executed from the namespace: it may not look into a process outside it.)
    let own = std::fs::File::open("/proc/self/exe").map_err(at("opening hutch's own program at", Path::new("/proc/self/exe")))?;
    let exe = PathBuf::from(format!("/proc/self/fd/{EXE_FD}"));
    let (request_file, outcome_file) = (job.work.join(REQUEST), job.work.join(OUTCOME));
    let request = serde_json::to_vec(job).map_err(std::io::Error::other).map_err(at("writing", &request_file))?;
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&request_file).map_err(at("writing", &request_file))?;
        file.write_all(&request).map_err(at("writing", &request_file))?;
    }
    let mut cmd = mode.unshare();
    cmd.arg("--").arg(&exe).arg(HELPER).arg(&request_file);
    prepare_child(&mut cmd, own);
    let ran = run(cmd, None, &Relay(progress));
    let _ = std::fs::remove_file(&request_file);
    // The tree's files belong to subordinate ids: only the namespace can remove what a
    // helper that died left of it.
    let tree = job.tree();
    if std::fs::symlink_metadata(&tree).is_ok() {
        mode.remove(&tree);
    }
    ran.map_err(crate::template::TemplateError::from)?;
    let text = match std::fs::read(&outcome_file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(FromImageError::InNamespace { message: "hutch's unprivileged unpacker (this program, run again) wrote no outcome; is this hutch's own binary?".into(), image: false });
        }
        Err(e) => return Err(at("reading", &outcome_file)(e).into()),
    };
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

/// The descriptor the child finds hutch's program at.
const EXE_FD: i32 = 200;

/// In the child, before exec: hutch's program at `EXE_FD` (not closed on exec), and
/// SIGKILL when the thread that spawned it ends (hutch killed, a cancelled build's
/// thread gone), instead of unpacking on for nobody.
#[allow(unsafe_code)]
fn prepare_child(cmd: &mut std::process::Command, exe: std::fs::File) {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only calls dup2(2) and
    // prctl(2), both async-signal-safe; it allocates nothing and takes no lock. `exe`
    // moves into the closure, so its descriptor is open whenever the closure runs.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::dup2(exe.as_raw_fd(), EXE_FD)?;
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
            Ok(())
        });
    }
}

/// Removes a directory tree, through the build namespace when plain removal is refused
/// (a tree a killed helper left, whose files belong to subordinate ids).
pub fn remove_tree(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => match BuildMode::for_this_user() {
            Ok(mode @ BuildMode::Unshare { .. }) => {
                mode.remove(dir);
                if std::fs::symlink_metadata(dir).is_ok() {
                    Err(e)
                } else {
                    Ok(())
                }
            }
            _ => Err(e),
        },
        other => other,
    }
}

/// The helper's body: `args` are what followed `HELPER`. Returns the exit code: 0 once
/// the outcome is written (success or not), else 1.
pub fn helper_main(args: &[String]) -> i32 {
    let job = args.first().and_then(|path| std::fs::read(path).ok()).and_then(|bytes| serde_json::from_slice::<ImageJob>(&bytes).ok());
    let Some(job) = job else {
        eprintln!("hutch: {HELPER} is hutch's own helper for unprivileged image builds and takes a request only hutch writes");
        return 1;
    };
    let outcome = match make_image_here(&job, &Lines) {
        Ok(image) => Outcome { image: Some(image), error: None, image_fault: false },
        Err(e) => {
            let _ = std::fs::remove_dir_all(job.tree());
            let mut message = hutch_proto::error_chain(&e);
            if matches!(e, FromImageError::Unpack(_)) && (message.contains("Invalid argument") || message.contains("Operation not permitted")) {
                message.push_str(" (without root, files owned by ids above 65535 and trusted.* or security.* xattrs other than file capabilities cannot be made; build it as root)");
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
        let dir = tempfile::tempdir().expect("tempdir");
        let bad = dir.path().join("request.json");
        std::fs::write(&bad, "not json").expect("write");
        assert_eq!(helper_main(&[bad.display().to_string()]), 1);
        assert_eq!(helper_main(&[dir.path().join("missing").display().to_string()]), 1);
        assert_eq!(helper_main(&[]), 1);
    }
}
