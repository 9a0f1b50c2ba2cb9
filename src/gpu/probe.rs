//! Turning `kvx_engine_config.device` into a `Gpu`.

use super::cuda::CudaGpu;
use super::{Emulated, Gpu};
use crate::error::{bail, Result};
use std::sync::Arc;

pub const DEVICE_AUTO: i32 = -2;
pub const DEVICE_EMULATED: i32 = -1;

/// Resolves the configured device. `KVX_DEVICE_AUTO` takes GPU 0 when a driver and a
/// device exist and otherwise the emulated device, saying why; an explicit ordinal never
/// falls back.
pub fn open_device(device: i32) -> Result<Arc<dyn Gpu>> {
    match device {
        DEVICE_EMULATED => Ok(Arc::new(Emulated::default())),
        DEVICE_AUTO => match CudaGpu::open(0) {
            Ok(g) => Ok(Arc::new(g)),
            Err(e) => {
                log::info!("no usable CUDA device ({}); using the emulated device", e.message);
                Ok(Arc::new(Emulated::default()))
            }
        },
        d if d >= 0 => Ok(Arc::new(CudaGpu::open(d)?)),
        d => bail!(InvalidArg, "device {d} is not a CUDA ordinal, KVX_DEVICE_AUTO (-2) or KVX_DEVICE_EMULATED (-1)"),
    }
}
