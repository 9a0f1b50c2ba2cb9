//! The store: a tier of KV blocks on disk or tmpfs, keyed by the runtime's block keys,
//! that never returns bytes not stored under the key asked for and survives crashes.
//!
//! ```text
//! put(src, ids, keys) ─► index: dedup, free slot or evict (tombstone first) ─► engine: src → data-<k>
//!                                                        store thread ◄─ completion (blocks sealed)
//!                                        record written (synced) ─► index: entry visible ─► key Ok
//! get(keys, dst, ids) ─► index: pin hits ─► engine: data-<k> → dst (regions and seal verified)
//!                           get thread ◄─ completion: record's seal = block's seal? ─► key Ok or a miss
//! ```
//!
//! Data lives in `shards` checksummed disk layouts (`data-<k>`), slot `s` at block
//! `s / shards` of shard `s % shards`. The engine hashes every region it writes and seals a
//! block when its write completes; each slot's 128-byte record (`records`) holds the key's
//! own bytes, the namespace's digest, a generation and that seal. The records file is the index on
//! disk: opening reads it alone (no data), and keeps the records whose CRC holds and whose
//! namespace is the store's. The order of writes is what makes a crash harmless: a slot's
//! tombstone is written before its data is overwritten, and its record only after the new
//! data and seal are complete, so a record names either no key or the key whose bytes the
//! slot holds; a get then checks that the block's current seal is the record's. No journal
//! is needed beside the records: each slot's record is written in place, one at a time.
//!
//! See `docs/store.md` for the contract (words, invariants) and the choices made here.

mod config;
mod dir;
mod handle;
mod index;
mod publish;
mod recency;
mod record;
mod request;
mod shared;
mod staging;
mod worker;

pub use config::{StoreConfig, StoreFlags, MAX_KEY_BYTES, MAX_NAMESPACE_BYTES};
pub use handle::{Reservation, SlotHandle};
pub use request::StoreRequest;

use crate::engine::{Engine, TransferOptions};
use crate::error::{bail, Error, Result, Status};
use crate::file::DiskFlags;
use crate::memory::Layout;
use crate::shared::{Tier, TierStats, WriteMode};
use config::{keys_of, Digest, Key};
use crossbeam_channel::Sender;
use index::{Index, PutStart, Removed};
use record::{Read, Records};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// A hit leased for its holder alone (`Store::lease`), until the holder gives it back
/// (`Store::release`). Its token is unique within an open of the store and never 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lease(pub u64);

/// What a store holds and has done since it was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub entries: u64,
    pub capacity: u64,
    /// Keys a get loaded.
    pub hits: u64,
    /// Keys a get did not load: not held, or a failed check.
    pub misses: u64,
    pub evictions: u64,
    /// Failed checks and damage: damaged records found on open, the entries of a shard
    /// found damaged on open (made anew), and gets whose block did not match its record or
    /// its checksums or lay past the end of a file cut short (each also a miss).
    pub integrity_failures: u64,
    /// Blocks written by puts.
    pub puts: u64,
    /// Keys of puts that were held already.
    pub dedups: u64,
    pub removes: u64,
    /// Bytes of the blocks held (`entries × block bytes`).
    pub bytes: u64,
    /// The shared tier's (all zero without one). A key a get loads from it counts in
    /// `hits` too; one it misses there counts in `misses` once.
    pub shared: TierStats,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    integrity_failures: AtomicU64,
    puts: AtomicU64,
    dedups: AtomicU64,
    removes: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// The identity of the write of a slot under `generation` by the owner's open `epoch`:
/// the tag its block's checksums carry, which a commit checks, so it takes only bytes this
/// very write stored (never those of another write of the slot that landed late).
fn write_id(epoch: u64, generation: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(&generation.to_le_bytes(), epoch).max(1)
}

/// A random epoch for an open (from the kernel; where it has none to give, from the
/// clock and the process id).
fn fresh_epoch() -> u64 {
    let mut v = 0u64;
    // SAFETY: getrandom fills the 8 bytes of `v`, which we own.
    let n = unsafe { libc::getrandom(&mut v as *mut u64 as *mut libc::c_void, 8, 0) };
    if n != 8 {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos() as u64;
        v = xxhash_rust::xxh3::xxh3_64_with_seed(&now.to_le_bytes(), std::process::id() as u64);
    }
    v
}

/// The state the caller's threads and the store thread share.
struct Inner {
    engine: Arc<Engine>,
    dir: PathBuf,
    cfg: StoreConfig,
    namespace: Digest,
    shards: Vec<Arc<Layout>>,
    /// The slots' records. Writes to one slot never race: a slot's record is written by
    /// whoever holds the slot alone in the index (a put or reservation that took it, the
    /// drop of an entry that failed a check), or under `deciding`.
    records: Records,
    /// Held where a record is written because of a decision that another may race: by a
    /// commit, from deciding which keys commit to their records written and synced, and by
    /// a removal, so a removal sees either the committed entry or a put that will not
    /// commit. Taken before `index` where both are. Tombstones of slots held alone are
    /// written and synced without it, so no put or reservation waits for a commit's sync.
    deciding: Mutex<()>,
    index: Mutex<Index>,
    counters: Counters,
    /// Engine requests submitted and not yet handled by the store thread.
    inflight: Mutex<u64>,
    idle: Condvar,
    tx: Sender<worker::Msg>,
    /// The get thread's queue: gets' completions (see `worker`).
    gets: Sender<worker::GetMsg>,
    /// Opened `DATA_ONLY`: moves handed-out slots only, writes no record.
    data_only: bool,
    /// Drawn at random at each open: with a put's or a handle's generation it makes the
    /// identity of that write of its slot (`write_id`), which no write of another open
    /// shares.
    epoch: u64,
    /// The process that opened the store: a child forked from it shares the epoch and the
    /// generations, so its reservations would repeat the parent's write identities.
    pid: u32,
    /// The shared tier under the store, if it was opened with one.
    shared: Option<shared::Shared>,
}

