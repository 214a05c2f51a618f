//! E2B's build request (`TemplateBuildStartV2`) as the official SDKs send it, read once
//! into the manager's typed `BuildPlan`: every question of shape (step types, their
//! arguments, the registry login's fields) is answered here, as a 400.

use crate::error::ApiError;
use hutch_core::manager::build_plan::{BuildPlan, PlannedBase, PlannedKind, PlannedStep, RegistryLogin};
use hutch_core::manager::builds::is_files_hash;
use serde::Deserialize;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct BuildRequest {
    from_image: Option<String>,
    from_template: Option<String>,
    from_image_registry: Option<RegistryAuth>,
    force: bool,
    steps: Vec<ApiStep>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
}

#[derive(Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RegistryAuth {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    /// Type `gcp`: a service account's key file, JSON.
    #[serde(default)]
    service_account_json: Option<String>,
    /// Type `aws`: an access key and the region of the ECR registry.
    #[serde(default)]
    aws_access_key_id: Option<String>,
    #[serde(default)]
    aws_secret_access_key: Option<String>,
    #[serde(default)]
    aws_region: Option<String>,
}

/// Shown without its secrets (a request may be logged with its fields).
impl std::fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryAuth")
            .field("kind", &self.kind)
            .field("username", &self.username)
            .field("aws_access_key_id", &self.aws_access_key_id)
            .field("aws_region", &self.aws_region)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ApiStep {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    files_hash: Option<String>,
    #[serde(default)]
    force: bool,
}

impl BuildRequest {
    /// The plan this request asks for, or a 400 that says what is wrong with it.
    pub fn into_plan(self) -> Result<BuildPlan, ApiError> {
        let base = match (self.from_image, self.from_template) {
            // The SDK's default base: E2B's image is hutch's `base` template.
            (Some(image), None) if image == "e2bdev/base" => PlannedBase::Template("base".into()),
            (Some(reference), None) => PlannedBase::Image { reference, login: self.from_image_registry.as_ref().map(RegistryAuth::login).transpose()? },
            (None, Some(template)) => PlannedBase::Template(template),
            _ => return Err(ApiError::bad_request("give exactly one of fromImage and fromTemplate")),
        };
        let steps = self.steps.into_iter().enumerate().map(|(i, step)| step.planned(i + 1)).collect::<Result<_, _>>()?;
        Ok(BuildPlan { base, steps, start_cmd: self.start_cmd, ready_cmd: self.ready_cmd, force: self.force })
    }
}

impl RegistryAuth {
    /// The login a pull uses. `gcp` is Google's basic-auth login (`_json_key` and the
    /// key file), which Artifact Registry and GCR take; `aws` asks ECR for a token with
    /// the access key when the pull starts.
    fn login(&self) -> Result<RegistryLogin, ApiError> {
        let missing = |what: &str| ApiError::bad_request(format!("fromImageRegistry of type '{}' needs {what}", self.kind));
        let given = |v: &Option<String>, what: &str| v.clone().filter(|v| !v.is_empty()).ok_or_else(|| missing(what));
        Ok(match self.kind.as_str() {
            "registry" => RegistryLogin::Basic {
                username: self.username.clone().ok_or_else(|| missing("username"))?,
                password: self.password.clone().ok_or_else(|| missing("password"))?,
            },
            "gcp" => RegistryLogin::Basic { username: "_json_key".into(), password: given(&self.service_account_json, "serviceAccountJson")? },
            "aws" => RegistryLogin::Aws {
                access_key_id: given(&self.aws_access_key_id, "awsAccessKeyId")?,
                secret_access_key: given(&self.aws_secret_access_key, "awsSecretAccessKey")?,
                region: given(&self.aws_region, "awsRegion")?,
            },
            other => return Err(ApiError::bad_request(format!("fromImageRegistry type '{other}' is not one of registry, aws, gcp"))),
        })
    }
}

