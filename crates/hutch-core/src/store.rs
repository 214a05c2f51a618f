//! Control-plane state in SQL (SQLite by default; the queries are portable to
//! PostgreSQL): API keys, stored hashed, and the sandboxes each key owns.

use crate::time::Timestamp;
use sha2::{Digest, Sha256};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use sqlx::Row;
use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("opening the database {0}")]
    Open(String, #[source] sqlx::Error),
    #[error("migrating the database")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    #[error("database query failed")]
    Query(#[from] sqlx::Error),
    #[error("corrupt {what} in the database")]
    Corrupt { what: &'static str },
    /// A stored time that does not parse: never read as some other instant.
    #[error("sandbox {id}'s {column} in the database")]
    BadTime { id: String, column: &'static str, #[source] source: crate::time::BadTime },
    /// Two requests raced for one snapshot name; the database kept the first.
    #[error("a snapshot named '{0}' exists; delete it or pick another name")]
    NameTaken(String),
}

#[derive(Clone)]
pub struct Store {
    pool: SqlitePool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ApiKeyInfo {
    pub id: String,
    pub name: String,
    pub created_at: String,
    pub revoked: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRow {
    pub id: String,
    pub key_id: String,
    pub template: String,
    pub state: String,
    pub cpu_count: i64,
    pub memory_mb: i64,
    pub disk_mb: i64,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub envd_token: Option<String>,
    /// Port traffic needs it (E2B's `allowPublicTraffic: false`).
    pub traffic_token: Option<String>,
    pub started_at: Timestamp,
    pub end_at: Timestamp,
    pub qemu_pid: Option<i64>,
    pub dir: String,
    /// On timeout, pause instead of kill.
    pub auto_pause: bool,
    /// Data-plane traffic to it while paused resumes it (E2B's `autoResume`).
    pub auto_resume: bool,
    /// The timeout's auto-pause keeps memory too (E2B's `autoPauseMemory`).
    pub auto_pause_memory: bool,
    /// What its pause kept, while it is paused: its files' word, never stored.
    pub pause_mode: Option<crate::sandbox::layout::PauseMode>,
    /// Why the sandbox failed, if it has: its owner's word, never stored (a failed
    /// sandbox does not outlive the server).
    pub failure: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotRow {
    pub id: String,
    pub key_id: String,
    pub name: Option<String>,
    pub template: String,
    pub source_sandbox: Option<String>,
    /// Holds memory (restores running processes), not only the disk.
    pub memory: bool,
    pub dir: String,
    pub created_at: String,
}

pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

pub fn now_rfc3339() -> String {
    rfc3339(std::time::SystemTime::now())
}

pub fn rfc3339(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// A new API key in the E2B format the SDKs accept: `e2b_` + 40 hex digits.
pub fn generate_key() -> String {
    let bytes: [u8; 20] = rand::random();
    format!("e2b_{}", hex::encode(bytes))
}

impl Store {
    pub async fn open_file(path: &Path) -> Result<Store, StoreError> {
        let url = format!("sqlite://{}", path.display());
        let opts = SqliteConnectOptions::from_str(&url)
            .map_err(|e| StoreError::Open(url.clone(), e))?
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new().max_connections(4).connect_with(opts).await.map_err(|e| StoreError::Open(url, e))?;
        sqlx::migrate!("./migrations").run(&pool).await.map_err(StoreError::Migrate)?;
        Ok(Store { pool })
    }

    /// The pool, for the tables another module owns (`secrets`).
    pub(crate) fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    pub async fn create_key(&self, name: &str) -> Result<(ApiKeyInfo, String), StoreError> {
        let key = generate_key();
        let info = self.insert_key(name, &key).await?;
        Ok((info, key))
    }

    /// Registers a key given from outside (HUTCH_API_KEY), unless already known.
    pub async fn ensure_key(&self, name: &str, key: &str) -> Result<ApiKeyInfo, StoreError> {
        let known = sqlx::query("SELECT id, name, created_at, revoked_at FROM api_keys WHERE key_hash = $1")
            .bind(hash_key(key))
            .fetch_optional(&self.pool)
            .await?;
        if let Some(row) = known {
            return Ok(key_info(&row));
        }
        self.insert_key(name, key).await
    }

    async fn insert_key(&self, name: &str, key: &str) -> Result<ApiKeyInfo, StoreError> {
        let id = format!("key_{}", &hex::encode(rand::random::<[u8; 6]>()));
        let created_at = now_rfc3339();
        sqlx::query("INSERT INTO api_keys (id, name, key_hash, created_at) VALUES ($1, $2, $3, $4)")
            .bind(&id)
            .bind(name)
            .bind(hash_key(key))
            .bind(&created_at)
            .execute(&self.pool)
            .await?;
        Ok(ApiKeyInfo { id, name: name.into(), created_at, revoked: false })
    }

    /// The id of a valid (not revoked) key.
    pub async fn key_id(&self, key: &str) -> Result<Option<String>, StoreError> {
        let row = sqlx::query("SELECT id FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL")
            .bind(hash_key(key))
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| r.get::<String, _>("id")))
    }

    pub async fn list_keys(&self) -> Result<Vec<ApiKeyInfo>, StoreError> {
        let rows = sqlx::query("SELECT id, name, created_at, revoked_at FROM api_keys ORDER BY created_at").fetch_all(&self.pool).await?;
        Ok(rows.iter().map(key_info).collect())
    }

    /// Revokes a key; false when there is no such key.
    pub async fn revoke_key(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL")
            .bind(now_rfc3339())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    pub async fn insert_sandbox(&self, s: &SandboxRow) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO sandboxes (id, key_id, template, state, cpu_count, memory_mb, disk_mb, metadata, env_vars, envd_token, started_at, end_at, qemu_pid, dir, auto_pause, traffic_token, auto_resume, auto_pause_memory) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18)",
        )
        .bind(&s.id)
        .bind(&s.key_id)
        .bind(&s.template)
        .bind(&s.state)
        .bind(s.cpu_count)
        .bind(s.memory_mb)
        .bind(s.disk_mb)
        .bind(serde_json::to_string(&s.metadata).unwrap_or_else(|_| "{}".into()))
        .bind(serde_json::to_string(&s.env_vars).unwrap_or_else(|_| "{}".into()))
        .bind(&s.envd_token)
        .bind(s.started_at.to_string())
        .bind(s.end_at.to_string())
        .bind(s.qemu_pid)
        .bind(&s.dir)
        .bind(s.auto_pause)
        .bind(&s.traffic_token)
        .bind(s.auto_resume)
        .bind(s.auto_pause_memory)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Records a pause (state `paused`, no QEMU) or a resume (`running`, its pid).
    pub async fn set_state(&self, id: &str, state: &str, qemu_pid: Option<i64>, end_at: Timestamp) -> Result<(), StoreError> {
        sqlx::query("UPDATE sandboxes SET state = $1, qemu_pid = $2, end_at = $3 WHERE id = $4")
            .bind(state)
            .bind(qemu_pid)
            .bind(end_at.to_string())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn insert_snapshot(&self, s: &SnapshotRow) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO snapshots (id, key_id, name, template, source_sandbox, memory, dir, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&s.id)
        .bind(&s.key_id)
        .bind(&s.name)
        .bind(&s.template)
        .bind(&s.source_sandbox)
        .bind(s.memory)
        .bind(&s.dir)
        .bind(&s.created_at)
        .execute(&self.pool)
        .await
        .map_err(|e| match (&s.name, e.as_database_error().is_some_and(|d| d.is_unique_violation())) {
            (Some(name), true) => StoreError::NameTaken(name.clone()),
            _ => StoreError::Query(e),
        })?;
        Ok(())
    }

    /// A key's snapshot by id or by name.
    pub async fn snapshot(&self, key_id: &str, id_or_name: &str) -> Result<Option<SnapshotRow>, StoreError> {
        let row = sqlx::query("SELECT * FROM snapshots WHERE key_id = $1 AND (id = $2 OR name = $2)")
            .bind(key_id)
            .bind(id_or_name)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(snapshot_row))
    }

    pub async fn snapshots(&self, key_id: &str) -> Result<Vec<SnapshotRow>, StoreError> {
        let rows = sqlx::query("SELECT * FROM snapshots WHERE key_id = $1 ORDER BY created_at, id").bind(key_id).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(snapshot_row).collect())
    }

    /// Every snapshot's directory, whoever owns it (to tell which files are in use).
    pub async fn snapshot_dirs(&self) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar("SELECT dir FROM snapshots").fetch_all(&self.pool).await?)
    }

    pub async fn delete_snapshot(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM snapshots WHERE id = $1").bind(id).execute(&self.pool).await?;
        Ok(())
    }

    pub async fn set_end_at(&self, id: &str, end_at: Timestamp) -> Result<(), StoreError> {
        sqlx::query("UPDATE sandboxes SET end_at = $1 WHERE id = $2").bind(end_at.to_string()).bind(id).execute(&self.pool).await?;
        Ok(())
    }

    pub async fn delete_sandbox(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM sandboxes WHERE id = $1").bind(id).execute(&self.pool).await?;
        Ok(())
    }

    pub async fn sandboxes(&self) -> Result<Vec<SandboxRow>, StoreError> {
        self.sandbox_records().await?.into_iter().collect()
    }

    /// Every sandbox row, each read on its own: one damaged row is its own error, and
    /// the rest still read (a server starting adopts those and leaves that one be).
    pub async fn sandbox_records(&self) -> Result<Vec<Result<SandboxRow, StoreError>>, StoreError> {
        let rows = sqlx::query("SELECT * FROM sandboxes ORDER BY started_at, id").fetch_all(&self.pool).await?;
        Ok(rows.iter().map(sandbox_row).collect())
    }
}

