//! What an image's config says a container starts with: `Env`, `WorkingDir`, `User`,
//! `Entrypoint` and `Cmd` become the template's defaults.

use serde::Deserialize;

#[derive(Debug, Deserialize)]
struct ConfigFile {
    #[serde(default)]
    architecture: Option<String>,
    #[serde(default)]
    os: Option<String>,
    #[serde(default)]
    config: Option<RunConfig>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RunConfig {
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
}

/// A template's defaults from its image (hutch-proto's: the agent reads the same shape).
pub use hutch_proto::agent::ImageDefaults;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("the image's config is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("the image is for {os}/{arch}; hutch runs linux/amd64 images")]
    Platform { os: String, arch: String },
}

/// The defaults an image config (its JSON) gives.
pub fn defaults_from_config(bytes: &[u8]) -> Result<ImageDefaults, ConfigError> {
    let file: ConfigFile = serde_json::from_slice(bytes)?;
    let (os, arch) = (file.os.unwrap_or_else(|| "linux".into()), file.architecture.unwrap_or_else(|| "amd64".into()));
    if os != "linux" || arch != "amd64" {
        return Err(ConfigError::Platform { os, arch });
    }
    let run = file.config.unwrap_or_default();
    let env = run
        .env
        .unwrap_or_default()
        .into_iter()
        .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect();
    let nonempty = |s: Option<String>| s.filter(|s| !s.is_empty());
    Ok(ImageDefaults {
        env,
        workdir: nonempty(run.working_dir),
        user: nonempty(run.user),
        entrypoint: run.entrypoint.unwrap_or_default(),
        cmd: run.cmd.unwrap_or_default(),
        ..ImageDefaults::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_becomes_defaults() {
        let json = br#"{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/bin:/bin","A=b=c"],
            "WorkingDir":"/app","User":"1000:1000","Entrypoint":["/bin/sh","-c"],"Cmd":["echo hi"]}}"#;
        let d = defaults_from_config(json).expect("config");
        assert_eq!(d.env.get("A").map(String::as_str), Some("b=c"));
        assert_eq!((d.workdir.as_deref(), d.user.as_deref()), (Some("/app"), Some("1000:1000")));
        assert_eq!((d.entrypoint.len(), d.cmd.len()), (2, 1));
    }

    #[test]
    fn other_platforms_are_named() {
        let err = defaults_from_config(br#"{"architecture":"arm64","os":"linux"}"#).expect_err("arm64");
        assert_eq!(err.to_string(), "the image is for linux/arm64; hutch runs linux/amd64 images");
    }
}
