//! Template root filesystems: a Debian bookworm tree made by mmdebstrap, written as a
//! raw ext4 image with `mkfs.ext4 -d` (no loop mounts). The agent is not in the image: it
//! comes from the initramfs, so any Linux root filesystem can be a template.

use crate::file_error::at;
use crate::progress::human_bytes;
use crate::recipes::{recipe, Recipe, MIRROR, SUITE};
use crate::run::run;
use crate::template::{Shape, Template, TemplateError, DISK_SIZE};
use crate::template_store::{install, sparse_image, MANIFEST};
use crate::{HutchHome, Progress};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;


/// Template `reference` (`name` or `name:tag`) if it is built; a tag it does not have is
/// an error saying which tags it has.
pub fn cached(home: &HutchHome, reference: &str) -> Result<Option<Template>, TemplateError> {
    let (name, tag) = crate::tags::split(reference);
    let name = recipe(name).map(|r| r.name).unwrap_or(name);
    if let Some(tag) = tag {
        if !home.template(name).join(MANIFEST).is_file() {
            return Ok(None);
        }
        return crate::tags::resolve(home, name, tag).map(Some).map_err(|e| TemplateError::Tag(Box::new(e)));
    }
    crate::template_store::current(home, name)
}

/// The template, built first if hutch knows how and it is not cached.
pub fn ensure(home: &HutchHome, reference: &str, progress: &dyn Progress) -> Result<Template, TemplateError> {
    // A tag names a build that exists or nothing; only the current build is made here.
    let name = match crate::tags::split(reference) {
        (name, None) => name,
        (_, Some(_)) => reference,
    };
    match cached(home, reference) {
        Ok(Some(t)) => return Ok(t),
        Ok(None) => {}
        // A damaged manifest of a template hutch can build: the build replaces it (old
        // builds stay for whatever stacks on them). A newer hutch's is left alone.
        Err(TemplateError::Manifest(e)) if e.is_replaceable() && recipe(name).is_some() => {
            tracing::warn!("rebuilding template '{name}': {e}");
        }
        Err(e) => return Err(e),
    }
    let Some(recipe) = recipe(name) else {
        return Err(TemplateError::Unknown { name: name.into() });
    };
    build_debian(home, recipe, progress)
}

fn build_debian(home: &HutchHome, recipe: &Recipe, progress: &dyn Progress) -> Result<Template, TemplateError> {
    let name = recipe.name;
    let packages: Vec<&str> = recipe.packages.iter().flat_map(|p| p.iter().copied()).collect();
    let mode = BuildMode::for_this_user()?;
    let work = home.tmp().join(format!("template-{name}-{}", std::process::id()));
    mode.remove(&work);
    std::fs::create_dir_all(&work).map_err(at("creating", &work))?;
    let result = build_in(home, recipe, &packages, &work, &mode, progress);
    mode.remove(&work);
    result
}

/// How a template tree is made. As root, mmdebstrap writes it as root. Without root,
/// mmdebstrap builds it in a user namespace (`--mode=unshare`) and hands over a tar;
/// the tar is unpacked and written to ext4 inside a namespace of the same shape
/// (root = this user, 1-65535 = its subordinate ids), so owners, modes and setuid bits
/// come out as the guest needs them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BuildMode {
    Root,
    Unshare { subuid: u32, subgid: u32 },
}

/// The first of 65535 subordinate ids `user` (or its `uid`) owns in an /etc/subuid-style file.
fn subordinate(text: &str, user: &str, uid: u32) -> Option<u32> {
    text.lines().find_map(|line| {
        let mut f = line.trim().split(':');
        let (who, start, count) = (f.next()?, f.next()?.parse::<u32>().ok()?, f.next()?.parse::<u32>().ok()?);
        ((who == user || who == uid.to_string()) && count >= 65535).then_some(start)
    })
}

