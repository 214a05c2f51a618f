//! The keys secret values are sealed with, kept outside the database: one file per
//! generation in `$HUTCH_HOME/secrets/keys/` (`<generation>.key`, 32 random bytes,
//! mode 0600, the directory 0700). A database copied away without that directory holds
//! only ciphertext.
//!
//! Every value is sealed with AES-256-GCM (ring) under the newest generation, with a
//! fresh random nonce, and bound by its additional data to what the caller names (the
//! secret, its version, its API key and the generation: `Secrets`), so a ciphertext
//! moved to another row, or an older one put back, does not open.
//!
//! A rotation (`Secrets::rotate_key`) adds a generation, seals every value again under
//! it in one transaction, and only then removes the older files. Processes share the
//! directory (a server and `hutch secret`), so whoever seals or opens holds a shared
//! flock on `.lock` from reading the keys until its row is written or read, and a
//! rotation holds it exclusively: no value is ever sealed with a generation that a
//! rotation is about to remove. A rotation first takes `.gate`, which every shared
//! holder passes on its way in, so a stream of requests cannot keep it out.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;
use zeroize::Zeroizing;

const KEY_LEN: usize = 32;
/// How long an operation waits for a rotation in another process to finish.
const LOCK_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum KeyringError {
    #[error("{what} {}: {source}", path.display())]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{} is not a key hutch wrote (it must be exactly {KEY_LEN} bytes); restore it from a backup, or remove the secrets it sealed", .0.display())]
    BadKey(PathBuf),
    #[error("no key of generation {0} in the secrets key directory: its values cannot be opened (was the directory restored from an older backup?)")]
    MissingGeneration(u32),
    #[error("another hutch held the secrets key lock for {} s (a rotation?); try again", LOCK_WAIT.as_secs())]
    Busy,
    #[error("a stored secret did not open with its key (the database or the key directory was changed outside hutch)")]
    Tampered,
    #[error("{} holds no key, but this database has secrets sealed with one: restore the directory from where the database came from (hutch will not make a new key that opens none of them)", .0.display())]
    NoKeys(PathBuf),
    #[error("the key of generation {0} in the secrets key directory is not the one this database's secrets were sealed with (a directory from another home?); restore the right one")]
    Mismatch(u32),
    #[error("the system's random number generator failed")]
    Random,
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> KeyringError + 'a {
    move |source| KeyringError::Io { what, path: path.to_path_buf(), source }
}

/// The key directory of one home.
#[derive(Debug, Clone)]
pub struct Keyring {
    dir: PathBuf,
}

/// The keys as read under the lock, held for as long as the lock (and, for a
/// rotation, the gate).
pub struct Keys {
    keys: BTreeMap<u32, Zeroizing<[u8; KEY_LEN]>>,
    _held: Vec<std::fs::File>,
}

