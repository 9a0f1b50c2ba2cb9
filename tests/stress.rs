//! Threads submitting mixed requests at once (every storage pair, random ids and layer
//! ranges, cancels, timeouts of 0, handles dropped before completion), then the engine
//! dropped with requests in flight. Counts come from `KVX_STRESS` ("threads x requests",
//! default 8x200) so the same test runs small under ThreadSanitizer (`make tsan`).

mod common;
use common::*;
use kvxfer::{LayoutKind, Status, StorageKind, TransferOptions};
use std::sync::Arc;
use std::time::Duration;

#[test]
fn threads_hammering_one_engine_end_every_request() {
    let (threads, requests) = std::env::var("KVX_STRESS")
        .ok()
        .and_then(|v| v.split_once('x').and_then(|(t, r)| Some((t.parse().ok()?, r.parse().ok()?))))
        .unwrap_or((8u64, 200u64));
    let e = Arc::new(engine_with(|c| c.max_inflight = 16));
    let c = cfg(threads * 4, 4, 2, 8, 100, 2);
    let layouts = [
        make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Pinned),
        make_layout(&e, &c, LayoutKind::LayerSeparate { block_first: true }, StorageKind::Host),
        make_layout(&e, &c, LayoutKind::LayerSeparate { block_first: false }, StorageKind::Device),
        make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Disk),
    ];
    let leftovers = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (e, layouts) = (e.clone(), layouts.clone());
                s.spawn(move || {
                    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ t;
                    let mut rnd = move |n: u64| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x % n
                    };
                    let mine: Vec<u64> = (t * 4..t * 4 + 4).collect();
                    for _ in 0..requests {
                        let (a, b) = (rnd(4) as usize, rnd(3) as usize);
                        let (src, dst) = (&layouts[a], &layouts[(a + 1 + b) % 4]);
                        let n = 1 + rnd(4) as usize;
                        let mut dst_ids = mine.clone();
                        dst_ids.rotate_left(rnd(4) as usize);
                        let opts = if rnd(3) == 0 {
                            TransferOptions { layer_begin: 1, layer_end: 3, ..Default::default() }
                        } else {
                            Default::default()
                        };
                        let r = match e.submit(src, &mine[..n], dst, &dst_ids[..n], &opts) {
                            Ok(r) => r,
                            Err(err) if err.status == Status::Busy => continue,
                            Err(err) => panic!("{err}"),
                        };
                        match rnd(4) {
                            0 => {
                                r.cancel();
                                let s = r.wait(None);
                                assert!(s == Status::Ok || s == Status::Cancelled, "{s:?}");
                            }
                            1 => {
                                while r.wait(Some(Duration::ZERO)) == Status::Timeout {
                                    std::thread::yield_now()
                                }
                            }
                            _ => assert_eq!(r.wait(None), Status::Ok),
                        }
                    }
                    // One more, left running for the engine's drop.
                    e.submit(&layouts[0], &mine[..1], &layouts[2], &mine[..1], &Default::default()).ok()
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    drop(layouts);
    drop(Arc::try_unwrap(e).ok().expect("threads are done"));
    for r in leftovers {
        let s = r.poll();
        assert!(s == Status::Ok || s == Status::Cancelled, "{s:?} after the engine was dropped");
    }
}