impl BuildMode {
    pub(crate) fn for_this_user() -> Result<BuildMode, TemplateError> {
        if nix_is_root() {
            return Ok(BuildMode::Root);
        }
        let uid = nix::unistd::getuid();
        let user = nix::unistd::User::from_uid(uid).ok().flatten().map(|u| u.name).unwrap_or_else(|| uid.to_string());
        let ids = |file: &str| std::fs::read_to_string(file).ok().and_then(|t| subordinate(&t, &user, uid.as_raw()));
        match (ids("/etc/subuid"), ids("/etc/subgid")) {
            (Some(subuid), Some(subgid)) => Ok(BuildMode::Unshare { subuid, subgid }),
            _ => Err(TemplateError::NoSubordinateIds { user }),
        }
    }

    /// `unshare`, set to run what follows it in a user namespace mapping root to this
    /// user and 1-65535 to its subordinate ids (as root: on the host).
    pub(crate) fn unshare(&self) -> Command {
        let mut cmd = Command::new("unshare");
        if let BuildMode::Unshare { subuid, subgid } = self {
            cmd.arg(format!("--map-users={subuid},1,65535")).arg(format!("--map-groups={subgid},1,65535")).arg("--map-root-user");
        }
        cmd
    }

    /// `sh -c script` in that namespace.
    fn in_namespace(&self, script: &str) -> Command {
        let mut cmd = self.unshare();
        cmd.args(["sh", "-c", script]);
        cmd
    }

    /// Removes a work directory. Without root, an unpacked tree's files belong to
    /// subordinate ids, which only the namespace can remove.
    pub(crate) fn remove(&self, dir: &Path) {
        if std::fs::remove_dir_all(dir).is_err() && dir.exists() && *self != BuildMode::Root {
            let mut cmd = self.in_namespace("rm -rf -- \"$0\"");
            cmd.arg(dir).stdin(std::process::Stdio::null());
            let _ = cmd.status();
        }
    }
}

pub(crate) fn nix_is_root() -> bool {
    std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0).unwrap_or(false)
}

