//! Storage behind a layout: engine-owned or registered (caller-owned) memory on the
//! device, in pinned or pageable host memory, or a disk file.

use crate::error::{bail, Result};
use crate::file::{checksum, DiskFile, DiskFlags, Mapping, DEFAULT_IO_ALIGN};
use crate::gpu::Gpu;
use crate::layout::{Geometry, LayoutKind, Placement};
use crate::remote::{blob::Mem, Peer, Registration};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Where a layout's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageKind {
    Device,
    Pinned,
    Host,
    Disk,
    /// Memory of an imported peer (`crate::remote`), moved by NIXL transfers.
    Remote,
}

/// An allocation kvxfer made and frees when the last user is gone.
pub struct Owned {
    gpu: Arc<dyn Gpu>,
    addr: u64,
    bytes: u64,
    kind: StorageKind,
}

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: each Owned is the only record of an allocation made in `allocate`.
        unsafe {
            match self.kind {
                StorageKind::Device => self.gpu.free_device(self.addr, self.bytes),
                StorageKind::Pinned => self.gpu.free_pinned(self.addr as *mut u8, self.bytes),
                StorageKind::Host => crate::host::unmap(self.addr as *mut u8, self.bytes),
                StorageKind::Disk | StorageKind::Remote => unreachable!("disk and remote storage are not allocations"),
            }
        }
    }
}

fn allocate(gpu: &Arc<dyn Gpu>, kind: StorageKind, bytes: u64) -> Result<Owned> {
    let addr = match kind {
        StorageKind::Device => gpu.alloc_device(bytes)?,
        StorageKind::Pinned => gpu.alloc_pinned(bytes)? as u64,
        StorageKind::Host => crate::host::map_anonymous(bytes)? as u64,
        StorageKind::Disk | StorageKind::Remote => unreachable!(),
    };
    Ok(Owned { gpu: gpu.clone(), addr, bytes, kind })
}

pub enum Storage {
    /// One base address per allocation (1 for fully contiguous, one per layer otherwise).
    Memory {
        kind: StorageKind,
        bases: Vec<u64>,
        _owned: Vec<Owned>,
    },
    Disk(DiskFile),
    /// `DiskFlags::MAPPED`: a disk file moved as the pinned memory it is mapped to.
    Mapped {
        file: DiskFile,
        map: Mapping,
    },
    /// An imported layout: its bases are addresses in the peer, never dereferenced here.
    Remote {
        peer: Arc<Peer>,
        mem: Mem,
        bases: Vec<u64>,
    },
}

/// A layout: placement math plus the storage it addresses. Shared (`Arc`) between the
/// caller's handle and every request that uses it, so destroying the handle while a
/// request runs is safe.
pub struct Layout {
    pub placement: Placement,
    /// The memory's registration with the engine's remote link, made on its first
    /// export or remote transfer; declared before `storage` so it is dropped (and the
    /// memory deregistered) before the memory is freed.
    pub registration: Mutex<Option<Registration>>,
    pub storage: Storage,
    /// The engine this layout belongs to; transfers across engines are refused.
    pub engine_id: u64,
    /// Unique per layout, to detect a transfer whose source and destination are the same.
    pub id: u64,
    /// The host can dereference its bases: host memory, or any memory of the emulated
    /// device (which is host memory too).
    host_addressable: bool,
    /// Pinned, and the device's kernels address every base directly (`Gpu::maps_host`).
    device_maps: bool,
    /// `device_maps`, and those kernels read it about as fast as a DMA does
    /// (`Gpu::reads_host_in_place`).
    device_reads: bool,
}

static NEXT_LAYOUT_ID: AtomicU64 = AtomicU64::new(1);

impl Layout {
    fn new(engine_id: u64, gpu: &Arc<dyn Gpu>, placement: Placement, storage: Storage) -> Layout {
        let on_device = matches!(storage, Storage::Memory { kind: StorageKind::Device, .. });
        let remote = matches!(storage, Storage::Remote { .. });
        let host_addressable = !remote && (!on_device || gpu.device() == crate::gpu::Device::Emulated);
        let mut layout = Layout {
            placement,
            registration: Mutex::new(None),
            storage,
            engine_id,
            id: NEXT_LAYOUT_ID.fetch_add(1, Ordering::Relaxed),
            host_addressable,
            device_maps: false,
            device_reads: false,
        };
        let bytes = layout.placement.base_bytes();
        layout.device_maps =
            layout.kind() == StorageKind::Pinned && layout.bases().is_some_and(|b| b.iter().all(|&a| gpu.maps_host(a, bytes)));
        layout.device_reads = layout.device_maps && gpu.reads_host_in_place();
        layout
    }

