//! A template build as a client asked for it, typed: what the server's wire format (E2B's
//! `TemplateBuildStartV2`, in hutch-server) becomes once its shape is checked. The
//! manager checks here only what needs its own state: which templates the key may
//! build on, which uploads it has, how much a build may write.

use super::ManagerError;
use hutch_oci::pull::RegistryOptions;

/// The steps of one build and what it starts from.
#[derive(Debug, Clone)]
pub struct BuildPlan {
    pub base: PlannedBase,
    pub steps: Vec<PlannedStep>,
    /// What sandboxes of the template start with, and the command that says they are ready.
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    /// Build every step again, cached or not.
    pub force: bool,
}

/// What a build starts from.
#[derive(Debug, Clone)]
pub enum PlannedBase {
    /// An image in a registry, pulled with a login when one is given.
    Image { reference: String, login: Option<RegistryLogin> },
    /// A template this key may use: a built-in one or one of its own.
    Template(String),
}

/// How an image pull logs in to its registry.
#[derive(Clone)]
pub enum RegistryLogin {
    /// A user and password (also Google's `_json_key` login with a service account's key file).
    Basic { username: String, password: String },
    /// An AWS access key, exchanged for an ECR token when the pull starts (`hutch_oci::ecr`).
    Aws { access_key_id: String, secret_access_key: String, region: String },
}

/// Shown without its secrets (a plan may be logged).
impl std::fmt::Debug for RegistryLogin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegistryLogin::Basic { username, .. } => f.debug_struct("Basic").field("username", username).finish_non_exhaustive(),
            RegistryLogin::Aws { access_key_id, region, .. } => f.debug_struct("Aws").field("access_key_id", access_key_id).field("region", region).finish_non_exhaustive(),
        }
    }
}

impl RegistryLogin {
    /// Sets the pull's login: a basic-auth one, or an ECR exchange through the server's
    /// proxy. An AWS region that is not one is the caller's mistake (400).
    pub(super) fn apply(&self, options: &mut RegistryOptions) -> Result<(), ManagerError> {
        match self {
            RegistryLogin::Basic { username, password } => options.credentials = Some((username.clone(), password.clone())),
            RegistryLogin::Aws { access_key_id, secret_access_key, region } => {
                let login = hutch_oci::ecr::AwsLogin { access_key_id: access_key_id.clone(), secret_access_key: secret_access_key.clone(), region: region.clone(), endpoint: None };
                login.check().map_err(|e| ManagerError::InvalidArgument(format!("fromImageRegistry: {e}")))?;
                options.aws = Some(login);
            }
        }
        Ok(())
    }
}

/// One step, as the client wrote it (`text`, for logs and errors) and as it runs.
#[derive(Debug, Clone)]
pub struct PlannedStep {
    pub kind: PlannedKind,
    /// Run it even if the cache has its result.
    pub force: bool,
    /// `RUN pip install x`: what the build's log and errors show.
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlannedKind {
    Run { cmd: String, user: Option<String> },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
    /// Files uploaded earlier under `files_hash`, copied from `src` (within the upload) to `dest`.
    Copy { files_hash: String, src: String, dest: String, owner: Option<String>, mode: Option<String> },
}

#[cfg(test)]
mod tests {
    use super::RegistryLogin;
    use hutch_oci::pull::RegistryOptions;

    #[test]
    fn logins_become_the_pulls_and_never_show_their_secrets() {
        let mut options = RegistryOptions::default();
        RegistryLogin::Basic { username: "me".into(), password: "pw".into() }.apply(&mut options).expect("basic");
        assert_eq!(options.credentials, Some(("me".into(), "pw".into())));
        let aws = RegistryLogin::Aws { access_key_id: "AKIAHUTCHTEST0000001".into(), secret_access_key: "s3cret".into(), region: "eu-west-1".into() };
        let mut options = RegistryOptions::default();
        aws.apply(&mut options).expect("aws");
        let login = options.aws.expect("an ECR login");
        assert_eq!((login.access_key_id.as_str(), login.region.as_str()), ("AKIAHUTCHTEST0000001", "eu-west-1"));
        assert!(options.credentials.is_none() && !format!("{login:?} {aws:?}").contains("s3cret"));
        let bad = RegistryLogin::Aws { access_key_id: "a".into(), secret_access_key: "b".into(), region: "x.example.com/".into() };
        let e = bad.apply(&mut RegistryOptions::default()).expect_err("not a region");
        assert!(matches!(e, super::ManagerError::InvalidArgument(_)) && e.to_string().contains("is not an AWS region"), "{e}");
    }
}