/// A store open as its owner (the process holds the directory's lock until it is closed),
/// or for data only (`StoreFlags::DATA_ONLY`: no lock, the owner's handed-out slots only).
pub struct Store {
    inner: Arc<Inner>,
    /// The store thread and the get thread (see `worker`).
    threads: Option<(JoinHandle<()>, JoinHandle<()>)>,
    /// The shared tier's publisher (see `shared`).
    publisher: Option<JoinHandle<()>>,
    /// The owner's lock (none in a data-only open).
    _lock: Option<dir::OwnerLock>,
}

impl Store {
    /// Opens the store in `dir`, or makes it there (`StoreFlags::CREATE`). Refused with
    /// `Busy` naming the owner's pid while another process (or another open in this one)
    /// has it, and with `Incompatible` when it was made with another geometry, capacity,
    /// shard count or namespace. A shard found damaged (a file missing or cut short, a
    /// checksum header lost) is made anew and its entries dropped: of damage, only a
    /// damaged `meta` refuses the store.
    pub fn open(engine: &Arc<Engine>, dir: &Path, cfg: &StoreConfig) -> Result<Store> {
        cfg.validate()?;
        let data_only = cfg.flags.contains(StoreFlags::DATA_ONLY);
        if !data_only {
            dir::prepare_dir(dir, cfg.flags)?;
        }
        let lock = if data_only { None } else { Some(dir::OwnerLock::take(dir)?) };
        let want = dir::Meta::of(cfg);
        let create = match dir::read_meta(dir)? {
            Some(found) => {
                found.refuse(&want, dir)?;
                false
            }
            None if cfg.flags.contains(StoreFlags::CREATE) && !data_only => true,
            None if data_only => bail!(InvalidArg, "{} holds no store; a data-only open needs the owner to have made it", dir.display()),
            None => bail!(InvalidArg, "{} holds no store; pass CREATE to make one there", dir.display()),
        };
        let durable = cfg.flags.contains(StoreFlags::DURABLE);
        let mut flags = DiskFlags::CHECKSUM | DiskFlags::KEEP;
        for (on, f) in
            [(create, DiskFlags::CREATE), (durable, DiskFlags::SYNC), (cfg.flags.contains(StoreFlags::BUFFERED), DiskFlags::BUFFERED)]
        {
            if on {
                flags |= f;
            }
        }
        let (shards, remade): (Vec<_>, Vec<_>) = (0..cfg.shards as usize)
            .map(|k| Self::open_shard(engine, cfg, dir, k, flags, data_only))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let lost = !create && !data_only && Self::records_lost(dir)?;
        let records = match data_only {
            true => Records::open_read_only(dir, cfg.capacity_blocks)?,
            false => Records::open(dir, cfg.capacity_blocks, create || lost, durable)?,
        };
        if lost {
            records.sync_all()?;
        }
        if create {
            // Whatever the mode, everything `meta` will say exists is durable before it:
            // a shard's size, its sidecar's header and both names (a durable shard was
            // synced as made). Else a power cut could keep `meta` and lose a header, and
            // no later open would take the store.
            if !durable {
                for shard in &shards {
                    shard.file().expect("store shards are files").sync_created()?;
                }
            }
            records.sync_all()?;
            dir::write_meta(dir, &want)?;
            log::info!(
                "store {}: made, {} blocks of {} bytes in {} shards",
                dir.display(),
                cfg.capacity_blocks,
                shards[0].geometry().block_bytes,
                cfg.shards
            );
        }
        let shared = match &cfg.shared {
            Some(sc) => Some(shared::Shared::new(Tier::open(sc, &cfg.namespace, cfg.block)?, engine, &cfg.block)?),
            None => None,
        };
        let counters = Counters::default();
        let (index, stale) = match data_only {
            true => (Index::new(cfg.capacity_blocks as u32, Vec::new()), Vec::new()),
            false => Self::scan(&records, cfg, want.namespace, &counters, dir, &remade)?,
        };
        let (tx, rx) = crossbeam_channel::unbounded();
        let (gets, gets_rx) = crossbeam_channel::unbounded();
        let inner = Arc::new(Inner {
            engine: engine.clone(),
            dir: dir.to_path_buf(),
            cfg: cfg.clone(),
            namespace: want.namespace,
            shards,
            records,
            deciding: Mutex::new(()),
            index: Mutex::new(index),
            counters,
            inflight: Mutex::new(0),
            idle: Condvar::new(),
            tx,
            gets,
            data_only,
            epoch: fresh_epoch(),
            pid: std::process::id(),
            shared,
        });
        inner.clear_stale(&stale)?;
        if cfg.flags.contains(StoreFlags::VERIFY_ON_OPEN) && !data_only {
            inner.verify_seals();
        }
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|e| Error::new(Status::NoMemory, format!("starting the store's thread {name}: {e}")))
        };
        let worker_inner = inner.clone();
        let thread = spawn("kvx-store", Box::new(move || worker::run(worker_inner, rx)))?;
        let get_inner = inner.clone();
        let get_thread = match spawn("kvx-store-get", Box::new(move || worker::run_gets(get_inner, gets_rx))) {
            Ok(t) => t,
            Err(e) => {
                let _ = inner.tx.send(worker::Msg::Stop);
                let _ = thread.join();
                return Err(e);
            }
        };
        let mut store = Store { inner, threads: Some((thread, get_thread)), publisher: None, _lock: lock };
        if let Some(sh) = &store.inner.shared {
            let (tx, rx) = crossbeam_channel::unbounded();
            sh.set_publisher(tx);
            let publisher_inner = store.inner.clone();
            store.publisher = Some(spawn("kvx-store-publish", Box::new(move || publisher_inner.run_publisher(rx)))?);
            log::info!("store {}: over the shared tier in {}", dir.display(), sh.tier.describe());
        }
        match data_only {
            true => log::info!("store {}: open for data only", dir.display()),
            false => log::info!("store {}: open, {} entries", dir.display(), store.inner.index.lock().unwrap().len()),
        }
        Ok(store)
    }

    /// Opens shard `k`'s data file and its checksums, or makes them: when the store is
    /// made, and in place of a shard found damaged (a file missing or cut short, a checksum
    /// header lost, as a power cut can leave them), whose entries all go: then with the
    /// reason. Damage to one shard costs its entries, never the store. A data-only open
    /// refuses a damaged shard: only the owner, which holds the records, may make it anew.
    fn open_shard(
        engine: &Arc<Engine>,
        cfg: &StoreConfig,
        dir: &Path,
        k: usize,
        flags: DiskFlags,
        data_only: bool,
    ) -> Result<(Arc<Layout>, Option<String>)> {
        let geometry = cfg.shard_geometry();
        let path = dir.join(format!("data-{k}"));
        let damage = match flags.contains(DiskFlags::CREATE) {
            true => None,
            false => crate::file::checksum::damage(&path, &geometry.validate()?)?,
        };
        match damage {
            None => Ok((engine.create_disk_layout(&geometry, &path, flags)?, None)),
            Some(why) if data_only => bail!(
                Integrity,
                "{why}: the store in {} has a damaged shard, which its owner makes anew when it opens the store; open the store in its owner first, then for data",
                dir.display()
            ),
            Some(why) => Ok((engine.create_disk_layout(&geometry, &path, flags | DiskFlags::CREATE)?, Some(why))),
        }
    }

    /// Whether the records file is gone (removed by hand: a store never removes it). The
    /// store then opens empty, with a new one: what its shards hold is no one's entry.
    fn records_lost(dir: &Path) -> Result<bool> {
        let path = Records::path(dir);
        match std::fs::symlink_metadata(&path) {
            Ok(_) => Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                log::warn!("store {}: {} is missing: every entry is lost, and the store opens empty", dir.display(), path.display());
                Ok(true)
            }
            Err(e) => Err(Error::io(format_args!("stat {}", path.display()), e)),
        }
    }

    /// Reads every record (no data): the index of the valid ones, and the slots whose
    /// records are damaged, of another namespace or in a shard made anew (`remade`: why,
    /// per shard), to be made tombstones.
    fn scan(
        records: &Records,
        cfg: &StoreConfig,
        namespace: Digest,
        counters: &Counters,
        dir: &Path,
        remade: &[Option<String>],
    ) -> Result<(Index, Vec<u32>)> {
        let mut found = Vec::new();
        let mut bad = Vec::new();
        let (mut gone, mut dropped) = (Vec::new(), vec![0u64; remade.len()]);
        for (slot, r) in records.read_all(cfg.capacity_blocks)?.into_iter().enumerate() {
            let shard = slot % remade.len();
            match r {
                Read::Free => {}
                Read::Entry(_) if remade[shard].is_some() => {
                    dropped[shard] += 1;
                    gone.push(slot as u32);
                }
                Read::Entry(rec) if rec.namespace == namespace => found.push((slot as u32, rec)),
                Read::Entry(_) | Read::Damaged => bad.push(slot as u32),
            }
        }
        for (k, why) in remade.iter().enumerate() {
            if let Some(why) = why {
                log::warn!("store {}: {why}; shard data-{k} is made anew and its {} entries are dropped", dir.display(), dropped[k]);
            }
        }
        add(&counters.integrity_failures, gone.len() as u64);
        if !bad.is_empty() {
            log::warn!(
                "store {}: {} slot records are damaged or of another namespace (first: slot {}); their slots are free",
                dir.display(),
                bad.len(),
                bad[0]
            );
            add(&counters.integrity_failures, bad.len() as u64);
        }
        let mut index = Index::new(cfg.capacity_blocks as u32, found);
        index.restore_order(&recency::read(dir));
        index.take_moved();
        bad.append(&mut gone);
        bad.append(&mut index.stale);
        Ok((index, bad))
    }

    /// Whether each key is held, and how many keys from the first are (the runtime's
    /// prefix hit). With `lease`, each hit is leased by key: it stays loadable (never
    /// evicted, its slot never reused) until a get of it or `release_leases`, whoever
    /// calls them; several holders of one key use `lease` instead.
    pub fn lookup<K: AsRef<[u8]>>(&self, keys: &[K], lease: bool) -> Result<(Vec<bool>, usize)> {
        self.inner.owner()?;
        let keys = keys_of(keys)?;
        let mut present: Vec<bool> = {
            let mut ix = self.inner.index.lock().unwrap();
            keys.iter().map(|&k| if lease { ix.lease_keyed(k).is_some() } else { ix.contains(k) }).collect()
        };
        let mut leading = present.iter().take_while(|&&p| p).count();
        if let (Some(sh), true) = (&self.inner.shared, leading < keys.len()) {
            let rest: Vec<&[u8]> = keys[leading..].iter().map(|k| k.as_bytes()).collect();
            let more = sh.tier.leading(&rest);
            present[leading..leading + more].iter_mut().for_each(|p| *p = true);
            leading += more;
        }
        Ok((present, leading))
    }

    /// Gives back the oldest lease taken by key (`lookup` with `lease`, `lease_slots`) of
    /// each key; a key without one is skipped.
    pub fn release_leases<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<()> {
        self.inner.owner()?;
        let keys = keys_of(keys)?;
        let mut ix = self.inner.index.lock().unwrap();
        for k in keys {
            ix.release_keyed(k);
        }
        Ok(())
    }

    /// Leases each hit for the caller alone: `Some(lease)` where the key is held, and how
    /// many keys from the first are. Each hit stays loadable (never evicted, its slot never
    /// reused) until its lease is given back with `release`, by its holder only: no get,
    /// and no other caller's lease or release, spends it. To load a leased hit, get the
    /// key, then release the lease (the get's own pin holds the slot from its submit).
    pub fn lease<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<(Vec<Option<Lease>>, usize)> {
        self.inner.owner()?;
        let keys = keys_of(keys)?;
        let mut ix = self.inner.index.lock().unwrap();
        let leases: Vec<Option<Lease>> = keys.iter().map(|&k| ix.lease(k).map(|(_, token)| Lease(token))).collect();
        let leading = leases.iter().take_while(|l| l.is_some()).count();
        Ok((leases, leading))
    }

    /// Gives back `leases` (from `lease`). All or none: a lease not held (given back
    /// already, or of another open of the store) refuses the call with `InvalidArg`,
    /// naming it, and gives back nothing.
    pub fn release(&self, leases: &[Lease]) -> Result<()> {
        self.inner.owner()?;
        let mut ix = self.inner.index.lock().unwrap();
        let mut seen = std::collections::HashSet::with_capacity(leases.len());
        if let Some((i, l)) = leases.iter().enumerate().find(|(_, l)| !ix.holds_lease(l.0) || !seen.insert(l.0)) {
            bail!(InvalidArg, "lease {} (index {i}) is not held: given back already, listed twice, or of another open of the store", l.0);
        }
        for l in leases {
            ix.release(l.0);
        }
        Ok(())
    }

    /// Stores block `src_ids[i]` of `src` under `keys[i]`. A key held already succeeds
    /// without writing; a key that finds no room (every entry held by a get, a lease or a
    /// put in flight) fails alone with `Busy`. Whole blocks only: a layer range is refused.
    /// Each key's status is on the request once its block and record are written (and
    /// synced, in durable mode).
    pub fn put<K: AsRef<[u8]>>(&self, src: &Arc<Layout>, src_ids: &[u64], keys: &[K], opts: &TransferOptions) -> Result<Arc<StoreRequest>> {
        self.inner.owner()?;
        let keys = keys_of(keys)?;
        let local = self.inner.put_keys(src, src_ids, keys.clone(), opts)?;
        match self.inner.write_mode() {
            None => Ok(local),
            Some(WriteMode::Behind) => {
                self.inner.publish(&local, keys, None);
                Ok(local)
            }
            Some(WriteMode::Through) => {
                let through = self.inner.request(keys.len());
                self.inner.publish(&local, keys, Some(through.clone()));
                Ok(through)
            }
        }
    }

    /// Loads the block of `keys[i]` into block `dst_ids[i]` of `dst`. Each key's status
    /// says whether it loaded: `NotFound` for a key not held, `Integrity` for a block that
    /// failed a check (its entry is dropped; the other keys still load).
    pub fn get<K: AsRef<[u8]>>(&self, keys: &[K], dst: &Arc<Layout>, dst_ids: &[u64], opts: &TransferOptions) -> Result<Arc<StoreRequest>> {
        self.inner.owner()?;
        self.inner.get_keys(keys_of(keys)?, dst, dst_ids, opts, true)
    }

    /// Removes each key: `Ok` once its removal is recorded (synced, in durable mode), so it
    /// never comes back; `NotFound` for a key not held. A key being put is removed too: that
    /// put's key ends `Cancelled`. A leased key, or one a get is loading, leaves the index
    /// at once; its slot is reused only after those leases and gets end.
    pub fn remove<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Status>> {
        self.inner.owner()?;
        let inner = &self.inner;
        let keys = keys_of(keys)?;
        let deciding = inner.deciding.lock().unwrap();
        let records = &inner.records;
        let mut out = Vec::with_capacity(keys.len());
        let mut retired = Vec::new();
        {
            let mut ix = inner.index.lock().unwrap();
            for k in keys {
                out.push(match ix.remove(k) {
                    Removed::Absent => Status::NotFound,
                    Removed::Writing => Status::Ok,
                    Removed::Entry(slot) => {
                        retired.push(slot);
                        Status::Ok
                    }
                });
            }
        }
        let written = retired.iter().try_for_each(|&s| records.tombstone(s)).and_then(|_| records.sync());
        drop(deciding);
        if let Err(e) = written {
            // Out of the index, but maybe not on disk: the slots stay out of use.
            let mut ix = inner.index.lock().unwrap();
            for &s in &retired {
                ix.abandon(s);
            }
            return Err(Error::new(e.status, format!("recording removals: {}", e.message)));
        }
        add(&inner.counters.removes, out.iter().filter(|s| **s == Status::Ok).count() as u64);
        let mut ix = inner.index.lock().unwrap();
        for s in retired {
            ix.recorded(s);
        }
        Ok(out)
    }

    pub fn stats(&self) -> StoreStats {
        let inner = &self.inner;
        let (entries, evictions) = {
            let ix = inner.index.lock().unwrap();
            (ix.len() as u64, ix.evictions)
        };
        let c = &inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StoreStats {
            entries,
            capacity: inner.cfg.capacity_blocks,
            hits: get(&c.hits),
            misses: get(&c.misses),
            evictions,
            integrity_failures: get(&c.integrity_failures),
            puts: get(&c.puts),
            dedups: get(&c.dedups),
            removes: get(&c.removes),
            bytes: entries * inner.shards[0].geometry().block_bytes,
            shared: inner.shared.as_ref().map(|s| s.tier.stats()).unwrap_or_default(),
        }
    }

    /// The directory the store lives in.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Waits for every put and get in flight, then stops the store thread and gives up
    /// the directory's lock (also on drop).
    pub fn close(mut self) {
        self.shut();
    }

    fn shut(&mut self) {
        let Some((thread, get_thread)) = self.threads.take() else { return };
        if std::process::id() != self.inner.pid {
            // A child forked from the opening process: the store's threads and the
            // transfers in flight are the parent's, and none of them runs here to be waited
            // for, nor detached (their handles name threads of another process).
            std::mem::forget((thread, get_thread, self.publisher.take()));
            return;
        }
        let mut n = self.inner.inflight.lock().unwrap();
        while *n > 0 {
            n = self.inner.idle.wait(n).unwrap();
        }
        drop(n);
        // Every put's publishing has ended (each is in flight until then; each write ends
        // at the shared tier's bound): the publisher has nothing left, so it stops.
        if let Some(p) = self.publisher.take() {
            self.inner.shared.as_ref().expect("a publisher serves a shared tier").stop_publishing();
            let _ = p.join();
        }
        // The store thread writes the eviction order last, so no periodic write of it
        // runs beside this one.
        let _ = self.inner.gets.send(None);
        let _ = get_thread.join();
        let _ = self.inner.tx.send(worker::Msg::Stop);
        let _ = thread.join();
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.shut();
    }
}

