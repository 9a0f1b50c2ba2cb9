//! The store under disk faults and counted disk calls (process-wide, so a suite of its
//! own, its tests one at a time): a write that fails, as on a full disk, fails its keys
//! alone and the store goes on; a read that fails is that get's failure, not a dropped
//! entry; opening reads no block; a write handle's write held in flight until its slot
//! was reserved again lands late and is never committed under another key; after a
//! failed sync no later put to that file is acknowledged.

mod common;
use common::*;
use kvxfer::fault::{self, Fault, Site};
use kvxfer::store::{Reservation, SlotHandle, Store, StoreConfig, StoreFlags, StoreRequest};
use kvxfer::{Engine, LayoutConfig, LayoutKind, Status, StorageKind, TransferOptions};
use std::sync::Arc;
use std::time::Duration;

/// Fault injection and counting are process-wide: one test at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn key(i: u64) -> Vec<u8> {
    format!("key-{i}").into_bytes()
}

#[test]
fn a_full_disk_fails_the_keys_written_there_alone_and_the_store_goes_on() {
    let _serial = serial();
    let e = Arc::new(engine());
    let dir = temp_dir("store-faults");
    let c = cfg(0, 2, 2, 4, 64, 2);
    let s = Store::open(&e, &dir, &StoreConfig { shards: 2, ..StoreConfig::new(c, 8, b"ns") }).unwrap();
    let src = e.create_layout(&cfg(4, 2, 2, 4, 64, 2), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    fill(&src, 1);
    let dst = e.create_layout(&cfg(4, 2, 2, 4, 64, 2), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    let keys: Vec<Vec<u8>> = (0..2).map(key).collect();
    // Two keys in two shards, so two transfers: the first write of either fails.
    fault::inject(Site::DiskWrite, 0, Fault::Errno(libc::ENOSPC));
    let r = s.put(&src, &[0, 1], &keys, &Default::default()).unwrap();
    r.wait(Some(Duration::from_secs(60)));
    fault::clear();
    let st: Vec<Status> = (0..2).map(|i| r.key_status(i).unwrap()).collect();
    let failed = st.iter().position(|&s| s != Status::Ok).expect("one key failed");
    assert_eq!(st[failed], Status::Io, "{}", r.key_message(failed));
    assert!(r.key_message(failed).contains("No space left"), "{}", r.key_message(failed));
    assert_eq!(st[1 - failed], Status::Ok, "the other shard's key is stored");
    let g = s.get(&keys, &dst, &[0, 1], &Default::default()).unwrap();
    g.wait(Some(Duration::from_secs(60)));
    assert_eq!(g.key_status(failed), Some(Status::NotFound));
    assert_eq!(g.key_status(1 - failed), Some(Status::Ok));
    let ok = 1 - failed as u64;
    assert!((0..2).all(|l| (0..2).all(|o| read_region(&dst, ok, l, o) == region_pattern(1, ok, l, o, 512))), "the stored key");
    // Room again: the failed key is put and loads; its slot was not lost.
    let r = s.put(&src, &[failed as u64], &keys[failed..=failed], &Default::default()).unwrap();
    assert_eq!(r.wait(Some(Duration::from_secs(60))), Status::Ok);
    assert_eq!(s.stats().entries, 2);
    // A read that fails is that get's failure (Io); the entry stays.
    fault::inject(Site::DiskRead, 0, Fault::Errno(libc::EIO));
    let g = s.get(&keys[..1], &dst, &[2], &Default::default()).unwrap();
    assert_eq!(g.wait(Some(Duration::from_secs(60))), Status::Io);
    fault::clear();
    assert_eq!(s.stats().entries, 2);
    let g = s.get(&keys, &dst, &[0, 1], &Default::default()).unwrap();
    assert_eq!(g.wait(Some(Duration::from_secs(60))), Status::Ok);
    assert!((0..2).all(|b| (0..2).all(|l| (0..2).all(|o| read_region(&dst, b, l, o) == region_pattern(1, b, l, o, 512)))), "both keys");
}

/// A read that fails in a batch (EIO) fails the batch's transfer: the keys are read again
/// one by one, so they load once the disk reads; a failed read is the disk's, not a
/// block's, so no entry is dropped.
#[test]
fn a_failed_read_in_a_batch_is_retried_key_by_key_and_drops_no_entry() {
    let _serial = serial();
    let e = Arc::new(engine());
    let dir = temp_dir("store-faults");
    let c = cfg(0, 2, 2, 4, 64, 2);
    let s = Store::open(&e, &dir, &StoreConfig::new(c, 4, b"ns")).unwrap();
    let src = e.create_layout(&cfg(4, 2, 2, 4, 64, 2), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    fill(&src, 1);
    let dst = e.create_layout(&cfg(4, 2, 2, 4, 64, 2), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    let keys: Vec<Vec<u8>> = (0..4).map(key).collect();
    let r = s.put(&src, &[0, 1, 2, 3], &keys, &Default::default()).unwrap();
    assert_eq!(r.wait(Some(Duration::from_secs(60))), Status::Ok);
    fault::inject(Site::DiskRead, 0, Fault::Errno(libc::EIO));
    let g = s.get(&keys, &dst, &[0, 1, 2, 3], &Default::default()).unwrap();
    let st = g.wait(Some(Duration::from_secs(60)));
    fault::clear();
    assert_eq!(st, Status::Ok, "{}", (0..4).map(|i| g.key_message(i)).collect::<Vec<_>>().join("; "));
    assert!((0..4).all(|b| (0..2).all(|l| (0..2).all(|o| read_region(&dst, b, l, o) == region_pattern(1, b, l, o, 512)))));
    let stats = s.stats();
    assert_eq!((stats.entries, stats.integrity_failures), (4, 0), "{stats:?}");
}

/// `VERIFY_ON_OPEN` whose read of one entry's seal fails (EIO) opens: the entry is not
/// dropped for the disk's failure (a get checks its block anyway), and every key loads.
#[test]
fn a_failed_seal_read_of_verify_on_open_keeps_the_entry_and_the_store_opens() {
    let _serial = serial();
    let e = Arc::new(engine());
    let dir = temp_dir("store-faults");
    let c = StoreConfig::new(cfg(0, 2, 2, 4, 64, 2), 4, b"ns");
    let src = e.create_layout(&cfg(4, 2, 2, 4, 64, 2), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    fill(&src, 1);
    let keys: Vec<Vec<u8>> = (0..4).map(key).collect();
    let s = Store::open(&e, &dir, &c).unwrap();
    assert_eq!(s.put(&src, &[0, 1, 2, 3], &keys, &Default::default()).unwrap().wait(Some(Duration::from_secs(60))), Status::Ok);
    drop(s);
    let verify = StoreConfig { flags: StoreFlags::VERIFY_ON_OPEN, ..c };
    fault::count_only();
    drop(Store::open(&e, &dir, &verify).unwrap());
    let reads = fault::calls(Site::DiskRead);
    assert!(reads >= 4, "one seal read per entry: {reads} reads");
    // The last read of the open is the last entry's seal.
    fault::inject(Site::DiskRead, reads - 1, Fault::Errno(libc::EIO));
    let opened = Store::open(&e, &dir, &verify);
    fault::clear();
    let s = opened.unwrap_or_else(|err| panic!("a failed seal read refused the open: {err}"));
    let stats = s.stats();
    assert_eq!((stats.entries, stats.integrity_failures), (4, 0), "{stats:?}");
    let dst = e.create_layout(&cfg(4, 2, 2, 4, 64, 2), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    assert_eq!(s.get(&keys, &dst, &[0, 1, 2, 3], &Default::default()).unwrap().wait(Some(Duration::from_secs(60))), Status::Ok);
    assert!((0..4).all(|b| (0..2).all(|l| (0..2).all(|o| read_region(&dst, b, l, o) == region_pattern(1, b, l, o, 512)))));
}

/// Warm restart: the disk reads of an open (headers, the direct-I/O probe) are as many with
/// 60 entries as with 4: no block and no per-entry checksum is read.
#[test]
fn opening_reads_no_block_however_many_entries_there_are() {
    let _serial = serial();
    let e = Arc::new(engine());
    let dir = temp_dir("store-open-reads");
    let c = StoreConfig { shards: 2, ..StoreConfig::new(cfg(0, 2, 2, 4, 64, 2), 64, b"ns") };
    let src = e.create_layout(&cfg(60, 2, 2, 4, 64, 2), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    fill(&src, 3);
    let reads_at_open = |n: u64| {
        let s = Store::open(&e, &dir, &c).unwrap();
        let have = s.stats().entries;
        let keys: Vec<Vec<u8>> = (have..n).map(key).collect();
        if !keys.is_empty() {
            let ids: Vec<u64> = (have..n).collect();
            assert_eq!(s.put(&src, &ids, &keys, &Default::default()).unwrap().wait(Some(Duration::from_secs(60))), Status::Ok);
        }
        drop(s);
        fault::count_only();
        let s = Store::open(&e, &dir, &c).unwrap();
        let reads = fault::calls(Site::DiskRead);
        fault::clear();
        assert_eq!(s.stats().entries, n);
        reads
    };
    let few = reads_at_open(4);
    assert_eq!(reads_at_open(60), few, "an open with more entries read more");
}

/// Two puts race for the last slot: the first holds it while its write is in flight, so
/// the second's key fails alone with Busy at once (no call waits for room); the first is
/// stored.
#[test]
fn of_two_puts_racing_for_the_last_slot_one_wins_and_the_other_fails_at_once() {
    let _serial = serial();
    let e = Arc::new(engine());
    let dir = temp_dir("store-race");
    let s = Store::open(&e, &dir, &StoreConfig::new(cfg(0, 2, 2, 4, 64, 2), 1, b"ns")).unwrap();
    let src = e.create_layout(&cfg(2, 2, 2, 4, 64, 2), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    fill(&src, 4);
    fault::inject(Site::DiskWrite, 0, Fault::Hold);
    let first = s.put(&src, &[0], &[key(1)], &Default::default()).unwrap();
    let started = std::time::Instant::now();
    while !fault::holding() {
        assert!(started.elapsed() < Duration::from_secs(60), "the first put's write never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    let second = s.put(&src, &[1], &[key(2)], &Default::default()).unwrap();
    assert_eq!(second.poll(), Status::Busy, "settled at once: {}", second.key_message(0));
    assert_eq!(first.poll(), Status::Pending);
    fault::clear();
    assert_eq!(first.wait(Some(Duration::from_secs(60))), Status::Ok);
    assert_eq!(s.lookup(&[key(1), key(2)], false).unwrap().0, vec![true, false]);
}

fn wait(r: &StoreRequest) -> Status {
    r.wait(Some(Duration::from_secs(60)))
}

/// The handle to write `k` that the owner hands out (the key is not held).
fn write_handle(s: &Store, k: &[u8]) -> SlotHandle {
    match s.reserve_slots(&[k]).unwrap()[0] {
        Reservation::Write(h) => h,
        r => panic!("no slot to write: {r:?}"),
    }
}

/// Lets a held write go when dropped: declared after the stores, it goes first when a
/// check fails, so their closing (which waits for the held write) never hangs the suite.
struct LetGo;

impl Drop for LetGo {
    fn drop(&mut self) {
        fault::clear();
    }
}

/// Waits until the held disk write is held (a hang guard only).
fn until_held() {
    let started = std::time::Instant::now();
    while !fault::holding() {
        assert!(started.elapsed() < Duration::from_secs(60), "the write never started");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A get of `k`: its status, after checking that a hit holds exactly `k`'s bytes.
fn get_exact(e: &Engine, s: &Store, block: &LayoutConfig, k: &[u8]) -> Status {
    let dst = e.create_layout(&LayoutConfig { num_blocks: 1, ..*block }, LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    fill(&dst, 99);
    let r = s.get(&[k], &dst, &[0], &Default::default()).unwrap();
    let st = wait(&r);
    assert!(st != Status::Ok || holds_key(&dst, 0, k), "{} loaded with bytes that are not its own", String::from_utf8_lossy(k));
    st
}

/// A store of one slot (every reservation takes it), its owner, a data-only open of it,
/// and a host layout holding the bytes of keys A (block 0) and B (block 1).
struct OneSlot {
    e: Arc<Engine>,
    dir: std::path::PathBuf,
    cfg: StoreConfig,
    owner: Store,
    data: Store,
    src: Arc<kvxfer::Layout>,
}

fn one_slot(block: LayoutConfig, tag: &str) -> OneSlot {
    let e = Arc::new(engine());
    let dir = temp_dir(tag);
    let cfg = StoreConfig::new(block, 1, b"ns");
    let owner = Store::open(&e, &dir, &cfg).unwrap();
    let data = Store::open(&e, &dir, &StoreConfig { flags: StoreFlags::DATA_ONLY, ..cfg.clone() }).unwrap();
    let src = e.create_layout(&LayoutConfig { num_blocks: 2, ..block }, LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    fill_block_for_key(&src, 0, &key(1));
    fill_block_for_key(&src, 1, &key(2));
    OneSlot { e, dir, cfg, owner, data, src }
}

/// Writes block `src` of the source through `h` from the data-only open, holding its
/// first disk write in flight: the request, once that write is held.
fn held_write(t: &OneSlot, src: u64, h: SlotHandle) -> Arc<StoreRequest> {
    fault::inject(Site::DiskWrite, 0, Fault::Hold);
    let r = t.data.write_slots(&t.src, &[src], &[h], &Default::default()).unwrap();
    until_held();
    r
}

/// A block of 4 regions of 512 bytes: one chunk, one data write.
fn small_block() -> LayoutConfig {
    cfg(0, 2, 2, 4, 64, 2)
}

/// A block of 4 regions of 32 KiB, twice the test engine's slot: two chunks, each its own
/// data write, so half of a write can land late.
fn large_block() -> LayoutConfig {
    cfg(0, 2, 2, 16, 1024, 2)
}

/// The write of an aborted handle lands after the slot was reserved for another key and
/// that key's write failed: committing that key anyway is refused (the slot holds the
/// aborted key's block, sealed), and the key, written again, is committed with its bytes.
#[test]
fn a_landed_write_of_an_aborted_handle_is_never_committed_under_the_next_key() {
    let _serial = serial();
    let t = one_slot(small_block(), "store-late-landed");
    let _let_go = LetGo;
    let (a, b) = (key(1), key(2));
    let ha = write_handle(&t.owner, &a);
    let ra = held_write(&t, 0, ha);
    t.owner.abort_slots(&[ha]).unwrap();
    let hb = write_handle(&t.owner, &b);
    assert_eq!(hb.slot, ha.slot, "one slot");
    fault::clear();
    assert_eq!(wait(&ra), Status::Ok, "A's write itself succeeds: {}", ra.key_message(0));
    fault::inject(Site::DiskWrite, 0, Fault::Errno(libc::EIO));
    let rb = t.data.write_slots(&t.src, &[1], &[hb], &Default::default()).unwrap();
    assert_eq!(wait(&rb), Status::Io, "{}", rb.key_message(0));
    fault::clear();
    assert_eq!(t.owner.commit_slots(&[hb]).unwrap(), vec![Status::Integrity], "B's slot holds A's block, not B's");
    assert_eq!(get_exact(&t.e, &t.owner, &small_block(), &b), Status::NotFound);
    let hb = write_handle(&t.owner, &b);
    let rb = t.data.write_slots(&t.src, &[1], &[hb], &Default::default()).unwrap();
    assert_eq!(wait(&rb), Status::Ok, "{}", rb.key_message(0));
    assert_eq!(t.owner.commit_slots(&[hb]).unwrap(), vec![Status::Ok]);
    assert_eq!(get_exact(&t.e, &t.owner, &small_block(), &b), Status::Ok);
}

/// The write of an aborted handle, held in flight, lands after the next key's write
/// completed: wholly (one chunk) or half of it (two chunks, one held), a mix of two
/// writes. The next key's commit is refused and its get misses; never A's bytes, nor a mix.
#[test]
fn a_late_write_of_an_aborted_handle_is_never_committed_under_the_next_key() {
    let _serial = serial();
    for (block, tag) in [(small_block(), "whole"), (large_block(), "half")] {
        let t = one_slot(block, &format!("store-late-{tag}"));
        let _let_go = LetGo;
        let (a, b) = (key(1), key(2));
        let ha = write_handle(&t.owner, &a);
        let ra = held_write(&t, 0, ha);
        t.owner.abort_slots(&[ha]).unwrap();
        let hb = write_handle(&t.owner, &b);
        assert_eq!(hb.slot, ha.slot, "one slot");
        let rb = t.data.write_slots(&t.src, &[1], &[hb], &Default::default()).unwrap();
        assert_eq!(wait(&rb), Status::Ok, "{tag}: {}", rb.key_message(0));
        fault::clear();
        assert_eq!(wait(&ra), Status::Ok, "{tag}: A's write itself succeeds: {}", ra.key_message(0));
        let committed = t.owner.commit_slots(&[hb]).unwrap();
        let got = get_exact(&t.e, &t.owner, &block, &b);
        assert_eq!((committed[0], got), (Status::Integrity, Status::NotFound), "{tag}");
    }
}

/// A write handle handed out before the owner opened the store again: its commit is
/// refused even where the new owner reserved the same slot for the same key, and its
/// write, landing late, is never committed under the key the slot went to next.
#[test]
fn a_handle_from_before_the_owner_opened_the_store_again_is_never_committed() {
    let _serial = serial();
    let OneSlot { e, dir, cfg, owner, data, src } = one_slot(small_block(), "store-late-reopen");
    let _let_go = LetGo;
    let (a, b) = (key(1), key(2));
    let ha = write_handle(&owner, &a);
    fault::inject(Site::DiskWrite, 0, Fault::Hold);
    let ra = data.write_slots(&src, &[0], &[ha], &Default::default()).unwrap();
    until_held();
    drop(owner);
    let owner = Store::open(&e, &dir, &StoreConfig { flags: StoreFlags::NONE, ..cfg }).unwrap();
    let ha2 = write_handle(&owner, &a);
    assert_eq!(ha2.slot, ha.slot, "one slot");
    assert_eq!(owner.commit_slots(&[ha]).unwrap(), vec![Status::InvalidArg], "handed out by the earlier open");
    owner.abort_slots(&[ha2]).unwrap();
    let hb = write_handle(&owner, &b);
    let rb = data.write_slots(&src, &[1], &[hb], &Default::default()).unwrap();
    assert_eq!(wait(&rb), Status::Ok, "{}", rb.key_message(0));
    fault::clear();
    assert_eq!(wait(&ra), Status::Ok, "A's write itself succeeds: {}", ra.key_message(0));
    assert_eq!(owner.commit_slots(&[hb]).unwrap(), vec![Status::Integrity], "B's slot holds A's late block");
    assert_eq!(get_exact(&e, &owner, &small_block(), &b), Status::NotFound);
}

/// `write_slots` takes write handles only: a zeroed handle (what C gives for a key
/// reserved no slot) or a read handle is refused, and the entry in that slot stays.
#[test]
fn a_write_of_a_handle_that_is_no_write_handle_is_refused_and_the_entry_stays() {
    let _serial = serial();
    let OneSlot { e, owner, data, src, .. } = one_slot(small_block(), "store-not-a-write-handle");
    let a = key(1);
    let ha = write_handle(&owner, &a);
    assert_eq!(wait(&data.write_slots(&src, &[0], &[ha], &Default::default()).unwrap()), Status::Ok);
    assert_eq!(owner.commit_slots(&[ha]).unwrap(), vec![Status::Ok]);
    let read = owner.lease_slots(&[&a]).unwrap()[0].expect("A is held");
    owner.release_leases(&[&a]).unwrap();
    let zeroed = SlotHandle { slot: 0, generation: 0, key_digest: 0, key_len: 0, seal: 0, epoch: 0 };
    for (what, h) in [("a zeroed handle", zeroed), ("a read handle", read)] {
        let r = data.write_slots(&src, &[1], &[h], &Default::default());
        assert_eq!(r.err().map(|e| e.status), Some(Status::InvalidArg), "{what} written");
    }
    assert_eq!(get_exact(&e, &owner, &small_block(), &a), Status::Ok, "A's entry stays");
}

/// A handle whose key length no key has is never committed: its record would not read
/// back, and the acknowledged entry would be gone at the next open.
#[test]
fn a_commit_of_a_handle_with_a_key_length_no_key_has_is_refused() {
    let _serial = serial();
    let OneSlot { owner, data, src, .. } = one_slot(small_block(), "store-key-length");
    let ha = write_handle(&owner, &key(1));
    assert_eq!(wait(&data.write_slots(&src, &[0], &[ha], &Default::default()).unwrap()), Status::Ok);
    for len in [0, 65] {
        let bad = SlotHandle { key_len: len, ..ha };
        assert_eq!(owner.commit_slots(&[bad]).unwrap(), vec![Status::InvalidArg], "key length {len} committed");
    }
    assert_eq!(owner.commit_slots(&[ha]).unwrap(), vec![Status::Ok], "the handle itself still commits");
}

/// The kernel reports a lost write-back once, to the sync that finds it, and a later sync
/// of the file succeeds over the lost pages. So after a durable store's sync of a shard
/// fails, no later put to that shard is acknowledged, through a commit of slot handles
/// neither, until the store is opened again.
#[test]
fn after_a_failed_sync_no_later_put_to_the_shard_is_acknowledged_until_the_store_is_opened_again() {
    let _serial = serial();
    let e = Arc::new(engine());
    let dir = temp_dir("store-sync-fails");
    let durable = StoreConfig { shards: 1, flags: StoreFlags::CREATE | StoreFlags::DURABLE, ..StoreConfig::new(small_block(), 8, b"ns") };
    let s = Store::open(&e, &dir, &durable).unwrap();
    let src = e.create_layout(&LayoutConfig { num_blocks: 4, ..small_block() }, LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    fill(&src, 1);
    fault::inject(Site::DiskSync, 0, Fault::Errno(libc::EIO));
    let r = s.put(&src, &[0], &[key(0)], &Default::default()).unwrap();
    wait(&r);
    fault::clear();
    assert_eq!(r.key_status(0), Some(Status::Io), "{}", r.key_message(0));
    let r = s.put(&src, &[1], &[key(1)], &Default::default()).unwrap();
    wait(&r);
    assert_eq!(r.key_status(0), Some(Status::Io), "a put after the failed sync was acknowledged: {}", r.key_message(0));
    assert!(r.key_message(0).contains("an earlier sync"), "{}", r.key_message(0));
    let data = Store::open(&e, &dir, &StoreConfig { flags: StoreFlags::DATA_ONLY, ..durable.clone() }).unwrap();
    let h = write_handle(&s, &key(2));
    assert_eq!(wait(&data.write_slots(&src, &[2], &[h], &Default::default()).unwrap()), Status::Ok);
    assert_eq!(s.commit_slots(&[h]).unwrap(), vec![Status::Io], "a commit after the failed sync");
    drop((data, s));
    let s = Store::open(&e, &dir, &StoreConfig { flags: StoreFlags::DURABLE, ..durable }).unwrap();
    let r = s.put(&src, &[1], &[key(1)], &Default::default()).unwrap();
    assert_eq!(wait(&r), Status::Ok, "opened again, the store syncs: {}", r.key_message(0));
}

/// A reservation whose evicted slot's tombstone cannot be made durable fails whole; the
/// slots it took from the free list go back there (their records are tombstones already),
/// so the store keeps its capacity, and only the evicted slot leaves use until a reopen.
#[test]
fn a_failed_reservation_gives_back_the_free_slots_it_took() {
    let _serial = serial();
    let e = Arc::new(engine());
    let dir = temp_dir("store-reserve-fails");
    let cfg = StoreConfig { shards: 1, flags: StoreFlags::CREATE | StoreFlags::DURABLE, ..StoreConfig::new(small_block(), 3, b"ns") };
    let s = Store::open(&e, &dir, &cfg).unwrap();
    let src = e.create_layout(&LayoutConfig { num_blocks: 4, ..small_block() }, LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    fill(&src, 1);
    let put = |ids: &[u64], keys: &[Vec<u8>]| {
        let r = s.put(&src, ids, keys, &Default::default()).unwrap();
        wait(&r);
        (0..keys.len()).map(|i| r.key_status(i).unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(put(&[0, 1], &[key(0), key(1)]), [Status::Ok, Status::Ok]);
    // One free slot and one eviction: the evicted slot's tombstone sync fails.
    fault::inject(Site::DiskSync, 0, Fault::Errno(libc::EIO));
    let err = s.reserve_slots(&[key(2), key(3)]).unwrap_err();
    fault::clear();
    assert_eq!(err.status, Status::Io, "{}", err.message);
    // The free slot is free again: a put takes it, and one more evicts key 1.
    assert_eq!(put(&[2, 3], &[key(4), key(5)]), [Status::Ok, Status::Ok], "the store kept its free slot");
    assert_eq!(s.stats().entries, 2);
    drop(s);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A write handle whose slot holds a committed entry is stale: writing it again, after its
/// commit, is refused before anything is written, and the entry keeps its bytes.
#[test]
fn a_write_through_a_committed_handle_is_refused_and_the_entry_stays() {
    let _serial = serial();
    let OneSlot { e, owner, data, src, .. } = one_slot(small_block(), "store-stale-write");
    let h = write_handle(&owner, &key(1));
    assert_eq!(wait(&data.write_slots(&src, &[0], &[h], &Default::default()).unwrap()), Status::Ok);
    assert_eq!(owner.commit_slots(&[h]).unwrap(), vec![Status::Ok]);
    let err = data.write_slots(&src, &[1], &[h], &Default::default()).map(|_| ()).unwrap_err();
    assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
    assert!(err.message.contains("stale"), "{}", err.message);
    assert_eq!(get_exact(&e, &owner, &small_block(), &key(1)), Status::Ok, "the committed entry keeps its bytes");
}

/// A store's transfers are never refused for the engine's admission limit, which bounds
/// the caller's own transfers: a store's are made for the caller's puts and gets, which the
/// caller paces, and a refused one failed a healthy key with `Busy`. Here the limit is 1 and the engine's
/// only I/O worker is held in a put's disk write, so every transfer after it stays in
/// flight: the puts and gets behind it wait, and every key loads once it goes on.
#[test]
fn store_transfers_are_never_refused_for_the_engines_admission_limit() {
    let _serial = serial();
    let e = Arc::new(engine_with(|c| {
        c.io_threads = 1;
        c.max_inflight = 1;
    }));
    let block = small_block();
    let s = Store::open(&e, &temp_dir("store-admission"), &StoreConfig { shards: 4, ..StoreConfig::new(block, 16, b"ns") }).unwrap();
    let _let_go = LetGo;
    let src = e.create_layout(&LayoutConfig { num_blocks: 9, ..block }, LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    for k in 0..9 {
        fill_block_for_key(&src, k, &key(k));
    }
    let held: Vec<Vec<u8>> = (0..4).map(key).collect();
    for (i, k) in held.iter().enumerate() {
        assert_eq!(wait(&s.put(&src, &[i as u64], &[k], &Default::default()).unwrap()), Status::Ok);
    }
    fault::inject(Site::DiskWrite, 0, Fault::Hold);
    let first = s.put(&src, &[8], &[key(8)], &Default::default()).unwrap();
    until_held();
    let new: Vec<Vec<u8>> = (4..8).map(key).collect();
    let put = s.put(&src, &[4, 5, 6, 7], &new, &Default::default()).unwrap();
    let dst = e.create_layout(&LayoutConfig { num_blocks: 4, ..block }, LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    fill(&dst, 99);
    let get = s.get(&held, &dst, &[0, 1, 2, 3], &Default::default()).unwrap();
    let pending = |r: &StoreRequest| (0..r.len()).map(|i| r.key_status(i).unwrap()).collect::<Vec<_>>();
    assert_eq!(pending(&put), vec![Status::Pending; 4], "a put behind the limit: {}", put.key_message(0));
    assert_eq!(pending(&get), vec![Status::Pending; 4], "a get behind the limit: {}", get.key_message(0));
    // The limit still bounds the caller's own transfers.
    let disk = make_layout(&e, &LayoutConfig { num_blocks: 2, ..block }, LayoutKind::FullyContiguous, StorageKind::Disk);
    let mine = e.submit(&src, &[0], &disk, &[0], &Default::default()).unwrap();
    let refused = e.submit(&src, &[1], &disk, &[1], &Default::default()).unwrap_err();
    assert_eq!(refused.status, Status::Busy, "{}", refused.message);
    fault::clear();
    assert_eq!(mine.wait(Some(Duration::from_secs(60))), Status::Ok);
    assert_eq!(wait(&first), Status::Ok, "{}", first.key_message(0));
    assert_eq!(wait(&put), Status::Ok, "{}", put.key_message(0));
    assert_eq!(wait(&get), Status::Ok, "{}", get.key_message(0));
    for (i, k) in held.iter().enumerate() {
        assert!(holds_key(&dst, i as u64, k), "key {i} loaded with bytes that are not its own");
    }
    for k in &new {
        assert_eq!(get_exact(&e, &s, &block, k), Status::Ok);
    }
}

/// A handle that names its slot but another key length is refused without claiming the
/// reservation: the handle itself still commits or aborts, and a put of its key is not
/// left waiting on a reservation nobody can end.
#[test]
fn a_handle_of_another_key_length_leaves_its_reservation_to_the_handle() {
    let _serial = serial();
    let OneSlot { e, owner, data, src, .. } = one_slot(small_block(), "store-handle-length");
    let h = write_handle(&owner, &key(1));
    let wrong = SlotHandle { key_len: h.key_len + 1, ..h };
    assert_eq!(owner.commit_slots(&[wrong]).unwrap(), vec![Status::InvalidArg]);
    let err = owner.abort_slots(&[wrong]).unwrap_err();
    assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
    assert_eq!(wait(&data.write_slots(&src, &[0], &[h], &Default::default()).unwrap()), Status::Ok);
    assert_eq!(owner.commit_slots(&[h]).unwrap(), vec![Status::Ok], "the handle itself commits");
    assert_eq!(get_exact(&e, &owner, &small_block(), &key(1)), Status::Ok);
}

/// Gets settle on a thread of their own: while a durable put's commit is held in the
/// sync of its record (under the records mutex), a latency-critical get of another key
/// loads its bytes, and the put is still in flight; once the sync goes on, the put is
/// stored.
#[test]
fn a_critical_get_completes_while_a_puts_commit_is_held_in_its_sync() {
    let _serial = serial();
    let e = Arc::new(engine());
    let dir = temp_dir("store-get-beside-commit");
    let block = small_block();
    let cfg = StoreConfig { flags: StoreFlags::CREATE | StoreFlags::DURABLE, ..StoreConfig::new(block, 8, b"ns") };
    let s = Store::open(&e, &dir, &cfg).unwrap();
    let src = e.create_layout(&LayoutConfig { num_blocks: 3, ..block }, LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    for b in 0..3 {
        fill_block_for_key(&src, b, &key(b));
    }
    assert_eq!(wait(&s.put(&src, &[0], &[key(0)], &Default::default()).unwrap()), Status::Ok);
    // A put of one key into a free slot: its last sync is its commit's, of the record.
    fault::count_only();
    assert_eq!(wait(&s.put(&src, &[1], &[key(1)], &Default::default()).unwrap()), Status::Ok);
    let syncs = fault::calls(Site::DiskSync);
    assert!(syncs > 0, "a durable put syncs");
    fault::inject(Site::DiskSync, syncs - 1, Fault::Hold);
    let put = s.put(&src, &[2], &[key(2)], &Default::default()).unwrap();
    let _let_go = LetGo;
    until_held();
    let dst = e.create_layout(&LayoutConfig { num_blocks: 1, ..block }, LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    let critical = TransferOptions { critical: true, ..Default::default() };
    let get = s.get(&[key(0)], &dst, &[0], &critical).unwrap();
    assert_eq!(wait(&get), Status::Ok, "the get waited for the put's commit: {}", get.key_message(0));
    assert!(holds_key(&dst, 0, &key(0)), "the get loaded bytes that are not its key's");
    assert!(fault::holding(), "the put's commit was let go before the get completed");
    assert_eq!(put.poll(), Status::Pending, "the put committed while its sync was held");
    fault::clear();
    assert_eq!(wait(&put), Status::Ok, "{}", put.key_message(0));
    assert_eq!(s.lookup(&[key(0), key(1), key(2)], false).unwrap().0, vec![true; 3]);
}

/// A durable put that evicts writes the evicted slot's tombstone and returns, while
/// another put's commit is held in the sync of its record: the tombstone's sync, and
/// then the put's transfer, are the store thread's. Once the held sync goes on, both
/// puts are stored and the evicted key is gone.
#[test]
fn a_durable_put_that_evicts_returns_while_a_commit_is_held_in_its_sync() {
    let _serial = serial();
    let e = Arc::new(engine());
    let dir = temp_dir("store-evict-beside-commit");
    let block = small_block();
    let cfg = StoreConfig { flags: StoreFlags::CREATE | StoreFlags::DURABLE, ..StoreConfig::new(block, 3, b"ns") };
    let s = Arc::new(Store::open(&e, &dir, &cfg).unwrap());
    let src = e.create_layout(&LayoutConfig { num_blocks: 4, ..block }, LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    for b in 0..4 {
        fill_block_for_key(&src, b, &key(b));
    }
    assert_eq!(wait(&s.put(&src, &[0], &[key(0)], &Default::default()).unwrap()), Status::Ok);
    // A put of one key into a free slot: its last sync is its commit's, of the record.
    fault::count_only();
    assert_eq!(wait(&s.put(&src, &[1], &[key(1)], &Default::default()).unwrap()), Status::Ok);
    let syncs = fault::calls(Site::DiskSync);
    fault::inject(Site::DiskSync, syncs - 1, Fault::Hold);
    let held = s.put(&src, &[2], &[key(2)], &Default::default()).unwrap();
    let _let_go = LetGo;
    until_held();
    // The store is full: this put evicts key 0, the oldest entry.
    let (tx, rx) = crossbeam_channel::bounded(1);
    let (s2, src2) = (s.clone(), src.clone());
    std::thread::spawn(move || {
        let _ = tx.send(s2.put(&src2, &[3], &[key(3)], &Default::default()).unwrap());
    });
    let evicting = rx.recv_timeout(Duration::from_secs(60)).expect("the put that evicts waited for the held commit's sync");
    assert!(fault::holding(), "the held commit was let go before the put returned");
    assert_eq!(evicting.poll(), Status::Pending, "the put's transfer did not wait for its tombstone's sync");
    fault::clear();
    assert_eq!(wait(&held), Status::Ok, "{}", held.key_message(0));
    assert_eq!(wait(&evicting), Status::Ok, "{}", evicting.key_message(0));
    assert_eq!(s.lookup(&[key(0), key(1), key(2), key(3)], false).unwrap().0, vec![false, true, true, true]);
    assert_eq!(get_exact(&e, &s, &block, &key(3)), Status::Ok);
}

/// A get whose block fails its check settles while a durable put's commit is held in the
/// sync of its record: its key is a miss at once, and the dropped entry's tombstone,
/// which the store thread writes once the commit is done, is recorded by the time the
/// store is closed.
#[test]
fn a_get_that_fails_its_check_completes_while_a_puts_commit_is_held_in_its_sync() {
    let _serial = serial();
    let e = Arc::new(engine());
    let dir = temp_dir("store-miss-beside-commit");
    let block = small_block();
    let cfg = StoreConfig { flags: StoreFlags::CREATE | StoreFlags::DURABLE, ..StoreConfig::new(block, 8, b"ns") };
    let src = e.create_layout(&LayoutConfig { num_blocks: 3, ..block }, LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    for b in 0..3 {
        fill_block_for_key(&src, b, &key(b));
    }
    {
        let s = Store::open(&e, &dir, &cfg).unwrap();
        assert_eq!(wait(&s.put(&src, &[0], &[key(0)], &Default::default()).unwrap()), Status::Ok);
    }
    // The only block written, the first of the one shard: one byte of it flipped.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().read(true).write(true).open(dir.join("data-0")).unwrap();
        let mut b = [0u8];
        f.read_exact_at(&mut b, 100).unwrap();
        f.write_all_at(&[b[0] ^ 0x5a], 100).unwrap();
    }
    let s = Store::open(&e, &dir, &StoreConfig { flags: StoreFlags::DURABLE, ..cfg.clone() }).unwrap();
    fault::count_only();
    assert_eq!(wait(&s.put(&src, &[1], &[key(1)], &Default::default()).unwrap()), Status::Ok);
    let syncs = fault::calls(Site::DiskSync);
    fault::inject(Site::DiskSync, syncs - 1, Fault::Hold);
    let put = s.put(&src, &[2], &[key(2)], &Default::default()).unwrap();
    let _let_go = LetGo;
    until_held();
    let dst = e.create_layout(&LayoutConfig { num_blocks: 1, ..block }, LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    let get = s.get(&[key(0)], &dst, &[0], &TransferOptions { critical: true, ..Default::default() }).unwrap();
    assert_eq!(wait(&get), Status::Integrity, "the get waited for the put's commit: {}", get.key_message(0));
    assert!(fault::holding(), "the put's commit was let go before the get completed");
    assert_eq!(s.lookup(&[key(0)], false).unwrap().0, vec![false], "the entry that failed its check is dropped at once");
    fault::clear();
    assert_eq!(wait(&put), Status::Ok, "{}", put.key_message(0));
    drop(s);
    let s = Store::open(&e, &dir, &StoreConfig { flags: StoreFlags::DURABLE, ..cfg }).unwrap();
    assert_eq!(s.lookup(&[key(0), key(1), key(2)], false).unwrap().0, vec![false, true, true], "the drop was recorded");
}
