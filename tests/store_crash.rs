//! Crash torture of the store: a child process runs random puts, gets and removes of keys
//! whose bytes derive from the key, on a store kept near capacity, and logs each
//! acknowledged put, eviction and removal; this process SIGKILLs it at a random instant,
//! reopens the store and checks it against the log. Rounds alternate between a plain kill
//! (the page cache keeps every write) and a power cut (`fault::power_cut`: the child
//! journals what undoes its writes, and this process undoes every one no sync made
//! durable before reopening). Each mode has a store of its own:
//!
//! - after any kill, and after a power cut in durable mode: every acknowledged put not
//!   since removed or evicted is found, and no removed or evicted key comes back;
//! - after a power cut without `DURABLE`: the store opens (acknowledged puts and removals
//!   since the last sync may be undone, and a key whose record the cut kept and not all
//!   its block's bytes is a miss, `Integrity`);
//! - always: every hit holds exactly its key's bytes.
//!
//! Half the power cuts undo every unsynced write; the others keep a random part of them,
//! as the kernel's writeback may have written them before the cut.
//!
//! The rounds that cut run on the POSIX backend, whose writes the journal covers.
//! `KVX_STORE_CRASH_ROUNDS` sets the rounds per mode (40 by default, half of each kind),
//! `KVX_STORE_CRASH_SEED` replays a run (the seed is printed).

mod common;
use common::*;
use kvxfer::fault::power_cut;
use kvxfer::store::{Store, StoreConfig, StoreFlags};
use kvxfer::{Engine, IoBackend, LayoutConfig, LayoutKind, Status, StorageKind};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEYS: u64 = 72;
const CAPACITY: u64 = 24;

fn block(n: u64) -> LayoutConfig {
    cfg(n, 2, 2, 4, 64, 2)
}

/// Page-cache I/O in two rounds of four, direct I/O in the other two: each kind of round
/// (`power_cut_round`) runs both.
fn store_cfg(durable: bool, round: u64) -> StoreConfig {
    let mut flags = StoreFlags::CREATE;
    if durable {
        flags = flags | StoreFlags::DURABLE;
    }
    if round % 4 < 2 {
        flags = flags | StoreFlags::BUFFERED;
    }
    StoreConfig { shards: 3, flags, ..StoreConfig::new(block(0), CAPACITY, b"crash torture") }
}

/// Even rounds cut the power, odd ones only kill.
fn power_cut_round(round: u64) -> bool {
    round % 2 == 0
}

/// Every other pair of cuts keeps a random part of what was not synced.
fn writeback_round(round: u64) -> bool {
    power_cut_round(round) && round % 8 >= 4
}

/// An engine whose disk writes all go by `pwrite`, which the power-cut journal covers.
fn posix_engine() -> Engine {
    engine_with(|c| c.io_backend = IoBackend::Posix)
}

/// Keys of 6 to 40 bytes.
fn key(i: u64) -> Vec<u8> {
    format!("k{i}-{}", "x".repeat((i * 7 % 35) as usize)).into_bytes()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    /// 1 to `max` distinct key numbers.
    fn keys(&mut self, max: u64) -> Vec<u64> {
        let mut v: Vec<u64> = Vec::new();
        for _ in 0..1 + self.next(max) {
            let k = self.next(KEYS);
            if !v.contains(&k) {
                v.push(k);
            }
        }
        v
    }
}

/// Appends whole lines to the log, one `write` each, so a kill leaves whole lines (and
/// at most a cut last one, which the reader drops).
struct Log(std::fs::File);

impl Log {
    fn line(&mut self, s: String) {
        self.0.write_all(format!("{s}\n").as_bytes()).unwrap();
    }
}

fn join(v: &[u64]) -> String {
    v.iter().map(|k| k.to_string()).collect::<Vec<_>>().join(" ")
}

