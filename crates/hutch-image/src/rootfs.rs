//! Template root filesystems: a Debian bookworm tree made by mmdebstrap, written as a
//! raw ext4 image with `mkfs.ext4 -d` (no loop mounts). The agent is not in the image: it
//! comes from the initramfs, so any Linux root filesystem can be a template.

use crate::progress::human_bytes;
use crate::run::{run, ToolError};
use crate::file_error::{at, FileError};
use crate::{HutchHome, Progress};
use serde::{Deserialize, Serialize};
use sha2::Digest;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

pub const BASE: &str = "base";
pub const SUITE: &str = "bookworm";
pub const MIRROR: &str = "http://deb.debian.org/debian";
/// Virtual size of a template disk; ext4 written by `-d` only occupies what it holds.
pub const DISK_SIZE: u64 = 4 << 30;

/// Packages of the `base` template.
pub const BASE_PACKAGES: &[&str] = &[
    "bash", "coreutils", "python3", "python3-pip", "python3-venv", "git", "curl", "ca-certificates",
    "procps", "sudo", "less", "iproute2", "file",
    // What E2B's base image has and users' first commands expect: `python` (not only
    // `python3`), node and npm, jq, and a C toolchain for pip wheels built from source.
    "python-is-python3", "nodejs", "npm", "jq", "build-essential",
];

/// Extra packages of the `code-interpreter` template (Jupyter kernels and the usual
/// data stack, from Debian: nothing is fetched at run time).
pub const CODE_INTERPRETER_PACKAGES: &[&str] = &[
    "python3-ipykernel", "python3-jupyter-client", "python3-numpy", "python3-pandas", "python3-matplotlib",
    "python3-matplotlib-inline", "fonts-dejavu-core", "python3-pexpect", "python3-filetype",
    // R with IRkernel, and a JDK whose jshell engine hutch's Java kernel drives.
    "r-base-core", "r-cran-irkernel", "openjdk-17-jdk-headless",
];

/// A template hutch knows how to build: Debian packages plus files written into the tree.
pub struct Recipe {
    pub name: &'static str,
    /// Other names it answers to (E2B's SDK asks for `code-interpreter-v1`).
    pub aliases: &'static [&'static str],
    pub packages: &'static [&'static [&'static str]],
    /// (path in the guest, contents, mode)
    pub files: &'static [(&'static str, &'static str, u32)],
    /// PyPI packages (exact pins) that Debian lacks: the host's pip downloads them (the
    /// host has the network and its certificates), the guest's pip installs them
    /// offline without dependencies (those come from Debian, listed in `packages`).
    pub wheels: &'static [&'static str],
    /// Shell commands run in the tree (chroot) once packages, files and wheels are in.
    pub setup: &'static [&'static str],
    /// A guest port the template's own service listens on; a sandbox is ready only
    /// once it accepts connections.
    pub ready_port: Option<u16>,
    /// HTTP requests to `ready_port` made before the template's memory snapshot is
    /// taken, so what it starts lazily (Jupyter kernels) is warm in every sandbox
    /// restored from it.
    pub warm_up: &'static [WarmUp],
    /// Guest memory (MiB) its sandboxes get unless a size is asked for; `None`: hutch's
    /// default. As on E2B, memory belongs to the template.
    pub memory_mib: Option<u32>,
}

/// One warm-up request: a POST of `body` (JSON) to `path` on the template's port.
pub struct WarmUp {
    pub path: &'static str,
    pub body: &'static str,
    /// The least guest memory (MiB) it is made at: in smaller guests what it starts
    /// would take the memory users' code needs (or not fit), so there it starts on
    /// first use instead.
    pub min_memory_mib: u32,
}

impl Recipe {
    /// A fingerprint of everything the recipe puts in the image: a cached template
    /// built from an older recipe is rebuilt.
    pub fn fingerprint(&self) -> String {
        let mut h = sha2::Sha256::new();
        for part in self.packages.iter().flat_map(|p| p.iter()).chain(self.wheels).chain(self.setup) {
            h.update(part.as_bytes());
            h.update([0]);
        }
        for (path, contents, mode) in self.files {
            h.update(format!("{path}\0{mode}\0").as_bytes());
            h.update(contents.as_bytes());
        }
        hex::encode(&h.finalize()[..8])
    }
}

