//! The last phase: the top layer's chain (the defaults already written into it by the
//! builder VM) flattened into one raw ext4 image and installed as the template's new
//! build. Nothing here reads the guest's filesystem: `qemu-img` copies clusters.

use super::cache::Key;
use super::{BuildError, BuildLog, BuildSpec, FailedAt, Level};
use hutch_image::rootfs::{ImageSource, Template};
use hutch_image::HutchHome;
use std::path::Path;
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
    // So is another VM shape; a build that names none keeps the id it always had.
    let shape = spec.shape;
    let (layer_name, shape_part) = (layer.to_string_lossy(), shape.id_part());
    let mut inputs = vec![layer_name.as_ref(), source.defaults.start_cmd.as_deref().unwrap_or(""), source.defaults.ready_cmd.as_deref().unwrap_or("")];
    if !shape_part.is_empty() {
        inputs.push(&shape_part);
    }
    let id = Key::of(Some(key), &inputs);
    let (home2, layer, scratch) = (home.clone(), layer.to_path_buf(), scratch.to_path_buf());
    let name = spec.name.clone();
    let api_build = spec.api_build.clone();
    let tags = hutch_image::tags::for_new_build(home, &spec.name, &spec.tags);
    let tags2 = tags.clone();
    let template = tokio::task::spawn_blocking(move || {
        let raw = scratch.join("rootfs.ext4");
        flatten(&layer, &raw)?;
        let mut template = hutch_image::from_image::image_template(&name, source);
        template.api_build = api_build;
        template.shape = shape;
        hutch_image::tags::install_tagged(&home2, &raw, template, &id.0[..16], &tags2).map_err(|e| hutch_proto::error_chain(&e))
    })
    .await
    .map_err(|e| BuildError::at(FailedAt::Finalize, false, e.to_string()))?
    .map_err(|e| BuildError::at(FailedAt::Finalize, false, e))?;
    let named: Vec<String> = tags.iter().map(|t| format!("{}:{t}", template.name)).collect();
    log.log(Level::Info, Some("finalize"), &format!("template {} ready (build {}) in {:.1} s", named.join(", "), template.build_id, started.elapsed().as_secs_f64()));
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