impl ApiStep {
    /// Step `n` as the build runs it, if its type and arguments make one.
    fn planned(self, n: usize) -> Result<PlannedStep, ApiError> {
        let text = format!("{} {}", self.kind, self.args.join(" "));
        let bad = |why: &str| ApiError::bad_request(format!("step {n} ({text}): {why}"));
        // An empty optional argument is an absent one (the SDK sends "" for "not given").
        let optional = |i: usize| self.args.get(i).filter(|a| !a.is_empty()).cloned();
        let args = &self.args;
        let kind = match self.kind.as_str() {
            "RUN" if !args.is_empty() => PlannedKind::Run { cmd: args[0].clone(), user: optional(1) },
            "ENV" if !args.is_empty() && args.len().is_multiple_of(2) => PlannedKind::Env(args.chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect()),
            "WORKDIR" if args.len() == 1 && !args[0].is_empty() => PlannedKind::Workdir(args[0].clone()),
            "USER" if args.len() == 1 && !args[0].is_empty() => PlannedKind::User(args[0].clone()),
            "COPY" if args.len() >= 2 => {
                let files_hash = self.files_hash.clone().unwrap_or_default();
                if !is_files_hash(&files_hash) {
                    return Err(bad("filesHash is missing or not 64 lowercase hex digits"));
                }
                PlannedKind::Copy { files_hash, src: args[0].clone(), dest: args[1].clone(), owner: optional(2), mode: optional(3) }
            }
            "RUN" | "ENV" | "WORKDIR" | "USER" | "COPY" => return Err(bad("wrong number of arguments")),
            other => return Err(bad(&format!("'{other}' is not a step type (RUN, COPY, ENV, WORKDIR, USER)"))),
        };
        Ok(PlannedStep { kind, force: self.force, text })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(json: serde_json::Value) -> Result<BuildPlan, String> {
        serde_json::from_value::<BuildRequest>(json).expect("a request").into_plan().map_err(|e| e.message)
    }

    fn login(auth: serde_json::Value) -> Result<RegistryLogin, String> {
        let plan = plan(serde_json::json!({"fromImage": "registry.example/app:1", "fromImageRegistry": auth}))?;
        let PlannedBase::Image { login: Some(login), .. } = plan.base else { panic!("an image with a login: {:?}", plan.base) };
        Ok(login)
    }

    #[test]
    fn registry_logins_are_the_users_and_passwords_registries_take() {
        let plain = login(serde_json::json!({"type": "registry", "username": "me", "password": "pw"})).expect("registry");
        assert!(matches!(plain, RegistryLogin::Basic { ref username, ref password } if username == "me" && password == "pw"), "{plain:?}");
        let gcp = login(serde_json::json!({"type": "gcp", "serviceAccountJson": "{\"type\":\"service_account\"}"})).expect("gcp");
        assert!(matches!(gcp, RegistryLogin::Basic { ref username, ref password } if username == "_json_key" && password == "{\"type\":\"service_account\"}"));
        let aws = login(serde_json::json!({"type": "aws", "awsAccessKeyId": "AKIAHUTCHTEST0000001", "awsSecretAccessKey": "s3cret", "awsRegion": "eu-west-1"})).expect("aws");
        assert!(matches!(aws, RegistryLogin::Aws { ref region, .. } if region == "eu-west-1") && !format!("{aws:?}").contains("s3cret"));
        for (json, says) in [
            (serde_json::json!({"type": "registry", "username": "me"}), "needs password"),
            (serde_json::json!({"type": "gcp"}), "needs serviceAccountJson"),
            (serde_json::json!({"type": "aws", "awsAccessKeyId": "a", "awsRegion": "r"}), "needs awsSecretAccessKey"),
            (serde_json::json!({"type": "azure"}), "is not one of registry, aws, gcp"),
        ] {
            let e = login(json).expect_err("refused");
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn steps_are_typed_once_and_a_malformed_one_is_a_400_naming_it() {
        let hash = "a".repeat(64);
        let ok = plan(serde_json::json!({"fromTemplate": "base", "steps": [
            {"type": "RUN", "args": ["pip install x", ""]},
            {"type": "ENV", "args": ["A", "1", "B", "2"]},
            {"type": "COPY", "args": ["app", "/srv/", "", "0644"], "filesHash": hash, "force": true},
        ]}))
        .expect("a plan");
        assert_eq!(ok.steps[0].kind, PlannedKind::Run { cmd: "pip install x".into(), user: None });
        assert_eq!(ok.steps[1].kind, PlannedKind::Env(vec![("A".into(), "1".into()), ("B".into(), "2".into())]));
        assert_eq!(ok.steps[2].kind, PlannedKind::Copy { files_hash: hash, src: "app".into(), dest: "/srv/".into(), owner: None, mode: Some("0644".into()) });
        assert!(ok.steps[2].force && ok.steps[2].text == "COPY app /srv/  0644");
        assert!(matches!(ok.base, PlannedBase::Template(ref t) if t == "base"));
        for (step, says) in [
            (serde_json::json!({"type": "ENV", "args": ["A"]}), "step 1 (ENV A): wrong number of arguments"),
            (serde_json::json!({"type": "COPY", "args": ["a", "b"], "filesHash": "../x"}), "filesHash is missing or not 64 lowercase hex digits"),
            (serde_json::json!({"type": "ADD", "args": ["a", "b"]}), "'ADD' is not a step type"),
        ] {
            let e = plan(serde_json::json!({"fromImage": "e2bdev/base", "steps": [step]})).expect_err("refused");
            assert!(e.contains(says), "{e}");
        }
        let both = plan(serde_json::json!({"fromImage": "x", "fromTemplate": "y"})).expect_err("both");
        assert!(both.contains("exactly one of fromImage and fromTemplate"), "{both}");
    }
}