pub const RECIPES: &[Recipe] = &[
    Recipe { name: BASE, aliases: &[], packages: &[BASE_PACKAGES], files: &[], wheels: &[], setup: &[], ready_port: None, warm_up: &[], memory_mib: None },
    Recipe {
        name: "code-interpreter",
        aliases: &["code-interpreter-v1"],
        packages: &[BASE_PACKAGES, CODE_INTERPRETER_PACKAGES],
        files: &[
            ("usr/lib/hutch/code_interpreter.py", include_str!("../guest/code_interpreter.py"), 0o755),
            ("usr/lib/hutch/ipython_formatters.py", include_str!("../guest/ipython_formatters.py"), 0o644),
            ("etc/hutch/start", CODE_INTERPRETER_START, 0o755),
            ("usr/lib/hutch/hutch_java_kernel.py", include_str!("../guest/hutch_java_kernel.py"), 0o644),
            ("usr/lib/hutch/java/HutchJShell.java", include_str!("../guest/java/HutchJShell.java"), 0o644),
            ("usr/local/share/jupyter/kernels/javascript/kernel.json", DENO_KERNEL_JS, 0o644),
            ("usr/local/share/jupyter/kernels/typescript/kernel.json", DENO_KERNEL_TS, 0o644),
            ("usr/local/share/jupyter/kernels/r/kernel.json", R_KERNEL, 0o644),
            ("usr/local/share/jupyter/kernels/java/kernel.json", JAVA_KERNEL, 0o644),
        ],
        // bash_kernel for run_code(language="bash"); Deno (PyPI redistributes its
        // binary) for JavaScript and TypeScript: its own Jupyter kernel has ES modules,
        // top-level await and TypeScript, which Node 18's kernels lack.
        wheels: &["bash_kernel==0.10.0", "deno==2.9.8"],
        setup: &[
            "python3 -m bash_kernel.install --prefix /usr/local",
            "javac -d /usr/lib/hutch/java /usr/lib/hutch/java/HutchJShell.java",
        ],
        ready_port: Some(49999),
        // Not counted (`warm_up`): the user's first cell is execution 1. The kernels
        // E2B's server starts (Python, JavaScript), bash, and the two slowest to start
        // under TCG for what they take (Java 24 s for ~130 MiB of guest memory, R 12 s
        // for ~105) are warm in the snapshot; TypeScript, a second Deno (6 s, ~185
        // MiB), starts on first use (measured in docs/BENCHMARKS.md).
        // R and Java only from 1 GiB: with them a restored guest uses ~800 MiB.
        warm_up: &[
            WarmUp { path: "/execute", body: r#"{"code": "import numpy, pandas, matplotlib.pyplot", "warm_up": true}"#, min_memory_mib: 0 },
            WarmUp { path: "/execute", body: r#"{"code": "true", "language": "bash", "warm_up": true}"#, min_memory_mib: 0 },
            WarmUp { path: "/execute", body: r#"{"code": "process.cwd()", "language": "javascript", "warm_up": true}"#, min_memory_mib: 0 },
            WarmUp { path: "/execute", body: r#"{"code": "getwd()", "language": "r", "warm_up": true}"#, min_memory_mib: 1024 },
            WarmUp { path: "/execute", body: r#"{"code": "System.getProperty(\"user.dir\")", "language": "java", "warm_up": true}"#, min_memory_mib: 1024 },
        ],
        // E2B's template has 2 GiB. With its warm kernels a restored guest uses ~800
        // MiB (resident: Deno ~215, Python with numpy and pandas ~135, R ~125, Java
        // ~100, bash's kernel and the server ~70 each; a kernel's start also costs the
        // guest the page cache and memory it frees again), which 512 MiB could not hold.
        memory_mib: Some(2048),
    },
];

/// Run by the agent at boot (see hutch-agent): the code-interpreter server, as `user`.
const CODE_INTERPRETER_START: &str = "#!/bin/sh\n\
cd /home/user\n\
exec runuser -u user -- env HOME=/home/user PYTHONUNBUFFERED=1 python3 /usr/lib/hutch/code_interpreter.py >/var/log/code-interpreter.log 2>&1\n";

/// Deno's kernel for JavaScript and for TypeScript (one binary, a context each); no
/// colours in results, no update check (a sandbox has no network to check with).
const DENO_KERNEL_JS: &str = r#"{"argv": ["/usr/local/bin/deno", "jupyter", "--kernel", "--conn", "{connection_file}"], "display_name": "JavaScript (Deno)", "language": "javascript", "env": {"NO_COLOR": "1", "DENO_NO_UPDATE_CHECK": "1", "DENO_NO_PROMPT": "1"}}"#;
const DENO_KERNEL_TS: &str = r#"{"argv": ["/usr/local/bin/deno", "jupyter", "--kernel", "--conn", "{connection_file}"], "display_name": "TypeScript (Deno)", "language": "typescript", "env": {"NO_COLOR": "1", "DENO_NO_UPDATE_CHECK": "1", "DENO_NO_PROMPT": "1"}}"#;
/// IRkernel from Debian ships no kernel spec; this is the one its installspec() writes.
const R_KERNEL: &str = r#"{"argv": ["R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"], "display_name": "R", "language": "R"}"#;
const JAVA_KERNEL: &str = r#"{"argv": ["python3", "/usr/lib/hutch/hutch_java_kernel.py", "-f", "{connection_file}"], "display_name": "Java (jshell)", "language": "java"}"#;

/// The templates hutch knows how to build.
pub fn builtin_names() -> Vec<&'static str> {
    RECIPES.iter().map(|r| r.name).collect()
}

/// The recipe a template name (or alias) refers to.
pub fn recipe(name: &str) -> Option<&'static Recipe> {
    RECIPES.iter().find(|r| r.name == name || r.aliases.contains(&name))
}

/// The guest memory (MiB) the built-in template `name` asks for, if it asks.
pub fn memory_mib(name: &str) -> Option<u32> {
    recipe(name)?.memory_mib
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Template {
    pub name: String,
    pub suite: String,
    pub packages: Vec<String>,
    pub built_at: String,
    pub disk_size: u64,
    /// The image's content id (a SHA-256 prefix): every build is a new one, so
    /// snapshots and overlays can tell, and the image under them is never replaced.
    pub build_id: String,
    /// The image, relative to the template's directory (`builds/<build_id>/rootfs.ext4`);
    /// empty in manifests from before builds were kept apart (`rootfs.ext4`).
    #[serde(default)]
    pub image: String,
    /// The fingerprint of the recipe it was built from (empty: not built by a recipe).
    #[serde(default)]
    pub recipe: String,
    /// The OCI image it was made from, with that image's defaults (None: a recipe's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<ImageSource>,
    /// The id the template API gave the build that made it (a UUID), if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_build: Option<String>,
    /// The VM shape its build asked sandboxes to get (unset: the server's or caller's).
    #[serde(default, flatten)]
    pub shape: Shape,
    /// When the `default` tag was last pointed at this build (None: when it was built).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tagged_at: Option<String>,
    #[serde(skip)]
    pub dir: PathBuf,
    /// The tag it was found by (None: the current build, `default`).
    #[serde(skip)]
    pub tag: Option<String>,
}

/// The vCPUs, memory and free disk a template's sandboxes get, when its build named
/// them (E2B's `cpuCount`/`memoryMB`/`minFreeDiskMb`, `hutch template build --cpus
/// --memory --min-free-disk`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Shape {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    /// Free space (MiB) the root filesystem has at least, for users, after the build
    /// steps: the disk grows to it (never shrinks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_free_disk_mib: Option<u32>,
}

impl Shape {
    /// What a build id says of it: empty when it names nothing, so builds that name no
    /// shape keep the ids they had (and those naming no free disk too).
    pub fn id_part(&self) -> String {
        let vm = match (self.cpus, self.memory_mib) {
            (None, None) if self.min_free_disk_mib.is_none() => return String::new(),
            (c, m) => format!("cpus={},mib={}", c.unwrap_or(0), m.unwrap_or(0)),
        };
        match self.min_free_disk_mib {
            Some(free) => format!("{vm},free={free}"),
            None => vm,
        }
    }
}

/// The OCI image a template was made from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageSource {
    pub reference: String,
    pub manifest_digest: String,
    pub defaults: hutch_oci::ImageDefaults,
}

impl Template {
    pub fn image(&self) -> PathBuf {
        match self.image.as_str() {
            "" => self.dir.join(IMAGE),
            relative => self.dir.join(relative),
        }
    }

    /// The port whose service must accept connections before a sandbox is ready.
    pub fn ready_port(&self) -> Option<u16> {
        recipe(&self.name).and_then(|r| r.ready_port)
    }

    /// The warm-up requests of a snapshot made at `memory_mib`.
    pub fn warm_up(&self, memory_mib: u32) -> impl Iterator<Item = &'static WarmUp> {
        recipe(&self.name).map(|r| r.warm_up).unwrap_or(&[]).iter().filter(move |w| memory_mib >= w.min_memory_mib)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// Names no other template: the home holds other API keys' templates too.
    #[error("unknown template '{name}': it is neither built here nor a built-in template ({}); build it first (`hutch template ls` lists the templates built here)", builtin_names().join(", "))]
    Unknown { name: String },
    #[error(transparent)]
    Tool(#[from] ToolError),
    #[error("building a template without root needs subordinate ids for user {user} in /etc/subuid and /etc/subgid (65536 of each; `usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {user}`), or run as root")]
    NoSubordinateIds { user: String },
    #[error(transparent)]
    File(#[from] FileError),
    /// The record's own sentence says what is wrong and, for a newer one, what to do.
    #[error(transparent)]
    Manifest(crate::record::RecordError),
    #[error("pip did not leave a wheel for {spec} in {dir}")]
    Wheel { spec: String, dir: PathBuf },
    #[error(transparent)]
    Tag(Box<crate::tags::TagError>),
}


pub(crate) const MANIFEST: &str = "template.json";
const IMAGE: &str = "rootfs.ext4";
/// Where a template's builds live, each in a directory named by its content id.
const BUILDS: &str = "builds";

/// An empty, sparse `rootfs.ext4` of the template disk's size in `work`, for
/// `mkfs.ext4 -d` to fill.
pub(crate) fn sparse_image(work: &Path) -> Result<PathBuf, TemplateError> {
    let image = work.join(IMAGE);
    let file = std::fs::File::create(&image).map_err(at("creating", &image))?;
    file.set_len(DISK_SIZE).map_err(at("sizing", &image))?;
    Ok(image)
}

/// The content id of a built image.
fn content_id(image: &Path) -> Result<String, TemplateError> {
    use sha2::Digest;
    let mut file = std::fs::File::open(image).map_err(at("reading", image))?;
    let mut hash = sha2::Sha256::new();
    std::io::copy(&mut file, &mut hash).map_err(at("reading", image))?;
    Ok(hex::encode(&hash.finalize()[..8]))
}

/// Makes the image at `built` the template's current build: it moves into a directory
/// of its own, and the manifest naming it replaces the old one in one rename. Earlier
/// builds stay where they are, for the overlays and snapshots stacked on them, until
/// `prune_builds` finds nothing refers to them.
pub(crate) fn install(home: &HutchHome, built: &Path, template: Template) -> Result<Template, TemplateError> {
    let id = content_id(built)?;
    install_as(home, built, template, &id)
}

/// `install` with the build's id given: a build whose id says what went into it (a
/// template build's cache key) need not read its whole image to name it.
pub fn install_as(home: &HutchHome, built: &Path, template: Template, build_id: &str) -> Result<Template, TemplateError> {
    let dir = home.template(&template.name);
    std::fs::create_dir_all(&dir).map_err(at("creating", &dir))?;
    let _held = crate::tags::lock(&dir).map_err(|e| TemplateError::Tag(Box::new(e)))?;
    let template = store_build(home, built, template, build_id)?;
    make_current(&template.dir, &template)?;
    Ok(template)
}

/// Where build `build`'s own manifest is, in template directory `dir`.
pub(crate) fn build_manifest_path(dir: &Path, build: &str) -> PathBuf {
    dir.join(BUILDS).join(build).join(MANIFEST)
}

/// Keeps the image at `built` as build `build_id` of its template, with a manifest of
/// its own (what a tag naming it boots), without making it the current build. The
/// caller holds the template's tag lock (`tags::lock`): a prune waits for neither.
pub(crate) fn store_build(home: &HutchHome, built: &Path, mut template: Template, build_id: &str) -> Result<Template, TemplateError> {
    let dir = home.template(&template.name);
    template.build_id = build_id.to_string();
    let relative = format!("{BUILDS}/{}/{IMAGE}", template.build_id);
    let image = dir.join(&relative);
    let build_dir = image.parent().unwrap_or(&dir).to_path_buf();
    std::fs::create_dir_all(&build_dir).map_err(at("creating", &build_dir))?;
    if image.is_file() {
        // The same bytes were built before: that build stands.
        let _ = std::fs::remove_file(built);
    } else {
        std::fs::rename(built, &image).map_err(at("moving the image to", &build_dir))?;
    }
    template.image = relative;
    template.dir = dir.clone();
    template.tagged_at = None;
    if template.api_build.is_none() {
        // Made again outside the API: it keeps the id an API build gave it.
        template.api_build = crate::record::read::<Template>(&build_manifest_path(&dir, build_id), crate::record::Kind::Template).ok().and_then(|t| t.api_build);
    }
    crate::record::write(&build_manifest_path(&dir, build_id), crate::record::Kind::Template, &template).map_err(TemplateError::Manifest)?;
    // The same build made again by an API build is known by that build's id from now
    // on, also as the current build: one id per build wherever it is shown.
    if template.api_build.is_some() {
        if let Ok(mut current) = crate::record::read::<Template>(&dir.join(MANIFEST), crate::record::Kind::Template) {
            if current.build_id == build_id && current.api_build != template.api_build {
                current.api_build = template.api_build.clone();
                make_current(&dir, &current)?;
            }
        }
    }
    Ok(template)
}

/// Gives a build from before builds kept their own manifests one (a tag can name it).
/// A build from before builds were kept apart (`rootfs.ext4` at the template's top) is
/// hard-linked into `builds/<id>/` too, so it is a build like any other (the top file
/// goes when it is no longer current; the link keeps the bytes for its tags).
pub(crate) fn keep_manifest(template: &Template) -> Result<(), TemplateError> {
    let path = build_manifest_path(&template.dir, &template.build_id);
    let build_dir = path.parent().unwrap_or(&template.dir).to_path_buf();
    std::fs::create_dir_all(&build_dir).map_err(at("creating", &build_dir))?;
    let mut own = Template { tagged_at: None, tag: None, ..template.clone() };
    if own.image.is_empty() {
        let linked = build_dir.join(IMAGE);
        if !linked.is_file() {
            std::fs::hard_link(template.image(), &linked).map_err(at("linking the build into", &build_dir))?;
        }
        own.image = format!("{BUILDS}/{}/{IMAGE}", own.build_id);
    }
    crate::record::write(&path, crate::record::Kind::Template, &own).map_err(TemplateError::Manifest)
}

/// Makes `template` (a stored build) its template's current one: the manifest naming it
/// replaces the old one in one rename, so readers see the old build or the new one.
pub(crate) fn make_current(dir: &Path, template: &Template) -> Result<(), TemplateError> {
    crate::record::write(&dir.join(MANIFEST), crate::record::Kind::Template, template).map_err(TemplateError::Manifest)
}

/// How long a prune waits for a template's lock before leaving it for the next prune.
const PRUNE_LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// Removes the builds of every template that are not its current one and hold no file
/// in `referenced` (every file some overlay or snapshot stacks on); returns them.
pub fn prune_builds(home: &HutchHome, referenced: &std::collections::HashSet<PathBuf>) -> Vec<PathBuf> {
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let referenced: std::collections::HashSet<PathBuf> = referenced.iter().map(|p| canonical(p)).collect();
    let mut removed = Vec::new();
    for name in list(home) {
        let dir = home.template(&name);
        // A template being built or retagged right now is left for the next prune.
        let Ok(Some(_held)) = crate::tags::try_lock_within(&dir, PRUNE_LOCK_PATIENCE) else { continue };
        // A template whose manifest cannot be read keeps every build.
        let Ok(mut current) = crate::record::read::<Template>(&dir.join(MANIFEST), crate::record::Kind::Template) else { continue };
        current.dir = dir.clone();
        let current = canonical(&current.image());
        // Builds a tag names stay; an unreadable tags file keeps every build.
        let Some(tagged) = crate::tags::tagged_builds(&dir) else { continue };
        let mut candidates: Vec<PathBuf> = std::fs::read_dir(dir.join(BUILDS)).into_iter().flatten().flatten().map(|e| e.path().join(IMAGE)).collect();
        // A build from before builds were kept apart.
        candidates.push(dir.join(IMAGE));
        for image in candidates.into_iter().filter(|i| i.is_file()) {
            let image = canonical(&image);
            let build = image.parent().and_then(Path::file_name).map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            if image == current || referenced.contains(&image) || tagged.contains(&build) {
                continue;
            }
            let gone = match image.parent().filter(|p| p.parent().and_then(Path::file_name).is_some_and(|n| n == BUILDS)) {
                Some(build_dir) => std::fs::remove_dir_all(build_dir),
                None => std::fs::remove_file(&image),
            };
            if gone.is_ok() {
                removed.push(image);
            }
        }
    }
    removed
}

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
    let dir = home.template(name);
    let mut t: Template = match crate::record::read(&dir.join(MANIFEST), crate::record::Kind::Template) {
        Ok(t) => t,
        Err(e) if e.is_missing() => return Ok(None),
        Err(e) => return Err(TemplateError::Manifest(e)),
    };
    t.dir = dir;
    // A template built from an older recipe of ours is stale: the caller rebuilds it.
    let stale = recipe(name).is_some_and(|r| r.fingerprint() != t.recipe);
    Ok((t.image().is_file() && !stale).then_some(t))
}

/// Names of the templates built under this home.
pub fn list(home: &HutchHome) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(home.templates())
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join(MANIFEST).is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
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
    let mut cmd = Command::new("mmdebstrap");
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

    fn built(home: &HutchHome, bytes: &[u8]) -> PathBuf {
        std::fs::create_dir_all(home.tmp()).expect("tmp");
        let path = home.tmp().join("rootfs.ext4");
        std::fs::write(&path, bytes).expect("image");
        path
    }

    fn manifest(name: &str) -> Template {
        Template { name: name.into(), suite: SUITE.into(), packages: vec![], built_at: String::new(), disk_size: 1, build_id: String::new(), image: String::new(), recipe: String::new(), source: None, api_build: None, shape: Shape::default(), tagged_at: None, dir: PathBuf::new(), tag: None }
    }

    #[test]
    fn a_rebuild_is_a_new_image_and_the_old_one_goes_only_when_nothing_stacks_on_it() {
        let root = tempfile::tempdir().expect("tempdir");
        let home = HutchHome::at(root.path());
        let first = install(&home, &built(&home, b"first build"), manifest("t")).expect("install");
        let second = install(&home, &built(&home, b"second build"), manifest("t")).expect("install");
        // Each build is its own content-addressed file; the first was not replaced.
        assert_ne!(first.build_id, second.build_id);
        assert_ne!(first.image(), second.image());
        assert_eq!(std::fs::read(first.image()).expect("first"), b"first build");
        assert_eq!(cached(&home, "t").expect("cached").expect("current").image(), second.image());
        // The same bytes again: the same build, kept.
        let again = install(&home, &built(&home, b"second build"), manifest("t")).expect("install");
        assert_eq!(again.image(), second.image());
        // A build from before builds were kept apart, at the template's top.
        std::fs::write(home.template("t").join(IMAGE), b"legacy").expect("legacy");
        let referenced: std::collections::HashSet<PathBuf> = [first.image()].into();
        assert_eq!(prune_builds(&home, &referenced), vec![home.template("t").join(IMAGE)]);
        assert!(first.image().is_file(), "a build an overlay stacks on was pruned");
        assert!(prune_builds(&home, &Default::default()).contains(&first.image()));
        assert!(!first.image().exists() && second.image().is_file(), "the current build must stay");
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
