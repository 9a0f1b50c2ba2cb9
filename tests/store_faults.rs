//! The store under disk faults (process-wide injection, so a suite of its own): a write
//! that fails, as on a full disk, fails its keys alone and the store goes on; a read that
//! fails is that get's failure, not a dropped entry.

mod common;
use common::*;
use kvxfer::fault::{self, Fault, Site};
use kvxfer::store::{Store, StoreConfig};
use kvxfer::{LayoutKind, Status, StorageKind};
use std::sync::Arc;
use std::time::Duration;

fn key(i: u64) -> Vec<u8> {
    format!("key-{i}").into_bytes()
}

#[test]
fn a_full_disk_fails_the_keys_written_there_alone_and_the_store_goes_on() {
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
