//! NIXL's POSIX backend as one I/O worker's disk path (`KVX_IO_NIXL`).
//!
//! NIXL is found at run time: nixl-sys is built with `stub-api`, so `libnixl_capi.so`
//! comes from the library path when the first engine asks for it, and
//! `nixl_sys::is_stub()` says it was not found. Each I/O worker owns one agent with the
//! POSIX backend; the bounce ring is registered as DRAM once, each disk file's
//! descriptors as FILE the first time the worker touches them. A chunk's extents go out
//! as one NIXL transfer (file offsets against slot addresses), which the worker waits on
//! until it has ended, also when it failed (`posted::Posted`).

use super::posted::{Posted, Settle};
use super::{FileKey, Io};
use crate::error::{Error, Result, Status};
use nixl_sys::{
    Agent, AgentConfig, MemType, MemoryRegion, NixlDescriptor, OptArgs, RegistrationHandle, XferDescList, XferOp, XferRequest, XferStatus,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Once, Weak};
use std::time::{Duration, Instant};

/// A span NIXL registers: memory (address, bytes) or a file (offset 0, bytes, fd).
/// Public for programs that drive NIXL beside kvxfer (`cpp_examples/remote_limit.rs`).
#[derive(Debug)]
pub struct Span {
    pub addr: u64,
    pub len: u64,
    pub mem: MemType,
    pub dev: u64,
}

impl MemoryRegion for Span {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    fn size(&self) -> usize {
        self.len as usize
    }
}

impl NixlDescriptor for Span {
    fn mem_type(&self) -> MemType {
        self.mem
    }
    fn device_id(&self) -> u64 {
        self.dev
    }
}

fn failed(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(Status::Io, format!("NIXL: {what} failed ({e})"))
}

/// Why NIXL cannot be used here, or `None` when `libnixl_capi.so` was found.
pub fn missing() -> Option<String> {
    nixl_sys::is_stub().then(|| {
        "libnixl_capi.so was not found on the library path; put NIXL's libraries (e.g. the nixl-cu13 wheel's \
         .nixl_cu13.mesonpy.libs folder) on LD_LIBRARY_PATH, or use KVX_IO_POSIX"
            .to_string()
    })
}

/// A NIXL agent. Every agent kvxfer makes is made here, and so are those of programs
/// that drive NIXL beside kvxfer (`cpp_examples/remote_limit.rs`): the first call loads
/// the host's RDMA verbs library, where one is installed, on its own before NIXL starts
/// UCX (`load_host_verbs`).
pub fn new_agent(name: &str, cfg: &AgentConfig) -> std::result::Result<Agent, nixl_sys::NixlError> {
    static HOST_VERBS: Once = Once::new();
    HOST_VERBS.call_once(load_host_verbs);
    Agent::new_configured(name, cfg)
}

/// Loads the host's `libibverbs.so.1`, with the netlink libraries it links
/// (`libnl-3`, `libnl-route-3`), local to itself and bound at once, before UCX loads its
/// modules; it stays loaded for the life of the process.
///
/// NIXL's wheel carries its own copies of libibverbs and libnl, which UCX's InfiniBand
/// modules link; UCX's EFA module links the host's `libefa.so.1` as well, and that pulls
/// the host's copies into the same dlopen group, behind the wheel's. The host's
/// libnl-route would then bind its own exported functions to the wheel's copy: its
/// constructors' registrations are refused as duplicates, and at exit its destructors
/// unlink list entries that were never linked (SIGSEGV in `rtnl_tc_unregister` under
/// `_dl_fini`). Loaded first on its own, the host's copy binds to itself, and the
/// wheel's, loaded later by UCX, to itself: both are consistent. Without the host's
/// library (no RDMA packages) this does nothing.
fn load_host_verbs() {
    // SAFETY: loads a system library by its soname; its constructors only set up
    // its own state.
    let handle = unsafe { libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror's string, when there is one, is read before any other dl call
        // on this thread.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "no reason given".into()
            } else {
                std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        log::debug!("NIXL: the host's libibverbs.so.1 was not loaded ({why}); UCX's InfiniBand modules use the copies NIXL ships");
    } else {
        log::debug!("NIXL: loaded the host's libibverbs.so.1 before UCX, local to itself");
    }
}

static NEXT_AGENT: AtomicU64 = AtomicU64::new(0);

/// Registered files: file id -> (the file's key, while it lives; its FILE registrations).
type Files = HashMap<u64, (Weak<FileKey>, Vec<(u64, RegistrationHandle)>)>;

pub struct Port {
    agent: Agent,
    name: String,
    opts: OptArgs,
    files: Files,
    // Dropped after `files`, before the agent: the DRAM registration of the bounce ring.
    _slots: RegistrationHandle,
}

// SAFETY: a port is built on the engine's thread and then used only by the one I/O worker
// it is moved to; its option list (a raw NIXL handle, hence not `Send` by itself) is never
// shared, and NIXL allows a handle to be used from another thread than its creator's.
unsafe impl Send for Port {}

