//! The store under disk faults and counted disk calls (process-wide, so a suite of its
//! own, its tests one at a time): a write that fails, as on a full disk, fails its keys
//! alone and the store goes on; a read that fails is that get's failure, not a dropped
//! entry; opening reads no block.

mod common;
use common::*;
use kvxfer::fault::{self, Fault, Site};
use kvxfer::store::{Store, StoreConfig};
use kvxfer::{LayoutKind, Status, StorageKind};
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
    let dir = temp_path("store-faults");
    std::fs::create_dir_all(&dir).unwrap();
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

/// Warm restart: the disk reads of an open (headers, the direct-I/O probe) are as many with
/// 60 entries as with 4: no block and no per-entry checksum is read.
#[test]
fn opening_reads_no_block_however_many_entries_there_are() {
    let _serial = serial();
    let e = Arc::new(engine());
    let dir = temp_path("store-open-reads");
    std::fs::create_dir_all(&dir).unwrap();
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
    let dir = temp_path("store-race");
    std::fs::create_dir_all(&dir).unwrap();
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
