//! A `COPY`'s files, taken from the build context on the host: sources (paths or
//! globs, never outside the context, minus what `.dockerignore` excludes) gathered
//! into one tar laid out as they land under the destination. The tar is written the
//! same way every time (sorted, owner 0, mtime 0), so its hash is the step's cache key.

use crate::budget::{Budget, BudgetError};
use globset::{GlobBuilder, GlobMatcher};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Component, Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    #[error("the COPY source '{0}' is outside the build context; name files inside it")]
    Outside(String),
    #[error("the COPY source '{src}' is not in the build context (nothing there has that name, or .dockerignore leaves it out); name a file that is")]
    Missing { src: String },
    #[error("COPY with more than one source file needs a destination directory ending in '/', not '{0}'")]
    DestNotDir(String),
    #[error("'{pattern}' in .dockerignore is not a valid pattern: {detail}")]
    BadIgnore { pattern: String, detail: String },
    #[error("'{0}' is not a valid COPY source pattern")]
    BadPattern(String),
    /// `path` is relative to the context (or the name the file takes in the COPY): the
    /// context may be hutch's scratch directory, whose host path a tenant is not shown.
    #[error("reading '{}' in the build context: {source}; make it a readable file or leave it out", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    /// The tar hutch writes is on the host: its path is not the tenant's to read.
    #[error("writing the COPY's files on the host: {0}")]
    Write(#[source] std::io::Error),
    #[error(transparent)]
    Budget(#[from] BudgetError),
}

/// `.dockerignore`: patterns in order, a later match (or `!` exception) winning; a
/// pattern matching a directory excludes what is under it.
#[derive(Default)]
pub struct Ignore {
    rules: Vec<(GlobMatcher, bool)>,
}

impl Ignore {
    pub fn parse(text: &str) -> Result<Ignore, ContextError> {
        let mut rules = Vec::new();
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let (negated, pattern) = match line.strip_prefix('!') {
                Some(rest) => (true, rest.trim()),
                None => (false, line),
            };
            let cleaned = clean(pattern).map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
            if cleaned.is_empty() {
                continue;
            }
            let glob = GlobBuilder::new(&cleaned)
                .literal_separator(true)
                .build()
                .map_err(|e| ContextError::BadIgnore { pattern: line.to_string(), detail: e.kind().to_string() })?;
            rules.push((glob.compile_matcher(), negated));
        }
        Ok(Ignore { rules })
    }

    /// Reads `.dockerignore` in `context`, if there is one.
    pub fn of_context(context: &Path) -> Result<Ignore, ContextError> {
        let path = context.join(".dockerignore");
        match std::fs::read_to_string(&path) {
            Ok(text) => Ignore::parse(&text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Ignore::default()),
            Err(source) => Err(ContextError::Read { path: inside(context, &path), source }),
        }
    }

    /// Whether `rel` (relative to the context) is left out.
    pub fn excludes(&self, rel: &Path) -> bool {
        let mut excluded = false;
        for (glob, negated) in &self.rules {
            if rel.ancestors().filter(|a| !a.as_os_str().is_empty()).any(|a| glob.is_match(a)) {
                excluded = !negated;
            }
        }
        excluded
    }
}

/// `path` as the build context names it: relative to `context`, never a host path.
fn inside(context: &Path, path: &Path) -> PathBuf {
    match path.strip_prefix(context) {
        Ok(rel) if rel.as_os_str().is_empty() => PathBuf::from("."),
        Ok(rel) => rel.to_path_buf(),
        Err(_) => path.file_name().map(PathBuf::from).unwrap_or_else(|| PathBuf::from(".")),
    }
}

/// `path` relative and without `.`/`..` (None when it climbs out).
fn clean(path: &str) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in Path::new(path).components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Some(out)
}

/// What E2B's builder copies for an SDK `copy(src, …)`: `src` itself, or, when it is a
/// pattern (`*`, `?`, `[`, `{`), the directory before its first wildcard component
/// (doublestar's `SplitPattern`; `.` when the first one has it). The SDK has matched the
/// pattern and uploaded only what matched, under that directory, so copying the
/// directory's contents is copying the matches, symlinks as the SDK sent them (links,
/// unless it was told to resolve them). `folder/*` to `folder` fills `folder`.
pub fn pattern_base(src: &str) -> &str {
    let Some(wild) = src.find(['*', '?', '[', '{']) else { return src };
    match src[..wild].rfind('/') {
        Some(0) => "/",
        Some(slash) => &src[..slash],
        None => ".",
    }
}

/// One `COPY`'s files, ready for the guest.
#[derive(Debug, Clone)]
pub struct CopyFiles {
    /// The tar (entries relative to the destination directory, or one file).
    pub tar: PathBuf,
    /// The tar holds one file that becomes the destination itself.
    pub single: bool,
    /// SHA-256 of the tar: the step's cache input.
    pub hash: String,
    pub entries: usize,
}