impl Inner {
    /// `Store::put` in the local store alone.
    fn put_keys(self: &Arc<Self>, src: &Arc<Layout>, src_ids: &[u64], keys: Vec<Key>, opts: &TransferOptions) -> Result<Arc<StoreRequest>> {
        let inner = self;
        if src_ids.len() != keys.len() {
            bail!(InvalidArg, "{} keys but {} source blocks; give one block per key", keys.len(), src_ids.len());
        }
        let layers = inner.cfg.block.num_layers;
        if opts.layer_begin != 0 || (opts.layer_end != 0 && opts.layer_end as u64 != layers) {
            bail!(
                InvalidArg,
                "a put stores whole blocks: layers [{}, {}) of {layers} asked; put every layer",
                opts.layer_begin,
                opts.layer_end
            );
        }
        inner.check_side(src, src_ids, "source")?;
        let plain = TransferOptions { on_complete: None, ..opts.clone() };
        inner.engine.check(src, &src_ids[..1], &inner.shards[0], &[0], &plain)?;
        let req = inner.request(keys.len());
        let mut groups: Vec<Vec<worker::PutKey>> = vec![Vec::new(); inner.shards.len()];
        let (mut evicted, mut settled) = (Vec::new(), Vec::new());
        {
            let mut ix = inner.index.lock().unwrap();
            // The batch's held keys first become the most recently used, so no key of the
            // batch is evicted to make room for another.
            for &key in &keys {
                ix.touch_held(key);
            }
            for (i, &key) in keys.iter().enumerate() {
                match ix.start_put(key, (&req, i)) {
                    PutStart::Present => settled.push((i, Status::Ok, String::new())),
                    PutStart::Joined => {}
                    PutStart::NoRoom => settled.push((
                        i,
                        Status::Busy,
                        "the store is full and every entry is held by a get, a lease or a put in flight; release leases or retry".into(),
                    )),
                    PutStart::Slot { slot, generation, evicted: e } => {
                        if e {
                            evicted.push(slot);
                        }
                        let k = worker::PutKey { index: i, key, slot, generation, src: src_ids[i] };
                        groups[inner.shard_of(slot)].push(k);
                    }
                }
            }
        }
        add(&inner.counters.dedups, settled.iter().filter(|s| s.1 == Status::Ok).count() as u64);
        for (i, st, m) in settled {
            req.settle(i, st, m);
        }
        // An evicted slot's record still names its old key: make it a tombstone before
        // anything overwrites the slot's data. It is written here; in durable mode it is
        // synced by the store thread, which then starts the transfers of the evicted slots'
        // shards, so this call waits for no sync.
        if let Err(e) = evicted.iter().try_for_each(|&s| inner.records.tombstone(s)) {
            inner.abandon_evicted(&req, &mut groups, &evicted, &e);
            evicted.clear();
        }
        let durable = inner.cfg.flags.contains(StoreFlags::DURABLE);
        let mut after_sync = worker::AfterSync { req: req.clone(), src: src.clone(), opts: plain.clone(), evicted, groups: Vec::new() };
        for (shard, keys) in groups.into_iter().enumerate().filter(|(_, g)| !g.is_empty()) {
            match durable && keys.iter().any(|k| after_sync.evicted.contains(&k.slot)) {
                true => after_sync.groups.push((shard, keys)),
                false => inner.submit_put(&req, shard, src, keys, &plain, false),
            }
        }
        if !after_sync.groups.is_empty() {
            inner.begin();
            if let Err(crossbeam_channel::SendError(worker::Msg::AfterSync(a))) = inner.tx.send(worker::Msg::AfterSync(after_sync)) {
                inner.start_after_sync(a);
                inner.end();
            }
        }
        Ok(req)
    }

