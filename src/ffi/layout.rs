//! `kvx_layout_*`. A `kvx_layout*` is an `Arc<Layout>` turned into a raw pointer; requests
//! hold clones, so destroying a layout in use is safe.

use super::boundary::*;
use super::convert;
use super::engine::engine;
use super::handle::ArcHandle;
use super::types::*;
use crate::error::{bail, Error, Result, Status};
use crate::layout::{LayoutConfig, LayoutKind};
use crate::memory::{Layout, StorageKind};
use std::ffi::{c_char, c_void, CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;

impl Versioned for kvx_layout_config {
    const NAME: &'static str = "kvx_layout_config";
    const V1_SIZE: usize = std::mem::size_of::<kvx_layout_config>();
    fn defaults() -> Self {
        kvx_layout_config {
            struct_size: std::mem::size_of::<kvx_layout_config>() as u32,
            kind: KVX_LAYOUT_FULLY_CONTIGUOUS,
            num_blocks: 0,
            num_layers: 0,
            outer_dim: 0,
            page_size: 0,
            inner_dim: 0,
            dtype_bytes: 0,
        }
    }
}

/// A new reference to the layout behind a handle.
///
/// # Safety
/// A non-NULL `l` must come from a `kvx_layout_*` constructor and not be destroyed.
pub(crate) unsafe fn layout(l: *const kvx_layout, name: &str) -> Result<Arc<Layout>> {
    kvx_layout::clone_arc(l, name)
}

unsafe fn read_config(c: *const kvx_layout_config) -> Result<(LayoutConfig, LayoutKind)> {
    let c = read_versioned(c)?;
    let kind = match c.kind {
        KVX_LAYOUT_FULLY_CONTIGUOUS => LayoutKind::FullyContiguous,
        KVX_LAYOUT_LAYER_SEPARATE_BLOCK_FIRST => LayoutKind::LayerSeparate { block_first: true },
        KVX_LAYOUT_LAYER_SEPARATE_OUTER_FIRST => LayoutKind::LayerSeparate { block_first: false },
        k => bail!(InvalidArg, "kvx_layout_config.kind {k} is not a KVX_LAYOUT_* value"),
    };
    let cfg = LayoutConfig {
        num_blocks: c.num_blocks,
        num_layers: c.num_layers,
        outer_dim: c.outer_dim,
        page_size: c.page_size,
        inner_dim: c.inner_dim,
        dtype_bytes: c.dtype_bytes,
    };
    Ok((cfg, kind))
}

fn publish(out: Out<*mut kvx_layout>, l: Arc<Layout>) {
    out.write(kvx_layout::into_c(l))
}

/// Fills `cfg` with `struct_size`, kind `KVX_LAYOUT_FULLY_CONTIGUOUS` and zero dimensions
/// (every dimension must then be set). NULL is ignored.
#[no_mangle]
pub unsafe extern "C" fn kvx_layout_config_init(cfg: *mut kvx_layout_config) {
    if !cfg.is_null() {
        cfg.write(kvx_layout_config::defaults());
    }
}

/// Allocates device memory for the layout (kvxfer owns and frees it). `*out` is freed
/// with `kvx_layout_destroy`.
#[no_mangle]
pub unsafe extern "C" fn kvx_layout_create_device(
    e: *mut kvx_engine,
    c: *const kvx_layout_config,
    out: *mut *mut kvx_layout,
) -> kvx_status {
    guard(
        || {
            let out = Out::new(out, "out")?;
            let (cfg, kind) = read_config(c)?;
            Ok((out, engine(e)?.create_layout(&cfg, kind, StorageKind::Device)?))
        },
        |(o, l)| publish(o, l),
    )
}

/// Allocates host memory for the layout, page-locked with `KVX_HOST_PINNED` (kvxfer owns
/// and frees it). `*out` is freed with `kvx_layout_destroy`.
#[no_mangle]
pub unsafe extern "C" fn kvx_layout_create_host(
    e: *mut kvx_engine,
    c: *const kvx_layout_config,
    flags: u32,
    out: *mut *mut kvx_layout,
) -> kvx_status {
    guard(
        || {
            let out = Out::new(out, "out")?;
            let (cfg, kind) = read_config(c)?;
            let storage = convert::host_storage(flags)?;
            Ok((out, engine(e)?.create_layout(&cfg, kind, storage)?))
        },
        |(o, l)| publish(o, l),
    )
}

/// A disk layout in the file at `path` (UTF-8 or any bytes, NUL-terminated), always fully
/// contiguous with each block padded to the direct-I/O alignment (`kind` is ignored).
/// `flags` are `KVX_DISK_*`: without `KVX_DISK_CREATE` the file must exist and be large
/// enough, and is never truncated. `*out` is freed with `kvx_layout_destroy`.
#[no_mangle]
pub unsafe extern "C" fn kvx_layout_create_disk(
    e: *mut kvx_engine,
    c: *const kvx_layout_config,
    path: *const c_char,
    flags: u32,
    out: *mut *mut kvx_layout,
) -> kvx_status {
    guard(
        || {
            let out = Out::new(out, "out")?;
            let (cfg, _) = read_config(c)?;
            let path = non_null(path, "path")?;
            let bytes = CStr::from_ptr(path).to_bytes();
            if bytes.is_empty() {
                bail!(InvalidArg, "path is empty");
            }
            let p = Path::new(OsStr::from_bytes(bytes));
            Ok((out, engine(e)?.create_disk_layout(&cfg, p, convert::disk_flags(flags)?)?))
        },
        |(o, l)| publish(o, l),
    )
}

/// Wraps caller-owned device memory (e.g. the runtime's KV pool): one base for fully
/// contiguous, `num_layers` bases for layer-separate kinds. kvxfer never frees it; it must
/// outlive every request that uses the layout.
#[no_mangle]
pub unsafe extern "C" fn kvx_layout_register_device(
    e: *mut kvx_engine,
    c: *const kvx_layout_config,
    bases: *const u64,
    num_bases: usize,
    out: *mut *mut kvx_layout,
) -> kvx_status {
    guard(
        || {
            let out = Out::new(out, "out")?;
            let (cfg, kind) = read_config(c)?;
            let bases = slice(bases, num_bases, "bases")?;
            Ok((out, engine(e)?.register_layout(&cfg, kind, StorageKind::Device, bases)?))
        },
        |(o, l)| publish(o, l),
    )
}

/// Wraps caller-owned host memory; `KVX_HOST_PINNED` says it is already page-locked.
/// Bases as for `kvx_layout_register_device`. kvxfer never frees it.
#[no_mangle]
pub unsafe extern "C" fn kvx_layout_register_host(
    e: *mut kvx_engine,
    c: *const kvx_layout_config,
    bases: *const *mut c_void,
    num_bases: usize,
    flags: u32,
    out: *mut *mut kvx_layout,
) -> kvx_status {
    guard(
        || {
            let out = Out::new(out, "out")?;
            let (cfg, kind) = read_config(c)?;
            let storage = convert::host_storage(flags)?;
            let bases: Vec<u64> = slice(bases, num_bases, "bases")?.iter().map(|p| *p as u64).collect();
            Ok((out, engine(e)?.register_layout(&cfg, kind, storage, &bases)?))
        },
        |(o, l)| publish(o, l),
    )
}

/// Bytes of one block (all layers, K and V): `num_layers × outer_dim × page_size ×
/// inner_dim × dtype_bytes`.
#[no_mangle]
pub unsafe extern "C" fn kvx_layout_block_bytes(l: *const kvx_layout, out: *mut u64) -> kvx_status {
    guard(|| Ok((Out::new(out, "out")?, layout(l, "layout")?.geometry().block_bytes)), |(o, v)| o.write(v))
}

/// Base address of one layer's allocation (layer 0 for fully contiguous): a device
/// pointer, or a host pointer for host and emulated-device layouts, and for a
/// `KVX_DISK_MAPPED` layout the file's mapping (blocks at the file's offsets). Other disk
/// layouts have none (`KVX_ERR_UNSUPPORTED`).
#[no_mangle]
pub unsafe extern "C" fn kvx_layout_base(l: *const kvx_layout, layer: u64, addr_out: *mut u64) -> kvx_status {
    guard(
        || {
            let out = Out::new(addr_out, "addr_out")?;
            let l = layout(l, "layout")?;
            if l.remote().is_some() {
                bail!(Unsupported, "an imported layout's memory is in its peer; it has no address here");
            }
            let Some(bases) = l.bases() else {
                bail!(Unsupported, "a disk layout has no base address");
            };
            let addr = *bases
                .get(layer as usize)
                .ok_or_else(|| Error::new(Status::OutOfRange, format!("layer {layer}: this layout has {} base(s)", bases.len())))?;
            Ok((out, addr))
        },
        |(o, a)| o.write(a),
    )
}

/// Drops the caller's reference. Memory kvxfer allocated (and a file it created without
/// `KVX_DISK_KEEP`) goes away once no request uses the layout. NULL is a no-op.
#[no_mangle]
pub unsafe extern "C" fn kvx_layout_destroy(l: *mut kvx_layout) {
    if !l.is_null() {
        infallible((), || kvx_layout::free(l));
    }
}