fn key_info(r: &sqlx::sqlite::SqliteRow) -> ApiKeyInfo {
    ApiKeyInfo {
        id: r.get("id"),
        name: r.get("name"),
        created_at: r.get("created_at"),
        revoked: r.get::<Option<String>, _>("revoked_at").is_some(),
    }
}

fn sandbox_row(r: &sqlx::sqlite::SqliteRow) -> Result<SandboxRow, StoreError> {
    let map = |col: &str| -> Result<BTreeMap<String, String>, StoreError> {
        serde_json::from_str(&r.get::<String, _>(col)).map_err(|_| StoreError::Corrupt { what: "sandbox metadata" })
    };
    let time = |column: &'static str| -> Result<Timestamp, StoreError> {
        Timestamp::parse(&r.get::<String, _>(column)).map_err(|source| StoreError::BadTime { id: r.get("id"), column, source })
    };
    Ok(SandboxRow {
        id: r.get("id"),
        key_id: r.get("key_id"),
        template: r.get("template"),
        state: r.get("state"),
        cpu_count: r.get("cpu_count"),
        memory_mb: r.get("memory_mb"),
        disk_mb: r.get("disk_mb"),
        metadata: map("metadata")?,
        env_vars: map("env_vars")?,
        envd_token: r.get("envd_token"),
        traffic_token: r.get("traffic_token"),
        started_at: time("started_at")?,
        end_at: time("end_at")?,
        qemu_pid: r.get("qemu_pid"),
        dir: r.get("dir"),
        auto_pause: r.get("auto_pause"),
        auto_resume: r.get("auto_resume"),
        auto_pause_memory: r.get("auto_pause_memory"),
        pause_mode: None,
        failure: None,
    })
}