    /// Whether it is pinned memory the device's kernels can read and write in place, so
    /// scattered regions need no CPU gather (see `HostSide::Mapped`).
    pub fn device_maps(&self) -> bool {
        self.device_maps
    }

    /// Whether the device's kernels read it in place about as fast as a DMA would, so a
    /// host-to-device copy of its scattered regions may read it there.
    pub fn device_reads(&self) -> bool {
        self.device_reads
    }

    /// Whether the host may dereference `bases()` (false for memory of a real GPU).
    pub fn host_addressable(&self) -> bool {
        self.host_addressable
    }

    /// How transfers treat it: a mapped file is pinned memory to the planner.
    pub fn kind(&self) -> StorageKind {
        match &self.storage {
            Storage::Memory { kind, .. } => *kind,
            Storage::Disk(_) => StorageKind::Disk,
            Storage::Mapped { .. } => StorageKind::Pinned,
            Storage::Remote { .. } => StorageKind::Remote,
        }
    }

    pub fn geometry(&self) -> &Geometry {
        &self.placement.geom
    }

    /// Memory bases, or `None` for disk moved by I/O.
    pub fn bases(&self) -> Option<&[u64]> {
        match &self.storage {
            Storage::Memory { bases, .. } => Some(bases),
            Storage::Mapped { map, .. } => Some(map.bases()),
            Storage::Remote { bases, .. } => Some(bases),
            Storage::Disk(_) => None,
        }
    }

    /// The file of a disk layout moved by I/O through the bounce slots.
    pub fn disk(&self) -> Option<&DiskFile> {
        match &self.storage {
            Storage::Disk(f) => Some(f),
            Storage::Memory { .. } | Storage::Mapped { .. } | Storage::Remote { .. } => None,
        }
    }

    /// The file behind a disk layout, moved by I/O or mapped.
    pub fn file(&self) -> Option<&DiskFile> {
        match &self.storage {
            Storage::Disk(f) | Storage::Mapped { file: f, .. } => Some(f),
            Storage::Memory { .. } | Storage::Remote { .. } => None,
        }
    }

    /// The peer and its memory type, for an imported layout.
    pub fn remote(&self) -> Option<(&Arc<Peer>, Mem)> {
        match &self.storage {
            Storage::Remote { peer, mem, .. } => Some((peer, *mem)),
            _ => None,
        }
    }

    /// What NIXL calls this (local, in-memory) layout's memory: device memory of a real
    /// GPU is VRAM, everything else (the emulated device too) host DRAM.
    pub fn local_mem(&self, gpu: &dyn Gpu) -> Mem {
        match (self.kind(), gpu.device()) {
            (StorageKind::Device, crate::gpu::Device::Cuda(d)) => Mem::Vram(d),
            _ => Mem::Dram,
        }
    }

    /// A layout of an imported peer; its geometry and bases were validated on import.
    pub fn import(
        engine_id: u64,
        gpu: &Arc<dyn Gpu>,
        kind: LayoutKind,
        geom: Geometry,
        peer: Arc<Peer>,
        mem: Mem,
        bases: Vec<u64>,
    ) -> Layout {
        Layout::new(engine_id, gpu, Placement::memory(kind, geom), Storage::Remote { peer, mem, bases })
    }

    /// Memory owned by kvxfer: device (`StorageKind::Device`) or host (pinned or not).
    pub fn create_memory(engine_id: u64, gpu: &Arc<dyn Gpu>, kind: LayoutKind, geom: Geometry, storage: StorageKind) -> Result<Layout> {
        let placement = Placement::memory(kind, geom);
        let owned = (0..placement.num_bases()).map(|_| allocate(gpu, storage, placement.base_bytes())).collect::<Result<Vec<_>>>()?;
        let bases = owned.iter().map(|o| o.addr).collect();
        Ok(Layout::new(engine_id, gpu, placement, Storage::Memory { kind: storage, bases, _owned: owned }))
    }

