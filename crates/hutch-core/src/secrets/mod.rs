//! Secrets, per API key: a name, metadata and a value that is written and never read
//! back by any API (E2B's `/secrets`, `hutch secret`). Values are sealed at rest
//! (`keyring.rs`); what may be stored is E2B's rules (`rules.rs`). A secret keeps the
//! count of its versions, and only the current value.
//!
//! Nothing here logs, formats or returns a value: errors carry fixed sentences, and
//! `value` (for the network stack that will place secrets into requests) is the one
//! way back to the plaintext.

mod keyring;
pub mod rules;

use crate::store::{Store, StoreError};
pub use keyring::{Keyring, KeyringError};
use rules::{Invalid, Selector};
use sqlx::Row;
use std::collections::BTreeMap;
use zeroize::Zeroizing;

/// At most this many secrets per API key.
pub const MAX_PER_KEY: i64 = 1000;
/// A page of a listing holds at most this many (E2B's `limit`, 1-100).
pub const MAX_PAGE: usize = 100;

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("Invalid secrets request: {}", .0.0)]
    Invalid(Invalid),
    #[error("no secret by that name or id for this API key; list them with GET /secrets or `hutch secret ls`")]
    NotFound,
    #[error("a secret with this name exists; update it, or delete it first")]
    NameTaken,
    #[error("this API key has {MAX_PER_KEY} secrets, the most it may; delete some first")]
    TooMany,
    #[error("the secrets store failed")]
    Store(#[from] StoreError),
    #[error("the secrets' keys")]
    Keys(#[from] KeyringError),
}

impl From<Invalid> for SecretError {
    fn from(e: Invalid) -> Self {
        SecretError::Invalid(e)
    }
}

impl From<sqlx::Error> for SecretError {
    fn from(e: sqlx::Error) -> Self {
        SecretError::Store(StoreError::Query(e))
    }
}

/// What the API shows of a secret: everything but its value.
#[derive(Debug, Clone, PartialEq)]
pub struct SecretInfo {
    pub id: String,
    pub name: String,
    pub version: i64,
    pub metadata: BTreeMap<String, String>,
    pub created_at: String,
    pub updated_at: String,
}

/// One page of a listing, and where the next starts (None: this was the last).
pub struct Page {
    pub secrets: Vec<SecretInfo>,
    pub next: Option<String>,
}

#[derive(Clone)]
pub struct Secrets {
    store: Store,
    keyring: Keyring,
}

/// What a sealed value is bound to: another secret's ciphertext, another key's, or
/// an older version of its own put back from a backup does not open here.
fn binding(id: &str, version: i64, key_id: &str, generation: u32) -> String {
    format!("{id}|{version}|{key_id}|{generation}")
}

/// Writers start their transaction holding SQLite's write lock, so two at once queue
/// (the busy timeout) instead of one failing on the other's commit.
const IMMEDIATE: &str = "BEGIN IMMEDIATE";

const COLUMNS: &str = "id, name, current_version, metadata, created_at, updated_at";

fn info(row: &sqlx::sqlite::SqliteRow) -> Result<SecretInfo, SecretError> {
    let metadata: String = row.try_get("metadata")?;
    Ok(SecretInfo {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        version: row.try_get("current_version")?,
        metadata: serde_json::from_str(&metadata).map_err(|_| StoreError::Corrupt { what: "secret metadata" })?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
    })
}

fn metadata_json(metadata: &BTreeMap<String, String>) -> String {
    serde_json::to_string(metadata).unwrap_or_else(|_| "{}".into())
}

impl Secrets {
    pub fn new(home_root: &std::path::Path, store: Store) -> Secrets {
        Secrets { store, keyring: Keyring::at(home_root) }
    }

    /// Stores a new secret at version 1.
    pub async fn create(&self, key_id: &str, name: &str, value: &str, metadata: BTreeMap<String, String>) -> Result<SecretInfo, SecretError> {
        let name = rules::name(name)?;
        rules::value(value)?;
        rules::metadata(&metadata)?;
        let keys = self.keys().await?;
        let id = rules::new_id();
        let generation = keys.newest();
        let sealed = keys.seal_with(generation, value.as_bytes(), &binding(&id, 1, key_id, generation))?;
        let now = crate::store::now_rfc3339();
        let mut tx = self.store.pool().begin_with(IMMEDIATE).await?;
        let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM secrets WHERE key_id = ?").bind(key_id).fetch_one(&mut *tx).await?;
        if count >= MAX_PER_KEY {
            return Err(SecretError::TooMany);
        }
        let inserted = sqlx::query(
            "INSERT INTO secrets (id, key_id, name, current_version, metadata, created_at, updated_at, key_gen, nonce, ciphertext) VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&id)
        .bind(key_id)
        .bind(&name)
        .bind(metadata_json(&metadata))
        .bind(&now)
        .bind(&now)
        .bind(i64::from(sealed.generation))
        .bind(&sealed.nonce)
        .bind(&sealed.ciphertext)
        .execute(&mut *tx)
        .await;
        match inserted {
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => return Err(SecretError::NameTaken),
            other => other?,
        };
        tx.commit().await?;
        Ok(SecretInfo { id, name, version: 1, metadata, created_at: now.clone(), updated_at: now })
    }

    /// Stores `value` as the secret's next version; `metadata`, when given, replaces
    /// what it had (E2B: omitted keeps it, `{}` clears it).
    pub async fn update(&self, key_id: &str, selector: &str, value: &str, metadata: Option<BTreeMap<String, String>>) -> Result<SecretInfo, SecretError> {
        let selector = rules::selector(selector)?;
        rules::value(value)?;
        if let Some(m) = &metadata {
            rules::metadata(m)?;
        }
        let keys = self.keys().await?;
        let mut tx = self.store.pool().begin_with(IMMEDIATE).await?;
        let row = select_one(&mut tx, key_id, &selector).await?.ok_or(SecretError::NotFound)?;
        let mut secret = info(&row)?;
        secret.version += 1;
        if let Some(m) = metadata {
            secret.metadata = m;
        }
        secret.updated_at = crate::store::now_rfc3339();
        let generation = keys.newest();
        let sealed = keys.seal_with(generation, value.as_bytes(), &binding(&secret.id, secret.version, key_id, generation))?;
        sqlx::query("UPDATE secrets SET current_version = ?, metadata = ?, updated_at = ?, key_gen = ?, nonce = ?, ciphertext = ? WHERE id = ? AND key_id = ?")
            .bind(secret.version)
            .bind(metadata_json(&secret.metadata))
            .bind(&secret.updated_at)
            .bind(i64::from(sealed.generation))
            .bind(&sealed.nonce)
            .bind(&sealed.ciphertext)
            .bind(&secret.id)
            .bind(key_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(secret)
    }

    pub async fn get(&self, key_id: &str, selector: &str) -> Result<SecretInfo, SecretError> {
        let selector = rules::selector(selector)?;
        let mut conn = self.store.pool().acquire().await?;
        let row = select_one(&mut conn, key_id, &selector).await?.ok_or(SecretError::NotFound)?;
        info(&row)
    }

    /// Up to `limit` secrets made after the one `after` names (a previous page's
    /// `next`), oldest first.
    pub async fn list(&self, key_id: &str, limit: usize, after: Option<&str>) -> Result<Page, SecretError> {
        if !(1..=MAX_PAGE).contains(&limit) {
            return Err(Invalid("limit must be 1-100").into());
        }
        let after = match after {
            None => String::new(),
            Some(token) => match rules::selector(token) {
                Ok(Selector::Id(id)) => id,
                _ => return Err(Invalid("nextToken is not one a listing gave").into()),
            },
        };
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM secrets WHERE key_id = ? AND id > ? ORDER BY id LIMIT ?"))
            .bind(key_id)
            .bind(&after)
            .bind(limit as i64 + 1)
            .fetch_all(self.store.pool())
            .await?;
        let mut secrets = rows.iter().map(info).collect::<Result<Vec<_>, _>>()?;
        let next = (secrets.len() > limit).then(|| {
            secrets.truncate(limit);
            secrets.last().map(|s| s.id.clone())
        });
        Ok(Page { secrets, next: next.flatten() })
    }

    /// Removes the secret and its value.
    pub async fn delete(&self, key_id: &str, selector: &str) -> Result<(), SecretError> {
        let selector = rules::selector(selector)?;
        let (column, wanted) = match &selector {
            Selector::Id(id) => ("id", id),
            Selector::Name(name) => ("name", name),
        };
        let done = sqlx::query(&format!("DELETE FROM secrets WHERE key_id = ? AND {column} = ?")).bind(key_id).bind(wanted).execute(self.store.pool()).await?;
        if done.rows_affected() == 0 {
            return Err(SecretError::NotFound);
        }
        Ok(())
    }

    /// The current value, for the host-side code that places it into requests; never
    /// served by any API.
    pub async fn value(&self, key_id: &str, selector: &str) -> Result<Zeroizing<String>, SecretError> {
        let selector = rules::selector(selector)?;
        let keys = self.keys().await?;
        let mut conn = self.store.pool().acquire().await?;
        let row = select_one(&mut conn, key_id, &selector).await?.ok_or(SecretError::NotFound)?;
        let (id, version): (String, i64) = (row.try_get("id")?, row.try_get("current_version")?);
        let sealed = sealed_of(&row)?;
        let plain = keys.open(&sealed, &binding(&id, version, key_id, sealed.generation))?;
        let text = std::str::from_utf8(&plain).map_err(|_| KeyringError::Tampered)?;
        Ok(Zeroizing::new(text.to_string()))
    }

    /// Seals every stored value again under a new key generation, in one transaction,
    /// then removes the older keys. Every value is opened before anything changes, so
    /// one that does not open stops the rotation with nothing done. Returns how many
    /// values were sealed again.
    pub async fn rotate_key(&self) -> Result<usize, SecretError> {
        let mut keys = self.keyring.exclusive().await?;
        let mut tx = self.store.pool().begin_with(IMMEDIATE).await?;
        if keys.generations().is_empty() {
            let stored: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM secrets").fetch_one(&mut *tx).await?;
            if stored > 0 {
                return Err(KeyringError::NoKeys(self.keyring.dir().to_path_buf()).into());
            }
        }
        check_keys(&mut tx, &keys).await?;
        let rows = sqlx::query("SELECT id, key_id, current_version, key_gen, nonce, ciphertext FROM secrets").fetch_all(&mut *tx).await?;
        let mut opened = Vec::with_capacity(rows.len());
        for row in &rows {
            let (id, key_id, version): (String, String, i64) = (row.try_get("id")?, row.try_get("key_id")?, row.try_get("current_version")?);
            let sealed = sealed_of(row)?;
            let plain = keys.open(&sealed, &binding(&id, version, &key_id, sealed.generation))?;
            opened.push((id, key_id, version, plain));
        }
        let next = keys.generations().last().copied().unwrap_or(0) + 1;
        self.keyring.add(&mut keys, next)?;
        for (id, key_id, version, plain) in &opened {
            let again = keys.seal_with(next, plain, &binding(id, *version, key_id, next))?;
            sqlx::query("UPDATE secrets SET key_gen = ?, nonce = ?, ciphertext = ? WHERE id = ?")
                .bind(i64::from(next))
                .bind(&again.nonce)
                .bind(&again.ciphertext)
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query("DELETE FROM secret_keys WHERE generation <> ?").bind(i64::from(next)).execute(&mut *tx).await?;
        sqlx::query("INSERT OR REPLACE INTO secret_keys (generation, fingerprint) VALUES (?, ?)").bind(i64::from(next)).bind(keys.fingerprint(next)?).execute(&mut *tx).await?;
        tx.commit().await?;
        self.keyring.retire_all_but(&mut keys, next)?;
        Ok(opened.len())
    }

    /// The keys under a shared lock, checked against the fingerprints this database
    /// keeps (a generation seen for the first time is recorded). The first key is
    /// made only for a database that never had one.
    async fn keys(&self) -> Result<keyring::Keys, SecretError> {
        let mut conn = self.store.pool().acquire().await?;
        let known: i64 = sqlx::query_scalar("SELECT (SELECT COUNT(*) FROM secret_keys) + (SELECT COUNT(*) FROM secrets)").fetch_one(&mut *conn).await?;
        let keys = self.keyring.shared(known == 0).await?;
        check_keys(&mut conn, &keys).await?;
        Ok(keys)
    }
}

/// Each generation's fingerprint against the one on record; one not on record yet is
/// recorded (`INSERT OR IGNORE`: two first sights at once keep the same).
async fn check_keys(conn: &mut sqlx::SqliteConnection, keys: &keyring::Keys) -> Result<(), SecretError> {
    for generation in keys.generations() {
        let fingerprint = keys.fingerprint(generation)?;
        sqlx::query("INSERT OR IGNORE INTO secret_keys (generation, fingerprint) VALUES (?, ?)").bind(i64::from(generation)).bind(&fingerprint).execute(&mut *conn).await?;
        let recorded: String = sqlx::query_scalar("SELECT fingerprint FROM secret_keys WHERE generation = ?").bind(i64::from(generation)).fetch_one(&mut *conn).await?;
        if recorded != fingerprint {
            return Err(KeyringError::Mismatch(generation).into());
        }
    }
    Ok(())
}

fn sealed_of(row: &sqlx::sqlite::SqliteRow) -> Result<keyring::Sealed, SecretError> {
    Ok(keyring::Sealed { generation: sealed_generation(row)?, nonce: row.try_get("nonce")?, ciphertext: row.try_get("ciphertext")? })
}

fn sealed_generation(row: &sqlx::sqlite::SqliteRow) -> Result<u32, SecretError> {
    let generation: i64 = row.try_get("key_gen")?;
    u32::try_from(generation).map_err(|_| StoreError::Corrupt { what: "secret key generation" }.into())
}

async fn select_one(conn: &mut sqlx::SqliteConnection, key_id: &str, selector: &Selector) -> Result<Option<sqlx::sqlite::SqliteRow>, SecretError> {
    let (column, wanted) = match selector {
        Selector::Id(id) => ("id", id),
        Selector::Name(name) => ("name", name),
    };
    let sql = format!("SELECT {COLUMNS}, key_gen, nonce, ciphertext FROM secrets WHERE key_id = ? AND {column} = ?");
    Ok(sqlx::query(&sql).bind(key_id).bind(wanted).fetch_optional(conn).await?)
}

#[cfg(test)]
mod tests;

/// Rules' `${e2b.secrets.NAME}` placeholders are filled in from here, on the host,
/// per request: an update reaches the next request, a deleted secret fails it.
#[async_trait::async_trait]
impl hutch_net::inspect::SecretVault for Secrets {
    async fn reveal(&self, owner: &str, name: &str) -> Result<Zeroizing<String>, String> {
        match self.value(owner, name).await {
            Ok(value) => Ok(value),
            Err(SecretError::NotFound | SecretError::Invalid(_)) => Err(format!("secret `{name}` no longer exists for the API key that made the sandbox")),
            Err(e) => Err(format!("secret `{name}` could not be read: {}", hutch_proto::error_chain(&e))),
        }
    }
}
