//! The jail for a hutch that is not root, as rootless Podman does it: each QEMU gets a
//! user namespace of its own in which hutch's user is root (so the mounts of
//! `jail.rs` can be made) and uid/gid 1 is one id of the user's `/etc/subuid` and
//! `/etc/subgid` ranges, which QEMU then switches to. On the host QEMU thus runs as an
//! id nobody else uses: it cannot signal, ptrace or read hutch or another VM, and it
//! holds no capability outside its namespace.
//!
//! Only setuid `newuidmap`/`newgidmap` (package `uidmap`) may map ids other than the
//! user's own, and they act on a running process: the child is cloned into its
//! namespace (with a PID namespace it owns, `spawn.rs`) and waits; hutch maps it by
//! its host pid and then says go.
//!
//! Each VM leases one id (a slot of the range) for its life with an flock on a file in
//! the user's `~/.cache/hutch/id-slots`, so every hutch process of that user, whatever
//! its `$HUTCH_HOME`, sees the same leases, and a dead hutch's leases end with it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// newuidmap and newgidmap are local and quick; this only guards against a wedged one.
const MAP_WAIT: Duration = Duration::from_secs(10);

/// Why this user's VMs cannot be jailed without root.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Unavailable {
    #[error("{table} has no range for {user}; add one (usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {user}) so hutch can give each VM an id of its own")]
    NoRange { table: &'static str, user: String },
    #[error("{tool} is missing; install the uidmap package so hutch can give each VM an id of its own")]
    NoTool { tool: &'static str },
}

/// A range of subordinate ids: the first and how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub start: u32,
    pub count: u32,
}

/// The ids a user may hand its VMs, and the tools that map them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubIds {
    pub uid: u32,
    pub gid: u32,
    pub uids: Range,
    pub gids: Range,
    newuidmap: PathBuf,
    newgidmap: PathBuf,
    /// Where the leases live (the user's own cache).
    slots: PathBuf,
}

/// The first range of `/etc/subuid`-style `table` for the user named `name` or with id `id`.
fn range_in(table: &str, name: &str, id: u32) -> Option<Range> {
    table.lines().find_map(|line| {
        let mut parts = line.trim().split(':');
        let (owner, start, count) = (parts.next()?, parts.next()?, parts.next()?);
        if owner != name && owner.parse::<u32>().ok() != Some(id) {
            return None;
        }
        let range = Range { start: start.parse().ok()?, count: count.parse().ok()? };
        (range.count >= 1).then_some(range)
    })
}

impl SubIds {
    /// The current user's ranges, if it has them and the tools are installed.
    pub fn of_current_user() -> Result<SubIds, Unavailable> {
        let uid = nix::unistd::getuid();
        let user = nix::unistd::User::from_uid(uid).ok().flatten();
        let name = user.as_ref().map(|u| u.name.clone()).unwrap_or_else(|| uid.to_string());
        let lookup = |table: &'static str| {
            let text = std::fs::read_to_string(table).unwrap_or_default();
            range_in(&text, &name, uid.as_raw()).ok_or_else(|| Unavailable::NoRange { table, user: name.clone() })
        };
        let (uids, gids) = (lookup("/etc/subuid")?, lookup("/etc/subgid")?);
        let tool = |tool: &'static str| crate::process::find_program(tool).filter(|p| p.is_file()).ok_or(Unavailable::NoTool { tool });
        let home = user.map(|u| u.dir).unwrap_or_else(std::env::temp_dir);
        Ok(SubIds {
            uid: uid.as_raw(),
            gid: nix::unistd::getgid().as_raw(),
            uids,
            gids,
            newuidmap: tool("newuidmap")?,
            newgidmap: tool("newgidmap")?,
            slots: home.join(".cache/hutch/id-slots"),
        })
    }

    fn slot_count(&self) -> u32 {
        self.uids.count.min(self.gids.count)
    }

    /// The host uid of the VM holding `slot`.
    pub fn host_uid(&self, slot: u32) -> u32 {
        self.uids.start + slot
    }

    /// Leases a slot no live VM of this user holds.
    pub fn lease(&self) -> std::io::Result<Lease> {
        let count = self.slot_count();
        // Start somewhere different in every process so two rarely probe the same files.
        let first = std::process::id() % count;
        for n in 0..count {
            if let Some(lease) = self.try_lease((first + n) % count)? {
                return Ok(lease);
            }
        }
        Err(std::io::Error::other(format!("all {count} ids of this user's /etc/subuid range are held by running VMs")))
    }

    /// Leases the slot of host uid `uid` again: a VM adopted from an earlier hutch
    /// runs as it, and its lease went with that hutch.
    pub fn lease_uid(&self, uid: u32) -> std::io::Result<Lease> {
        let slot = uid.checked_sub(self.uids.start).filter(|s| *s < self.slot_count());
        let slot = slot.ok_or_else(|| std::io::Error::other(format!("uid {uid} is not in this user's /etc/subuid range")))?;
        self.try_lease(slot)?.ok_or_else(|| std::io::Error::other(format!("the id slot {slot} of uid {uid} is held by another VM")))
    }

    /// The slot's lease, or None while another holds it.
    fn try_lease(&self, slot: u32) -> std::io::Result<Option<Lease>> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&self.slots)?;
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(self.slots.join(slot.to_string()))?;
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(Some(Lease { _lock: lock, slot })),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, e)) => Err(e.into()),
        }
    }
}

