//! What unit tests of templates build their fixtures with.

use crate::recipes::SUITE;
use crate::template::{Shape, Template};
use crate::HutchHome;
use std::path::PathBuf;

/// An image file with `bytes` in the home's scratch, as a build leaves one.
pub fn built(home: &HutchHome, bytes: &[u8]) -> PathBuf {
    std::fs::create_dir_all(home.tmp()).expect("tmp");
    let path = home.tmp().join("rootfs.ext4");
    std::fs::write(&path, bytes).expect("image");
    path
}

/// A template record named `name`, as a recipe build makes one.
pub fn manifest(name: &str) -> Template {
    Template { name: name.into(), suite: SUITE.into(), packages: vec![], built_at: String::new(), disk_size: 1, build_id: String::new(), image: String::new(), recipe: String::new(), source: None, api_build: None, shape: Shape::default(), tagged_at: None, dir: PathBuf::new(), tag: None }
}
