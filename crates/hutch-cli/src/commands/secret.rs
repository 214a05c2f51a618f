//! `hutch secret`: the secrets of `hutch serve`'s API keys, in its home (what E2B's
//! `/secrets` API serves to each key). A value is read from stdin, never from the
//! command line (which any user can read in /proc), and never printed.

use anyhow::Context;
use clap::Subcommand;
use hutch_core::secrets::Secrets;
use hutch_core::store::Store;
use hutch_image::HutchHome;
use std::collections::BTreeMap;
use std::io::Read;

#[derive(Subcommand, Debug)]
pub enum SecretCommand {
    /// Store a secret; its value is read from stdin (`printf %s "$TOKEN" | hutch secret create NAME`).
    Create {
        /// Its name: letters, digits, '-' and '_' (stored lower-cased).
        name: String,
        /// Metadata, as KEY=VALUE (repeat for more).
        #[arg(long = "metadata", value_parser = parse_pair)]
        metadata: Vec<(String, String)>,
        #[command(flatten)]
        key: KeyArg,
    },
    /// Store a new value (read from stdin) as the secret's next version.
    Update {
        /// Its name or id.
        secret: String,
        #[command(flatten)]
        key: KeyArg,
    },
    /// List secrets: ids, names, versions and metadata, never values.
    Ls {
        #[command(flatten)]
        key: KeyArg,
    },
    /// Delete a secret and its value.
    Rm {
        /// Its name or id.
        secret: String,
        #[command(flatten)]
        key: KeyArg,
    },
    /// Seal every stored value under a new key, then delete the old key.
    RotateKey,
}

#[derive(clap::Args, Debug)]
pub struct KeyArg {
    /// The API key's id (`hutch keys list`) whose secrets these are [default: the only active key].
    #[arg(long = "key")]
    key: Option<String>,
}

fn parse_pair(text: &str) -> Result<(String, String), String> {
    text.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("'{text}' is not KEY=VALUE"))
}

/// The value on stdin, without one trailing newline (what `echo` adds).
fn value_from_stdin() -> anyhow::Result<zeroize::Zeroizing<String>> {
    anyhow::ensure!(!std::io::IsTerminal::is_terminal(&std::io::stdin()), "pipe the value in on stdin (printf %s \"$TOKEN\" | hutch secret ...): it is never taken from the command line");
    let mut value = zeroize::Zeroizing::new(String::new());
    std::io::stdin().read_to_string(&mut value).context("reading the value from stdin")?;
    if value.ends_with('\n') {
        value.pop();
    }
    Ok(value)
}

/// Whose secrets: the key named (a revoked one too, whose secrets can still be listed
/// and removed), else the only active one.
async fn key_id(store: &Store, given: Option<String>) -> anyhow::Result<String> {
    let keys = store.list_keys().await?;
    let active: Vec<_> = keys.iter().filter(|k| !k.revoked).collect();
    match given {
        Some(id) => keys.iter().any(|k| k.id == id).then_some(id.clone()).with_context(|| format!("no API key with id '{id}' (see `hutch keys list`)")),
        None => match active.as_slice() {
            [only] => Ok(only.id.clone()),
            [] => anyhow::bail!("this home has no API key; create one with `hutch keys create`"),
            _ => anyhow::bail!("this home has {} API keys; say whose secrets with --key ID (see `hutch keys list`)", active.len()),
        },
    }
}

/// What a tenant wrote, safe to print on an operator's terminal: no escape sequences,
/// no line breaks.
fn printable(text: &str) -> String {
    text.chars().flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] }).collect()
}

pub async fn run(cmd: SecretCommand) -> anyhow::Result<i32> {
    let home = HutchHome::from_env();
    // Another user's key files would be unreadable to the server that owns the home.
    if let Ok(meta) = std::fs::metadata(home.root()) {
        let owner = std::os::unix::fs::MetadataExt::uid(&meta);
        let me = nix::unistd::geteuid().as_raw();
        anyhow::ensure!(owner == me, "{} belongs to uid {owner}, not to this user (uid {me}); run hutch secret as the user that runs hutch serve", home.root().display());
    }
    home.make_private()?;
    let store = Store::open_file(&home.root().join("hutch.db")).await?;
    let secrets = Secrets::new(home.root(), store.clone());
    match cmd {
        SecretCommand::Create { name, metadata, key } => {
            let key = key_id(&store, key.key).await?;
            let value = value_from_stdin()?;
            let info = secrets.create(&key, &name, &value, metadata.into_iter().collect::<BTreeMap<_, _>>()).await?;
            crate::output::outln!("{} {}", info.id, info.name);
        }
        SecretCommand::Update { secret, key } => {
            let key = key_id(&store, key.key).await?;
            let value = value_from_stdin()?;
            let info = secrets.update(&key, &secret, &value, None).await?;
            crate::output::outln!("{} {} version {}", info.id, info.name, info.version);
        }
        SecretCommand::Ls { key } => {
            let key = key_id(&store, key.key).await?;
            crate::output::outln!("{:<31} {:<24} {:>7} {:<26} METADATA", "ID", "NAME", "VERSION", "UPDATED");
            let mut after: Option<String> = None;
            loop {
                let page = secrets.list(&key, hutch_core::secrets::MAX_PAGE, after.as_deref()).await?;
                for s in &page.secrets {
                    let metadata: Vec<String> = s.metadata.iter().map(|(k, v)| format!("{}={}", printable(k), printable(v))).collect();
                    crate::output::outln!("{:<31} {:<24} {:>7} {:<26} {}", s.id, s.name, s.version, s.updated_at, metadata.join(","));
                }
                match page.next {
                    Some(next) => after = Some(next),
                    None => break,
                }
            }
        }
        SecretCommand::Rm { secret, key } => {
            let key = key_id(&store, key.key).await?;
            secrets.delete(&key, &secret).await?;
            crate::output::outln!("deleted {secret}");
        }
        SecretCommand::RotateKey => {
            let sealed = secrets.rotate_key().await?;
            crate::output::outln!("sealed {sealed} value(s) under a new key; the old key is deleted");
        }
    }
    Ok(0)
}