    /// Caller-owned memory: `bases` must hold one address per allocation of the kind;
    /// device bases are checked with the device. kvxfer never frees them.
    pub fn register_memory(
        engine_id: u64,
        gpu: &Arc<dyn Gpu>,
        kind: LayoutKind,
        geom: Geometry,
        storage: StorageKind,
        bases: &[u64],
    ) -> Result<Layout> {
        let placement = Placement::memory(kind, geom);
        if bases.len() as u64 != placement.num_bases() {
            bail!(
                InvalidArg,
                "{} bases given; a {} layout of {} layers needs {}",
                bases.len(),
                kind_name(kind),
                geom.cfg.num_layers,
                placement.num_bases()
            );
        }
        for (i, &b) in bases.iter().enumerate() {
            if b == 0 {
                bail!(InvalidArg, "base {i} is NULL");
            }
            let checked = match storage {
                StorageKind::Device => gpu.check_device_range(b, placement.base_bytes()),
                StorageKind::Pinned => gpu.check_pinned_range(b, placement.base_bytes()),
                _ => Ok(()),
            };
            checked.map_err(|e| crate::error::Error::new(e.status, format!("base {i}: {}", e.message)))?;
        }
        Ok(Layout::new(engine_id, gpu, placement, Storage::Memory { kind: storage, bases: bases.to_vec(), _owned: Vec::new() }))
    }

    /// A disk layout in the file at `path`, moved through bounce slots of `slot_bytes`.
    /// A geometry those slots cannot carry is refused before any file is made or
    /// truncated; a file this call made is removed again if it fails.
    pub fn create_disk(
        engine_id: u64,
        gpu: &Arc<dyn Gpu>,
        geom: Geometry,
        path: &Path,
        flags: DiskFlags,
        slot_bytes: u64,
    ) -> Result<Layout> {
        let mapped = flags.contains(DiskFlags::MAPPED);
        if mapped && flags.contains(DiskFlags::CHECKSUM) {
            bail!(
                InvalidArg,
                "KVX_DISK_MAPPED and KVX_DISK_CHECKSUM together: a mapped file's bytes go straight between its pages and the device, so nothing on the host could verify them; drop one"
            );
        }
        if mapped {
            Mapping::check_file_system(path)?;
        } else {
            fits_slots(&geom, path, flags, slot_bytes, DEFAULT_IO_ALIGN)?;
        }
        let mut file = DiskFile::open(path, flags)?;
        let create = flags.contains(DiskFlags::CREATE);
        let checksum = flags.contains(DiskFlags::CHECKSUM);
        if checksum && !create {
            // The file's padding as written, wherever it was written; where the sidecar
            // does not record it, as the file's size and block count tell.
            let sidecar = checksum::Sidecar::open(path, &geom)?;
            match sidecar.block_align() {
                Some(align) => file.use_align(align),
                None => file.find_align(geom.block_bytes, sidecar.file_blocks())?,
            }
            file.checksum = Some(sidecar);
        } else if !create {
            file.find_align(geom.block_bytes, geom.cfg.num_blocks)?;
        }
        if !mapped {
            fits_slots(&geom, path, flags, slot_bytes, file.align())?;
        }
        let placement = Placement::disk(geom, file.align());
        file.prepare(placement.base_bytes(), create)?;
        if checksum && create {
            file.checksum = Some(checksum::Sidecar::create(path, &geom, file.align())?);
        }
        if create && file.sync {
            file.sync_created()?;
        }
        let storage = match mapped {
            true => Storage::Mapped { map: Mapping::new(gpu, &file, placement.base_bytes())?, file },
            false => Storage::Disk(file),
        };
        let mut layout = Layout::new(engine_id, gpu, placement, storage);
        if let Storage::Disk(file) | Storage::Mapped { file, .. } = &mut layout.storage {
            file.commit();
        }
        Ok(layout)
    }
}

/// Refuses a disk layout whose I/O, aligned to `align`, bounce slots of `slot_bytes`
/// cannot carry.
fn fits_slots(geom: &Geometry, path: &Path, flags: DiskFlags, slot_bytes: u64, align: u64) -> Result<()> {
    if slot_bytes < 2 * align {
        bail!(Unsupported, "{} needs {align}-byte aligned I/O; raise slot_bytes to at least {}", path.display(), 2 * align);
    }
    // Checksums are computed per region inside one slot, so a region must fit in one.
    let region = geom.region_bytes;
    if flags.contains(DiskFlags::CHECKSUM) && region + 2 * align > slot_bytes {
        bail!(
            Unsupported,
            "KVX_DISK_CHECKSUM hashes whole {region}-byte regions inside one bounce slot; raise slot_bytes above {}",
            region + 2 * align
        );
    }
    Ok(())
}

pub fn kind_name(kind: LayoutKind) -> &'static str {
    match kind {
        LayoutKind::FullyContiguous => "fully contiguous",
        LayoutKind::LayerSeparate { block_first: true } => "layer-separate block-first",
        LayoutKind::LayerSeparate { block_first: false } => "layer-separate outer-first",
    }
}

impl std::fmt::Debug for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Layout")
            .field("storage", &self.kind())
            .field("kind", &self.placement.kind)
            .field("config", &self.placement.geom.cfg)
            .finish()
    }
}
