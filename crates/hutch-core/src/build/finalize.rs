//! The last phase: the top layer's chain (the defaults already written into it by the
//! builder VM) flattened into one raw ext4 image and installed as the template's new
//! build. Nothing here reads the guest's filesystem: the disk layer (`hutch_vmm::disk`) copies clusters.

use super::cache::Key;
use super::spec::{BuildError, BuildLog, BuildSpec, FailedAt, Level};
use hutch_image::template::{ImageSource, Template};
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
        // The disk's size is the flattened image's: a build from a grown template is as
        // large as its base, whatever it asks.
        template.disk_size = match shape.min_free_disk_mib {
            Some(mib) => grow_to_free(&raw, u64::from(mib) << 20)?,
            None => std::fs::metadata(&raw).map_err(|e| format!("reading the image's size: {e}"))?.len(),
        };
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
    hutch_vmm::disk::flatten_to_raw(layer, raw, TOOL_DEADLINE).map_err(|e| format!("flattening the build's layers: {}", hutch_proto::error_chain(&e)))
}

/// An e2fsprogs tool: from /usr/sbin, which a user's PATH on Debian lacks.
fn e2fsprogs(name: &str) -> Command {
    let sbin = Path::new("/usr/sbin").join(name);
    Command::new(if sbin.is_file() { sbin.into_os_string() } else { name.into() })
}

/// Space of an ext4 image, from `dumpe2fs -h`.
#[derive(Debug, PartialEq, Eq)]
struct Ext4Space {
    block_size: u64,
    blocks: u64,
    /// Free blocks that users (not only root) may take.
    available_blocks: u64,
}

fn ext4_space(dumpe2fs: &str) -> Option<Ext4Space> {
    let field = |name: &str| dumpe2fs.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<u64>().ok());
    let (free, reserved) = (field("Free blocks:")?, field("Reserved block count:")?);
    Some(Ext4Space { block_size: field("Block size:")?, blocks: field("Block count:")?, available_blocks: free.saturating_sub(reserved) })
}

fn space_of(raw: &Path) -> Result<Ext4Space, String> {
    let out = tool(e2fsprogs("dumpe2fs").arg("-h").arg(raw), "reading the image's free space")?;
    ext4_space(&String::from_utf8_lossy(&out)).ok_or_else(|| "reading the image's free space: dumpe2fs printed no block counts".to_string())
}

/// Grows the ext4 image `raw` (file and filesystem) until users have `free` bytes
/// free in it, as E2B's `minFreeDiskMb` asks; never shrinks it. Returns its size.
/// The file stays sparse: the host pays only for what the guest writes. Each round
/// adds what is missing plus a margin for the new groups' metadata and the root
/// reserve, which grow with the filesystem; a round or two suffices.
fn grow_to_free(raw: &Path, free: u64) -> Result<u64, String> {
    // resize2fs wants a checked filesystem; this one was just mounted by the builder.
    let check = hutch_vmm::process::output_within(e2fsprogs("e2fsck").args(["-f", "-p"]).arg(raw), TOOL_DEADLINE).map_err(|e| format!("checking the image before growing it: {e}"))?;
    // 0: clean, 1 or 2: errors fixed; anything else is a filesystem e2fsck would not fix.
    if !matches!(check.status.code(), Some(0..=2)) {
        return Err(format!("checking the image before growing it: {}", String::from_utf8_lossy(&check.stdout).trim()));
    }
    for _ in 0..4 {
        let space = space_of(raw)?;
        let available = space.available_blocks * space.block_size;
        if available >= free {
            return Ok(space.blocks * space.block_size);
        }
        let missing = free - available;
        let size = (space.blocks * space.block_size + missing + missing / 10 + (16 << 20)).next_multiple_of(1 << 20);
        std::fs::OpenOptions::new().write(true).open(raw).and_then(|f| f.set_len(size)).map_err(|e| format!("growing the image: {e}"))?;
        tool(e2fsprogs("resize2fs").arg(raw), "growing the image's filesystem")?;
    }
    Err(format!("growing the image: it still had less than {} MiB free after four rounds", free >> 20))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_space_is_what_users_may_take() {
        let text = "Filesystem volume name:   hutch-root\nBlock count:              1048576\nReserved block count:     52428\nFree blocks:              900000\nBlock size:               4096\n";
        assert_eq!(ext4_space(text), Some(Ext4Space { block_size: 4096, blocks: 1048576, available_blocks: 900000 - 52428 }));
        assert_eq!(ext4_space("Block size: 4096\n"), None);
    }

    /// A real image grows to the free space asked for, and stays sparse; asking for
    /// less than it has changes nothing.
    #[test]
    fn an_image_grows_to_the_free_space_asked_for() {
        let dir = tempfile::tempdir().expect("dir");
        let raw = dir.path().join("rootfs.ext4");
        std::fs::File::create(&raw).and_then(|f| f.set_len(64 << 20)).expect("file");
        tool(e2fsprogs("mkfs.ext4").args(["-q", "-F"]).arg(&raw), "mkfs").expect("mkfs");
        let size = grow_to_free(&raw, 200 << 20).expect("grow");
        let space = space_of(&raw).expect("space");
        assert!(space.available_blocks * space.block_size >= 200 << 20, "{space:?}");
        assert_eq!(size, std::fs::metadata(&raw).expect("meta").len());
        use std::os::unix::fs::MetadataExt;
        assert!(std::fs::metadata(&raw).expect("meta").blocks() * 512 < size / 2, "the grown image is not sparse");
        assert_eq!(grow_to_free(&raw, 1 << 20).expect("no growth"), size);
    }
}
