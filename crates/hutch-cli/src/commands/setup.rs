//! `hutch setup`: prepare every artifact ahead of time.

use clap::Args;
use hutch_vmm::AccelChoice;

#[derive(Args, Debug)]
pub struct SetupArgs {
    /// Templates to build.
    #[arg(long = "template", default_values_t = vec!["base".to_string()])]
    pub templates: Vec<String>,
}

pub async fn run(args: SetupArgs) -> anyhow::Result<i32> {
    for template in &args.templates {
        let local = crate::local::Local::prepare(template, AccelChoice::Auto).await?;
        let a = &local.artifacts;
        crate::output::outln!("kernel      {} ({})", a.kernel.version, a.kernel.vmlinuz().display());
        crate::output::outln!("initramfs   {}", a.initramfs.display());
        crate::output::outln!("template    {} ({})", a.template.name, a.template.image().display());
        crate::output::outln!("accel       {} ({})", local.accel.accel.as_str(), local.accel.why);
        let opts = hutch_core::SandboxOptions { accel: local.accel.accel, memory: hutch_core::MemMib::of_template(template), ..Default::default() };
        let snapshot = super::run::ensure_snapshot(&local, &opts).await?;
        crate::output::outln!("snapshot    {}", snapshot.dir.display());
    }
    crate::output::outln!("hutch is ready: try `hutch run -- python3 -c 'print(42)'`");
    Ok(0)
}
