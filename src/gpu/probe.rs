//! Turning `kvx_engine_config.device` into a `Gpu`.

use super::{Emulated, Gpu};
use crate::error::{bail, Result};
use std::sync::Arc;

pub const DEVICE_AUTO: i32 = -2;
pub const DEVICE_EMULATED: i32 = -1;

/// Whether a CUDA driver library can be loaded in this process.
fn cuda_driver_present() -> bool {
    // SAFETY: dlopen/dlclose with a constant, NUL-terminated name.
    unsafe {
        let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if h.is_null() {
            return false;
        }
        libc::dlclose(h);
        true
    }
}

/// Resolves the configured device. `KVX_DEVICE_AUTO` falls back to the emulated device
/// (and logs why); an explicit ordinal never falls back.
pub fn open_device(device: i32) -> Result<Arc<dyn Gpu>> {
    match device {
        DEVICE_EMULATED => Ok(Arc::new(Emulated)),
        DEVICE_AUTO => {
            if cuda_driver_present() {
                log::warn!("a CUDA driver is present but this build has no CUDA backend; using the emulated device");
            } else {
                log::info!("no CUDA driver (libcuda.so.1 not found); using the emulated device");
            }
            Ok(Arc::new(Emulated))
        }
        d if d >= 0 => {
            if cuda_driver_present() {
                bail!(Unsupported, "device {d}: this build of kvxfer has no CUDA backend; use KVX_DEVICE_EMULATED");
            }
            bail!(NoDevice, "device {d}: no CUDA driver (libcuda.so.1 not found); use KVX_DEVICE_AUTO or KVX_DEVICE_EMULATED")
        }
        d => bail!(InvalidArg, "device {d} is not a CUDA ordinal, KVX_DEVICE_AUTO (-2) or KVX_DEVICE_EMULATED (-1)"),
    }
}
