//! How a template's builds are named to E2B's SDKs, which parse a build id as a UUID.

/// One build of a template, as the API shows it.
#[derive(Debug, Clone)]
pub struct BuildInfo {
    /// A UUID (`build_uuid`).
    pub id: String,
    /// RFC 3339.
    pub built_at: String,
    pub disk_size: u64,
}

/// A template build's id as E2B shows it: the one the API gave the build that made
/// it, else (a CLI or recipe build) the UUIDv8 of the build's own id, a content hash,
/// so the same build keeps its UUID.
pub(crate) fn build_uuid(template: &hutch_image::template::Template) -> String {
    if let Some(id) = &template.api_build {
        return id.clone();
    }
    name_uuid(&format!("hutch-template-build:{}", template.build_id))
}

/// A UUID (version 8) that `seed` always gives: for things hutch names by content.
pub(crate) fn name_uuid(seed: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(seed);
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Uuid::new_v8(bytes).hyphenated().to_string()
}

/// A new API build's id: a random UUIDv4.
pub(crate) fn new_build_uuid() -> String {
    uuid::Uuid::new_v4().hyphenated().to_string()
}

#[cfg(test)]
mod tests {
    use super::{build_uuid, new_build_uuid};

    fn uuid_of(build_id: &str) -> String {
        let mut t = crate::fake_guest::artifacts(std::path::Path::new("/nonexistent")).template;
        t.build_id = build_id.into();
        build_uuid(&t)
    }

    #[test]
    fn a_build_shows_as_the_same_uuid_every_time() {
        let id = uuid_of("4ca41cc4113a2bd3");
        // The UUID templates built before the uuid crate were shown with: it must not move.
        assert_eq!(id, "73bc1978-b4b3-8581-abee-441b442e1daa");
        assert_ne!(id, uuid_of("4ca41cc4113a2bd4"));
        let fresh = new_build_uuid();
        assert_eq!((&fresh[14..15], fresh.len()), ("4", 36), "version 4: {fresh}");
        assert_ne!(fresh, new_build_uuid());
        assert_eq!(&id[14..15], "8", "version 8: {id}");
        assert!("89ab".contains(&id[19..20]), "RFC 4122 variant: {id}");
    }
}
