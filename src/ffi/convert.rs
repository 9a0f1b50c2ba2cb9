//! The C codes and bit sets of the ABI turned into the typed values below `ffi`, and
//! back: the one place that knows `KVX_DEVICE_*`, `KVX_IO_*`, `KVX_DISK_*` and
//! `KVX_HOST_*`. Every unknown value or bit is refused here, with what is accepted.

use super::types::*;
use crate::engine::{EngineConfig, IoBackend};
use crate::error::{bail, Result};
use crate::file::DiskFlags;
use crate::gpu::Device;
use crate::memory::StorageKind;

pub fn device(d: i32) -> Result<Device> {
    match d {
        KVX_DEVICE_AUTO => Ok(Device::Auto),
        KVX_DEVICE_EMULATED => Ok(Device::Emulated),
        d if d >= 0 => Ok(Device::Cuda(d as u32)),
        d => bail!(InvalidArg, "device {d} is not a CUDA ordinal, KVX_DEVICE_AUTO (-2) or KVX_DEVICE_EMULATED (-1)"),
    }
}

pub fn device_code(d: Device) -> i32 {
    match d {
        Device::Auto => KVX_DEVICE_AUTO,
        Device::Emulated => KVX_DEVICE_EMULATED,
        Device::Cuda(n) => n as i32,
    }
}

const BACKENDS: [(u32, IoBackend); 5] = [
    (KVX_IO_AUTO, IoBackend::Auto),
    (KVX_IO_POSIX, IoBackend::Posix),
    (KVX_IO_URING, IoBackend::Uring),
    (KVX_IO_NIXL, IoBackend::Nixl),
    (KVX_IO_GDS, IoBackend::Gds),
];

pub fn io_backend(code: u32) -> Result<IoBackend> {
    match BACKENDS.iter().find(|(c, _)| *c == code) {
        Some(&(_, b)) => Ok(b),
        None => bail!(InvalidArg, "engine config: io_backend {code} is not a KVX_IO_* value (0 to {KVX_IO_GDS})"),
    }
}

pub fn io_backend_code(b: IoBackend) -> u32 {
    BACKENDS.iter().find(|(_, x)| *x == b).map(|&(c, _)| c).expect("every IoBackend has a code")
}

const DISK_FLAGS: [(u32, DiskFlags); 6] = [
    (KVX_DISK_CREATE, DiskFlags::CREATE),
    (KVX_DISK_KEEP, DiskFlags::KEEP),
    (KVX_DISK_BUFFERED, DiskFlags::BUFFERED),
    (KVX_DISK_SYNC, DiskFlags::SYNC),
    (KVX_DISK_CHECKSUM, DiskFlags::CHECKSUM),
    (KVX_DISK_MAPPED, DiskFlags::MAPPED),
];

pub fn disk_flags(bits: u32) -> Result<DiskFlags> {
    let mut flags = DiskFlags::NONE;
    let mut left = bits;
    for &(c, f) in &DISK_FLAGS {
        if bits & c != 0 {
            flags |= f;
            left &= !c;
        }
    }
    if left != 0 {
        bail!(InvalidArg, "unknown disk flags {left:#x}; known: KVX_DISK_CREATE|KEEP|BUFFERED|SYNC|CHECKSUM|MAPPED");
    }
    Ok(flags)
}

/// `KVX_HOST_*` as the host storage they ask for.
pub fn host_storage(flags: u32) -> Result<StorageKind> {
    if flags & !KVX_HOST_PINNED != 0 {
        bail!(InvalidArg, "unknown host flags {:#x}; the only one is KVX_HOST_PINNED", flags & !KVX_HOST_PINNED);
    }
    Ok(if flags & KVX_HOST_PINNED != 0 { StorageKind::Pinned } else { StorageKind::Host })
}

/// A caller's engine config, every code checked (the sizes are `EngineConfig::resolve`'s).
pub fn engine_config(c: &kvx_engine_config) -> Result<EngineConfig> {
    if c.flags != 0 {
        bail!(InvalidArg, "engine config: unknown flags {:#x}; none are defined, pass 0", c.flags);
    }
    Ok(EngineConfig {
        device: device(c.device)?,
        io_threads: c.io_threads,
        io_backend: io_backend(c.io_backend)?,
        bounce_bytes: c.bounce_bytes,
        slot_bytes: c.slot_bytes,
        max_inflight: c.max_inflight,
    })
}

pub fn engine_config_c(c: &EngineConfig) -> kvx_engine_config {
    kvx_engine_config {
        struct_size: std::mem::size_of::<kvx_engine_config>() as u32,
        device: device_code(c.device),
        io_threads: c.io_threads,
        io_backend: io_backend_code(c.io_backend),
        bounce_bytes: c.bounce_bytes,
        slot_bytes: c.slot_bytes,
        max_inflight: c.max_inflight,
        flags: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_ones_are_refused() {
        for d in [KVX_DEVICE_AUTO, KVX_DEVICE_EMULATED, 0, 7] {
            assert_eq!(device_code(device(d).unwrap()), d);
        }
        assert!(device(-3).unwrap_err().message.contains("not a CUDA ordinal"));
        for b in 0..=KVX_IO_GDS {
            assert_eq!(io_backend_code(io_backend(b).unwrap()), b);
        }
        assert!(io_backend(KVX_IO_GDS + 1).unwrap_err().message.contains("not a KVX_IO_* value"));
        let all = KVX_DISK_CREATE | KVX_DISK_KEEP | KVX_DISK_BUFFERED | KVX_DISK_SYNC | KVX_DISK_CHECKSUM | KVX_DISK_MAPPED;
        let f = disk_flags(all).unwrap();
        for (_, one) in DISK_FLAGS {
            assert!(f.contains(one));
        }
        assert_eq!(disk_flags(KVX_DISK_SYNC).unwrap(), DiskFlags::SYNC);
        assert!(disk_flags(all | 64).unwrap_err().message.contains("0x40"));
        assert_eq!(host_storage(KVX_HOST_PINNED).unwrap(), StorageKind::Pinned);
        assert!(host_storage(2).is_err());
    }
}