/// `s` as one single-quoted shell word.
fn shell_word(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// mmdebstrap hooks that finish the tree: the default user, hostname, the recipe's
/// files (staged under `stage` and uploaded, so they are root's whoever builds), its
/// wheels and setup commands, then the package caches removed.
fn customize_hooks(recipe: &Recipe, stage: &Path, wheels: &[String]) -> Result<Vec<String>, TemplateError> {
    let mut hooks = vec![
        "chroot \"$1\" useradd --create-home --uid 1000 --user-group --shell /bin/bash --groups sudo user".to_string(),
        "echo 'user ALL=(ALL) NOPASSWD:ALL' > \"$1/etc/sudoers.d/user\" && chmod 0440 \"$1/etc/sudoers.d/user\"".to_string(),
        "echo hutch > \"$1/etc/hostname\" && printf '127.0.0.1 localhost hutch\\n::1 localhost\\n' > \"$1/etc/hosts\"".to_string(),
    ];
    for (i, (path, contents, mode)) in recipe.files.iter().enumerate() {
        let staged = stage.join(format!("file-{i}"));
        std::fs::write(&staged, contents).map_err(at("writing", &staged))?;
        let dir = Path::new("/").join(path).parent().map(|d| d.display().to_string()).unwrap_or_else(|| "/".into());
        hooks.push(format!("mkdir -p \"$1\"{}", shell_word(&dir)));
        hooks.push(format!("upload {} /{path}", staged.display()));
        hooks.push(format!("chmod {mode:o} \"$1\"/{}", shell_word(path)));
    }
    if !wheels.is_empty() {
        let staged: Vec<String> = wheels.iter().map(|w| stage.join(w).display().to_string()).collect();
        let inside: Vec<String> = wheels.iter().map(|w| shell_word(&format!("/tmp/hutch-wheels/{w}"))).collect();
        hooks.push("mkdir -p \"$1/tmp/hutch-wheels\"".into());
        hooks.push(format!("copy-in {} /tmp/hutch-wheels", staged.join(" ")));
        hooks.push(format!("chroot \"$1\" pip3 install --quiet --no-index --no-deps --break-system-packages {}", inside.join(" ")));
        hooks.push("rm -rf \"$1/tmp/hutch-wheels\"".into());
    }
    for command in recipe.setup {
        hooks.push(format!("chroot \"$1\" /bin/sh -c {}", shell_word(command)));
    }
    hooks.push("rm -rf \"$1/var/cache/apt/archives\"/*.deb \"$1/var/lib/apt/lists\"/*_Packages".into());
    Ok(hooks)
}

fn build_in(home: &HutchHome, recipe: &Recipe, packages: &[&str], work: &Path, mode: &BuildMode, progress: &dyn Progress) -> Result<Template, TemplateError> {
    let name = recipe.name;
    let started = Instant::now();
    let stage = work.join("stage");
    std::fs::create_dir_all(&stage).map_err(at("creating", &stage))?;
    let wheels = download_wheels(home, recipe, &stage, progress)?;
    let root = *mode == BuildMode::Root;
    progress.step(&format!("building template '{name}': Debian {SUITE} with {} ({})", packages.join(", "), if root { "mmdebstrap" } else { "mmdebstrap, unprivileged" }));
    let tree = work.join("tree");
    let tarball = work.join("rootfs.tar");
    // As root, mmdebstrap mounts /proc, /sys and /dev into the tree: in a mount
    // namespace of its own, so they end with it however it ends. In the host's, a
    // hutch killed mid-build left four mounts, and mmdebstrap, apt and dpkg building
    // on into a tree nothing could remove. Its own PID namespace, whose first process
    // dies with `unshare` (`--kill-child`), which dies with hutch, takes them all.
    // Unprivileged, mmdebstrap makes its own namespaces.
    let mut cmd = if root {
        // Run by `unshare`, a missing mmdebstrap would read as unshare's failure.
        let on_path = std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|d| d.join("mmdebstrap").is_file()));
        if !on_path {
            return Err(crate::run::ToolError::Missing { tool: "mmdebstrap".into(), package: "mmdebstrap".into() }.into());
        }
        let mut unshare = Command::new("unshare");
        unshare.args(["--mount", "--propagation", "private", "--fork", "--pid", "--kill-child", "--", "mmdebstrap"]);
        crate::run::die_with_thread(&mut unshare);
        unshare
    } else {
        Command::new("mmdebstrap")
    };
    cmd.args(["--variant=apt", if root { "--mode=root" } else { "--mode=unshare" }, if root { "--format=directory" } else { "--format=tar" }]);
    cmd.arg(format!("--include={}", packages.join(",")));
    for hook in customize_hooks(recipe, &stage, &wheels)? {
        cmd.arg(format!("--customize-hook={hook}"));
    }
    cmd.arg(SUITE).arg(if root { &tree } else { &tarball }).arg(MIRROR);
    run(cmd, None, progress)?;
    let tree_bytes = if root { crate::progress::tree_size(&tree) } else { std::fs::metadata(&tarball).map(|m| m.len()).unwrap_or(0) };
    progress.done(&format!("{} unpacked", human_bytes(tree_bytes)), started.elapsed());

    let started = Instant::now();
    progress.step(&format!("writing the ext4 image ({} virtual)", human_bytes(DISK_SIZE)));
    let image = sparse_image(work)?;
    let mkfs = "mkfs.ext4 -q -F -L hutch-root -E root_owner=0:0 -d \"$1\" \"$2\"";
    let script = if root {
        mkfs.to_string()
    } else {
        // Device nodes cannot be made in a user namespace, and the guest's /dev is a
        // devtmpfs anyway. The tree is removed in the namespace that owns its files.
        format!("set -e; trap 'rm -rf \"$1\"' EXIT; mkdir \"$1\"; tar -xpf \"$0\" -C \"$1\" --numeric-owner --exclude='./dev/*'; {mkfs}")
    };
    let mut cmd = mode.in_namespace(&script);
    cmd.arg(&tarball).arg(&tree).arg(&image);
    run(cmd, None, progress)?;
    let _ = std::fs::remove_file(&tarball);
    let on_disk = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&image).map_err(at("reading", &image))?) * 512;
    progress.done(&format!("{} on disk", human_bytes(on_disk)), started.elapsed());

    let built_at = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let template = Template {
        name: name.into(),
        suite: SUITE.into(),
        packages: packages.iter().map(|s| s.to_string()).collect(),
        build_id: String::new(),
        image: String::new(),
        recipe: recipe.fingerprint(),
        source: None,
        built_at,
        disk_size: DISK_SIZE,
        api_build: None,
        shape: Shape::default(),
        tagged_at: None,
        dir: PathBuf::new(),
        tag: None,
    };
    install(home, &image, template)
}