/// A sealed value as stored.
pub struct Sealed {
    pub generation: u32,
    pub nonce: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

impl Keyring {
    pub fn at(home_root: &Path) -> Keyring {
        Keyring { dir: home_root.join("secrets").join("keys") }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads the keys under a shared lock. With none there, makes the first
    /// generation if `may_create` (nothing was ever sealed), else refuses.
    pub async fn shared(&self, may_create: bool) -> Result<Keys, KeyringError> {
        let dir = self.dir.clone();
        blocking(move || {
            let held = lock(&dir, false)?;
            let mut keys = read_keys(&dir)?;
            if keys.is_empty() {
                if !may_create {
                    return Err(KeyringError::NoKeys(dir));
                }
                // Made under the shared lock: two processes making the first key at
                // once both try `1.key` (a link never replaces a file), and one wins.
                write_key(&dir, 1)?;
                keys = read_keys(&dir)?;
            }
            Ok(Keys { keys, _held: held })
        })
        .await
    }

    /// Reads the keys under the gate and the exclusive lock (a rotation).
    pub async fn exclusive(&self) -> Result<Keys, KeyringError> {
        let dir = self.dir.clone();
        blocking(move || {
            let held = lock(&dir, true)?;
            let keys = read_keys(&dir)?;
            Ok(Keys { keys, _held: held })
        })
        .await
    }

    /// Adds generation `generation` (under the exclusive lock `keys` holds).
    pub fn add(&self, keys: &mut Keys, generation: u32) -> Result<(), KeyringError> {
        write_key(&self.dir, generation)?;
        keys.keys = read_keys(&self.dir)?;
        Ok(())
    }

    /// Removes every generation but `keep` (under the exclusive lock, once no row
    /// uses them), and what a writer that died mid-write left.
    pub fn retire_all_but(&self, keys: &mut Keys, keep: u32) -> Result<(), KeyringError> {
        for generation in keys.keys.keys().copied().filter(|g| *g != keep).collect::<Vec<_>>() {
            let path = key_path(&self.dir, generation);
            std::fs::remove_file(&path).map_err(io("removing", &path))?;
            keys.keys.remove(&generation);
        }
        for entry in std::fs::read_dir(&self.dir).map_err(io("reading", &self.dir))?.flatten() {
            if entry.file_name().to_str().is_some_and(|n| n.starts_with('.') && n.contains(".key.")) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        sync_dir(&self.dir)
    }
}

impl Keys {
    /// The generation new values are sealed with.
    pub fn newest(&self) -> u32 {
        self.keys.keys().next_back().copied().unwrap_or(1)
    }

    pub fn generations(&self) -> Vec<u32> {
        self.keys.keys().copied().collect()
    }

    /// What tells generation `generation`'s key from any other without giving it
    /// away: HMAC-SHA256 of a fixed text under it, in hex.
    pub fn fingerprint(&self, generation: u32) -> Result<String, KeyringError> {
        let bytes = self.keys.get(&generation).ok_or(KeyringError::MissingGeneration(generation))?;
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &bytes[..]);
        Ok(hex::encode(ring::hmac::sign(&key, b"hutch secrets key fingerprint").as_ref()))
    }

    fn key(&self, generation: u32) -> Result<LessSafeKey, KeyringError> {
        let bytes = self.keys.get(&generation).ok_or(KeyringError::MissingGeneration(generation))?;
        let unbound = UnboundKey::new(&AES_256_GCM, &bytes[..]).map_err(|_| KeyringError::Tampered)?;
        Ok(LessSafeKey::new(unbound))
    }

    /// Seals `plain` under `generation`, bound to `aad`.
    pub fn seal_with(&self, generation: u32, plain: &[u8], aad: &str) -> Result<Sealed, KeyringError> {
        let key = self.key(generation)?;
        let nonce: [u8; NONCE_LEN] = random()?;
        let mut buffer = plain.to_vec();
        key.seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad.as_bytes()), &mut buffer).map_err(|_| KeyringError::Tampered)?;
        Ok(Sealed { generation, nonce: nonce.to_vec(), ciphertext: buffer })
    }

    pub fn open(&self, sealed: &Sealed, aad: &str) -> Result<Zeroizing<Vec<u8>>, KeyringError> {
        let key = self.key(sealed.generation)?;
        let nonce = Nonce::try_assume_unique_for_key(&sealed.nonce).map_err(|_| KeyringError::Tampered)?;
        let mut buffer = Zeroizing::new(sealed.ciphertext.clone());
        let plain_len = key.open_in_place(nonce, Aad::from(aad.as_bytes()), &mut buffer).map_err(|_| KeyringError::Tampered)?.len();
        buffer.truncate(plain_len);
        Ok(buffer)
    }
}

fn random<const N: usize>() -> Result<[u8; N], KeyringError> {
    let mut bytes = [0u8; N];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes).map_err(|_| KeyringError::Random)?;
    Ok(bytes)
}

fn key_path(dir: &Path, generation: u32) -> PathBuf {
    dir.join(format!("{generation}.key"))
}

async fn blocking<T: Send + 'static>(work: impl FnOnce() -> Result<T, KeyringError> + Send + 'static) -> Result<T, KeyringError> {
    tokio::task::spawn_blocking(work).await.unwrap_or_else(|e| Err(KeyringError::Io { what: "waiting for", path: PathBuf::from("the key task"), source: std::io::Error::other(e.to_string()) }))
}

/// Makes the directory (0700, its parent too) and takes its locks: `.gate` then
/// `.lock`, both exclusively for a rotation (which keeps both); shared for everyone
/// else, who lets the gate go once past it. A rotation waiting at the gate thus stops
/// newcomers while the holders of `.lock` finish.
fn lock(dir: &Path, exclusive: bool) -> Result<Vec<std::fs::File>, KeyringError> {
    for d in [dir.parent().unwrap_or(dir), dir] {
        std::fs::create_dir_all(d).map_err(io("creating", d))?;
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).map_err(io("restricting", d))?;
    }
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    let gate = take(&dir.join(".gate"), exclusive, deadline)?;
    let lock = take(&dir.join(".lock"), exclusive, deadline)?;
    Ok(if exclusive { vec![gate, lock] } else { vec![lock] })
}

fn take(path: &Path, exclusive: bool, deadline: std::time::Instant) -> Result<std::fs::File, KeyringError> {
    let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).mode(0o600).open(path).map_err(io("opening", path))?;
    loop {
        let tried = if exclusive { file.try_lock() } else { file.try_lock_shared() };
        match tried {
            Ok(()) => return Ok(file),
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Err(std::fs::TryLockError::WouldBlock) => return Err(KeyringError::Busy),
            Err(std::fs::TryLockError::Error(e)) => return Err(KeyringError::Io { what: "locking", path: path.to_path_buf(), source: e }),
        }
    }
}