impl Port {
    /// An agent with the POSIX backend and `slots` (address, bytes) registered as DRAM.
    pub fn new(slots: (u64, u64)) -> Result<Port> {
        if let Some(why) = missing() {
            return Err(Error::new(Status::Unsupported, format!("KVX_IO_NIXL: {why}")));
        }
        let name = format!("kvxfer-{}-{}", std::process::id(), NEXT_AGENT.fetch_add(1, Ordering::Relaxed));
        // No progress or listener threads: the worker drives its own transfers, locally.
        let cfg = AgentConfig { enable_prog_thread: false, enable_listen_thread: false, ..AgentConfig::default() };
        let unsupported = |what: &str, e: nixl_sys::NixlError| {
            Error::new(Status::Unsupported, format!("KVX_IO_NIXL: {what} ({e}); check NIXL_PLUGIN_DIR, or use KVX_IO_POSIX"))
        };
        let agent = new_agent(&name, &cfg).map_err(|e| unsupported("creating an agent failed", e))?;
        let (_mems, params) = agent.get_plugin_params("POSIX").map_err(|e| unsupported("the POSIX plugin was not found", e))?;
        let backend = agent.create_backend("POSIX", &params).map_err(|e| unsupported("the POSIX backend did not start", e))?;
        let mut opts = OptArgs::new().map_err(|e| failed("creating options", e))?;
        opts.add_backend(&backend).map_err(|e| failed("choosing the POSIX backend", e))?;
        let span = Span { addr: slots.0, len: slots.1, mem: MemType::Dram, dev: 0 };
        let _slots = agent.register_memory(&span, Some(&opts)).map_err(|e| unsupported("registering the bounce slots failed", e))?;
        Ok(Port { agent, name, opts, files: HashMap::new(), _slots })
    }

    /// Registers `file`'s descriptors that `ios` use, once per file; forgets files that
    /// are gone first, so a reused descriptor number is never registered twice.
    fn register(&mut self, file: &Arc<FileKey>, ios: &[Io]) -> Result<()> {
        let (agent, opts) = (&self.agent, &self.opts);
        if !self.files.contains_key(&file.id) {
            self.files.retain(|_, (key, _)| key.strong_count() > 0);
        }
        let (_, regs) = self.files.entry(file.id).or_insert_with(|| (Arc::downgrade(file), Vec::new()));
        for io in ios {
            let fd = io.fd as u64;
            if regs.iter().any(|(f, _)| *f == fd) {
                continue;
            }
            let span = Span { addr: 0, len: file.bytes, mem: MemType::File, dev: fd };
            regs.push((fd, agent.register_memory(&span, Some(opts)).map_err(|e| failed("registering the file", e))?));
        }
        Ok(())
    }

    /// Moves every byte of `ios` (all reads or all writes) between `file` and the slots.
    pub fn run(&mut self, write: bool, file: &Arc<FileKey>, ios: &[Io]) -> Result<()> {
        self.register(file, ios)?;
        let mut local = XferDescList::new(MemType::Dram).map_err(|e| failed("building a transfer", e))?;
        let mut remote = XferDescList::new(MemType::File).map_err(|e| failed("building a transfer", e))?;
        for io in ios {
            local.add_desc(io.addr as usize, io.len as usize, 0);
            remote.add_desc(io.off as usize, io.len as usize, io.fd as u64);
        }
        let op = if write { XferOp::Write } else { XferOp::Read };
        let what = if write { "writing" } else { "reading" };
        let req = self
            .agent
            .create_xfer_req(op, &local, &remote, &self.name, Some(&self.opts))
            .map_err(|e| failed(&format!("preparing a {what} transfer"), e))?;
        let posted = self.agent.post_xfer_req(&req, Some(&self.opts)).map_err(|e| failed(what, e))?;
        // Until NIXL says the transfer has ended, NIXL may still write into the slot.
        let mut running = Running { agent: &self.agent, req: &req, pending: posted };
        let mut xfer = Posted::new(&mut running);
        let (start, mut spins, mut warned) = (Instant::now(), 0u32, Duration::from_secs(10));
        while xfer.pending {
            match xfer.agent.get_xfer_status(xfer.req) {
                Ok(XferStatus::Success) => xfer.pending = false,
                Ok(XferStatus::InProgress) => {
                    spins += 1;
                    if spins < 64 {
                        std::hint::spin_loop();
                    } else {
                        std::thread::sleep(Duration::from_micros(20));
                    }
                    if start.elapsed() > warned {
                        log::warn!("NIXL {what} transfer still running after {warned:?}");
                        warned *= 2;
                    }
                }
                // A failed status is final: the backend has given the request up.
                Err(e) => {
                    xfer.pending = false;
                    return Err(failed(what, e));
                }
            }
        }
        Ok(())
    }
}

/// One posted NIXL transfer, settled before its slot can be reused.
struct Running<'a> {
    agent: &'a Agent,
    req: &'a XferRequest,
    pending: bool,
}

impl Settle for Running<'_> {
    fn settle(&mut self) {
        while self.pending {
            match self.agent.get_xfer_status(self.req) {
                Ok(XferStatus::InProgress) => std::thread::sleep(Duration::from_micros(20)),
                _ => self.pending = false,
            }
        }
    }
}
