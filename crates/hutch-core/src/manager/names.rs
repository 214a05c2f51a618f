//! Names users give that become file names under `$HUTCH_HOME` (template ids, snapshot
//! names): checked before anything is made from them.

use super::error::ManagerError;

/// Snapshot names share the template namespace: short, plain, unambiguous.
pub fn validate_name(name: &str) -> Result<(), ManagerError> {
    validate_identifier("snapshot name", name)
}

/// A name that becomes a file name under `$HUTCH_HOME` (template ids, snapshot names):
/// no separators, nothing hidden, nothing that climbs (`..` needs a leading dot or `/`).
pub fn validate_identifier(what: &str, name: &str) -> Result<(), ManagerError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        let shown: String = name.chars().take(64).flat_map(char::escape_default).collect();
        Err(ManagerError::InvalidArgument(format!(
            "{what} '{shown}' is not allowed: use 1-64 letters, digits, '-', '_' or '.', not starting with '.'"
        )))
    }
}
