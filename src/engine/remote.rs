//! The engine's side of remote layouts: its link (created on first use), export,
//! import, and the registration of local memory that remote transfers touch.

use super::Engine;
use crate::error::{bail, Result};
use crate::memory::{Layout, StorageKind};
use crate::remote::blob::{Blob, Shared};
use crate::remote::{abi_major, Exported, Link};
use std::sync::Arc;
use std::time::Duration;

/// A remote transfer that does not end within this is failed with `KVX_ERR_REMOTE`
/// when the importer passes 0.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

impl Engine {
    /// The engine's NIXL/UCX link, started on the first export or import.
    pub(super) fn link(&self) -> Result<Arc<Link>> {
        let mut link = self.link.lock().unwrap();
        if let Some(l) = &*link {
            return Ok(l.clone());
        }
        let l = Link::new(self.id, self.ring.memory())?;
        log::info!("engine {}: remote layouts enabled (NIXL with UCX)", self.id);
        *link = Some(l.clone());
        Ok(l)
    }

    /// Registers a local memory layout with the link once; later calls are free.
    pub(super) fn register_for_remote(&self, link: &Link, layout: &Layout) -> Result<()> {
        let mut reg = layout.registration.lock().unwrap();
        if reg.is_none() {
            let bases = layout.bases().expect("memory layout");
            let bytes = layout.placement.base_bytes();
            let spans: Vec<_> = bases.iter().map(|&b| (b, bytes)).collect();
            // UCX asks the driver about device memory: in our context, pushed on the
            // caller's thread for the call.
            self.gpu.enter()?;
            let registered = link.register(layout.local_mem(&*self.gpu), &spans);
            self.gpu.leave();
            *reg = Some(registered?);
        }
        Ok(())
    }

    /// One blob through which a peer reaches `layouts` (device, pinned or pageable host
    /// memory of this engine) and nothing else. Each call makes a newer blob; a peer
    /// that imports it replaces what it imported from this engine before.
    pub fn export(&self, layouts: &[Arc<Layout>]) -> Result<Vec<u8>> {
        if layouts.is_empty() {
            bail!(InvalidArg, "no layouts to export; pass at least one");
        }
        for (i, l) in layouts.iter().enumerate() {
            if l.engine_id != self.id {
                bail!(InvalidArg, "layout {i} belongs to another engine; export layouts of this engine");
            }
            let memory = matches!(l.storage, crate::memory::Storage::Memory { .. });
            if !memory {
                bail!(Unsupported, "layout {i} is {:?} storage; only device, pinned and host memory layouts can be exported", l.kind());
            }
        }
        for (i, l) in layouts.iter().enumerate() {
            if let Some(j) = layouts[..i].iter().position(|m| m.id == l.id) {
                bail!(InvalidArg, "layouts {j} and {i} are the same layout; export each layout once");
            }
        }
        let link = self.link()?;
        // One registration lock at a time: two exports of the same layouts in other
        // orders never wait on each other.
        let shared = layouts
            .iter()
            .map(|l| {
                self.register_for_remote(&link, l)?;
                let reg = l.registration.lock().unwrap();
                let reg = reg.as_ref().expect("registered above");
                let storage = match l.kind() {
                    StorageKind::Device => Exported::Device,
                    StorageKind::Pinned => Exported::Pinned,
                    _ => Exported::Host,
                };
                let metadata = link.metadata(reg)?;
                Ok(Shared {
                    id: l.id,
                    storage,
                    mem: reg.mem(),
                    kind: l.placement.kind,
                    cfg: l.geometry().cfg,
                    bases: l.bases().unwrap().to_vec(),
                    metadata,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        link.export(shared)
    }

    /// How many layouts `blob` holds, after the checks `import` makes; imports nothing.
    pub fn import_count(&self, blob: &[u8]) -> Result<usize> {
        let blob = Blob::decode(blob, abi_major())?;
        self.link()?.may_import(&blob)?;
        Ok(blob.layouts.len())
    }

    /// The layouts of a peer's blob, in the order it exported them. `timeout`: how long
    /// one remote transfer may take before it fails (zero: `DEFAULT_TIMEOUT`).
    pub fn import(&self, blob: &[u8], timeout: Duration) -> Result<Vec<Arc<Layout>>> {
        let blob = Blob::decode(blob, abi_major())?;
        let link = self.link()?;
        let timeout = if timeout.is_zero() { DEFAULT_TIMEOUT } else { timeout };
        let peer = link.import(&blob, timeout)?;
        Ok(blob
            .layouts
            .iter()
            .map(|s| {
                let geom = s.geometry().expect("validated by decode");
                Arc::new(Layout::import(self.id, &self.gpu, s.kind, geom, peer.clone(), s.mem, s.bases.clone()))
            })
            .collect())
    }

    /// Checks that go with a remote side: one side remote, not a stale import, and the
    /// local memory side registered with the link.
    pub(super) fn validate_remote(&self, src: &Layout, dst: &Layout) -> Result<()> {
        let (remote, local) = match (src.remote(), dst.remote()) {
            (None, None) => return Ok(()),
            (Some(_), Some(_)) => bail!(Unsupported, "both layouts are remote; move remote to remote through a local layout"),
            (Some(r), None) => (r, dst),
            (None, Some(r)) => (r, src),
        };
        if remote.0.stale() {
            bail!(InvalidArg, "the remote layout comes from an older blob of {}; use the layouts of its newest import", remote.0.name);
        }
        if remote.0.dead() {
            return Err(remote.0.closed());
        }
        if local.kind() == StorageKind::Disk {
            return Ok(()); // through the bounce ring, registered with the link
        }
        if !matches!(local.storage, crate::memory::Storage::Memory { .. }) {
            bail!(
                Unsupported,
                "remote transfers move device, pinned or host memory layouts, or disk through the bounce ring; not a mapped file"
            );
        }
        let link = self.link()?;
        self.register_for_remote(&link, local)
    }
}