    /// `Store::get`: what the local store misses is loaded from the shared tier where
    /// `shared` and the store has one, else it is a miss.
    fn get_keys(
        self: &Arc<Self>,
        keys: Vec<Key>,
        dst: &Arc<Layout>,
        dst_ids: &[u64],
        opts: &TransferOptions,
        shared: bool,
    ) -> Result<Arc<StoreRequest>> {
        let inner = self;
        if dst_ids.len() != keys.len() {
            bail!(InvalidArg, "{} keys but {} destination blocks; give one block per key", keys.len(), dst_ids.len());
        }
        inner.check_side(dst, dst_ids, "destination")?;
        let mut seen = std::collections::HashSet::with_capacity(dst_ids.len());
        if let Some((i, b)) = dst_ids.iter().enumerate().find(|(_, b)| !seen.insert(**b)) {
            bail!(InvalidArg, "destination block {b} appears twice (index {i}); each destination block may be written once");
        }
        let plain = TransferOptions { on_complete: None, ..opts.clone() };
        inner.engine.check(&inner.shards[0], &[0], dst, &dst_ids[..1], &plain)?;
        let req = inner.request(keys.len());
        let mut groups: Vec<Vec<worker::GetKey>> = vec![Vec::new(); inner.shards.len()];
        let mut misses = Vec::new();
        {
            let mut ix = inner.index.lock().unwrap();
            for (i, &key) in keys.iter().enumerate() {
                match ix.pin(key) {
                    Some(entry) => {
                        // The get's own pin holds the slot from here; a lease taken by key on
                        // that slot is spent (leases from `lease` are their holders' own).
                        ix.spend_keyed_on(key, entry.slot);
                        let holder = worker::Holder::Pinned(key);
                        groups[inner.shard_of(entry.slot)].push(worker::GetKey { index: i, holder, entry, dst: dst_ids[i] });
                    }
                    None => misses.push(i),
                }
            }
        }
        if shared && inner.shared.is_some() && !misses.is_empty() {
            let misses = misses.into_iter().map(|i| (i, keys[i], dst_ids[i])).collect();
            inner.load_shared(&req, misses, dst, &plain);
        } else {
            add(&inner.counters.misses, misses.len() as u64);
            for i in misses {
                req.settle(i, Status::NotFound, "the store does not hold this key");
            }
        }
        for (shard, keys) in groups.into_iter().enumerate().filter(|(_, g)| !g.is_empty()) {
            inner.submit_get(&req, shard, dst, keys, &plain, false);
        }
        Ok(req)
    }

