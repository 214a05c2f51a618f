mod progress;
fn main() {
    let home = hutch_image::HutchHome::from_env();
    let p = progress::TermProgress::new();
    let k = hutch_image::kernel::ensure(&home, &p).expect("kernel");
    let i = hutch_image::initramfs::ensure(&home, &k, std::path::Path::new("target/x86_64-unknown-linux-musl/agent/hutch-agent"), &p).expect("initramfs");
    println!("{} {}", k.vmlinuz().display(), i.display());
}
