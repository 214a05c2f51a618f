//! What every local command needs: the home, orphan sweeping, the accelerator, artifacts.

use anyhow::Context;
use hutch_core::Artifacts;
use hutch_image::HutchHome;
use hutch_vmm::accel::{self, Selected};
use hutch_vmm::AccelChoice;

pub struct Local {
    pub home: HutchHome,
    pub accel: Selected,
    pub artifacts: Artifacts,
}

impl Local {
    pub async fn prepare(template: &str, accel_choice: AccelChoice) -> anyhow::Result<Local> {
        let home = HutchHome::from_env();
        let swept = hutch_core::sweep::sweep_orphans(&home, hutch_core::sweep::Sweeper::Local);
        if swept > 0 {
            tracing::info!("removed {swept} sandbox(es) left behind by hutch processes that died");
        }
        home.make_private().with_context(|| format!("creating {} (mode 0700)", home.root().display()))?;
        // Before anything is downloaded or built: a missing or too old QEMU is one sentence.
        let qemu = hutch_vmm::qemu::QemuBackend::with_cache_dir(home.root());
        let version = tokio::task::spawn_blocking(move || qemu.version()).await??;
        tracing::debug!(qemu = %version.line, "QEMU");
        let cache = home.root().join("accel-probe");
        let accel = tokio::task::spawn_blocking(move || accel::select(accel_choice, Some(&cache))).await??;
        tracing::info!(accel = accel.accel.as_str(), "{}", accel.why);
        if accel.accel == hutch_vmm::Accel::Tcg {
            tracing::info!("running on TCG (software emulation): QEMU's TCG is not a security boundary");
        }
        let template_name = template.to_string();
        let home2 = home.clone();
        let artifacts = tokio::task::spawn_blocking(move || {
            let progress = crate::progress::TermProgress::new();
            Artifacts::prepare(&home2, &template_name, &progress)
        })
        .await?
        .with_context(|| format!("preparing template '{template}'"))?;
        Ok(Local { home, accel, artifacts })
    }

    /// The QEMU backend, caching host facts in this home.
    pub fn backend(&self) -> hutch_vmm::qemu::QemuBackend {
        hutch_vmm::qemu::QemuBackend::with_cache_dir(self.home.root())
    }
}
