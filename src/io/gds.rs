//! GPUDirect Storage through cuFile (`KVX_IO_GDS`): disk <-> device memory with no bounce
//! slot, from the I/O workers.
//!
//! `libcufile.so` is loaded at run time (cudarc's `cufile` bindings). The engine uses
//! cuFile only after a probe at start-up read a known file into device memory and the
//! bytes came back right. Without the `nvidia-fs` kernel module cuFile runs in its
//! compatibility mode (POSIX reads into its own bounce buffers): that works, but it is
//! the two-hop path again, so we say so and `KVX_IO_AUTO` does not choose it.
//! cuFileRead/cuFileWrite are synchronous: nothing is still posted when they return, so
//! the rule of `posted` holds without a guard.

use super::{FileKey, Io};
use crate::error::{Error, Result, Status};
use crate::gpu::{CopyError, CopyKind, CopyOp, Gpu, HostSide};
use cudarc::cufile::sys;
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, RwLock, Weak};

/// One registered file descriptor.
struct Handle(sys::CUfileHandle_t);

// SAFETY: cuFile handles may be used from any thread (cuFile is thread-safe).
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: registered by `register` and deregistered only here.
        unsafe { sys::cuFileHandleDeregister(self.0) }
    }
}

fn register(fd: i32) -> std::result::Result<Handle, String> {
    // Built field by field: the handle-type enum has no zero value, so a zeroed
    // descriptor would not be a valid Rust value.
    let mut descr = sys::CUfileDescr_t {
        type_: sys::CUfileFileHandleType::CU_FILE_HANDLE_TYPE_OPAQUE_FD,
        handle: sys::CUfileDescr_t__bindgen_ty_1 { fd },
        fs_ops: std::ptr::null(),
    };
    let mut fh = std::mem::MaybeUninit::uninit();
    // SAFETY: `descr` is initialised; cuFile writes the handle on success.
    let err = unsafe { sys::cuFileHandleRegister(fh.as_mut_ptr(), &mut descr) };
    match err.err {
        sys::CUfileOpError::CU_FILE_SUCCESS => Ok(Handle(unsafe { fh.assume_init() })),
        e => Err(format!("cuFileHandleRegister: {e:?} (CUresult {:?})", err.cu_err)),
    }
}

/// What a cuFileRead/cuFileWrite return means: bytes moved, or why not.
fn moved(ret: isize) -> std::result::Result<u64, String> {
    match ret {
        n if n >= 0 => Ok(n as u64),
        -1 => Err(std::io::Error::last_os_error().to_string()),
        n => Err(format!("cuFile error {}", -n)),
    }
}

/// Registered files: (file id, descriptor) -> (the file's key while it lives, handle).
type Handles = HashMap<(u64, i32), (Weak<FileKey>, Arc<Handle>)>;

pub struct Gds {
    /// cuFile runs without nvidia-fs (POSIX I/O inside cuFile).
    pub compat: bool,
    /// Read-locked on every I/O, write-locked only to register a file's descriptor.
    handles: RwLock<Handles>,
}

/// Whether the nvidia-fs kernel module is loaded: without it cuFile can only run in
/// compatibility mode.
pub fn nvidia_fs_loaded() -> bool {
    std::path::Path::new("/proc/driver/nvidia-fs/version").exists()
}

fn unsupported(why: impl std::fmt::Display) -> Error {
    Error::new(Status::Unsupported, format!("KVX_IO_GDS: {why}; use KVX_IO_POSIX or KVX_IO_AUTO"))
}

const PROBE_BYTES: u64 = 1 << 20;

impl Gds {
    /// Opens cuFile and proves it: a known file read into device memory must come back
    /// byte for byte (checked through `scratch`, pinned host memory of at least 1 MiB).
    /// Runs on the caller's thread, before the engine's threads start, with the device's
    /// context pushed for the call.
    pub fn open(gpu: &Arc<dyn Gpu>, scratch: (u64, u64)) -> Result<Gds> {
        if gpu.device() == crate::gpu::Device::Emulated {
            return Err(unsupported("GPUDirect Storage needs a CUDA device; this engine runs on the emulated device"));
        }
        gpu.enter()?;
        let opened = Gds::open_here(gpu, scratch);
        gpu.leave();
        opened
    }

    fn open_here(gpu: &Arc<dyn Gpu>, scratch: (u64, u64)) -> Result<Gds> {
        // SAFETY: only probes for the library with dlopen.
        if !unsafe { sys::is_culib_present() } {
            return Err(unsupported(
                "libcufile.so was not found on the library path (it ships with the CUDA toolkit, e.g. /usr/local/cuda/lib64)",
            ));
        }
        // SAFETY: plain cuFile driver calls.
        let opened = unsafe { sys::cuFileDriverOpen() };
        if opened.err != sys::CUfileOpError::CU_FILE_SUCCESS {
            return Err(unsupported(format_args!("cuFileDriverOpen: {:?}", opened.err)));
        }
        let compat = !nvidia_fs_loaded();
        let gds = Gds { compat, handles: RwLock::new(HashMap::new()) };
        let mode = if compat { " (cuFile is in compatibility mode here: no nvidia-fs kernel module)" } else { "" };
        gds.probe(gpu, scratch).map_err(|why| unsupported(format_args!("the start-up probe failed{mode}: {why}")))?;
        Ok(gds)
    }