/// The process the torture kills: random operations until it is killed.
#[test]
#[ignore = "run by the crash tortures in a child process"]
fn crash_child() {
    let env = |v: &str| std::env::var(v).unwrap_or_else(|_| panic!("{v}: run by the crash torture"));
    let dir = PathBuf::from(env("KVX_STORE_CRASH_DIR"));
    let round: u64 = env("KVX_STORE_CRASH_ROUND").parse().unwrap();
    let durable = env("KVX_STORE_CRASH_DURABLE") == "1";
    let mut rng = Rng(env("KVX_STORE_CRASH_CHILD_SEED").parse::<u64>().unwrap() | 1);
    let mut log = Log(std::fs::OpenOptions::new().append(true).create(true).open(env("KVX_STORE_CRASH_LOG")).unwrap());
    let e = Arc::new(match power_cut_round(round) {
        true => {
            power_cut::record(Path::new(&env("KVX_STORE_CRASH_JOURNAL")), &dir).unwrap();
            posix_engine()
        }
        false => engine(),
    });
    let s = Store::open(&e, &dir, &store_cfg(durable, round)).unwrap();
    let host = e.create_layout(&block(4), LayoutKind::LayerSeparate { block_first: false }, StorageKind::Host).unwrap();
    let dst = e.create_layout(&block(4), LayoutKind::FullyContiguous, StorageKind::Pinned).unwrap();
    // What this process knows is held: from the store itself at start, then its own acks.
    let all: Vec<Vec<u8>> = (0..KEYS).map(key).collect();
    let mut live: HashSet<u64> = s.lookup(&all, false).unwrap().0.iter().enumerate().filter(|p| *p.1).map(|p| p.0 as u64).collect();
    log.line("ready".into());
    loop {
        match rng.next(20) {
            0..=8 => {
                let ks = rng.keys(4);
                let keys: Vec<Vec<u8>> = ks.iter().map(|&k| key(k)).collect();
                for (i, k) in keys.iter().enumerate() {
                    fill_block_for_key(&host, i as u64, k);
                }
                log.line(format!("B {}", join(&ks)));
                let ids: Vec<u64> = (0..ks.len() as u64).collect();
                let r = s.put(&host, &ids, &keys, &Default::default()).unwrap();
                r.wait(None);
                // The put's evictions are recorded once it is done (in durable mode the
                // store thread syncs their tombstones before its writes start): whatever it
                // took is gone by now.
                let before: Vec<u64> = live.iter().copied().collect();
                let present = match before.is_empty() {
                    true => Vec::new(),
                    false => s.lookup(&before.iter().map(|&k| key(k)).collect::<Vec<_>>(), false).unwrap().0,
                };
                for (k, p) in before.iter().zip(present) {
                    if !p {
                        log.line(format!("E {k}"));
                        live.remove(k);
                    }
                }
                log.line("D".into());
                for (i, &k) in ks.iter().enumerate() {
                    match r.key_status(i).unwrap() {
                        Status::Ok => {
                            log.line(format!("P {k}"));
                            live.insert(k);
                        }
                        Status::Busy => {}
                        other => panic!("put of key {k}: {other:?}: {}", r.key_message(i)),
                    }
                }
            }
            9..=15 => {
                let ks = rng.keys(4);
                let keys: Vec<Vec<u8>> = ks.iter().map(|&k| key(k)).collect();
                let ids: Vec<u64> = (0..ks.len() as u64).collect();
                let r = s.get(&keys, &dst, &ids, &Default::default()).unwrap();
                r.wait(None);
                for (i, &k) in ks.iter().enumerate() {
                    match r.key_status(i).unwrap() {
                        Status::Ok if holds_key(&dst, i as u64, &keys[i]) => {}
                        Status::Ok => log.line(format!("WRONG {k}")),
                        Status::NotFound if !live.contains(&k) => {}
                        other => log.line(format!("BAD {k} {other:?} {}", r.key_message(i))),
                    }
                }
            }
            _ => {
                let ks = rng.keys(2);
                log.line(format!("r {}", join(&ks)));
                let st = s.remove(&ks.iter().map(|&k| key(k)).collect::<Vec<_>>()).unwrap();
                for (&k, st) in ks.iter().zip(st) {
                    assert!(st == Status::Ok || st == Status::NotFound, "remove of key {k}: {st:?}");
                    log.line(format!("R {k}"));
                    live.remove(&k);
                }
            }
        }
    }
}

/// What the log says of a key, so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Must {
    /// An acknowledged put since its last removal or eviction.
    Be,
    /// Removed or evicted (recorded) since its last acknowledged put.
    NotBe,
    /// A put or a removal of it was in flight: either is right.
    Either,
}

/// Reads the child's log into `model`; how many `Be` keys may be missing because a put's
/// evictions were under way at the kill.
fn apply_log(log: &str, model: &mut HashMap<u64, Must>, round: u64, seed: u64) -> usize {
    let mut lines: Vec<&str> = log.split('\n').collect();
    lines.pop(); // "" after the last newline, or a line the kill cut
    let (mut evicting, mut batch) = (0, Vec::new());
    for l in lines {
        let (op, rest) = l.split_once(' ').unwrap_or((l, ""));
        let keys = || rest.split(' ').map(|k| k.parse::<u64>().unwrap());
        match op {
            "ready" => {}
            "B" => {
                batch = keys().collect();
                evicting = batch.len();
                for k in keys() {
                    let m = model.entry(k).or_insert(Must::NotBe);
                    if *m != Must::Be {
                        *m = Must::Either;
                    }
                }
            }
            "E" => {
                // Evicted (its tombstone written), unless the put under way writes it again.
                let k = keys().next().unwrap();
                model.insert(k, if batch.contains(&k) { Must::Either } else { Must::NotBe });
            }
            "D" => evicting = 0,
            "P" => {
                model.insert(keys().next().unwrap(), Must::Be);
            }
            "r" => {
                for k in keys() {
                    model.insert(k, Must::Either);
                }
            }
            "R" => {
                model.insert(keys().next().unwrap(), Must::NotBe);
            }
            _ => panic!("round {round} (seed {seed}): the child reported: {l}"),
        }
    }
    evicting
}