fn snapshot_row(r: &sqlx::sqlite::SqliteRow) -> SnapshotRow {
    SnapshotRow {
        id: r.get("id"),
        key_id: r.get("key_id"),
        name: r.get("name"),
        template: r.get("template"),
        source_sandbox: r.get("source_sandbox"),
        memory: r.get("memory"),
        dir: r.get("dir"),
        created_at: r.get("created_at"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_malformed_stored_time_is_an_error_naming_the_sandbox_not_the_epoch() {
        let tmp = tempfile::tempdir().expect("tmp");
        let store = Store::open_file(&tmp.path().join("t.db")).await.expect("open");
        let (key, _) = store.create_key("ci").await.expect("key");
        let started = Timestamp::parse("2026-12-06T02:03:43.123Z").expect("time");
        let row = SandboxRow {
            id: "isbx".into(),
            key_id: key.id.clone(),
            template: "base".into(),
            state: "running".into(),
            cpu_count: 1,
            memory_mb: 512,
            disk_mb: 1,
            metadata: Default::default(),
            env_vars: Default::default(),
            envd_token: None,
            traffic_token: None,
            started_at: started,
            end_at: started.after(std::time::Duration::from_secs(300)),
            qemu_pid: Some(7),
            dir: "/nonexistent".into(),
            auto_pause: false,
            auto_resume: false,
            auto_pause_memory: true,
            pause_mode: None,
            failure: None,
        };
        store.insert_sandbox(&row).await.expect("insert");
        let read = store.sandboxes().await.expect("read");
        assert_eq!((read[0].started_at, read[0].end_at), (row.started_at, row.end_at), "times read back as written");
        sqlx::query("UPDATE sandboxes SET end_at = 'soon'").execute(&store.pool).await.expect("damage");
        let e = store.sandboxes().await.expect_err("a bad time is not read as another instant");
        assert!(matches!(&e, StoreError::BadTime { id, column: "end_at", .. } if id == "isbx"), "{e:?}");
    }

    #[tokio::test]
    async fn keys_are_hashed_and_revocable() {
        let tmp = tempfile::tempdir().expect("tmp");
        let store = Store::open_file(&tmp.path().join("t.db")).await.expect("open");
        let (info, key) = store.create_key("ci").await.expect("create");
        assert!(key.starts_with("e2b_") && key.len() == 44);
        assert_eq!(store.key_id(&key).await.expect("q"), Some(info.id.clone()));
        assert_eq!(store.key_id("e2b_wrong").await.expect("q"), None);
        let raw: Vec<String> = sqlx::query_scalar("SELECT key_hash FROM api_keys").fetch_all(&store.pool).await.expect("q");
        assert!(!raw.iter().any(|h| h.contains(&key)), "the key is stored in clear");
        assert!(store.revoke_key(&info.id).await.expect("revoke"));
        assert_eq!(store.key_id(&key).await.expect("q"), None);
        assert!(!store.revoke_key("key_missing").await.expect("revoke"));
        let again = store.ensure_key("env", &key).await.expect("ensure");
        assert!(again.revoked, "ensure_key must not resurrect a revoked key");
    }

    #[tokio::test]
    async fn a_second_snapshot_of_one_name_is_refused_by_name() {
        let tmp = tempfile::tempdir().expect("tmp");
        let store = Store::open_file(&tmp.path().join("t.db")).await.expect("open");
        let (key, _) = store.create_key("ci").await.expect("create");
        let row = |id: &str| SnapshotRow {
            id: id.into(),
            key_id: key.id.clone(),
            name: Some("nightly".into()),
            template: "base".into(),
            source_sandbox: None,
            memory: true,
            dir: format!("/s/{id}"),
            created_at: "2026-12-01T00:00:00Z".into(),
        };
        store.insert_snapshot(&row("a")).await.expect("first");
        assert!(matches!(store.insert_snapshot(&row("b")).await, Err(StoreError::NameTaken(n)) if n == "nightly"));
    }
}