/// Downloads the recipe's wheels with the host's pip (cached under `$HUTCH_HOME/cache`)
/// and stages them in `stage` for the guest's pip to install offline; returns their
/// file names.
fn download_wheels(home: &HutchHome, recipe: &Recipe, stage: &Path, progress: &dyn Progress) -> Result<Vec<String>, TemplateError> {
    if recipe.wheels.is_empty() {
        return Ok(Vec::new());
    }
    let cache = home.root().join("cache").join("wheels");
    std::fs::create_dir_all(&cache).map_err(at("creating", &cache))?;
    let mut download = Command::new("python3");
    download.args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest"]).arg(&cache).args(recipe.wheels);
    run(download, None, progress)?;
    let mut wanted = Vec::new();
    for spec in recipe.wheels {
        let (name, version) = spec.split_once("==").unwrap_or((spec, ""));
        let prefix = format!("{}-{version}-", name.replace('-', "_"));
        let wheel = std::fs::read_dir(&cache)
            .map_err(at("reading", &cache))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|f| f.to_lowercase().starts_with(&prefix.to_lowercase()) && f.ends_with(".whl"));
        let Some(wheel) = wheel else {
            return Err(TemplateError::Wheel { spec: spec.to_string(), dir: cache });
        };
        std::fs::copy(cache.join(&wheel), stage.join(&wheel)).map_err(at("copying", stage))?;
        wanted.push(wheel);
    }
    Ok(wanted)
}

#[cfg(test)]
mod build_tests {
    use super::*;
    use crate::recipes::*;
    use crate::template_store::*;
    use crate::test_support::{built, manifest};

    /// A server's home holds every API key's templates: the error one key can read
    /// names none of them.
    #[test]
    fn an_unknown_template_is_named_alone() {
        let root = tempfile::tempdir().expect("home");
        let home = HutchHome::at(root.path());
        std::fs::create_dir_all(home.template("other-keys-secret")).expect("template");
        std::fs::write(home.template("other-keys-secret").join(MANIFEST), "{}").expect("manifest");
        assert_eq!(list(&home), ["other-keys-secret"]);
        let e = ensure(&home, "nope", &crate::progress::Quiet).expect_err("unknown").to_string();
        assert!(e.contains("unknown template 'nope'") && e.contains("base") && e.contains("hutch template ls"), "{e}");
        assert!(!e.contains("other-keys-secret"), "{e}");
    }

    #[test]
    fn the_r_and_java_kernels_are_warmed_only_in_guests_of_a_gib_or_more() {
        let t = manifest("code-interpreter");
        let languages = |mib| t.warm_up(mib).map(|w| serde_json::from_str::<serde_json::Value>(w.body).expect("json")["language"].as_str().unwrap_or("python").to_string()).collect::<Vec<_>>();
        assert_eq!(languages(512), ["python", "bash", "javascript"]);
        assert_eq!(languages(2048), ["python", "bash", "javascript", "r", "java"]);
        assert_eq!(manifest("base").warm_up(2048).count(), 0);
    }