/// A round: its store's mode, its number (which says its kind), the run's seed.
#[derive(Clone, Copy)]
struct Round {
    durable: bool,
    number: u64,
    seed: u64,
}

impl Round {
    fn cut(&self) -> bool {
        power_cut_round(self.number)
    }

    /// Whether the store must hold what the log says: after any kill, and after a power
    /// cut where every acknowledgement waited for its sync.
    fn strict(&self) -> bool {
        self.durable || !self.cut()
    }
}

impl std::fmt::Display for Round {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = if self.durable { "durable" } else { "not durable" };
        let kind = match (self.cut(), writeback_round(self.number)) {
            (false, _) => "kill",
            (true, false) => "power cut",
            (true, true) => "power cut, random writeback",
        };
        write!(f, "round {} ({mode}, {kind}; KVX_STORE_CRASH_SEED={})", self.number, self.seed)
    }
}

/// Reopens the store after a kill or a power cut and checks it against the model; then
/// the model is what was found.
fn check_store(e: &Arc<Engine>, dir: &Path, round: Round, model: &mut HashMap<u64, Must>, mut may_miss: usize) -> (u64, u64) {
    let s = Store::open(e, dir, &store_cfg(round.durable, round.number)).unwrap_or_else(|err| panic!("{round}: reopen: {err}"));
    let dst = e.create_layout(&block(KEYS), LayoutKind::FullyContiguous, StorageKind::Host).unwrap();
    let keys: Vec<Vec<u8>> = (0..KEYS).map(key).collect();
    let ids: Vec<u64> = (0..KEYS).collect();
    let r = s.get(&keys, &dst, &ids, &Default::default()).unwrap();
    r.wait(Some(Duration::from_secs(60)));
    let (mut found, mut required) = (0, 0);
    for k in 0..KEYS {
        let must = model.get(&k).copied().unwrap_or(Must::NotBe);
        let st = r.key_status(k as usize).unwrap();
        let what = format!("{round} key {k} ({must:?})");
        match st {
            Status::Ok => {
                assert!(holds_key(&dst, k, &keys[k as usize]), "{what}: a hit with wrong bytes");
                assert!(must != Must::NotBe || !round.strict(), "{what}: removed or evicted, and back");
                found += 1;
            }
            Status::NotFound if must == Must::Be && round.strict() => {
                assert!(may_miss > 0, "{what}: an acknowledged put is missing");
                may_miss -= 1;
            }
            Status::NotFound => {}
            // A block a cut kept its record of and not all its bytes: a miss, never them.
            Status::Integrity if !round.strict() => {}
            other => panic!("{what}: {other:?}: {}", r.key_message(k as usize)),
        }
        if must == Must::Be && round.strict() {
            required += 1;
        }
        model.insert(k, if st == Status::Ok { Must::Be } else { Must::NotBe });
    }
    let stats = s.stats();
    assert!(stats.entries <= CAPACITY, "{round}: {stats:?}");
    // Without `DURABLE`, a cut may keep a record and not its block's bytes: a miss.
    if round.strict() {
        assert_eq!(stats.integrity_failures, 0, "{round}: a record names a block it does not hold, or is damaged");
    }
    (found, required)
}

