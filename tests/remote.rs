//! Remote layouts across two processes on loopback: this binary spawns itself as the
//! peer (`KVX_REMOTE_PEER`), which exports a host and an emulated-device layout and
//! prints the blob; the test imports it and moves blocks both ways through NIXL's UCX
//! backend, byte-exact, with random ids and layer ranges, to and from memory and disk.
//! Then the peer is SIGKILLed mid-transfer: the survivor's requests end with
//! `KVX_ERR_REMOTE` within the import's timeout and local work goes on; a stopped peer's
//! read keeps its bounce slot out of the ring until NIXL reports it ended, and a direct
//! read its local layout alive; held slots never take the whole ring; a replaced import
//! ends its transfers at once. Bad blobs are refused and leave working imports alone.
//! Programs that used remote layouts, peer and importer, exit with status 0. Skipped
//! (and counted) without NIXL's libraries on the library path.
mod common;
use common::cases::{case, run};
use common::*;
use kvxfer::{DiskFlags, Engine, LayoutKind, Status, StorageKind, TransferOptions};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const FC: LayoutKind = LayoutKind::FullyContiguous;
const OUTER_FIRST: LayoutKind = LayoutKind::LayerSeparate { block_first: false };
const PEER_SEEDS: [u64; 2] = [71, 72];

fn peer_cfg(blocks: u64) -> kvxfer::LayoutConfig {
    cfg(blocks, 4, 2, 4, 96, 2)
}

