//! `hutch run`: an ephemeral sandbox for one command.

use super::exec::{exec, ExecFlags};
use crate::local::Local;
use anyhow::Context;
use clap::Args;
use hutch_core::{MemMib, Sandbox, SandboxOptions};
use hutch_vmm::AccelChoice;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Template whose root filesystem the sandbox boots.
    #[arg(long, default_value = "base")]
    pub template: String,
    /// Virtual CPUs [default: the template's own (`hutch template build --cpus`), else 1].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub cpus: Option<u32>,
    /// Guest memory in MiB (or with a unit: 512M, 2G) [default: the template's own: what
    /// its build asked for, 2 GiB for code-interpreter, else 512 MiB].
    #[arg(long)]
    pub memory: Option<MemMib>,
    /// Accelerator: `auto` (KVM when it runs at native speed, else TCG), `kvm` or `tcg`.
    #[arg(long, default_value = "auto")]
    pub accel: AccelChoice,
    /// Boot the guest kernel instead of restoring the template's memory snapshot.
    #[arg(long)]
    pub cold: bool,
    /// Where the sandbox may connect: `none`, `public` (the internet, nothing private),
    /// or egress rules separated by commas (`allow@public:tcp:443,allow@*.pypi.org`).
    #[arg(long, default_value = "none", value_parser = parse_policy)]
    pub net: hutch_net::Policy,
    /// A secret the sandbox uses without holding it: `NAME=VALUE@HOST[,HOST…]`, or
    /// `NAME@HOST…` to take the value from this shell's variable NAME (so it stays out
    /// of `ps` and shell history). The guest's variable NAME holds a placeholder, which
    /// hutch fills in on HTTPS requests to those exact hosts only, in the headers APIs
    /// take keys in (Authorization, X-Api-Key, Api-Key, X-Goog-Api-Key, X-Auth-Token,
    /// Private-Token); `--net` must allow the hosts. Repeatable.
    #[arg(long = "secret", value_name = "NAME[=VALUE]@HOST")]
    pub secrets: Vec<String>,
    /// A PEM file of CA certificates trusted, besides this host's, when hutch checks the
    /// real server of a host a `--secret` is for (repeatable).
    #[arg(long = "upstream-ca", value_name = "FILE")]
    pub upstream_ca: Vec<std::path::PathBuf>,
    #[command(flatten)]
    pub exec: ExecFlags,
}

/// The template's memory snapshot for this VM shape, made (and said so) on first use.
pub async fn ensure_snapshot(local: &Local, opts: &SandboxOptions) -> anyhow::Result<hutch_core::snapshot::MemorySnapshot> {
    let dir = hutch_core::template_snapshot::dir_for(&local.home, &local.artifacts, opts, &local.backend());
    let fresh = !dir.join(hutch_core::snapshot::MANIFEST).is_file();
    let started = std::time::Instant::now();
    // Said on a terminal only: piped, stderr is the command's.
    let say = fresh && std::io::IsTerminal::is_terminal(&std::io::stderr());
    if say {
        eprintln!("hutch: first use of template '{}' at this size: booting it once to save a memory snapshot ...", local.artifacts.template.name);
    } else if fresh {
        tracing::info!(template = %local.artifacts.template.name, "making the template's memory snapshot (first use at this size)");
    }
    let backend = local.backend();
    let snapshot = hutch_core::template_snapshot::ensure(&local.home, &local.artifacts, &backend, opts)
        .await
        .with_context(|| format!("making the memory snapshot of template '{}'", local.artifacts.template.name))?;
    if say {
        eprintln!("hutch: snapshot saved in {:.1} s; sandboxes of '{}' now start from it", started.elapsed().as_secs_f64(), local.artifacts.template.name);
    }
    Ok(snapshot)
}

pub fn parse_policy(text: &str) -> Result<hutch_net::Policy, String> {
    hutch_net::Policy::parse(text).map_err(|e| e.to_string())
}

/// One `--secret`: the variable, its value, and the hosts it is for. Nothing that may
/// be the value is ever in an error: a name is shown only once it is a variable's name.
fn parse_secret(text: &str) -> anyhow::Result<(String, zeroize::Zeroizing<String>, Vec<String>)> {
    let Some((given, hosts)) = text.rsplit_once('@') else {
        anyhow::bail!("--secret takes NAME=VALUE@HOST or NAME@HOST; this one names no host after `@`");
    };
    let (var, value) = match given.split_once('=') {
        Some((var, value)) => (var, Some(value)),
        None => (given, None),
    };
    let var_name = var.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_') && var.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !var_name {
        anyhow::bail!("--secret takes NAME=VALUE@HOST or NAME@HOST; what comes before `=` or `@` in this one is not a variable's name (did you leave out `NAME=`?)");
    }
    let value = match value {
        Some(value) => zeroize::Zeroizing::new(value.to_string()),
        // A token looks like a variable's name too (`ghp_…`): until the value is found,
        // the name is not repeated.
        None => zeroize::Zeroizing::new(std::env::var(var).map_err(|_| anyhow::anyhow!("--secret …@{hosts}: this shell has no variable of the name before `@` to take the value from; export it, or give NAME=VALUE@HOST"))?),
    };
    if value.is_empty() {
        anyhow::bail!("--secret …@{hosts}: the value is empty; give NAME=VALUE@HOST, or NAME@HOST with NAME exported");
    }
    if http::HeaderValue::from_str(&value).is_err() {
        anyhow::bail!("--secret {var}: the value holds a byte a header cannot (a control character or non-ASCII), so it could not be filled in");
    }
    let hosts = hosts.split(',').map(str::trim).filter(|h| !h.is_empty()).map(str::to_string).collect();
    Ok((var.to_string(), value, hosts))
}

