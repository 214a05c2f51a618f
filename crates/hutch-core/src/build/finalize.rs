//! The last phase: the top layer's chain flattened into one raw ext4 image, the
//! template's defaults written into it (`/etc/hutch/image.json`, read by the agent at
//! every start), and the image installed as the template's new build.
//!
//! The defaults go in with `debugfs` on the unmounted image, not through a VM: a build
//! whose steps were all cached then needs no VM at all. The image is clean (mkfs made
//! it, or it was copied from a frozen guest), which `debugfs -w` requires.

use super::cache::Key;
use super::{BuildError, BuildLog, BuildSpec, FailedAt, Level};
use hutch_image::rootfs::{ImageSource, Template};
use hutch_image::HutchHome;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Flattening copies at most the template disk's worth of data.
const TOOL_DEADLINE: Duration = Duration::from_secs(10 * 60);

pub async fn finish(home: &HutchHome, spec: &BuildSpec, layer: &Path, key: &Key, source: ImageSource, scratch: &Path, log: &Arc<dyn BuildLog>) -> Result<Template, BuildError> {
    let started = Instant::now();
    log.log(Level::Info, Some("finalize"), "[finalize] writing the template's image");
    // A forced rebuild has the key of the build before it but a new top layer: the id
    // names both, and the defaults, so a changed start command is a new build too.
    let id = Key::of(Some(key), &[&layer.to_string_lossy(), source.defaults.start_cmd.as_deref().unwrap_or(""), source.defaults.ready_cmd.as_deref().unwrap_or("")]);
    let (home2, layer, scratch) = (home.clone(), layer.to_path_buf(), scratch.to_path_buf());
    let name = spec.name.clone();
    let template = tokio::task::spawn_blocking(move || {
        let raw = scratch.join("rootfs.ext4");
        flatten(&layer, &raw)?;
        write_defaults(&raw, &source.defaults, &scratch)?;
        let template = hutch_image::from_image::image_template(&name, source);
        hutch_image::rootfs::install_as(&home2, &raw, template, &id.0[..16]).map_err(|e| hutch_proto::error_chain(&e))
    })
    .await
    .map_err(|e| BuildError::at(FailedAt::Finalize, false, e.to_string()))?
    .map_err(|e| BuildError::at(FailedAt::Finalize, false, e))?;
    log.log(Level::Info, Some("finalize"), &format!("template {} ready (build {}) in {:.1} s", template.name, template.build_id, started.elapsed().as_secs_f64()));
    Ok(template)
}

fn tool(cmd: &mut Command, what: &str) -> Result<Vec<u8>, String> {
    let out = hutch_vmm::process::output_within(cmd, TOOL_DEADLINE).map_err(|e| format!("{what}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{what}: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(out.stdout)
}

/// The chain under `layer` as one sparse raw image.
fn flatten(layer: &Path, raw: &Path) -> Result<(), String> {
    let format = if layer.extension().is_some_and(|e| e == "qcow2") { "qcow2" } else { "raw" };
    tool(Command::new("qemu-img").args(["convert", "-f", format, "-O", "raw"]).arg(layer).arg(raw), "flattening the build's layers")?;
    Ok(())
}

/// Writes `defaults` as the image's `/etc/hutch/image.json` (root's, mode 0644), and
/// reads it back: debugfs reports a failed command on stderr but exits 0.
fn write_defaults(raw: &Path, defaults: &hutch_oci::ImageDefaults, scratch: &Path) -> Result<(), String> {
    let json = serde_json::to_vec_pretty(defaults).map_err(|e| e.to_string())?;
    let file: PathBuf = scratch.join("image.json");
    std::fs::write(&file, &json).map_err(|e| format!("writing {}: {e}", file.display()))?;
    let target = hutch_proto::agent::IMAGE_DEFAULTS_PATH;
    let dir = Path::new(target).parent().and_then(Path::to_str).unwrap_or("/etc/hutch");
    let script = format!(
        "mkdir /etc\nmkdir {dir}\nrm {target}\nwrite {} {target}\nset_inode_field {target} uid 0\nset_inode_field {target} gid 0\nset_inode_field {target} mode 0100644\n",
        file.display()
    );
    let commands = scratch.join("debugfs.cmds");
    std::fs::write(&commands, script).map_err(|e| format!("writing {}: {e}", commands.display()))?;
    tool(Command::new("debugfs").arg("-w").arg("-f").arg(&commands).arg(raw), "writing the template's defaults")?;
    let back = tool(Command::new("debugfs").arg("-R").arg(format!("cat {target}")).arg(raw), "reading the template's defaults back")?;
    if back != json {
        return Err(format!("the template's defaults did not land in {target} (is {dir} a directory in the image?)"));
    }
    Ok(())
}
