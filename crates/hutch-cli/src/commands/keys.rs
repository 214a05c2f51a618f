//! `hutch keys`: API keys of `hutch serve`, stored hashed in its database.

use clap::Subcommand;
use hutch_core::store::Store;
use hutch_image::HutchHome;

#[derive(Subcommand, Debug)]
pub enum KeysCommand {
    /// Create a key; it is printed once and stored only as a hash.
    Create {
        /// A name to tell the key by in `hutch keys list`.
        #[arg(long, default_value = "default")]
        name: String,
    },
    /// List keys (ids and names, never the keys).
    List,
    /// Revoke a key by id.
    Revoke {
        /// The key's id, as `hutch keys list` shows it.
        id: String,
    },
}

pub async fn run(cmd: KeysCommand) -> anyhow::Result<i32> {
    let home = HutchHome::from_env();
    home.make_private()?;
    let store = Store::open_file(&home.root().join("hutch.db")).await?;
    match cmd {
        KeysCommand::Create { name } => {
            let (info, key) = store.create_key(&name).await?;
            eprintln!("created key {} ({}); it is shown only now:", info.id, info.name);
            crate::output::outln!("{key}");
        }
        KeysCommand::List => {
            crate::output::outln!("{:<18} {:<20} {:<26} STATUS", "ID", "NAME", "CREATED");
            for k in store.list_keys().await? {
                crate::output::outln!("{:<18} {:<20} {:<26} {}", k.id, k.name, k.created_at, if k.revoked { "revoked" } else { "active" });
            }
        }
        KeysCommand::Revoke { id } => {
            if !store.revoke_key(&id).await? {
                anyhow::bail!("no active key with id '{id}' (see `hutch keys list`)");
            }
            crate::output::outln!("revoked {id}");
        }
    }
    Ok(0)
}