    /// For logs: what cuFile does here.
    pub fn mode(&self) -> &'static str {
        if self.compat {
            "cuFile in compatibility mode (no nvidia-fs: POSIX I/O through cuFile's own bounce buffers)"
        } else {
            "cuFile with GPUDirect Storage (nvidia-fs)"
        }
    }

    fn probe(&self, gpu: &Arc<dyn Gpu>, scratch: (u64, u64)) -> std::result::Result<(), String> {
        let n = PROBE_BYTES.min(scratch.1);
        let pattern: Vec<u8> = (0..n).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        let path = std::env::temp_dir().join(format!("kvxfer-gds-probe-{}-{:p}", std::process::id(), self));
        std::fs::write(&path, &pattern).map_err(|e| format!("writing {}: {e}", path.display()))?;
        // O_DIRECT where the filesystem allows it: GPUDirect Storage reads need it.
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .or_else(|_| std::fs::File::open(&path))
            .map_err(|e| format!("opening {}: {e}", path.display()));
        let _ = std::fs::remove_file(&path);
        let file = file?;
        let dev = gpu.alloc_device(n).map_err(|e| e.message)?;
        let result = (|| {
            let h = register(file.as_raw_fd())?;
            // SAFETY: `dev` holds `n` bytes of device memory.
            let got = moved(unsafe { sys::cuFileRead(h.0, dev as *mut _, n as usize, 0, 0) })?;
            if got != n {
                return Err(format!("read {got} of {n} bytes"));
            }
            let back = [CopyOp { dst: scratch.0, src: dev, len: n }];
            gpu.copy(CopyKind::DeviceToHost, &back, 0, HostSide::Bounce, None, false)
                .map_err(CopyError::settle)
                .and_then(|f| f.wait(false))
                .map_err(|e| e.message)?;
            // SAFETY: the scratch memory holds `n` bytes, just copied.
            let seen = unsafe { std::slice::from_raw_parts(scratch.0 as *const u8, n as usize) };
            if seen != pattern.as_slice() {
                return Err("the bytes read through cuFile differ from the file's".into());
            }
            Ok(())
        })();
        // SAFETY: allocated above, no longer used.
        unsafe { gpu.free_device(dev, n) };
        result
    }

    /// The handle for `fd` of `file`, registered on first use. Files that are gone are
    /// forgotten first, so a reused descriptor number is never served a stale handle.
    fn handle(&self, file: &Arc<FileKey>, fd: i32) -> Result<Arc<Handle>> {
        if let Some((_, h)) = self.handles.read().unwrap().get(&(file.id, fd)) {
            return Ok(h.clone());
        }
        let mut handles = self.handles.write().unwrap();
        if let Some((_, h)) = handles.get(&(file.id, fd)) {
            return Ok(h.clone()); // another worker registered it meanwhile
        }
        handles.retain(|_, (key, _)| key.strong_count() > 0);
        let h = Arc::new(register(fd).map_err(|e| Error::new(Status::Io, e))?);
        handles.insert((file.id, fd), (Arc::downgrade(file), h.clone()));
        Ok(h)
    }

    /// Moves every byte of `ios` (`addr`: device address) between `file` and the device.
    pub fn run(&self, write: bool, file: &Arc<FileKey>, ios: &[Io]) -> Result<()> {
        // A chunk's I/Os mostly share one descriptor: look its handle up once per run.
        let mut cur: Option<(i32, Arc<Handle>)> = None;
        for io in ios {
            if cur.as_ref().map(|(fd, _)| *fd) != Some(io.fd) {
                cur = Some((io.fd, self.handle(file, io.fd)?));
            }
            let h = &cur.as_ref().expect("set above").1;
            let mut done = 0u64;
            while done < io.len {
                let (dev, len, off) = ((io.addr + done) as *mut std::ffi::c_void, (io.len - done) as usize, (io.off + done) as i64);
                // SAFETY: the planner keeps `ios` inside the validated device layout.
                let ret = unsafe {
                    if write {
                        sys::cuFileWrite(h.0, dev, len, off, 0)
                    } else {
                        sys::cuFileRead(h.0, dev, len, off, 0)
                    }
                };
                match moved(ret) {
                    Ok(0) => {
                        return Err(Error::new(Status::Io, format!("cuFile: the file ends at offset {off} (expected {len} more bytes)")))
                    }
                    Ok(n) => done += n,
                    Err(e) => {
                        return Err(Error::new(Status::Io, format!("cuFile{} at offset {off}: {e}", if write { "Write" } else { "Read" })))
                    }
                }
            }
        }
        Ok(())
    }
}