/// Gathers `srcs` from `context` for a copy to `dest`, into the tar `out`.
pub fn collect(context: &Path, srcs: &[String], dest: &str, ignore: &Ignore, out: &Path) -> Result<CopyFiles, ContextError> {
    collect_within(context, srcs, dest, ignore, out, &mut Budget::unlimited())
}

/// [`collect`], taking every byte of the tar from `budget` before it is written; a
/// tar refused part way is removed.
pub fn collect_within(context: &Path, srcs: &[String], dest: &str, ignore: &Ignore, out: &Path, budget: &mut Budget) -> Result<CopyFiles, ContextError> {
    let read = |path: &Path| {
        let path = inside(context, path);
        move |source| ContextError::Read { path, source }
    };
    // (name in the tar, file on the host)
    let mut items: Vec<(PathBuf, PathBuf)> = Vec::new();
    let mut sources = 0;
    let mut any_dir = false;
    for src in srcs {
        let rel = clean(src).ok_or_else(|| ContextError::Outside(src.clone()))?;
        let matches = if src.contains(['*', '?', '[']) {
            let glob = GlobBuilder::new(&rel.to_string_lossy()).literal_separator(true).build().map_err(|_| ContextError::BadPattern(src.clone()))?.compile_matcher();
            let mut found = Vec::new();
            walk(context, Path::new(""), ignore, &mut |r, _| {
                if glob.is_match(r) {
                    found.push(r.to_path_buf());
                }
            })?;
            // A directory matched whole: its own entries are not matches too.
            let all = found.clone();
            found.retain(|f| !all.iter().any(|other| other != f && f.starts_with(other)));
            found
        } else if rel.as_os_str().is_empty() {
            vec![PathBuf::new()]
        } else {
            let exists = std::fs::metadata(context.join(&rel)).is_ok() && !ignore.excludes(&rel);
            if exists { vec![rel.clone()] } else { Vec::new() }
        };
        if matches.is_empty() {
            return Err(ContextError::Missing { src: src.clone() });
        }
        for m in matches {
            let host = context.join(&m);
            // Sources may be symlinks, followed as Docker does, but never out of the context.
            let real = std::fs::canonicalize(&host).map_err(read(&host))?;
            let root = std::fs::canonicalize(context).map_err(read(context))?;
            if !real.starts_with(&root) {
                return Err(ContextError::Outside(src.clone()));
            }
            sources += 1;
            if real.is_dir() {
                any_dir = true;
                walk(context, &m, ignore, &mut |r, _| {
                    if let Ok(inside) = r.strip_prefix(&m) {
                        items.push((inside.to_path_buf(), context.join(r)));
                    }
                })?;
            } else {
                items.push((PathBuf::from(m.file_name().unwrap_or(m.as_os_str())), real));
            }
        }
    }
    let single = sources == 1 && !any_dir && !dest.ends_with('/');
    if sources > 1 && !dest.ends_with('/') {
        return Err(ContextError::DestNotDir(dest.to_string()));
    }
    items.sort();
    items.dedup_by(|a, b| a.0 == b.0);
    let written = write_tar(&items, out, budget);
    if written.is_err() {
        let _ = std::fs::remove_file(out);
    }
    Ok(CopyFiles { single, ..written? })
}

/// Calls `each(relative path, host path)` for everything under `context/start` (not
/// `start` itself), in name order, minus what `ignore` excludes.
fn walk(context: &Path, start: &Path, ignore: &Ignore, each: &mut dyn FnMut(&Path, &Path)) -> Result<(), ContextError> {
    let dir = context.join(start);
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .map_err(|source| ContextError::Read { path: inside(context, &dir), source })?
        .flatten()
        .map(|e| e.file_name())
        .collect();
    names.sort();
    for name in names {
        let rel = start.join(&name);
        if ignore.excludes(&rel) {
            continue;
        }
        let host = context.join(&rel);
        each(&rel, &host);
        if std::fs::symlink_metadata(&host).is_ok_and(|m| m.is_dir()) {
            walk(context, &rel, ignore, each)?;
        }
    }
    Ok(())
}

/// Writes a hashed writer's bytes to a file and to SHA-256 as they go, each taken
/// from the budget first.
struct Hashing<'b, W> {
    inner: W,
    hash: Sha256,
    budget: &'b mut Budget,
}

