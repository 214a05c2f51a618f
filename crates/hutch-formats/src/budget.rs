//! What a template build's COPY files may take of the host's disk: two allowances of
//! bytes, drawn before the bytes are written (one for each write — an upload's
//! unpacked files, a COPY's tar — and one for the whole build), and a reserve of free
//! space that must remain on the filesystem written to, for every tenant's VMs.

use std::path::{Path, PathBuf};

/// Free space is asked for this much at a time, so a stream of small writes costs one
/// `statvfs` per 64 MiB (and may dip into the reserve by no more than what other
/// writers take in between).
const CHECK_EVERY: u64 = 64 << 20;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BudgetError {
    #[error("the COPY's files come to more than {} MiB, the most one COPY may hold; copy fewer or smaller files in each step", .limit >> 20)]
    Write { limit: u64 },
    #[error("the build's COPY files come to more than {} MiB, the most one template build may write; copy fewer or smaller files", .limit >> 20)]
    Build { limit: u64 },
    /// The numbers are the operator's: the tenant who reads the build log is told only
    /// that the server is short.
    #[error("the server is short of disk, too little for the COPY's files; try again later")]
    NoSpace { free: u64, reserve: u64 },
}

/// A build's allowance for its COPY files. Every byte is taken before it is written.
#[derive(Debug)]
pub struct Budget {
    /// Where the bytes go (its filesystem is the one checked); None: no check.
    dir: Option<PathBuf>,
    reserve: u64,
    build_limit: u64,
    build_used: u64,
    write_limit: u64,
    write_used: u64,
    /// Bytes already found to fit above the reserve, not yet taken.
    covered: u64,
}

impl Budget {
    /// A build's budget: `limit` bytes in all, written under `dir`, leaving `reserve`
    /// bytes free on its filesystem.
    pub fn new(dir: &Path, limit: u64, reserve: u64) -> Budget {
        Budget { dir: Some(dir.to_path_buf()), reserve, build_limit: limit, build_used: 0, write_limit: limit, write_used: 0, covered: 0 }
    }

    /// No limit and no free-space check: the operator's own files (`hutch build`).
    pub fn unlimited() -> Budget {
        Budget { dir: None, reserve: 0, build_limit: u64::MAX, build_used: 0, write_limit: u64::MAX, write_used: 0, covered: 0 }
    }

    /// Starts one write (an upload's files, a COPY's tar), allowed `limit` bytes of
    /// what the build has left.
    pub fn begin(&mut self, limit: u64) {
        (self.write_limit, self.write_used) = (limit, 0);
    }

    /// Takes `bytes` about to be written: refused past either allowance, or when they
    /// would leave less than the reserve free.
    pub fn take(&mut self, bytes: u64) -> Result<(), BudgetError> {
        let write = self.write_used.saturating_add(bytes);
        if write > self.write_limit {
            return Err(BudgetError::Write { limit: self.write_limit });
        }
        let build = self.build_used.saturating_add(bytes);
        if build > self.build_limit {
            return Err(BudgetError::Build { limit: self.build_limit });
        }
        if bytes > self.covered {
            self.covered = self.room(bytes)?;
        }
        self.covered -= bytes;
        (self.write_used, self.build_used) = (write, build);
        Ok(())
    }

    /// Bytes (at least `bytes`) that may be written before free space is asked again.
    fn room(&self, bytes: u64) -> Result<u64, BudgetError> {
        let want = bytes.max(CHECK_EVERY);
        let Some(dir) = &self.dir else { return Ok(want) };
        // Cannot tell: a failed statvfs refuses nothing (as `space::check_room`).
        let Ok(free) = hutch_vmm::space::available(dir) else { return Ok(want) };
        let room = free.saturating_sub(self.reserve);
        if room < bytes {
            return Err(BudgetError::NoSpace { free, reserve: self.reserve });
        }
        Ok(room.min(want))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_write_and_the_build_have_their_own_allowance() {
        let dir = tempfile::tempdir().expect("dir");
        let mut budget = Budget::new(dir.path(), 10 << 10, 0);
        budget.begin(6 << 10);
        budget.take(6 << 10).expect("within the write's allowance");
        assert_eq!(budget.take(1), Err(BudgetError::Write { limit: 6 << 10 }));
        budget.begin(6 << 10);
        budget.take(4 << 10).expect("within the build's");
        assert_eq!(budget.take(1), Err(BudgetError::Build { limit: 10 << 10 }));
        assert!(Budget::unlimited().take(u64::MAX).is_ok());
    }

    #[test]
    fn a_write_that_would_eat_into_the_reserve_is_refused() {
        let dir = tempfile::tempdir().expect("dir");
        let free = hutch_vmm::space::available(dir.path()).expect("statvfs");
        let mut budget = Budget::new(dir.path(), u64::MAX, free + (1 << 30));
        let e = budget.take(1).expect_err("no room above the reserve");
        assert!(matches!(e, BudgetError::NoSpace { .. }) && e.to_string().starts_with("the server is short of disk"), "{e}");
        // With the reserve met, what is asked for is granted.
        let mut budget = Budget::new(dir.path(), u64::MAX, 0);
        budget.take(1 << 20).expect("room");
    }
}