/// Runs the rounds of one mode on a store of its own.
fn torture(durable: bool) {
    let rounds: u64 = std::env::var("KVX_STORE_CRASH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(40);
    let seed: u64 = std::env::var("KVX_STORE_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64);
    let mode = if durable { "durable" } else { "not durable" };
    let _ = writeln!(std::io::stderr(), "store crash torture ({mode}): {rounds} rounds, KVX_STORE_CRASH_SEED={seed}");
    let mut rng = Rng(seed | 1);
    let dir = temp_dir("crash-store");
    // Beside the store, not in it: the journal is not one of its files.
    let (log_path, journal) = (dir.with_extension("log"), dir.with_extension("journal"));
    let e = Arc::new(engine());
    let mut model: HashMap<u64, Must> = HashMap::new();
    let (mut acks, mut checked, mut cuts) = (0usize, 0u64, power_cut::Cut::default());
    for number in 0..rounds {
        let round = Round { durable, number, seed };
        for p in [&log_path, &journal] {
            let _ = std::fs::remove_file(p);
        }
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            // Its panic, if any, on the stderr read below.
            .args(["--ignored", "--exact", "crash_child", "--test-threads", "1", "--nocapture"])
            .env("KVX_STORE_CRASH_DIR", &dir)
            .env("KVX_STORE_CRASH_ROUND", number.to_string())
            .env("KVX_STORE_CRASH_DURABLE", if durable { "1" } else { "0" })
            .env("KVX_STORE_CRASH_CHILD_SEED", rng.next(u64::MAX).to_string())
            .env("KVX_STORE_CRASH_LOG", &log_path)
            .env("KVX_STORE_CRASH_JOURNAL", &journal)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // A quarter of the rounds kill at any instant from the start, so as the child
        // makes or opens the store; the others once it is open. The wait for it is a
        // hang guard only: the child is ready within milliseconds.
        let started = Instant::now();
        let early = number % 8 < 2;
        while !early && !std::fs::read_to_string(&log_path).is_ok_and(|l| l.starts_with("ready\n")) {
            if let Some(status) = child.try_wait().unwrap() {
                let mut err = String::new();
                std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
                panic!("{round}: the child exited ({status}) before it was ready:\n{err}");
            }
            assert!(started.elapsed() < Duration::from_secs(60), "{round}: the child never got ready");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_micros(rng.next(if early { 150_000 } else { 60_000 })));
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        if status.code().is_some() {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
            panic!("{round}: the child stopped before the kill ({status}):\n{err}");
        }
        if round.cut() {
            let writeback = writeback_round(number).then(|| rng.next(u64::MAX));
            let cut = power_cut::cut(&journal, writeback).unwrap_or_else(|err| panic!("{round}: cutting the power: {err}"));
            cuts.writes += cut.writes;
            cuts.kept += cut.kept;
            cuts.removed += cut.removed;
            cuts.renames += cut.renames;
        }
        // None where the kill came before the child's first line.
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        acks += log.lines().filter(|l| l.starts_with("P ")).count();
        let may_miss = apply_log(&log, &mut model, number, seed);
        let (found, required) = check_store(&e, &dir, round, &mut model, may_miss);
        checked += required;
        if number < 3 || number + 1 == rounds {
            let _ = writeln!(std::io::stderr(), "{round}: {} log lines, {found} keys found, {required} required", log.lines().count());
        }
    }
    let _ = writeln!(
        std::io::stderr(),
        "store crash torture ({mode}): {rounds} rounds ({} kills, {} power cuts undoing {} writes (keeping {}), {} creations, {} renames), {acks} acknowledged puts, {checked} required keys checked, 0 wrong bytes, 0 stores that failed to open",
        rounds / 2,
        rounds - rounds / 2,
        cuts.writes,
        cuts.kept,
        cuts.removed,
        cuts.renames
    );
    assert!(acks > 0, "the child never acknowledged a put");
    assert!(cuts.writes > 0 || rounds < 2, "no power cut undid a write: the journal covers nothing");
    for p in [&log_path, &journal] {
        let _ = std::fs::remove_file(p);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_durable_store_keeps_every_acknowledged_put_and_removal_through_kills_and_power_cuts() {
    torture(true);
}

#[test]
fn a_store_without_durable_keeps_its_acknowledged_puts_through_kills_and_opens_after_power_cuts() {
    torture(false);
}

/// A power cut at any point of a store's making, in either mode, leaves a directory that
/// opens, holding either no store (made again) or a whole one: what `meta` says exists
/// (the shards' sizes and sidecar headers, every file's name) was synced before it.
#[test]
fn a_store_opens_after_a_power_cut_at_any_point_of_its_making() {
    let e = Arc::new(posix_engine());
    for durable in [false, true] {
        let cfg = store_cfg(durable, 0);
        let mut made = 0;
        loop {
            let dir = temp_dir("cut-making");
            let journal = dir.with_extension("journal");
            power_cut::record(&journal, &dir).unwrap();
            let opened = Store::open(&e, &dir, &cfg);
            power_cut::stop();
            drop(opened.unwrap());
            let cut = power_cut::cut_after(&journal, made).unwrap();
            let what = format!("durable {durable}, a power cut after {made} of the {} changes and syncs of its making", cut.entries);
            let s = Store::open(&e, &dir, &cfg).unwrap_or_else(|err| panic!("{what}: {err}"));
            assert_eq!(s.stats().integrity_failures, 0, "{what}");
            drop(s);
            let _ = std::fs::remove_file(&journal);
            let _ = std::fs::remove_dir_all(&dir);
            if made >= cut.entries {
                break;
            }
            made += 1;
        }
    }
}