impl<W: Write> Write for Hashing<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.budget.take(buf.len() as u64).map_err(std::io::Error::other)?;
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn write_tar(items: &[(PathBuf, PathBuf)], out: &Path, budget: &mut Budget) -> Result<CopyFiles, ContextError> {
    use std::os::unix::fs::PermissionsExt;
    let werr = |source: std::io::Error| match source.get_ref().and_then(|e| e.downcast_ref::<BudgetError>()) {
        Some(refused) => ContextError::Budget(refused.clone()),
        None => ContextError::Write(source),
    };
    let file = std::fs::File::create(out).map_err(werr)?;
    let mut tar = tar::Builder::new(Hashing { inner: std::io::BufWriter::new(file), hash: Sha256::new(), budget });
    for (name, host) in items {
        let meta = std::fs::symlink_metadata(host).map_err(|source| ContextError::Read { path: name.clone(), source })?;
        let mut header = tar::Header::new_gnu();
        header.set_mode(meta.permissions().mode() & 0o7777);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        if meta.is_dir() {
            header.set_entry_type(tar::EntryType::Directory);
            header.set_size(0);
            tar.append_data(&mut header, name, std::io::empty()).map_err(werr)?;
        } else if meta.file_type().is_symlink() {
            let target = std::fs::read_link(host).map_err(|source| ContextError::Read { path: name.clone(), source })?;
            header.set_entry_type(tar::EntryType::Symlink);
            header.set_size(0);
            tar.append_link(&mut header, name, &target).map_err(werr)?;
        } else if meta.is_file() {
            header.set_entry_type(tar::EntryType::Regular);
            header.set_size(meta.len());
            let file = std::fs::File::open(host).map_err(|source| ContextError::Read { path: name.clone(), source })?;
            tar.append_data(&mut header, name, file).map_err(werr)?;
        } else {
            continue; // sockets, FIFOs, devices: not build inputs
        }
    }
    let mut hashing = tar.into_inner().map_err(werr)?;
    hashing.flush().map_err(werr)?;
    Ok(CopyFiles { tar: out.to_path_buf(), single: false, hash: hex::encode(hashing.hash.finalize()), entries: items.len() })
}

/// A tar of one regular file `name` holding `content` (mode `mode`, root's, mtime 0).
pub fn single_file_tar(name: &str, content: &[u8], mode: u32) -> std::io::Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_mode(mode);
    header.set_mtime(0);
    header.set_size(content.len() as u64);
    tar.append_data(&mut header, name, content)?;
    tar.into_inner()
}