    /// Writes the eviction order (`recency`) where it changed since it was last written,
    /// or `always`; a failure is logged (the order is a hint: a store without it opens).
    fn save_order(&self, always: bool) {
        if self.data_only || std::process::id() != self.pid {
            return;
        }
        let order = {
            let mut ix = self.index.lock().unwrap();
            if !ix.take_moved() && !always {
                return;
            }
            ix.order()
        };
        if let Err(e) = recency::write(&self.dir, &order) {
            log::warn!("store {}: {e}; a reopen orders entries by when they were written", self.dir.display());
        }
    }

    /// Refuses what only the owner may do (everything touching the index) in a data-only open.
    fn owner(&self) -> Result<()> {
        if std::process::id() != self.pid {
            bail!(
                InvalidArg,
                "the store in {} was opened by process {}, and this process is a child forked from it: open the store in the child (DATA_ONLY, to move the owner's slots)",
                self.dir.display(),
                self.pid
            );
        }
        if self.data_only {
            bail!(
                InvalidArg,
                "the store in {} is open DATA_ONLY: it moves the slots its owner hands out (read_slots, write_slots); keys are looked up, put and removed in the owner",
                self.dir.display()
            );
        }
        Ok(())
    }

    /// A put's or get's request, which signals the engine's completion fd when it ends.
    fn request(&self, n: usize) -> Arc<StoreRequest> {
        Arc::new(StoreRequest::signalling(n, &self.engine))
    }

