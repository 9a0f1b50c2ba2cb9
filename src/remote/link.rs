//! The engine's NIXL agent with the UCX backend: registrations, export and import,
//! and posting and checking the transfers of remote chunks; and a second agent on which
//! a blob's metadata is tried before the first loads it.

use super::blob::{Blob, Mem, Shared};
use crate::error::{bail, Error, Result, Status};
use crate::io::nixl::{missing, new_agent, Span};
use nixl_sys::{
    Agent, AgentConfig, MemType, OptArgs, RegDescList, RegistrationHandle, ThreadSync, XferDescList, XferOp, XferRequest, XferStatus,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// The agent, created on the engine's first export or import.
pub struct Link {
    agent: Agent,
    opts: Opts,
    name: String,
    generation: AtomicU64,
    /// The peers imported, by agent name: the newest import of each (weak: a peer
    /// lives as long as its layouts, and holds the link).
    peers: Mutex<HashMap<String, Weak<Peer>>>,
    /// The agent that loads a blob's metadata before `agent` does (`Link::try_load`),
    /// made on first use and made anew after it refused a blob.
    checker: Mutex<Option<Agent>>,
    /// The bounce ring's registration, for remote ↔ disk chunks.
    _slots: Registration,
}

/// NIXL's option list is a raw handle (not `Send`); it is built once, never changed
/// after, and NIXL only reads it, so sharing it between threads is sound.
struct Opts(OptArgs);
unsafe impl Send for Opts {}
unsafe impl Sync for Opts {}

/// Memory registered with the link; kept by what it covers and dropped before that
/// memory is freed.
pub struct Registration {
    handles: Vec<RegistrationHandle>,
    mem: Mem,
    spans: Vec<(u64, u64)>,
}

/// One imported peer: its agent's name, and the import it came from.
pub struct Peer {
    pub name: String,
    generation: u64,
    /// Set when a newer blob of this peer was imported.
    stale: AtomicBool,
    /// Set when one of its transfers timed out or failed: nothing new is posted to it.
    dead: AtomicBool,
    /// How long one of its transfers may take before it ends with `KVX_ERR_REMOTE`.
    pub timeout: Duration,
    link: Arc<Link>,
}

/// The C ABI's major version (Cargo.toml), which both ends of a blob must share.
pub fn abi_major() -> u32 {
    env!("KVX_CARGO_ABI_MAJOR").parse().expect("abi_major")
}

fn mem_type(mem: Mem) -> (MemType, u64) {
    match mem {
        Mem::Dram => (MemType::Dram, 0),
        Mem::Vram(d) => (MemType::Vram, d as u64),
    }
}

fn nixl_failed(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(Status::Remote, format!("NIXL/UCX: {what} failed ({e})"))
}

impl Link {
    /// An agent with the UCX backend, the bounce ring registered. `Unsupported` with
    /// the reason when NIXL or its UCX plugin is not there.
    pub fn new(engine: u64, slots: (u64, u64)) -> Result<Arc<Link>> {
        if let Some(why) = missing() {
            bail!(Unsupported, "remote layouts need NIXL: {why}");
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let name = format!("kvxfer-{}-{}-{engine}", host.trim(), std::process::id());
        // The progress thread serves peers' transfers into our exported memory over
        // transports that need the target to take part (TCP); it sleeps between polls.
        let cfg = AgentConfig {
            enable_prog_thread: true,
            enable_listen_thread: false,
            thread_sync: ThreadSync::Strict,
            pthr_delay_us: 1000,
            ..AgentConfig::default()
        };
        let (agent, backend) = ucx_agent(&name, &cfg)?;
        let mut opts = OptArgs::new().map_err(|e| nixl_failed("creating options", e))?;
        opts.add_backend(&backend).map_err(|e| nixl_failed("choosing the UCX backend", e))?;
        let opts = Opts(opts);
        let _slots = register(&agent, &opts, Mem::Dram, &[slots])?;
        Ok(Arc::new(Link {
            agent,
            opts,
            name,
            generation: AtomicU64::new(0),
            peers: Mutex::new(HashMap::new()),
            checker: Mutex::new(None),
            _slots,
        }))
    }

    /// Registers memory spans (address, bytes) of one memory type.
    pub fn register(&self, mem: Mem, spans: &[(u64, u64)]) -> Result<Registration> {
        register(&self.agent, &self.opts, mem, spans)
    }

    /// The NIXL metadata of one registration: what a peer loads to reach that memory.
    pub fn metadata(&self, reg: &Registration) -> Result<Vec<u8>> {
        let (mt, dev) = mem_type(reg.mem);
        let mut descs = RegDescList::new(mt).map_err(|e| nixl_failed("building a descriptor list", e))?;
        reg.spans.iter().for_each(|&(a, n)| descs.add_desc(a as usize, n as usize, dev));
        self.agent.get_local_partial_md(&descs, Some(&self.opts.0)).map_err(|e| nixl_failed("reading a layout's metadata", e))
    }

    /// The blob of these layouts (their metadata from `metadata`), with the agent's
    /// connection metadata.
    pub fn export(&self, shared: Vec<Shared>) -> Result<Vec<u8>> {
        let empty = RegDescList::new(MemType::Dram).map_err(|e| nixl_failed("building a descriptor list", e))?;
        let connection = self
            .agent
            .get_local_partial_md(&empty, Some(&self.opts.0))
            .map_err(|e| nixl_failed("reading the agent's connection metadata", e))?;
        let blob = Blob {
            abi_major: abi_major(),
            abi_minor: env!("KVX_CARGO_ABI_MINOR").parse().expect("abi_minor"),
            generation: self.generation.fetch_add(1, Ordering::AcqRel) + 1,
            agent: self.name.clone(),
            connection,
            layouts: shared,
        };
        Ok(blob.encode())
    }

    /// Loads a decoded blob's metadata: the peer it names, replacing an older import of
    /// the same peer. A blob older than the one already imported is refused. A blob
    /// refused here leaves every import as it was: its metadata is checked on another
    /// agent (`try_load`) before the older import of its peer is dropped.
    pub fn import(self: &Arc<Link>, blob: &Blob, timeout: Duration) -> Result<Arc<Peer>> {
        let mut peers = self.peers.lock().unwrap();
        self.check(&peers, blob)?;
        self.try_load(blob)?;
        if let Some(old) = peers.remove(&blob.agent) {
            if let Some(old) = old.upgrade() {
                old.stale.store(true, Ordering::Release);
            }
            // Forget the old registrations before loading the new ones.
            let _ = self.agent.invalidate_remote_md(&blob.agent);
        }
        if let Err(e) = load(&self.agent, blob) {
            let _ = self.agent.invalidate_remote_md(&blob.agent);
            return Err(Error::new(
                Status::Remote,
                format!("{}, after the same metadata loaded on a checking agent; import the blob again", e.message),
            ));
        }
        let peer = Arc::new(Peer {
            name: blob.agent.clone(),
            generation: blob.generation,
            stale: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            timeout,
            link: self.clone(),
        });
        peers.insert(blob.agent.clone(), Arc::downgrade(&peer));
        Ok(peer)
    }

    /// Loads the blob's metadata on the checking agent, then forgets it there. NIXL drops
    /// all it holds of an agent when a load of that agent's registrations fails, and its
    /// UCX backend then refuses that agent's connection again: a damaged blob loaded
    /// straight into the link's agent would break the working import of its peer for
    /// good. A checking agent that refused a blob is dropped for the same reason.
    fn try_load(&self, blob: &Blob) -> Result<()> {
        let mut checker = self.checker.lock().unwrap();
        let agent = match checker.take() {
            Some(agent) => agent,
            None => {
                let cfg = AgentConfig { enable_prog_thread: false, enable_listen_thread: false, ..AgentConfig::default() };
                ucx_agent(&format!("{}-check", self.name), &cfg)?.0
            }
        };
        load(&agent, blob)?;
        let _ = agent.invalidate_remote_md(&blob.agent);
        *checker = Some(agent);
        Ok(())
    }

    /// Whether `blob` may be imported now, without importing it (the blob's count
    /// query must not replace what is imported).
    pub fn may_import(&self, blob: &Blob) -> Result<()> {
        self.check(&self.peers.lock().unwrap(), blob)
    }

    fn check(&self, peers: &HashMap<String, Weak<Peer>>, blob: &Blob) -> Result<()> {
        if blob.agent == self.name {
            bail!(InvalidArg, "the blob is this engine's own export; use its local layouts instead");
        }
        if let Some(old) = peers.get(&blob.agent).and_then(Weak::upgrade) {
            if blob.generation < old.generation {
                bail!(
                    InvalidArg,
                    "the blob is export {} of {}, older than export {} already imported; import the newest blob",
                    blob.generation,
                    blob.agent,
                    old.generation
                );
            }
        }
        Ok(())
    }
}

/// An agent named `name` with the UCX backend. `Unsupported` with the reason when NIXL's
/// UCX plugin does not start.
fn ucx_agent(name: &str, cfg: &AgentConfig) -> Result<(Agent, nixl_sys::Backend)> {
    let unsupported = |what: &str, e: nixl_sys::NixlError| {
        Error::new(Status::Unsupported, format!("remote layouts: {what} ({e}); check that NIXL's plugins/libplugin_UCX.so and UCX's libraries are installed, or NIXL_PLUGIN_DIR"))
    };
    let agent = new_agent(name, cfg).map_err(|e| unsupported("creating a NIXL agent failed", e))?;
    let (_mems, params) = agent.get_plugin_params("UCX").map_err(|e| unsupported("the UCX plugin was not found", e))?;
    let backend = agent.create_backend("UCX", &params).map_err(|e| unsupported("the UCX backend did not start", e))?;
    Ok((agent, backend))
}

/// Loads the blob's connection and layout metadata into `agent`; each must belong to
/// the agent the blob names.
fn load(agent: &Agent, blob: &Blob) -> Result<()> {
    for md in std::iter::once(&blob.connection).chain(blob.layouts.iter().map(|l| &l.metadata)) {
        let name = agent.load_remote_md(md).map_err(|e| {
            Error::new(
                Status::InvalidArg,
                format!("the blob's NIXL metadata was refused ({e}); it is damaged or from an incompatible NIXL"),
            )
        })?;
        if name != blob.agent {
            bail!(InvalidArg, "the blob names agent {} but its metadata belongs to {name}", blob.agent);
        }
    }
    Ok(())
}

fn register(agent: &Agent, opts: &Opts, mem: Mem, spans: &[(u64, u64)]) -> Result<Registration> {
    let (mt, dev) = mem_type(mem);
    let handles = spans
        .iter()
        .map(|&(addr, len)| agent.register_memory(&Span { addr, len, mem: mt, dev }, Some(&opts.0)))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| nixl_failed("registering memory with UCX", e))?;
    Ok(Registration { handles, mem, spans: spans.to_vec() })
}

impl Registration {
    pub fn mem(&self) -> Mem {
        self.mem
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.handles.clear();
    }
}

/// A transfer `Peer::post` could not post.
pub struct PostFailed {
    pub error: Error,
    /// Whether NIXL may have issued part of it: its post failed after the transfer was
    /// prepared, so the local memory may still be read or written.
    pub maybe_issued: bool,
}

/// A posted transfer; dropping it releases it. Drop it only once `done` reported it
/// ended: NIXL's release of a running transfer cancels it, and UCX does not stop the
/// reads and writes already under way, which may land in local memory after.
pub struct Posted {
    req: Option<XferRequest>,
    pub peer: Arc<Peer>,
    pub deadline: std::time::Instant,
}

impl Peer {
    /// Whether a newer blob of this peer has replaced the one its layouts came from.
    pub fn stale(&self) -> bool {
        self.stale.load(Ordering::Acquire)
    }

    /// Whether a transfer with this import timed out or failed (`close`).
    pub fn dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Closes this import after one of its transfers timed out or failed: the peer is
    /// gone or stuck, and every new transfer that timed out too would keep its slot out
    /// of the ring, so nothing new is posted until the peer's blob is imported again.
    pub fn close(&self) {
        if !self.dead.swap(true, Ordering::AcqRel) {
            log::warn!("remote peer {}: a transfer timed out or failed; its import is closed until its blob is imported again", self.name);
        }
    }

    /// The error of a transfer with a closed import.
    pub fn closed(&self) -> Error {
        Error::new(
            Status::Remote,
            format!("remote peer {}: an earlier transfer with it timed out or failed, so its import is closed; re-import its blob once the peer is back", self.name),
        )
    }

    fn failed(&self, what: &str, e: impl std::fmt::Display) -> Error {
        Error::new(
            Status::Remote,
            format!(
                "remote peer {}: {what} failed ({e}); the peer may have exited or be unreachable — re-import its blob once it is back",
                self.name
            ),
        )
    }

    /// Posts one NIXL transfer of `ops` (source, destination, bytes): `write` from
    /// local `local` memory to the peer's `remote` memory, else from the peer to local.
    pub fn post(
        self: &Arc<Peer>,
        write: bool,
        local: Mem,
        remote: Mem,
        ops: &[crate::gpu::CopyOp],
    ) -> std::result::Result<Posted, PostFailed> {
        let before = |error| PostFailed { error, maybe_issued: false };
        if self.stale() {
            return Err(before(Error::new(
                Status::Remote,
                format!("remote peer {}: a newer blob of it was imported; use the layouts of that import", self.name),
            )));
        }
        if self.dead() {
            return Err(before(self.closed()));
        }
        let link = &self.link;
        let ((lt, ld), (rt, rd)) = (mem_type(local), mem_type(remote));
        let mut l = XferDescList::new(lt).map_err(|e| before(nixl_failed("building a transfer", e)))?;
        let mut r = XferDescList::new(rt).map_err(|e| before(nixl_failed("building a transfer", e)))?;
        for op in ops {
            let (la, ra) = if write { (op.src, op.dst) } else { (op.dst, op.src) };
            l.add_desc(la as usize, op.len as usize, ld);
            r.add_desc(ra as usize, op.len as usize, rd);
        }
        let xop = if write { XferOp::Write } else { XferOp::Read };
        let req = link
            .agent
            .create_xfer_req(xop, &l, &r, &self.name, Some(&link.opts.0))
            .map_err(|e| before(self.failed("preparing a transfer", e)))?;
        // NIXL may have issued some of the transfer's descriptors before its post failed.
        let running = link
            .agent
            .post_xfer_req(&req, Some(&link.opts.0))
            .map_err(|e| PostFailed { error: self.failed("posting a transfer", e), maybe_issued: true })?;
        let deadline = std::time::Instant::now() + self.timeout;
        Ok(Posted { req: running.then_some(req), peer: self.clone(), deadline })
    }
}

impl Posted {
    /// `Ok(true)` once the transfer has ended well; an error once it failed.
    pub fn done(&mut self) -> Result<bool> {
        let Some(req) = &self.req else { return Ok(true) };
        match self.peer.link.agent.get_xfer_status(req) {
            Ok(XferStatus::Success) => {
                self.req = None;
                Ok(true)
            }
            Ok(XferStatus::InProgress) => Ok(false),
            Err(e) => Err(self.peer.failed("a transfer", e)),
        }
    }

    /// The error of a transfer whose peer was imported again while it ran.
    pub fn replaced(&self) -> Error {
        Error::new(
            Status::Remote,
            format!(
                "remote peer {}: a newer blob of it was imported while a transfer with the older import ran; submit again with the layouts of the newer import. The transfer's local blocks may still be written",
                self.peer.name
            ),
        )
    }

    pub fn timed_out(&self) -> Error {
        Error::new(
            Status::Remote,
            format!(
                "remote peer {}: a transfer did not complete within {} ms (the import's timeout); the peer may be gone or overloaded. Its import is closed: re-import its blob once the peer is back. The transfer's local blocks may still be written",
                self.peer.name,
                self.peer.timeout.as_millis()
            ),
        )
    }
}
