//! An idle engine uses no CPU: its threads may look for work for a moment after a
//! request (so back-to-back requests find them awake), then sleep. Its own test binary,
//! so no other test's engine runs beside it.

mod common;

use common::*;
use kvxfer::{LayoutKind, Status, StorageKind};
use std::time::Duration;

/// CPU time (user + system, in clock ticks) of this process's threads named kvx-*.
fn engine_ticks() -> u64 {
    let mut ticks = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let Ok(stat) = std::fs::read_to_string(task.unwrap().path().join("stat")) else { continue };
        // pid (comm) state ... field 14 utime, 15 stime; comm may hold spaces, so split after ')'.
        let (head, rest) = stat.rsplit_once(')').unwrap();
        if !head.contains("(kvx-") {
            continue;
        }
        let f: Vec<&str> = rest.split_whitespace().collect();
        ticks += f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    }
    ticks
}

#[test]
fn an_idle_engine_uses_no_cpu() {
    let e = engine();
    let c = cfg(16, 2, 2, 16, 64, 2);
    let src = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Pinned);
    let dst = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Device);
    let ids: Vec<u64> = (0..16).collect();
    for _ in 0..200 {
        assert_eq!(transfer(&e, &src, &ids[..2], &dst, &ids[..2], &Default::default()), Status::Ok);
    }
    std::thread::sleep(Duration::from_millis(100));
    let before = engine_ticks();
    std::thread::sleep(Duration::from_secs(1));
    let used = engine_ticks() - before;
    // A tick is 10 ms: 1 s idle may show a stray tick of timer accounting, never more.
    assert!(used <= 1, "the idle engine's threads used {used} ticks of CPU in 1 s");
}
