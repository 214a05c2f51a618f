//! The initramfs: hutch-agent as `/init` plus the virtio modules it loads, in
//! dependency order (read from the kernel's `modules.dep`).

use crate::cpio::{Kind, Writer};
use crate::kernel::Kernel;
use crate::file_error::{at, FileError};
use crate::{HutchHome, Progress};
use flate2::write::GzEncoder;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Modules the guest needs, by name; their dependencies come along.
pub const MODULES: &[&str] = &["virtio_mmio", "virtio_blk", "virtio_console", "virtio_net"];

#[derive(Debug, thiserror::Error)]
pub enum InitramfsError {
    #[error("the agent binary {0} does not exist; build it with: cargo build --profile agent --target x86_64-unknown-linux-musl -p hutch-agent")]
    NoAgent(PathBuf),
    #[error("kernel module '{0}' is a dependency but not a module file of this kernel")]
    UnknownModule(String),
    #[error(transparent)]
    File(#[from] FileError),
}


/// Module name → (file relative to the modules dir, names it depends on).
pub type ModuleIndex = HashMap<String, (String, Vec<String>)>;

/// Indexes the `.ko` files under a modules dir by the `depends=` of their `.modinfo`.
/// Debian runs depmod at install time, and hutch never installs the package, so there
/// is no modules.dep to read.
pub fn index_modules(modules_dir: &Path) -> Result<ModuleIndex, InitramfsError> {
    let mut index = ModuleIndex::new();
    let mut stack = vec![modules_dir.join("kernel")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(at("listing", &dir))?.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "ko") {
                let data = std::fs::read(&path).map_err(at("reading", &path))?;
                let rel = path.strip_prefix(modules_dir).unwrap_or(&path).display().to_string();
                index.insert(module_name(&rel), (rel, modinfo_depends(&data)));
            }
        }
    }
    Ok(index)
}

fn modinfo_depends(ko: &[u8]) -> Vec<String> {
    const KEY: &[u8] = b"\0depends=";
    let Some(at) = ko.windows(KEY.len()).position(|w| w == KEY) else { return Vec::new() };
    let rest = &ko[at + KEY.len()..];
    let end = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
    String::from_utf8_lossy(&rest[..end]).split(',').filter(|d| !d.is_empty()).map(|d| d.replace('-', "_")).collect()
}

/// Module files (relative to the modules dir) in load order, dependencies first.
pub fn module_order(index: &ModuleIndex, wanted: &[&str]) -> Result<Vec<String>, InitramfsError> {
    fn visit(name: &str, index: &ModuleIndex, order: &mut Vec<String>) -> Result<(), InitramfsError> {
        let (file, deps) = index.get(name).ok_or_else(|| InitramfsError::UnknownModule(name.into()))?;
        for d in deps {
            visit(d, index, order)?;
        }
        if !order.contains(file) {
            order.push(file.clone());
        }
        Ok(())
    }
    let mut order = Vec::new();
    // A wanted name that is not a module file is built into this kernel.
    for w in wanted.iter().filter(|w| index.contains_key(**w)) {
        visit(w, index, &mut order)?;
    }
    Ok(order)
}

fn module_name(path: &str) -> String {
    let base = path.rsplit('/').next().unwrap_or(path);
    let base = base.split(".ko").next().unwrap_or(base);
    base.replace('-', "_")
}

/// What names one build of the initramfs's inputs without reading them: the agent
/// binary's identity (path, inode, size, mtime), the kernel and the module list. A
/// rebuilt agent changes its mtime and size, so it is noticed.
fn source_key(kernel: &Kernel, agent: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(agent).ok()?;
    let mut hash = Sha256::new();
    for part in [
        agent.display().to_string(),
        format!("{} {} {}.{}", m.ino(), m.len(), m.mtime(), m.mtime_nsec()),
        kernel.version.clone(),
        kernel.package_version.clone(),
        MODULES.join(","),
    ] {
        hash.update(part.as_bytes());
        hash.update([0]);
    }
    Some(hex::encode(&hash.finalize()[..12]))
}

