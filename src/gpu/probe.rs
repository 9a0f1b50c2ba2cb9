//! Which GPU an engine uses: `Device`, and opening it.

use super::cuda::CudaGpu;
use super::{Emulated, Gpu};
use crate::error::Result;
use std::sync::Arc;

/// The device an engine moves blocks to and from (`KVX_DEVICE_*` or an ordinal at the C ABI).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// GPU 0 when a driver and a device exist, else the emulated device.
    #[default]
    Auto,
    /// Host memory standing in for a GPU.
    Emulated,
    /// This CUDA ordinal; never falls back.
    Cuda(u32),
}

/// Resolves the configured device. `Device::Auto` takes GPU 0 when a driver and a device
/// exist and otherwise the emulated device, saying why; an explicit ordinal never falls
/// back.
pub fn open_device(device: Device) -> Result<Arc<dyn Gpu>> {
    match device {
        Device::Emulated => Ok(Arc::new(Emulated::new())),
        Device::Auto => match CudaGpu::open(0) {
            Ok(g) => Ok(Arc::new(g)),
            Err(e) => {
                log::info!("no usable CUDA device ({}); using the emulated device", e.message);
                Ok(Arc::new(Emulated::new()))
            }
        },
        Device::Cuda(d) => Ok(Arc::new(CudaGpu::open(d)?)),
    }
}