/// The peer: exports [host FC, emulated-device outer-first] layouts filled with
/// `PEER_SEEDS`, prints two blobs (exports 1 and 2) as hex lines, then serves until
/// stdin closes.
fn peer_main(blocks: u64) {
    let e = engine();
    let host = make_layout(&e, &peer_cfg(blocks), FC, StorageKind::Host);
    let dev = make_layout(&e, &peer_cfg(blocks), OUTER_FIRST, StorageKind::Device);
    fill(&host, PEER_SEEDS[0]);
    fill(&dev, PEER_SEEDS[1]);
    let mut out = std::io::stdout().lock();
    for _ in 0..2 {
        let blob = e.export(&[host.clone(), dev.clone()]).expect("export");
        writeln!(out, "{}", blob.iter().map(|b| format!("{b:02x}")).collect::<String>()).unwrap();
    }
    out.flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

struct Peer {
    child: Child,
    blobs: Vec<Vec<u8>>,
}

impl Peer {
    fn spawn(blocks: u64) -> Peer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env("KVX_REMOTE_PEER", blocks.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawning the peer");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let blobs = (0..2)
            .map(|_| {
                let hex = lines.next().expect("the peer exited before printing its blob").unwrap();
                (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect()
            })
            .collect();
        Peer { child, blobs }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn import(e: &Engine, blob: &[u8], timeout: Duration) -> Vec<Arc<kvxfer::Layout>> {
    let ls = e.import(blob, timeout).expect("import");
    assert_eq!(ls.len(), 2);
    ls
}

/// A permutation of 0..n from a seed.
fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let r = random_bytes(seed, n as usize * 8);
    for i in (1..v.len()).rev() {
        let j = u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().unwrap()) as usize % (i + 1);
        v.swap(i, j);
    }
    v
}

fn layers(begin: u32, end: u32) -> TransferOptions {
    TransferOptions { layer_begin: begin, layer_end: end, ..Default::default() }
}

/// Remote → local memory and disk, local → remote, byte-exact; random ids, a layer range.
fn moves_blocks_both_ways() {
    let peer = Peer::spawn(32);
    let e = engine();
    let remote = import(&e, &peer.blobs[1], Duration::from_secs(20));
    let c = peer_cfg(32);
    for (r, (rl, &seed)) in remote.iter().zip(PEER_SEEDS.iter()).enumerate() {
        for (kind, storage) in [
            (FC, StorageKind::Host),
            (OUTER_FIRST, StorageKind::Device),
            (LayoutKind::LayerSeparate { block_first: true }, StorageKind::Pinned),
        ] {
            let what = format!("remote {r} -> {storage:?}");
            let local = make_layout(&e, &c, kind, storage);
            fill(&local, 5);
            let src = shuffled(32, r as u64 + 1)[..12].to_vec();
            let dst = shuffled(32, r as u64 + 9)[..12].to_vec();
            assert_eq!(transfer(&e, rl, &src, &local, &dst, &TransferOptions::default()), Status::Ok, "{what}");
            let pairs: Vec<_> = src.iter().copied().zip(dst.iter().copied()).collect();
            check(&local, 5, seed, &pairs, 0..4, &what);
            // A layer range of other blocks on top.
            let (s2, d2) = (vec![30, 31], vec![0, 1]);
            assert_eq!(transfer(&e, rl, &s2, &local, &d2, &layers(1, 3)), Status::Ok, "{what}, layers 1..3");
            for (sb, db) in s2.iter().zip(&d2) {
                for l in 0..4 {
                    let want = if (1..3).contains(&l) {
                        region_pattern(seed, *sb, l, 0, 768)
                    } else if pairs.iter().any(|p| p.1 == *db) {
                        region_pattern(seed, pairs.iter().find(|p| p.1 == *db).unwrap().0, l, 0, 768)
                    } else {
                        region_pattern(5, *db, l, 0, 768)
                    };
                    assert!(read_region(&local, *db, l, 0) == want, "{what}: block {db} layer {l} after the layer range");
                }
            }
        }
        // Local -> remote, from pinned memory and from the device: write blocks 0..8
        // (from a local pattern), read them back into a fresh layout; the blocks not
        // written still hold the peer's pattern (or the previous writer's).
        let all: Vec<u64> = (0..32).collect();
        let back = make_layout(&e, &c, FC, StorageKind::Host);
        let mut last: Vec<(u64, u64)> = all.iter().map(|&b| (seed, b)).collect();
        for (storage, local_seed) in [(StorageKind::Pinned, 44), (StorageKind::Device, 45)] {
            let what = format!("local {storage:?} -> remote {r}");
            let local = make_layout(&e, &c, FC, storage);
            fill(&local, local_seed);
            let written: Vec<u64> = shuffled(32, local_seed + r as u64)[..8].to_vec();
            let from: Vec<u64> = (0..8).collect();
            assert_eq!(transfer(&e, &local, &from, rl, &written, &TransferOptions::default()), Status::Ok, "{what}");
            written.iter().zip(&from).for_each(|(&w, &f)| last[w as usize] = (local_seed, f));
            fill(&back, 3);
            assert_eq!(transfer(&e, rl, &all, &back, &all, &TransferOptions::default()), Status::Ok, "{what}: reading back");
            for b in 0..32u64 {
                let (want_seed, want_block) = last[b as usize];
                for l in 0..4 {
                    assert!(read_region(&back, b, l, 1) == region_pattern(want_seed, want_block, l, 1, 768), "{what}: block {b} layer {l}");
                }
            }
        }
        // Remote -> disk -> remote through the bounce ring.
        let what = format!("remote {r} <-> disk");
        let path = temp_path(&format!("remote-{r}"));
        let disk = e.create_disk_layout(&c, &path, DiskFlags::CREATE).expect("disk layout");
        assert_eq!(transfer(&e, rl, &all, &disk, &all, &TransferOptions::default()), Status::Ok, "{what}");
        let check_back = make_layout(&e, &c, FC, StorageKind::Host);
        assert_eq!(transfer(&e, &disk, &all, &check_back, &all, &TransferOptions::default()), Status::Ok, "{what}: disk -> host");
        for b in 0..32u64 {
            assert!(read_region(&check_back, b, 2, 0) == read_region(&back, b, 2, 0), "{what}: block {b}");
        }
        assert_eq!(transfer(&e, &disk, &[0], rl, &[31], &TransferOptions::default()), Status::Ok, "{what}: disk -> remote");
        let one = make_layout(&e, &c, FC, StorageKind::Host);
        assert_eq!(transfer(&e, rl, &[31], &one, &[0], &TransferOptions::default()), Status::Ok, "{what}: reading back");
        assert!(read_region(&one, 0, 3, 1) == read_region(&back, 0, 3, 1), "{what}: block 31 holds block 0");
        let _ = std::fs::remove_file(path);
    }
}

/// Same geometry rules as local layouts; the peer's bounds are checked before posting;
/// remote to remote and the address of remote memory are refused.
fn remote_layouts_follow_the_local_rules() {
    let peer = Peer::spawn(16);
    let e = engine();
    let remote = import(&e, &peer.blobs[1], Duration::from_secs(20));
    let local = make_layout(&e, &peer_cfg(16), FC, StorageKind::Host);
    let other = make_layout(&e, &cfg(16, 4, 2, 4, 64, 2), FC, StorageKind::Host);
    let err = |r: kvxfer::Result<Arc<kvxfer::Request>>| r.expect_err("refused").status;
    assert_eq!(err(e.submit(&remote[0], &[16], &local, &[0], &TransferOptions::default())), Status::OutOfRange);
    assert_eq!(err(e.submit(&remote[0], &[0], &other, &[0], &TransferOptions::default())), Status::Incompatible);
    assert_eq!(err(e.submit(&remote[0], &[0], &remote[1], &[0], &TransferOptions::default())), Status::Unsupported);
    assert_eq!(err(e.submit(&local, &[0], &remote[1], &[0], &layers(2, 5))), Status::OutOfRange);
    // Another engine's import is not this engine's layout.
    let e2 = engine();
    assert_eq!(err(e2.submit(&remote[0], &[0], &local, &[0], &TransferOptions::default())), Status::InvalidArg);
}

/// Garbage, truncated, altered, foreign-ABI and own blobs are `InvalidArg` with a
/// reason; an older export after a newer one is refused, a newer one replaces the older
/// import and the older handles are then refused; counting a blob's layouts imports
/// nothing.
fn bad_and_replaced_blobs() {
    let peer = Peer::spawn(4);
    let e = engine();
    let good = &peer.blobs[0];
    let refused = |b: &[u8], want: &str| {
        let err = e.import(b, Duration::ZERO).expect_err("refused");
        assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
        assert!(err.message.contains(want), "wanted '{want}': {}", err.message);
    };
    refused(b"not a blob at all", "not a kvxfer export blob");
    refused(&good[..good.len() / 2], "checksum");
    let mut altered = good.clone();
    let mid = altered.len() / 2;
    altered[mid] ^= 1;
    refused(&altered, "checksum");
    let mut other_major = good.clone();
    other_major[8] = 99;
    refused(&other_major, "ABI 99");
    let own_engine = engine();
    let own = make_layout(&own_engine, &peer_cfg(4), FC, StorageKind::Host);
    let blob = own_engine.export(std::slice::from_ref(&own)).expect("export");
    let err = own_engine.import(&blob, Duration::ZERO).expect_err("own blob refused");
    assert!(err.status == Status::InvalidArg && err.message.contains("own export"), "{}", err.message);
    drop((own, own_engine));

    let old = import(&e, &peer.blobs[0], Duration::ZERO);
    let new = import(&e, &peer.blobs[1], Duration::ZERO);
    refused(&peer.blobs[0], "older than export 2");
    // The count query (C: `layouts` NULL) checks like an import but replaces nothing.
    assert_eq!(e.import_count(&peer.blobs[1]).expect("count"), 2);
    let err = e.import_count(&peer.blobs[0]).expect_err("older blob's count refused");
    assert!(err.message.contains("older than export 2"), "{}", err.message);
    let local = make_layout(&e, &peer_cfg(4), FC, StorageKind::Host);
    fill(&local, 0);
    let err = e.submit(&old[0], &[0], &local, &[0], &TransferOptions::default()).expect_err("stale handle refused");
    assert!(err.status == Status::InvalidArg && err.message.contains("older blob"), "{}", err.message);
    assert_eq!(transfer(&e, &new[0], &[1], &local, &[1], &TransferOptions::default()), Status::Ok);
    check(&local, 0, PEER_SEEDS[0], &[(1, 1)], 0..4, "after re-import");
}

/// Remote requests keep the local request semantics: `on_complete` sees the status,
/// `poll` spins to it, and a cancel ends queued requests as cancelled and running ones
/// when their posted transfers end; every slot comes back and later transfers are exact.
fn callbacks_poll_and_cancel_hold() {
    let blocks = 2048; // 12 MiB per layout
    let peer = Peer::spawn(blocks);
    let e = engine_with(|c| c.bounce_bytes = 8 << 20);
    let remote = import(&e, &peer.blobs[1], Duration::from_secs(20));
    let c = peer_cfg(blocks);
    let local = make_layout(&e, &c, FC, StorageKind::Device);
    fill(&local, 6);
    let seen = Arc::new(std::sync::Mutex::new(None));
    let cb = {
        let seen = seen.clone();
        move |_: &kvxfer::Request, st: Status| *seen.lock().unwrap() = Some(st)
    };
    let opts = TransferOptions { on_complete: Some(Arc::new(cb)), ..Default::default() };
    let ids = shuffled(blocks, 5)[..16].to_vec();
    let r = e.submit(&remote[1], &ids, &local, &ids, &opts).expect("submit");
    assert_eq!(r.wait(Some(Duration::from_secs(20))), Status::Ok);
    let deadline = Instant::now() + Duration::from_secs(5);
    while seen.lock().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(*seen.lock().unwrap(), Some(Status::Ok), "on_complete of a remote request");
    check(&local, 6, PEER_SEEDS[1], &ids.iter().map(|&b| (b, b)).collect::<Vec<_>>(), 0..4, "remote read with on_complete");

    let ids2 = shuffled(blocks, 6)[..16].to_vec();
    let r = e.submit(&local, &ids2, &remote[0], &ids2, &TransferOptions::default()).expect("submit");
    let deadline = Instant::now() + Duration::from_secs(20);
    while r.poll() == Status::Pending {
        assert!(Instant::now() < deadline, "poll of a remote write never left Pending");
        std::hint::spin_loop();
    }
    assert_eq!(r.poll(), Status::Ok);

    let all: Vec<u64> = (0..blocks).collect();
    let big: Vec<_> = (0..8).map(|_| e.submit(&remote[1], &all, &local, &all, &TransferOptions::default()).expect("submit")).collect();
    big.iter().for_each(|r| r.cancel());
    let ends: Vec<Status> = big.iter().map(|r| r.wait(Some(Duration::from_secs(20)))).collect();
    assert!(ends.iter().all(|&s| s == Status::Ok || s == Status::Cancelled), "{ends:?}");
    assert!(ends.contains(&Status::Cancelled), "none of 8 queued 12 MiB reads was cancelled: {ends:?}");
    assert_eq!(e.slots().0, e.slots().1, "every slot came back");
    let back = make_layout(&e, &c, FC, StorageKind::Host);
    assert_eq!(transfer(&e, &remote[0], &all, &back, &all, &TransferOptions::default()), Status::Ok, "after the cancels");
    for b in 0..blocks {
        // The polled write put the device's bytes of then into ids2; the rest is the peer's.
        let seed = if !ids2.contains(&b) {
            PEER_SEEDS[0]
        } else if ids.contains(&b) {
            PEER_SEEDS[1]
        } else {
            6
        };
        for (l, o) in (0..4).flat_map(|l| (0..2).map(move |o| (l, o))) {
            assert!(
                read_region(&back, b, l, o) == region_pattern(seed, b, l, o, 768),
                "peer host layout after the cancels: block {b} layer {l}"
            );
        }
    }
}

/// The peer is SIGKILLed while big reads run: every request ends, the ones after the
/// kill with `KVX_ERR_REMOTE` (or are refused, once a transfer failed and closed the
/// import), within the import's timeout; local work goes on.
fn killed_peer_ends_requests_in_time() {
    let blocks = 2048; // 12 MiB per layout
    let mut peer = Peer::spawn(blocks);
    let e = engine_with(|c| c.bounce_bytes = 8 << 20);
    let timeout = Duration::from_secs(3);
    let remote = import(&e, &peer.blobs[1], timeout);
    let c = peer_cfg(blocks);
    let local = make_layout(&e, &c, FC, StorageKind::Host);
    let all: Vec<u64> = (0..blocks).collect();
    assert_eq!(transfer(&e, &remote[0], &all, &local, &all, &TransferOptions::default()), Status::Ok, "before the kill");
    let inflight: Vec<_> = (0..4).map(|_| e.submit(&remote[0], &all, &local, &all, &TransferOptions::default()).expect("submit")).collect();
    peer.child.kill().expect("SIGKILL");
    let _ = peer.child.wait();
    let killed = Instant::now();
    // A submit after one of the import's transfers failed is refused at once.
    let after: Vec<_> = (0..4)
        .filter_map(|_| match e.submit(&remote[1], &all[..64], &local, &all[..64], &TransferOptions::default()) {
            Ok(r) => Some(r),
            Err(err) => {
                assert!(err.status == Status::Remote && err.message.contains("re-import"), "a submit after the kill: {err}");
                None
            }
        })
        .collect();
    for (i, r) in inflight.iter().chain(&after).enumerate() {
        let s = r.wait(Some(timeout * 3));
        assert_ne!(s, Status::Pending, "request {i} still pending {:?} after the kill", killed.elapsed());
        if i >= inflight.len() {
            assert_eq!(s, Status::Remote, "request {i} after the kill: {}", r.error_message().to_string_lossy());
            let msg = r.error_message().to_string_lossy().to_string();
            assert!(msg.contains("re-import") || msg.contains("within"), "{msg}");
        } else {
            assert!(s == Status::Ok || s == Status::Remote, "request {i} in flight at the kill: {s:?}");
        }
    }
    assert!(killed.elapsed() < timeout * 2, "requests took {:?} to end after the kill", killed.elapsed());
    let (a, b) = (make_layout(&e, &c, FC, StorageKind::Host), make_layout(&e, &c, FC, StorageKind::Device));
    fill(&a, 9);
    fill(&b, 0);
    assert_eq!(transfer(&e, &a, &all, &b, &all, &TransferOptions::default()), Status::Ok, "local work after the kill");
    check(&b, 0, 9, &all.iter().map(|&x| (x, x)).collect::<Vec<_>>(), 0..4, "local work after the kill");
    assert_eq!(e.slots().0, e.slots().1, "every slot came back");
}

/// Stops a process (SIGSTOP) until dropped (SIGCONT), so a failed assertion never leaves
/// it stopped.
struct Stopped(i32);

impl Stopped {
    fn new(pid: u32) -> Stopped {
        // SAFETY: signals a child process this test spawned.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0, "SIGSTOP");
        let stopped = Stopped(pid as i32);
        // The signal takes effect when each thread is next scheduled: wait until every
        // thread shows state T (stopped) in /proc.
        let all_stopped = || {
            std::fs::read_dir(format!("/proc/{pid}/task")).expect("the stopped peer's threads").all(|t| {
                let stat = std::fs::read_to_string(t.unwrap().path().join("stat")).unwrap_or_default();
                stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T'))
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !all_stopped() {
            assert!(Instant::now() < deadline, "the peer's threads did not stop within 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        stopped
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

/// The peer is stopped (SIGSTOP) while a read from it into a bounce slot runs, past the
/// import's timeout: over TCP its progress thread serves the read, so the read cannot
/// end. The request ends with `KVX_ERR_REMOTE`; the slot stays out of the ring (counted)
/// while the read may still write it; the import is closed, so new requests to its
/// layouts are refused until it is imported again. After SIGCONT, local disk <-> device
/// requests through the ring stay byte-exact, the held slot is back only if NIXL
/// reported the read ended, and the peer imported again works. Runs in a child process
/// (TCP on loopback), so a hang fails the test.
fn a_stalled_peer_holds_the_slot_and_closes_the_import() {
    run_child("KVX_REMOTE_STALLED", "the stalled-peer case");
}

fn stalled_peer_main() {
    let blocks = 64;
    let peer = Peer::spawn(blocks);
    let e = engine_with(|c| c.bounce_bytes = 8 << 20);
    let timeout = Duration::from_millis(500);
    let remote = import(&e, &peer.blobs[1], timeout);
    let c = peer_cfg(blocks);
    let d = TransferOptions::default();
    let path = temp_path("remote-stalled");
    let disk = e.create_disk_layout(&c, &path, DiskFlags::CREATE).expect("disk layout");
    assert_eq!(transfer(&e, &remote[0], &[0], &disk, &[0], &d), Status::Ok, "before the stop");
    let (_, total) = e.slots();
    let stopped = Stopped::new(peer.child.id());
    let r = e.submit(&remote[0], &[1], &disk, &[1], &d).expect("submit");
    let s = r.wait(Some(timeout * 20));
    let msg = r.error_message().to_string_lossy().to_string();
    assert_eq!(s, Status::Remote, "the read from the stopped peer: {msg}");
    assert!(msg.contains("within"), "{msg}");
    assert_eq!(e.slots().0, total - 1, "the slot of the read that may still run is out of the ring");
    assert_eq!(e.stats().slots_quarantined, 1);
    assert!(msg.contains("re-import"), "{msg}");
    let local = make_layout(&e, &c, FC, StorageKind::Host);
    let err = e.submit(&remote[1], &[0], &local, &[0], &d).expect_err("the closed import is refused");
    assert!(err.status == Status::Remote && err.message.contains("re-import"), "{err}");
    drop(stopped);
    let (host, dev) = (make_layout(&e, &c, FC, StorageKind::Host), make_layout(&e, &c, OUTER_FIRST, StorageKind::Device));
    let all: Vec<u64> = (0..blocks).collect();
    let pairs: Vec<_> = all.iter().map(|&b| (b, b)).collect();
    for seed in 100..108 {
        fill(&host, seed);
        fill(&dev, 0);
        assert_eq!(transfer(&e, &host, &all, &disk, &all, &d), Status::Ok, "host -> disk after the stall");
        assert_eq!(transfer(&e, &disk, &all, &dev, &all, &d), Status::Ok, "disk -> device after the stall");
        check(&dev, 0, seed, &pairs, 0..4, "disk -> device after the stall");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while e.stats().slots_quarantined > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let held = e.stats().slots_quarantined;
    assert!(held <= 1, "{held} slots held");
    assert_eq!(e.slots().0 as u64 + held, total as u64, "every slot not held came back");
    // Imported again, the peer is reachable as before.
    let again = import(&e, &peer.blobs[1], timeout);
    fill(&local, 0);
    assert_eq!(transfer(&e, &again[0], &[1], &local, &[2], &d), Status::Ok, "after importing the peer again");
    check(&local, 0, PEER_SEEDS[0], &[(1, 2)], 0..4, "after importing the peer again");
    let _ = std::fs::remove_file(path);
}

/// A peer stopped (SIGSTOP) and imported again after each read from it into a bounce
/// slot timed out, then killed: every such read keeps its slot out of the ring, but never
/// the whole ring. Once all slots but one are held, the next remote -> disk request
/// ends with `KVX_ERR_REMOTE` saying so, local disk <-> device work goes on through the
/// slot left, and the engine's destruction returns. Runs in a child process (TCP on
/// loopback), so a hang fails the test.
fn held_slots_never_take_the_whole_ring() {
    run_child("KVX_REMOTE_HELD", "the held-slots case");
}

/// Runs this binary again with `var` set (TCP on loopback) and waits at most 120 s.
fn run_child(var: &str, what: &str) {
    run_child_with(var, what, &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")]);
}

/// Runs this binary again with `var` and `env` set and waits at most 120 s for it to
/// exit with status 0.
fn run_child_with(var: &str, what: &str, env: &[(&str, &str)]) {
    let mut child =
        Command::new(std::env::current_exe().unwrap()).env(var, "1").envs(env.iter().copied()).spawn().expect("spawning the test's child");
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the child") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not end within 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{what} failed: {status}");
}

fn held_slots_main() {
    let blocks = 16;
    let mut peer = Peer::spawn(blocks);
    let e = engine_with(|c| c.bounce_bytes = 4 * c.slot_bytes);
    let (_, total) = e.slots();
    assert_eq!(total, 4);
    let timeout = Duration::from_millis(300);
    let c = peer_cfg(blocks);
    let d = TransferOptions::default();
    let path = temp_path("remote-held");
    let disk = e.create_disk_layout(&c, &path, DiskFlags::CREATE).expect("disk layout");
    let mut remote = import(&e, &peer.blobs[1], timeout);
    assert_eq!(transfer(&e, &remote[0], &[0], &disk, &[0], &d), Status::Ok, "before the stop");
    let stopped = Stopped::new(peer.child.id());
    for round in 0..total as u64 + 1 {
        let r = e.submit(&remote[0], &[round], &disk, &[round], &d).expect("submit");
        let s = r.wait(Some(Duration::from_secs(30)));
        let msg = r.error_message().to_string_lossy().to_string();
        assert_eq!(s, Status::Remote, "round {round}, the read from the stopped peer: {msg}");
        let held = e.stats().slots_quarantined;
        assert!(held < total as u64, "round {round}: all {held} slots held");
        if held == total as u64 - 1 && round == total as u64 {
            assert!(msg.contains("bounce slots"), "round {round}: {msg}");
        }
        remote = import(&e, &peer.blobs[1], timeout);
    }
    assert_eq!(e.stats().slots_quarantined, total as u64 - 1, "every slot but one held");
    drop(stopped);
    peer.child.kill().expect("SIGKILL");
    let _ = peer.child.wait();
    let (host, dev) = (make_layout(&e, &c, FC, StorageKind::Host), make_layout(&e, &c, OUTER_FIRST, StorageKind::Device));
    let all: Vec<u64> = (0..blocks).collect();
    let pairs: Vec<_> = all.iter().map(|&b| (b, b)).collect();
    fill(&host, 7);
    fill(&dev, 0);
    assert_eq!(transfer(&e, &host, &all, &disk, &all, &d), Status::Ok, "host -> disk with slots held");
    assert_eq!(transfer(&e, &disk, &all, &dev, &all, &d), Status::Ok, "disk -> device with slots held");
    check(&dev, 0, 7, &pairs, 0..4, "disk -> device with slots held");
    drop((host, dev, disk, remote));
    drop(e);
    let _ = std::fs::remove_file(path);
}

/// A stopped peer (SIGSTOP) is imported again while a read from it into a bounce slot
/// runs: the read ends at once with `KVX_ERR_REMOTE` saying its import was replaced, not
/// at the import's timeout, and NIXL is not asked about it again (the metadata it was
/// checked against is gone); its slot stays out of the ring. Runs in a child process
/// (TCP on loopback).
fn a_read_from_a_replaced_import_ends_at_once() {
    run_child("KVX_REMOTE_REPLACED", "the replaced-import case");
}

fn replaced_import_main() {
    let blocks = 16;
    let peer = Peer::spawn(blocks);
    let e = engine();
    let timeout = Duration::from_secs(60);
    let c = peer_cfg(blocks);
    let d = TransferOptions::default();
    let path = temp_path("remote-replaced");
    let disk = e.create_disk_layout(&c, &path, DiskFlags::CREATE).expect("disk layout");
    let remote = import(&e, &peer.blobs[1], timeout);
    assert_eq!(transfer(&e, &remote[0], &[0], &disk, &[0], &d), Status::Ok, "before the stop");
    let stopped = Stopped::new(peer.child.id());
    let r = e.submit(&remote[0], &[1], &disk, &[1], &d).expect("submit");
    // Most likely posted by now; a read not posted yet is refused at its post, which
    // ends it at once too.
    std::thread::sleep(Duration::from_millis(500));
    let again = import(&e, &peer.blobs[1], timeout);
    let s = r.wait(Some(timeout / 2));
    let msg = r.error_message().to_string_lossy().to_string();
    assert_eq!(s, Status::Remote, "the read from the replaced import: {msg}");
    assert!(msg.contains("newer blob"), "{msg}");
    assert!(e.stats().slots_quarantined <= 1);
    drop(stopped);
    let local = make_layout(&e, &c, FC, StorageKind::Host);
    fill(&local, 0);
    assert_eq!(transfer(&e, &again[0], &[1], &local, &[2], &d), Status::Ok, "with the new import");
    check(&local, 0, PEER_SEEDS[0], &[(1, 2)], 0..4, "with the new import");
    let _ = std::fs::remove_file(path);
}

/// The peer is killed, then a read from it into a bounce slot is submitted: it ends
/// with `KVX_ERR_REMOTE`, and its slot stays out of the ring, whether NIXL refused its
/// post (after which parts of it may have been issued) or failed the transfer. Local
/// work goes on, and the engine's destruction returns. Runs in a child process (TCP on
/// loopback).
fn a_read_from_a_killed_peer_holds_its_slot() {
    run_child("KVX_REMOTE_KILLED", "the killed-peer read case");
}

fn killed_peer_read_main() {
    let blocks = 16;
    let mut peer = Peer::spawn(blocks);
    let e = engine_with(|c| c.bounce_bytes = 4 * c.slot_bytes);
    let (_, total) = e.slots();
    let c = peer_cfg(blocks);
    let d = TransferOptions::default();
    let path = temp_path("remote-killed-read");
    let disk = e.create_disk_layout(&c, &path, DiskFlags::CREATE).expect("disk layout");
    let remote = import(&e, &peer.blobs[1], Duration::from_secs(5));
    assert_eq!(transfer(&e, &remote[0], &[0], &disk, &[0], &d), Status::Ok, "before the kill");
    peer.child.kill().expect("SIGKILL");
    let _ = peer.child.wait();
    let r = e.submit(&remote[0], &[1], &disk, &[1], &d).expect("submit");
    let s = r.wait(Some(Duration::from_secs(30)));
    let msg = r.error_message().to_string_lossy().to_string();
    assert_eq!(s, Status::Remote, "the read from the killed peer: {msg}");
    assert_eq!(e.stats().slots_quarantined, 1, "the slot of the read that may have been issued is held: {msg}");
    assert_eq!(e.slots().0, total - 1);
    let (host, dev) = (make_layout(&e, &c, FC, StorageKind::Host), make_layout(&e, &c, OUTER_FIRST, StorageKind::Device));
    let all: Vec<u64> = (0..blocks).collect();
    fill(&host, 3);
    fill(&dev, 0);
    assert_eq!(transfer(&e, &host, &all, &disk, &all, &d), Status::Ok, "host -> disk after the kill");
    assert_eq!(transfer(&e, &disk, &all, &dev, &all, &d), Status::Ok, "disk -> device after the kill");
    check(&dev, 0, 3, &all.iter().map(|&b| (b, b)).collect::<Vec<_>>(), 0..4, "disk -> device after the kill");
    drop((host, dev, disk, remote));
    drop(e);
    let _ = std::fs::remove_file(path);
}

/// A read from a stopped peer (SIGSTOP) straight into a local layout times out; the
/// caller then drops the request and the layout. The layout lives on (its memory stays
/// allocated and registered) while the read may still write it. Runs in a child process
/// (TCP on loopback).
fn a_timed_out_read_keeps_its_local_layout() {
    run_child("KVX_REMOTE_KEEPS", "the kept-layout case");
}

fn kept_layout_main() {
    let blocks = 16;
    let peer = Peer::spawn(blocks);
    let e = engine();
    let c = peer_cfg(blocks);
    let d = TransferOptions::default();
    let remote = import(&e, &peer.blobs[1], Duration::from_millis(500));
    let local = make_layout(&e, &c, FC, StorageKind::Host);
    assert_eq!(transfer(&e, &remote[0], &[0], &local, &[0], &d), Status::Ok, "before the stop");
    let stopped = Stopped::new(peer.child.id());
    let r = e.submit(&remote[0], &[1], &local, &[1], &d).expect("submit");
    let s = r.wait(Some(Duration::from_secs(30)));
    let msg = r.error_message().to_string_lossy().to_string();
    assert_eq!(s, Status::Remote, "the read from the stopped peer: {msg}");
    assert!(msg.contains("within"), "{msg}");
    let kept = Arc::downgrade(&local);
    drop((r, local));
    assert!(kept.upgrade().is_some(), "the layout a timed-out read may still write was freed");
    drop(stopped);
}

/// A program that used remote layouts exits with status 0 when it returns from main:
/// the child imports the peer's blob, reads from it and exports a layout of its own;
/// the peer, once its stdin closes, returns from main as well. Both run over the
/// transports this suite runs with (UCX's own choice unless `UCX_TLS` says otherwise),
/// with whatever RDMA libraries the host has installed.
fn a_program_that_used_remote_layouts_exits_0() {
    run_child_with("KVX_REMOTE_EXITS", "the child that used remote layouts", &[]);
}

fn exits_main() {
    let mut peer = Peer::spawn(4);
    let e = engine();
    let remote = import(&e, &peer.blobs[1], Duration::from_secs(20));
    let local = make_layout(&e, &peer_cfg(4), FC, StorageKind::Host);
    fill(&local, 0);
    assert_eq!(transfer(&e, &remote[0], &[3], &local, &[0], &TransferOptions::default()), Status::Ok);
    check(&local, 0, PEER_SEEDS[0], &[(3, 0)], 0..4, "the read before the exit");
    e.export(&[local]).expect("export");
    drop(peer.child.stdin.take());
    let status = peer.child.wait().expect("waiting for the peer");
    assert!(status.success(), "the peer, which exported layouts, exited with {status}");
}

/// A blob refused by import leaves every working import as it was: a newer blob of the
/// same peer whose layout metadata NIXL refuses, and a blob that names one peer but
/// carries another's metadata, break neither peer's layouts; the peer's real newer
/// blob then still replaces the older import.
fn a_refused_blob_leaves_working_imports_alone() {
    use kvxfer::remote::{abi_major, blob::Blob};
    let (p, q) = (Peer::spawn(4), Peer::spawn(4));
    let e = engine();
    let old = import(&e, &p.blobs[0], Duration::ZERO);
    let other = import(&e, &q.blobs[1], Duration::ZERO);
    let local = make_layout(&e, &peer_cfg(4), FC, StorageKind::Host);
    let works = |layouts: &[Arc<kvxfer::Layout>], what: &str| {
        fill(&local, 0);
        assert_eq!(transfer(&e, &layouts[0], &[1], &local, &[2], &TransferOptions::default()), Status::Ok, "{what}");
        check(&local, 0, PEER_SEEDS[0], &[(1, 2)], 0..4, what);
    };
    works(&old, "p's import before");
    works(&other, "q's import before");
    let refused = |blob: &Blob, want: &str| {
        let err = e.import(&blob.encode(), Duration::ZERO).expect_err("refused");
        assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
        assert!(err.message.contains(want), "wanted '{want}': {}", err.message);
    };
    let newer = Blob::decode(&p.blobs[1], abi_major()).expect("p's blob");
    let mut damaged = newer.clone();
    damaged.layouts[1].metadata[0] ^= 0xff;
    refused(&damaged, "NIXL metadata was refused");
    works(&old, "p's import after p's blob with damaged NIXL metadata");
    works(&other, "q's import after p's blob with damaged NIXL metadata");
    // Past the header, in the registrations: NIXL drops all it holds of an agent whose
    // registrations it refuses.
    let mut damaged = newer.clone();
    let md = &mut damaged.layouts[1].metadata;
    let at = md.windows(11).position(|w| w == b"nixlSecElms").expect("the registrations' section");
    md[at + 1] ^= 0x01;
    refused(&damaged, "NIXL metadata was refused");
    works(&old, "p's import after p's blob with damaged registrations");
    works(&other, "q's import after p's blob with damaged registrations");
    let mut borrowed = Blob::decode(&q.blobs[1], abi_major()).expect("q's blob");
    borrowed.agent = newer.agent.clone();
    refused(&borrowed, "metadata belongs to");
    works(&old, "p's import after a blob naming p with q's metadata");
    works(&other, "q's import after a blob naming p with q's metadata");
    let new = import(&e, &p.blobs[1], Duration::ZERO);
    works(&new, "p's newer import");
    works(&other, "q's import after p's newer import");
    let err = e.submit(&old[0], &[0], &local, &[0], &TransferOptions::default()).expect_err("the replaced import refused");
    assert!(err.message.contains("older blob"), "{}", err.message);
}

/// Runs `f` on a thread and waits at most `limit` for it: a hang fails the test
/// instead of blocking the suite (the hung thread is left behind).
fn within<T: Send + 'static>(limit: Duration, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).unwrap_or_else(|_| panic!("{what} did not return within {limit:?}"))
}

/// An export that lists one layout twice is refused with which; two threads exporting
/// the same layouts in opposite orders never wait on each other for good.
fn duplicate_and_crossed_exports_end() {
    let e = Arc::new(engine());
    let (a, b) = (make_layout(&e, &peer_cfg(4), FC, StorageKind::Host), make_layout(&e, &peer_cfg(4), FC, StorageKind::Pinned));
    let err = {
        let (e, a, b) = (e.clone(), a.clone(), b.clone());
        within(Duration::from_secs(10), "export of [a, b, a]", move || {
            e.export(&[a.clone(), b, a]).map(drop).expect_err("a duplicate refused")
        })
    };
    assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
    assert!(err.message.contains("layouts 0 and 2"), "{}", err.message);
    let crossed: Vec<_> = [[a.clone(), b.clone()], [b, a]]
        .into_iter()
        .map(|pair| {
            let e = e.clone();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for _ in 0..1000 {
                    e.export(&pair).expect("export");
                }
                let _ = tx.send(());
            });
            rx
        })
        .collect();
    for rx in crossed {
        rx.recv_timeout(Duration::from_secs(60))
            .expect("1000 exports of two layouts, crossed with another thread's, did not end within 60 s");
    }
}

/// Without NIXL at run time, export and import say why; local work is as before.
fn without_nixl_export_and_import_are_unsupported() {
    let e = engine();
    let l = make_layout(&e, &peer_cfg(4), FC, StorageKind::Host);
    let err = e.export(std::slice::from_ref(&l)).expect_err("export refused");
    assert!(err.status == Status::Unsupported && err.message.contains("libnixl_capi.so"), "{err}");
    let err = e.import(b"not a blob", Duration::ZERO).expect_err("import refused");
    assert_eq!(err.status, Status::InvalidArg, "{err}");
    let d = make_layout(&e, &peer_cfg(4), FC, StorageKind::Device);
    assert_eq!(transfer(&e, &l, &[0, 1], &d, &[2, 3], &TransferOptions::default()), Status::Ok);
}

fn main() {
    if let Ok(blocks) = std::env::var("KVX_REMOTE_PEER") {
        peer_main(blocks.parse().unwrap());
        return;
    }
    if std::env::var_os("KVX_REMOTE_STALLED").is_some() {
        return stalled_peer_main();
    }
    if std::env::var_os("KVX_REMOTE_REPLACED").is_some() {
        return replaced_import_main();
    }
    if std::env::var_os("KVX_REMOTE_KEEPS").is_some() {
        return kept_layout_main();
    }
    if std::env::var_os("KVX_REMOTE_KILLED").is_some() {
        return killed_peer_read_main();
    }
    if std::env::var_os("KVX_REMOTE_HELD").is_some() {
        return held_slots_main();
    }
    if std::env::var_os("KVX_REMOTE_EXITS").is_some() {
        return exits_main();
    }
    let why = kvxfer::io::nixl::missing();
    run(vec![
        case("moves_blocks_both_ways", moves_blocks_both_ways).unless(why.clone()),
        case("remote_layouts_follow_the_local_rules", remote_layouts_follow_the_local_rules).unless(why.clone()),
        case("bad_and_replaced_blobs", bad_and_replaced_blobs).unless(why.clone()),
        case("callbacks_poll_and_cancel_hold", callbacks_poll_and_cancel_hold).unless(why.clone()),
        case("killed_peer_ends_requests_in_time", killed_peer_ends_requests_in_time).unless(why.clone()),
        case("a_refused_blob_leaves_working_imports_alone", a_refused_blob_leaves_working_imports_alone).unless(why.clone()),
        case("a_stalled_peer_holds_the_slot_and_closes_the_import", a_stalled_peer_holds_the_slot_and_closes_the_import)
            .unless(why.clone()),
        case("held_slots_never_take_the_whole_ring", held_slots_never_take_the_whole_ring).unless(why.clone()),
        case("a_read_from_a_replaced_import_ends_at_once", a_read_from_a_replaced_import_ends_at_once).unless(why.clone()),
        case("a_read_from_a_killed_peer_holds_its_slot", a_read_from_a_killed_peer_holds_its_slot).unless(why.clone()),
        case("a_timed_out_read_keeps_its_local_layout", a_timed_out_read_keeps_its_local_layout).unless(why.clone()),
        case("a_program_that_used_remote_layouts_exits_0", a_program_that_used_remote_layouts_exits_0).unless(why.clone()),
        case("duplicate_and_crossed_exports_end", duplicate_and_crossed_exports_end).unless(why.clone()),
        case("without_nixl_export_and_import_are_unsupported", without_nixl_export_and_import_are_unsupported)
            .unless(why.is_none().then(|| "NIXL is on the library path; this case checks the refusal without it".to_string())),
    ])
}