/// Builds (or finds cached) the initramfs for this kernel and agent; the file name
/// carries a hash of both, so a new agent or kernel makes a new image. Finding it
/// reads nothing big: a small file named by `source_key` remembers which image the
/// same inputs made (indexing the kernel's ~1,100 module files and reading the agent
/// cost ~235 ms of every `hutch run`).
pub fn ensure(home: &HutchHome, kernel: &Kernel, agent: &Path, progress: &dyn Progress) -> Result<PathBuf, InitramfsError> {
    let remembered = source_key(kernel, agent).map(|k| home.initramfs_dir().join(format!("source-{k}")));
    if let Some(name) = remembered.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        let out = home.initramfs_dir().join(name.trim());
        if name.starts_with("initramfs-") && out.is_file() {
            return Ok(out);
        }
    }
    let out = build(home, kernel, agent, progress)?;
    if let (Some(file), Some(name)) = (remembered, out.file_name()) {
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, name.to_string_lossy().as_bytes()).is_ok() {
            let _ = std::fs::rename(&tmp, &file);
        }
    }
    Ok(out)
}

fn build(home: &HutchHome, kernel: &Kernel, agent: &Path, progress: &dyn Progress) -> Result<PathBuf, InitramfsError> {
    let agent_bytes = std::fs::read(agent).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => InitramfsError::NoAgent(agent.to_path_buf()),
        _ => at("reading", agent)(e).into(),
    })?;
    let order = module_order(&index_modules(&kernel.modules())?, MODULES)?;
    let mut hash = Sha256::new();
    hash.update(&agent_bytes);
    hash.update(kernel.version.as_bytes());
    hash.update(order.join("\n").as_bytes());
    let id = hex::encode(&hash.finalize()[..8]);
    let out = home.initramfs_dir().join(format!("initramfs-{id}.cpio.gz"));
    if out.is_file() {
        return Ok(out);
    }
    let started = Instant::now();
    progress.step("assembling the initramfs (hutch-agent + virtio modules)");
    std::fs::create_dir_all(home.initramfs_dir()).map_err(at("creating", &home.initramfs_dir()))?;
    let tmp = out.with_extension(format!("tmp{}", std::process::id()));
    let file = std::fs::File::create(&tmp).map_err(at("creating", &tmp))?;
    let gz = GzEncoder::new(std::io::BufWriter::new(file), flate2::Compression::fast());
    let mut w = Writer::new(gz);
    let write = |w: &mut Writer<_>| -> std::io::Result<()> {
        for dir in ["dev", "proc", "sys", "newroot", "lib", "lib/modules"] {
            w.add(dir, 0o755, Kind::Dir)?;
        }
        w.add("dev/console", 0o600, Kind::CharDev(5, 1))?;
        w.add("dev/null", 0o666, Kind::CharDev(1, 3))?;
        w.add("init", 0o755, Kind::File(&agent_bytes))?;
        let mut names = Vec::new();
        for rel in &order {
            let name = rel.rsplit('/').next().unwrap_or(rel).to_string();
            let data = std::fs::read(kernel.modules().join(rel))?;
            w.add(&format!("lib/modules/{name}"), 0o644, Kind::File(&data))?;
            names.push(name);
        }
        w.add("lib/modules/hutch.order", 0o644, Kind::File(names.join("\n").as_bytes()))
    };
    write(&mut w).map_err(at("writing", &tmp))?;
    let gz = w.finish().map_err(at("writing", &tmp))?;
    let mut buf = gz.finish().map_err(at("writing", &tmp))?;
    std::io::Write::flush(&mut buf).map_err(at("writing", &tmp))?;
    drop(buf);
    std::fs::rename(&tmp, &out).map_err(at("writing", &out))?;
    let size = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    progress.done(&format!("{} modules, {}", order.len(), crate::progress::human_bytes(size)), started.elapsed());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dependencies_come_first() {
        let ko = |deps: &str| format!("\x7fELF...\0license=GPL\0depends={deps}\0vermagic=6.1").into_bytes();
        let mut index = ModuleIndex::new();
        for (name, dir, deps) in [
            ("virtio_blk", "block", "virtio_ring,virtio"),
            ("virtio", "virtio", "virtio_ring"),
            ("virtio_ring", "virtio", ""),
            ("virtio_mmio", "virtio", "virtio,virtio_ring"),
        ] {
            index.insert(name.into(), (format!("kernel/{dir}/{name}.ko"), modinfo_depends(&ko(deps))));
        }
        let order = module_order(&index, &["virtio_mmio", "virtio_blk", "built_in_thing"]).expect("order");
        let names: Vec<&str> = order.iter().map(|p| p.rsplit('/').next().unwrap_or(p)).collect();
        assert_eq!(names, ["virtio_ring.ko", "virtio.ko", "virtio_mmio.ko", "virtio_blk.ko"]);
    }
}