/// One slot of the range, held (by an flock) while its VM runs.
#[derive(Debug)]
pub struct Lease {
    _lock: nix::fcntl::Flock<File>,
    pub slot: u32,
}

/// Maps one child's user namespace: hutch's user is root in it, the leased id is 1.
pub struct Mapping {
    ids: SubIds,
    slot: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("mapping the VM's ids with {tool}: {detail}")]
    Tool { tool: String, detail: String },
}

impl Mapping {
    pub fn new(ids: &SubIds, lease: &Lease) -> Mapping {
        Mapping { ids: ids.clone(), slot: lease.slot }
    }

    /// Maps the namespace of the child `pid` (its host pid), which was cloned into it
    /// and waits for hutch's word before it does anything that needs ids.
    pub fn map(&self, pid: u32) -> Result<(), MapError> {
        let pid = pid.to_string();
        let (uid, gid) = (self.ids.uid.to_string(), self.ids.gid.to_string());
        let (sub_uid, sub_gid) = ((self.ids.uids.start + self.slot).to_string(), (self.ids.gids.start + self.slot).to_string());
        run(&self.ids.newuidmap, &[&pid, "0", &uid, "1", "1", &sub_uid, "1"])?;
        run(&self.ids.newgidmap, &[&pid, "0", &gid, "1", "1", &sub_gid, "1"])
    }
}

fn run(tool: &Path, args: &[&str]) -> Result<(), MapError> {
    let fail = |detail: String| MapError::Tool { tool: tool.display().to_string(), detail };
    let out = crate::process::output_within(std::process::Command::new(tool).args(args), MAP_WAIT).map_err(|e| fail(e.to_string()))?;
    if out.status.success() {
        return Ok(());
    }
    Err(fail(format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_users_range_by_name_or_id() {
        let table = "tester:100000:65536\n1002:165536:65536\nbad:line\n";
        assert_eq!(range_in(table, "tester", 1001), Some(Range { start: 100000, count: 65536 }));
        assert_eq!(range_in(table, "other", 1002), Some(Range { start: 165536, count: 65536 }));
        assert_eq!(range_in(table, "nobody", 1003), None);
        assert_eq!(range_in("zero:1:0\n", "zero", 5), None);
    }

    #[test]
    fn leases_are_exclusive_until_dropped() {
        let tmp = tempfile::tempdir().expect("lease test");
        let ids = SubIds {
            uid: 1,
            gid: 1,
            uids: Range { start: 100, count: 2 },
            gids: Range { start: 200, count: 3 },
            newuidmap: "/x".into(),
            newgidmap: "/x".into(),
            slots: tmp.path().join("slots"),
        };
        let a = ids.lease().expect("lease test");
        let b = ids.lease().expect("lease test");
        assert_ne!(a.slot, b.slot);
        assert!(ids.lease().is_err(), "only two slots (the smaller range)");
        let freed = a.slot;
        drop(a);
        assert_eq!(ids.lease().expect("lease test").slot, freed);
    }
}