/// The bindings of `--secret`s: the network settings fill them in, the returned
/// variables hold their placeholders, the vault holds their values.
fn bind_secrets(given: &[String], network: &mut hutch_net::Settings) -> anyhow::Result<(std::collections::BTreeMap<String, String>, hutch_net::inspect::InlineVault)> {
    let mut bindings = std::collections::BTreeMap::new();
    let mut values = std::collections::HashMap::new();
    for text in given {
        let (var, value, hosts) = parse_secret(text)?;
        // The secret is named by the variable, lower-cased: two variables that differ
        // only in case would be one secret bound to both's hosts.
        if values.insert(var.to_ascii_lowercase(), value).is_some() {
            anyhow::bail!("--secret {var}: another --secret names the same variable (names are compared lower-cased); give each secret once, with all its hosts");
        }
        bindings.insert(var, hutch_net::inspect::SecretBinding { name: None, hosts, headers: None, query: None });
    }
    let env = network.transforms.bind_all("--secret", &bindings).map_err(|e| anyhow::anyhow!("{e}"))?;
    network.transforms.secrets_of = Some("local".into());
    Ok((env, hutch_net::inspect::InlineVault(values)))
}

pub async fn run(args: RunArgs) -> anyhow::Result<i32> {
    let mut network = hutch_net::Settings::native(args.net.clone());
    let (secret_env, vault) = bind_secrets(&args.secrets, &mut network)?;
    let local = Local::prepare(&args.template, args.accel).await?;
    let mut net_env = hutch_net::Environment::from_env(Vec::new(), Vec::new()).map_err(anyhow::Error::msg)?;
    let inspect_ca = if secret_env.is_empty() {
        None
    } else {
        net_env.vault = Some(std::sync::Arc::new(vault));
        net_env.upstream = std::sync::Arc::new(hutch_net::inspect::Upstream::with_ca_files(&args.upstream_ca)?);
        Some(std::sync::Arc::new(hutch_net::inspect::SandboxCa::generate().context("making the sandbox's inspection CA")?))
    };
    let opts = SandboxOptions {
        cpus: args.cpus.or(local.artifacts.template.shape.cpus).unwrap_or(1),
        memory: args.memory.or_else(|| local.artifacts.template.shape.memory_mib.and_then(|m| MemMib::new(m).ok())).unwrap_or_else(|| MemMib::of_template(&args.template)),
        accel: local.accel.accel,
        cold: args.cold,
        network,
        net_env: std::sync::Arc::new(net_env),
        envs: secret_env,
        inspect_ca,
        ..SandboxOptions::default()
    };
    // One Ctrl-C future for the whole run: a fresh `ctrl_c()` per step would miss a
    // Ctrl-C pressed between two steps, and the command would run on.
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    if !args.cold {
        tokio::select! {
            s = ensure_snapshot(&local, &opts) => { s?; }
            _ = &mut ctrl_c => return Ok(130),
        }
    }
    let backend = local.backend();
    let create = Sandbox::create(&local.home, &local.artifacts, &backend, &opts);
    let sandbox = tokio::select! {
        s = create => s.context("creating the sandbox")?,
        _ = &mut ctrl_c => return Ok(130),
    };
    let outcome = tokio::select! {
        r = exec(sandbox.agent(), &args.exec) => r,
        _ = &mut ctrl_c => Ok(130),
    };
    let destroyed = sandbox.destroy().await;
    let code = outcome?;
    destroyed.context("stopping the sandbox")?;
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::parse_secret;

    #[test]
    fn a_secret_given_wrong_is_refused_without_showing_it() {
        for text in ["c2VjcmV0dG9rZW4=@api.x.com", "sk-live-abc=def@api.x.com", "sk-live-abc@api.x.com", "1KEY=v@a.com", "ghp_NOT_EXPORTED_abc@github.com"] {
            let err = parse_secret(text).expect_err(text).to_string();
            assert!(!err.contains("c2Vj") && !err.contains("sk-live") && !err.contains("1KEY") && !err.contains("ghp_"), "{err}");
        }
        assert!(parse_secret("KEY=@a.com").is_err(), "an empty value");
        let (var, value, hosts) = parse_secret("KEY=a@b@x.com,y.com").expect("valid");
        assert_eq!((var.as_str(), value.as_str(), hosts), ("KEY", "a@b", vec!["x.com".to_string(), "y.com".to_string()]));
    }
}