    fn shard_of(&self, slot: u32) -> usize {
        slot as usize % self.shards.len()
    }

    fn block_of(&self, slot: u32) -> u64 {
        slot as u64 / self.shards.len() as u64
    }

    /// The checksum sidecar of shard `k` (every shard is made with one).
    fn sidecar(&self, k: usize) -> &crate::file::checksum::Sidecar {
        self.shards[k].file().and_then(|f| f.checksum.as_ref()).expect("store shards are checksummed")
    }

    /// Refuses block ids past `layout`'s blocks, naming the first.
    fn check_side(&self, layout: &Layout, ids: &[u64], side: &str) -> Result<()> {
        let n = layout.geometry().cfg.num_blocks;
        if let Some((i, b)) = ids.iter().enumerate().find(|(_, &b)| b >= n) {
            bail!(OutOfRange, "{side} block id {b} (index {i}) is out of range; the layout has {n} blocks");
        }
        Ok(())
    }

    /// Writes tombstones over `slots`, each held alone by the caller (synced in durable
    /// mode).
    fn tombstone(&self, slots: &[u32]) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        slots.iter().try_for_each(|&s| self.records.tombstone(s))?;
        self.records.sync()
    }

    /// Makes the records of `slots` (found on open, used by no entry) tombstones, then
    /// frees the slots.
    fn clear_stale(&self, slots: &[u32]) -> Result<()> {
        self.tombstone(slots)?;
        let mut ix = self.index.lock().unwrap();
        for &s in slots {
            ix.recorded(s);
        }
        Ok(())
    }

    /// Drops every entry whose record's seal is not its block's current seal. An entry
    /// whose seal the disk fails to read (EIO: shards cut short were made anew before)
    /// stays, counted in one warning: a failed read says nothing about the block, and
    /// every get checks the block it loads.
    fn verify_seals(&self) {
        let entries: Vec<_> = self.index.lock().unwrap().entries().collect();
        let (mut unread, mut first) = (0u64, None);
        for (key, e) in entries {
            match self.sidecar(self.shard_of(e.slot)).seal_of_block(self.block_of(e.slot)) {
                Ok(seal) if seal == e.seal => {}
                Ok(_) => self.integrity_miss(&worker::Holder::Pinned(key), &e, "its block is not the one its record was written for"),
                Err(err) => {
                    unread += 1;
                    first.get_or_insert(err);
                }
            }
        }
        if let Some(err) = first {
            log::warn!(
                "store {}: the seals of {unread} entries could not be read ({err}); they stay, and a get checks each block it loads",
                self.dir.display()
            );
        }
    }

    /// Why `slot`'s own bytes cannot be read however often it is tried: its block, or its
    /// checksums, lie past the end of a file cut short. `None` where they are all there:
    /// a failed read of them is then the disk's failure, not this key's, and its entry
    /// stays.
    fn cut_short(&self, slot: u32) -> Option<String> {
        let (k, block) = (self.shard_of(slot), self.block_of(slot));
        let shard = &self.shards[k];
        let end = (block + 1) * shard.placement.block_stride;
        let file = shard.file()?;
        match file.file_len() {
            Ok(len) if len < end => {
                return Some(format!("{} was cut short to {len} bytes, before the end of slot {slot}'s block", file.path().display()))
            }
            Ok(_) => {}
            Err(_) => return None,
        }
        match self.sidecar(k).holds_block(block) {
            Ok(false) => Some(format!("{} was cut short before the end of slot {slot}'s checksums", self.sidecar(k).path().display())),
            _ => None,
        }
    }

    /// A check failed on the entry `holder` read: counted, logged, and the entry dropped
    /// (its tombstone written) where this store's index holds it and it is still the one
    /// checked.
    fn integrity_miss(&self, holder: &worker::Holder, e: &index::Entry, why: &str) {
        add(&self.counters.integrity_failures, 1);
        log::warn!("store {}: slot {} failed a check, a miss: {why}", self.dir.display(), e.slot);
        let worker::Holder::Pinned(key) = *holder else { return };
        if !self.index.lock().unwrap().drop_entry(key, e.slot, e.generation) {
            return;
        }
        // Its tombstone is the store thread's to write: a get never waits for the records
        // mutex, which a commit holds across its sync. The slot is reused only once it is
        // recorded.
        self.begin();
        if self.tx.send(worker::Msg::Retire(e.slot)).is_err() {
            self.end();
        }
    }

    /// Writes the tombstone of `slot`, whose entry left the index after a failed check,
    /// then frees the slot (or, where the write fails, keeps it out of use).
    fn retire(&self, slot: u32) {
        match self.tombstone(&[slot]) {
            Ok(()) => self.index.lock().unwrap().recorded(slot),
            Err(err) => {
                log::error!("store {}: {err}; slot {slot} stays out of use until the store is opened again", self.dir.display());
                self.index.lock().unwrap().abandon(slot);
            }
        }
    }

    /// Fails the keys of `groups` (a put's, by shard) whose slots are among `evicted`, whose
    /// tombstones could not be written or synced: `err` says why.
    fn abandon_evicted(&self, req: &Arc<StoreRequest>, groups: &mut [Vec<worker::PutKey>], evicted: &[u32], err: &Error) {
        for g in groups {
            let (bad, keep): (Vec<_>, Vec<_>) = g.drain(..).partition(|k| evicted.contains(&k.slot));
            *g = keep;
            self.abandon_keys(req, &bad, err);
        }
    }

    /// Syncs the tombstones of a put's evicted slots, then starts the transfers that
    /// overwrite them (failing the evicted slots' keys where the sync fails).
    fn start_after_sync(self: &Arc<Self>, a: worker::AfterSync) {
        let (shards, mut groups): (Vec<usize>, Vec<Vec<worker::PutKey>>) = a.groups.into_iter().unzip();
        if let Err(e) = self.records.sync() {
            self.abandon_evicted(&a.req, &mut groups, &a.evicted, &e);
        }
        for (shard, keys) in shards.into_iter().zip(groups).filter(|(_, g)| !g.is_empty()) {
            self.submit_put(&a.req, shard, &a.src, keys, &a.opts, false);
        }
    }

    /// Fails `keys` of a put whose slots could not be made ready (their records may still
    /// name other keys): the slots leave use, the keys (and any that joined them) fail.
    fn abandon_keys(&self, req: &Arc<StoreRequest>, keys: &[worker::PutKey], err: &Error) {
        let mut waiters = Vec::new();
        {
            let mut ix = self.index.lock().unwrap();
            for k in keys {
                waiters.extend(ix.abandon(k.slot));
            }
        }
        for k in keys {
            req.settle(k.index, err.status, err.message.clone());
        }
        for (r, i) in waiters {
            r.settle(i, err.status, err.message.clone());
        }
    }

    fn begin(&self) {
        *self.inflight.lock().unwrap() += 1;
    }

    fn end(&self) {
        let mut n = self.inflight.lock().unwrap();
        *n -= 1;
        if *n == 0 {
            self.idle.notify_all();
        }
    }

    /// One engine transfer of a put's keys that go to shard `shard`; its completion goes
    /// to the store thread.
    fn submit_put(
        self: &Arc<Self>,
        req: &Arc<StoreRequest>,
        shard: usize,
        src: &Arc<Layout>,
        keys: Vec<worker::PutKey>,
        opts: &TransferOptions,
        alone: bool,
    ) {
        let src_ids: Vec<u64> = keys.iter().map(|k| k.src).collect();
        let dst_ids: Vec<u64> = keys.iter().map(|k| self.block_of(k.slot)).collect();
        let writes: Vec<u64> = keys.iter().map(|k| write_id(self.epoch, k.generation)).collect();
        let group = worker::PutGroup { req: req.clone(), keys };
        let source = worker::PutSource { shard, src: src.clone(), opts: opts.clone(), alone };
        self.begin();
        let (opts, group) =
            worker::on_complete(&self.tx, opts, (group, source), |(g, s), st, m| worker::Msg::Done(worker::Done::Put(g, s), st, m));
        if let Err(e) = self.engine.submit_for_store(src, &src_ids, &self.shards[shard], &dst_ids, &opts, Some(&writes)) {
            if let Some((g, _)) = group.lock().unwrap().take() {
                self.put_failed(g, e.status, &e.message);
            }
            self.end();
        }
    }

    /// One engine transfer of a get's keys held in shard `shard`; its completion goes to
    /// the get thread.
    fn submit_get(
        self: &Arc<Self>,
        req: &Arc<StoreRequest>,
        shard: usize,
        dst: &Arc<Layout>,
        keys: Vec<worker::GetKey>,
        opts: &TransferOptions,
        alone: bool,
    ) {
        let src_ids: Vec<u64> = keys.iter().map(|k| self.block_of(k.entry.slot)).collect();
        let dst_ids: Vec<u64> = keys.iter().map(|k| k.dst).collect();
        let group = worker::GetGroup { req: req.clone(), keys, shard, dst: dst.clone(), opts: opts.clone(), alone };
        self.begin();
        let (opts, group) = worker::on_complete(&self.gets, opts, group, |g, st, m| Some((g, st, m)));
        if let Err(e) = self.engine.submit_for_store(&self.shards[shard], &src_ids, dst, &dst_ids, &opts, None) {
            if let Some(g) = group.lock().unwrap().take() {
                self.get_failed(g, e.status, &e.message);
            }
            self.end();
        }
    }
}
