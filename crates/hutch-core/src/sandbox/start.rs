//! A new sandbox of a template: restored from the template's memory snapshot (made on
//! first use), or booted when asked. The one place that chooses between the two, for
//! the manager, `hutch run` and the benchmarks alike.

use super::boot::SandboxOptions;
use super::errors::CreateError;
use super::Sandbox;
use crate::artifacts::Artifacts;
use hutch_image::HutchHome;
use hutch_vmm::VmBackend;

impl Sandbox {
    /// A new sandbox of the template: restored from the template's memory snapshot
    /// (made on first use) unless `opts.cold` asks for a boot.
    pub async fn create(
        home: &HutchHome,
        artifacts: &Artifacts,
        backend: &dyn VmBackend,
        opts: &SandboxOptions,
    ) -> Result<Sandbox, CreateError> {
        if opts.cold {
            return Self::create_cold(home, artifacts, backend, opts).await;
        }
        let snapshot = crate::template_snapshot::ensure(home, artifacts, backend, opts)
            .await
            .map_err(|e| CreateError::TemplateSnapshot(Box::new(e)))?;
        Self::from_snapshot(home, artifacts, backend, &snapshot, opts).await
    }

    /// A new sandbox that boots the guest kernel.
    /// The template's start command runs as it does before a memory snapshot is taken:
    /// started, then its ready command waited for.
    pub async fn create_cold(home: &HutchHome, artifacts: &Artifacts, backend: &dyn VmBackend, opts: &SandboxOptions) -> Result<Sandbox, CreateError> {
        let sandbox = Self::boot_on(home, artifacts, backend, opts, &artifacts.template.image(), None).await?;
        let Some(defaults) = artifacts.template.source.as_ref().map(|s| &s.defaults) else { return Ok(sandbox) };
        match crate::template_snapshot::start_command(sandbox.agent(), defaults).await {
            Ok(()) => Ok(sandbox),
            Err(detail) => {
                let console = sandbox.console_tail(20);
                if let Err(e) = sandbox.destroy().await {
                    tracing::warn!("stopping a sandbox whose start command failed: {e}");
                }
                Err(CreateError::StartCmd { detail, console })
            }
        }
    }
}