    /// `template.json` is a versioned record: damaged, it is an error saying so (and a
    /// build of a template hutch knows replaces it); from a newer hutch, it is refused
    /// and not rebuilt over; from before versioning, it still reads.
    #[test]
    fn a_damaged_or_newer_template_manifest_is_refused_with_a_sentence() {
        let root = tempfile::tempdir().expect("tempdir");
        let home = HutchHome::at(root.path());
        let current = Template { recipe: recipe(BASE).expect("base").fingerprint(), ..manifest(BASE) };
        let installed = install(&home, &built(&home, b"a build"), current).expect("install");
        let path = home.template("base").join(MANIFEST);
        let text = std::fs::read_to_string(&path).expect("manifest");
        assert!(text.contains("hutch-template-manifest"), "{text}");

        std::fs::write(&path, &text[..text.len() / 2]).expect("truncate");
        let e = cached(&home, "base").expect_err("truncated");
        assert!(matches!(&e, TemplateError::Manifest(r) if r.is_replaceable()), "{e}");
        assert!(e.to_string().contains("truncated or damaged") && e.to_string().contains("template.json"), "{e}");

        std::fs::write(&path, text.replace(&installed.build_id, "0000000000000000")).expect("edit");
        assert!(matches!(cached(&home, "base"), Err(TemplateError::Manifest(crate::record::RecordError::Checksum { .. }))));

        std::fs::write(&path, text.replace("\"version\": 1", "\"version\": 9")).expect("newer");
        let e = ensure(&home, "base", &crate::progress::Quiet).expect_err("a newer hutch's template is not rebuilt over");
        assert!(e.to_string().contains("newer hutch"), "{e}");
        assert_eq!(std::fs::read_to_string(&path).expect("kept"), text.replace("\"version\": 1", "\"version\": 9"));

        let mut legacy = installed.clone();
        legacy.dir = PathBuf::new();
        std::fs::write(&path, serde_json::to_string(&legacy).expect("json")).expect("legacy");
        assert_eq!(cached(&home, "base").expect("a manifest from before versioning").expect("current").image(), installed.image());
    }

    #[test]
    fn subordinate_ids_are_found_by_name_or_uid_and_must_cover_65535() {
        let text = "alice:100000:65536\n1001:165536:65536\nbob:231072:1000\n";
        assert_eq!(subordinate(text, "alice", 1000), Some(100000));
        assert_eq!(subordinate(text, "carol", 1001), Some(165536));
        assert_eq!(subordinate(text, "bob", 1002), None);
    }

    #[test]
    fn hooks_quote_setup_commands_and_upload_files_as_root() {
        let dir = tempfile::tempdir().expect("tempdir");
        let recipe = Recipe {
            name: "t",
            aliases: &[],
            packages: &[],
            files: &[("etc/hutch/start", "#!/bin/sh\n", 0o755)],
            wheels: &[],
            setup: &["echo it's"],
            ready_port: None,
            warm_up: &[],
            memory_mib: None,
        };
        let hooks = customize_hooks(&recipe, dir.path(), &["w-1.whl".into()]).expect("hooks");
        assert!(hooks.contains(&format!("upload {}/file-0 /etc/hutch/start", dir.path().display())), "{hooks:?}");
        assert!(hooks.contains(&r#"chmod 755 "$1"/'etc/hutch/start'"#.to_string()), "{hooks:?}");
        assert!(hooks.contains(&r#"chroot "$1" /bin/sh -c 'echo it'\''s'"#.to_string()), "{hooks:?}");
        assert!(hooks.iter().any(|h| h.ends_with("'/tmp/hutch-wheels/w-1.whl'")), "{hooks:?}");
        assert!(hooks.last().is_some_and(|h| h.contains("var/cache/apt")), "{hooks:?}");
        assert_eq!(std::fs::read_to_string(dir.path().join("file-0")).expect("staged"), "#!/bin/sh\n");
    }
}
