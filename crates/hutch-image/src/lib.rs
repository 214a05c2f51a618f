//! Guest artifacts: the Debian cloud kernel, the initramfs that carries hutch-agent as
//! `/init`, and template root filesystems as raw ext4 images, all cached under
//! `$HUTCH_HOME`.
//!
//! This crate builds and finds files; it never starts VMs and never installs anything
//! into the host system (packages are downloaded and unpacked, not installed).

#[cfg(test)]
mod builds_tests;
pub mod cpio;
pub mod file_error;
pub mod flock;
pub mod from_image;
pub mod home;
mod image_tree;
pub mod initramfs;
pub mod kernel;
pub mod progress;
pub mod prune;
pub mod recipes;
pub mod record;
pub mod rootfs;
mod run;
pub mod tags;
pub mod template;
pub mod template_store;
#[cfg(test)]
mod test_support;
pub mod unprivileged;

pub use home::HutchHome;
pub use progress::Progress;