/// A `COPY <<EOF dest` here-document: one file of `content`.
pub fn here_doc(name: &str, content: &str, out: &Path) -> Result<CopyFiles, ContextError> {
    let werr = ContextError::Write;
    let bytes = single_file_tar(name, content.as_bytes(), 0o644).map_err(werr)?;
    std::fs::write(out, &bytes).map_err(werr)?;
    Ok(CopyFiles { tar: out.to_path_buf(), single: true, hash: hex::encode(Sha256::digest(&bytes)), entries: 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(tar: &Path) -> Vec<String> {
        let mut a = tar::Archive::new(std::fs::File::open(tar).expect("tar"));
        a.entries().expect("entries").map(|e| e.expect("entry").path().expect("path").to_string_lossy().into_owned()).collect()
    }

    fn context() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("dir");
        let root = dir.path();
        std::fs::create_dir_all(root.join("app/sub")).expect("dirs");
        std::fs::write(root.join("app/main.py"), "print(1)\n").expect("file");
        std::fs::write(root.join("app/sub/x.txt"), "x").expect("file");
        std::fs::write(root.join("app/debug.log"), "noise").expect("file");
        std::fs::write(root.join("req.txt"), "six\n").expect("file");
        std::fs::write(root.join("a.md"), "a").expect("file");
        std::fs::write(root.join("b.md"), "b").expect("file");
        dir
    }

    #[test]
    fn a_directory_copies_its_contents_minus_ignored_files() {
        let ctx = context();
        let ignore = Ignore::parse("# logs\n**/*.log\n").expect("ignore");
        let out = ctx.path().join("../copy.tar");
        let files = collect(ctx.path(), &["app".into()], "/srv/", &ignore, &out).expect("collect");
        assert_eq!(names(&out), ["main.py", "sub", "sub/x.txt"]);
        assert!(!files.single);
        // The same files give the same hash; a changed file another.
        let again = collect(ctx.path(), &["app".into()], "/srv/", &ignore, &out).expect("again");
        assert_eq!(files.hash, again.hash);
        std::fs::write(ctx.path().join("app/main.py"), "print(2)\n").expect("edit");
        assert_ne!(files.hash, collect(ctx.path(), &["app".into()], "/srv/", &ignore, &out).expect("edited").hash);
        let _ = std::fs::remove_file(out);
    }

    #[test]
    fn one_file_is_single_and_globs_need_a_directory() {
        let ctx = context();
        let out = ctx.path().join("t.tar");
        let none = Ignore::default();
        assert!(collect(ctx.path(), &["req.txt".into()], "/app/requirements.txt", &none, &out).expect("file").single);
        assert!(!collect(ctx.path(), &["req.txt".into()], "/app/", &none, &out).expect("into dir").single);
        let err = collect(ctx.path(), &["*.md".into()], "/docs", &none, &out).expect_err("two files");
        assert!(err.to_string().contains("ending in '/'"), "{err}");
        collect(ctx.path(), &["*.md".into()], "/docs/", &none, &out).expect("glob");
        assert_eq!(names(&out), ["a.md", "b.md"]);
    }

    #[test]
    fn sources_outside_or_missing_or_ignored_are_refused() {
        let ctx = context();
        let out = ctx.path().join("t.tar");
        let none = Ignore::default();
        assert!(matches!(collect(ctx.path(), &["../etc/passwd".into()], "/x", &none, &out), Err(ContextError::Outside(_))));
        std::os::unix::fs::symlink("/etc", ctx.path().join("hostetc")).expect("link");
        assert!(matches!(collect(ctx.path(), &["hostetc/passwd".into()], "/x", &none, &out), Err(ContextError::Outside(_))));
        assert!(matches!(collect(ctx.path(), &["nope.txt".into()], "/x", &none, &out), Err(ContextError::Missing { .. })));
        let ignore = Ignore::parse("req.txt\n").expect("ignore");
        assert!(matches!(collect(ctx.path(), &["req.txt".into()], "/x", &ignore, &out), Err(ContextError::Missing { .. })));
        let exception = Ignore::parse("*.md\n!b.md\n").expect("ignore");
        assert!(exception.excludes(Path::new("a.md")) && !exception.excludes(Path::new("b.md")));
    }

    #[test]
    fn a_tar_past_its_allowance_or_the_disk_reserve_is_refused_and_removed() {
        let ctx = context();
        std::fs::write(ctx.path().join("app/big.bin"), vec![7u8; 1 << 20]).expect("file");
        let out = ctx.path().join("t.tar");
        let none = Ignore::default();
        let mut budget = Budget::new(ctx.path(), u64::MAX, 0);
        budget.begin(512 << 10);
        let e = collect_within(ctx.path(), &["app".into()], "/srv/", &none, &out, &mut budget).expect_err("past the allowance");
        assert!(matches!(e, ContextError::Budget(BudgetError::Write { .. })), "{e}");
        assert!(!out.exists(), "the partial tar is removed");
        let free = hutch_vmm::space::available(ctx.path()).expect("statvfs");
        let mut short = Budget::new(ctx.path(), u64::MAX, free + (1 << 30));
        let e = collect_within(ctx.path(), &["req.txt".into()], "/srv/", &none, &out, &mut short).expect_err("short of disk");
        assert!(e.to_string().starts_with("the server is short of disk") && !out.exists(), "{e}");
        let mut roomy = Budget::new(ctx.path(), u64::MAX, 0);
        roomy.begin(2 << 20);
        collect_within(ctx.path(), &["app".into()], "/srv/", &none, &out, &mut roomy).expect("within");
    }

    /// The context of an API build is hutch's scratch directory: what the tenant reads
    /// names files as the context does, never the host path.
    #[test]
    fn errors_name_files_relative_to_the_context() {
        let ctx = context();
        let out = ctx.path().join("t.tar");
        let none = Ignore::default();
        let host = ctx.path().display().to_string();
        let missing = collect(ctx.path(), &["nope.txt".into()], "/x", &none, &out).expect_err("missing").to_string();
        assert!(missing.contains("'nope.txt'") && !missing.contains(&host), "{missing}");
        std::os::unix::fs::symlink(ctx.path().join("gone"), ctx.path().join("app/dangling")).expect("link");
        let unreadable = collect(ctx.path(), &["app/*".into()], "/x/", &none, &out).expect_err("dangling").to_string();
        assert!(unreadable.contains("'app/dangling'") && !unreadable.contains(&host), "{unreadable}");
        let unwritable = collect(ctx.path(), &["req.txt".into()], "/x/", &none, &ctx.path().join("no/such/dir/t.tar")).expect_err("write").to_string();
        assert!(!unwritable.contains(&host), "{unwritable}");
    }

    #[test]
    fn a_pattern_copies_the_directory_before_its_first_wildcard() {
        assert_eq!(pattern_base("folder/*"), "folder");
        assert_eq!(pattern_base("a/b/*.txt"), "a/b");
        assert_eq!(pattern_base("a/b*/c"), "a");
        assert_eq!(pattern_base("*.txt"), ".");
        assert_eq!(pattern_base("src/[ab].py"), "src");
        assert_eq!(pattern_base("app"), "app");
    }

}