fn read_keys(dir: &Path) -> Result<BTreeMap<u32, Zeroizing<[u8; KEY_LEN]>>, KeyringError> {
    let mut keys = BTreeMap::new();
    for entry in std::fs::read_dir(dir).map_err(io("reading", dir))? {
        let entry = entry.map_err(io("reading", dir))?;
        let name = entry.file_name();
        let Some(generation) = name.to_str().and_then(|n| n.strip_suffix(".key")).and_then(|g| g.parse::<u32>().ok()) else { continue };
        let path = entry.path();
        let bytes = Zeroizing::new(std::fs::read(&path).map_err(io("reading", &path))?);
        let key: [u8; KEY_LEN] = bytes.as_slice().try_into().map_err(|_| KeyringError::BadKey(path.clone()))?;
        keys.insert(generation, Zeroizing::new(key));
    }
    Ok(keys)
}

/// Writes a new key file whole (a partial file renamed into place, never over one).
fn write_key(dir: &Path, generation: u32) -> Result<(), KeyringError> {
    let key = Zeroizing::new(random::<KEY_LEN>()?);
    let path = key_path(dir, generation);
    // A name of its own: two writers in one process, or a pid reused after a crash,
    // never meet at the same partial file.
    let partial = dir.join(format!(".{generation}.key.{:016x}", rand::random::<u64>()));
    let mut file = std::fs::OpenOptions::new().create_new(true).write(true).mode(0o600).open(&partial).map_err(io("creating", &partial))?;
    file.write_all(&key[..]).and_then(|()| file.sync_all()).map_err(io("writing", &partial))?;
    drop(file);
    // A hard link fails where a file exists: a key is never replaced.
    let linked = std::fs::hard_link(&partial, &path);
    let _ = std::fs::remove_file(&partial);
    match linked {
        Ok(()) => sync_dir(dir),
        // Another process made this generation first: its key is the one.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(KeyringError::Io { what: "creating", path, source: e }),
    }
}

fn sync_dir(dir: &Path) -> Result<(), KeyringError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io("syncing", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_value_opens_only_with_its_own_binding_and_survives_a_new_generation() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let ring = Keyring::at(tmp.path());
        assert!(matches!(ring.shared(false).await, Err(KeyringError::NoKeys(_))), "a key was made where one was owed");
        let keys = ring.shared(true).await.expect("first key");
        assert_eq!(keys.newest(), 1);
        let fingerprint = keys.fingerprint(1).expect("fingerprint");
        assert_eq!(fingerprint.len(), 64);
        let sealed = keys.seal_with(1, b"hunter2", "sec_a|1|key").expect("seal");
        assert!(!sealed.ciphertext.windows(7).any(|w| w == b"hunter2"), "the value is stored in the clear");
        assert_eq!(&keys.open(&sealed, "sec_a|1|key").expect("open")[..], b"hunter2");
        assert!(matches!(keys.open(&sealed, "sec_b|1|key"), Err(KeyringError::Tampered)), "opened under another secret's binding");
        drop(keys);
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        assert_eq!((mode(&tmp.path().join("secrets/keys")), mode(&tmp.path().join("secrets/keys/1.key"))), (0o700, 0o600));

        let mut keys = ring.exclusive().await.expect("exclusive");
        ring.add(&mut keys, 2).expect("second generation");
        assert_eq!(keys.newest(), 2);
        let again = keys.seal_with(2, &keys.open(&sealed, "sec_a|1|key").expect("open"), "sec_a|1|key").expect("reseal");
        ring.retire_all_but(&mut keys, 2).expect("retire");
        assert!(matches!(keys.open(&sealed, "sec_a|1|key"), Err(KeyringError::MissingGeneration(1))));
        assert_eq!(&keys.open(&again, "sec_a|1|key").expect("open")[..], b"hunter2");
        drop(keys);
        assert!(!tmp.path().join("secrets/keys/1.key").exists());
        let reloaded = ring.shared(false).await.expect("reload");
        assert_eq!(reloaded.newest(), 2, "a reload made a new first key");
        assert_ne!(reloaded.fingerprint(2).expect("fingerprint"), fingerprint);
    }

    #[tokio::test]
    async fn a_key_file_of_the_wrong_size_is_refused_by_name() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let ring = Keyring::at(tmp.path());
        drop(ring.shared(true).await.expect("first key"));
        std::fs::write(tmp.path().join("secrets/keys/1.key"), b"short").expect("write");
        let err = ring.shared(true).await.err().expect("a short key was read");
        assert!(err.to_string().contains("1.key"), "{err}");
    }
}
