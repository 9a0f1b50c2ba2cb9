//! Random bytes through every (source, destination) storage pair and layout kind,
//! with layer ranges and geometries that are not multiples of 4096.

mod common;
use common::*;
use kvxfer::{DiskFlags, LayoutKind, Status, StorageKind, TransferOptions};

/// Mixed runs: consecutive ids (coalesced), a gap, and out-of-order blocks.
const PAIRS: [(u64, u64); 6] = [(0, 2), (1, 3), (2, 4), (5, 0), (7, 7), (3, 6)];

fn run_matrix(c: &kvxfer::LayoutConfig, layers: std::ops::Range<u32>) {
    let e = engine();
    let (sb, db): (Vec<u64>, Vec<u64>) = PAIRS.iter().copied().unzip();
    let opts = TransferOptions { layer_begin: layers.start, layer_end: layers.end, ..Default::default() };
    let layer_range = layers.start as u64..if layers.end == 0 { c.num_layers } else { layers.end as u64 };
    for src_storage in STORAGES {
        for dst_storage in STORAGES {
            for sk in KINDS {
                for dk in KINDS {
                    // Disk layouts have one kind; skip the duplicates.
                    if (src_storage == StorageKind::Disk && sk != LayoutKind::FullyContiguous)
                        || (dst_storage == StorageKind::Disk && dk != LayoutKind::FullyContiguous)
                    {
                        continue;
                    }
                    let what = format!("{src_storage:?}/{sk:?} → {dst_storage:?}/{dk:?} layers {layers:?}");
                    let src = make_layout(&e, c, sk, src_storage);
                    let dst = make_layout(&e, c, dk, dst_storage);
                    fill(&src, 11);
                    fill(&dst, 22);
                    assert_eq!(transfer(&e, &src, &sb, &dst, &db, &opts), Status::Ok, "{what}");
                    check(&dst, 22, 11, &PAIRS, layer_range.clone(), &what);
                }
            }
        }
    }
    let s = e.stats();
    assert_eq!(s.requests_failed, 0);
    assert!(s.bytes_disk_read > 0 && s.bytes_disk_written > 0 && s.bytes_host_to_device > 0 && s.bytes_device_to_host > 0);
}

#[test]
fn every_storage_pair_and_kind_round_trips_all_layers() {
    // 8 KiB regions: aligned, and larger blocks than a slot (64 KiB) in total.
    run_matrix(&cfg(8, 3, 2, 16, 128, 2), 0..0);
}

#[test]
fn layer_ranges_move_only_their_layers() {
    run_matrix(&cfg(8, 4, 2, 16, 128, 2), 1..3);
}

#[test]
fn unaligned_geometry_round_trips_with_and_without_layer_ranges() {
    // 30-byte regions and 540-byte blocks: nothing is a multiple of 4096, so disk writes
    // of partial blocks take the buffered path and reads are widened to alignment.
    run_matrix(&cfg(8, 9, 2, 3, 5, 2), 0..0);
    run_matrix(&cfg(8, 9, 2, 3, 5, 2), 2..7);
    // MLA (outer_dim 1), odd dtype, regions larger than a slot.
    run_matrix(&cfg(8, 2, 1, 7, 3001, 5), 0..1);
}

/// Scattered small regions of pinned memory move without a CPU gather when the device
/// maps that memory (the emulated device does; so does CUDA pinned memory under unified
/// addressing): no host memcpy stage runs, and the bytes are exact both ways. Pageable
/// memory, which the device cannot reach, is still gathered on the CPU.
#[test]
fn scattered_pinned_regions_move_without_a_cpu_gather() {
    let e = engine();
    let c = cfg(64, 4, 2, 16, 128, 2); // 4 KiB regions
    let kind = LayoutKind::LayerSeparate { block_first: true };
    let ids: Vec<u64> = (0..32).map(|i| (i * 37 + 5) % 64).collect(); // 32 distinct, scattered
    let slots: Vec<u64> = (0..32).collect();
    let pairs: Vec<(u64, u64)> = ids.iter().copied().zip(slots.iter().copied()).collect();
    let host = make_layout(&e, &c, kind, StorageKind::Pinned);
    let dev = make_layout(&e, &c, kind, StorageKind::Device);
    let back = make_layout(&e, &c, kind, StorageKind::Pinned);
    fill(&host, 1);
    fill(&dev, 2);
    fill(&back, 3);
    assert_eq!(transfer(&e, &host, &ids, &dev, &slots, &Default::default()), Status::Ok);
    check(&dev, 2, 1, &pairs, 0..4, "pinned → device");
    assert_eq!(transfer(&e, &dev, &slots, &back, &ids, &Default::default()), Status::Ok);
    check(&back, 3, 1, &ids.iter().map(|&b| (b, b)).collect::<Vec<_>>(), 0..4, "device → pinned");
    assert_eq!(e.stats().host_copy_ns, 0, "a scattered pinned transfer ran a host memcpy stage (a CPU gather)");
    let pageable = make_layout(&e, &c, kind, StorageKind::Host);
    fill(&pageable, 4);
    assert_eq!(transfer(&e, &pageable, &ids, &dev, &slots, &Default::default()), Status::Ok);
    check(&dev, 2, 4, &pairs, 0..4, "pageable → device");
    assert!(e.stats().host_copy_ns > 0, "pageable memory goes through the slots");
}

/// A read in a shallow ring (one block, one layer, a request's first chunks) is shared
/// by every I/O worker (`engine::fanout`): every byte lands, for O_DIRECT and buffered files, whole blocks
/// (one extent cut in parts) and one layer of scattered blocks (many extents), with
/// regions that are not multiples of 4096 (reads widened to alignment) too.
#[test]
fn reads_shared_in_a_shallow_ring_land_every_byte() {
    let e = engine_with(|c| {
        c.io_threads = 4;
        c.slot_bytes = 1 << 20;
        c.bounce_bytes = 4 << 20;
    });
    // 1 MiB blocks of 128 KiB regions; 4 layers of 7 x 3001 x 5 B regions (odd sizes).
    for c in [cfg(8, 4, 2, 16, 2048, 2), cfg(8, 4, 2, 7, 3001, 5)] {
        for flags in [DiskFlags::CREATE, DiskFlags::CREATE | DiskFlags::BUFFERED] {
            let disk = e.create_disk_layout(&c, &temp_path("shared"), flags).unwrap();
            let host = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Host);
            let all: Vec<u64> = (0..c.num_blocks).collect();
            fill(&host, 31);
            assert_eq!(transfer(&e, &host, &all, &disk, &all, &Default::default()), Status::Ok);
            let dev = make_layout(&e, &c, LayoutKind::LayerSeparate { block_first: true }, StorageKind::Device);
            fill(&dev, 32);
            let before = e.stats().reads_fanned_out;
            // One block at a time, each from another block, and then layer 2 of every block.
            let pairs: Vec<(u64, u64)> = (0..c.num_blocks).map(|b| (b, (b * 3 + 1) % c.num_blocks)).collect();
            for &(s, d) in &pairs {
                assert_eq!(transfer(&e, &disk, &[s], &dev, &[d], &Default::default()), Status::Ok);
            }
            let what = format!("{c:?} {flags:?}");
            check(&dev, 32, 31, &pairs, 0..c.num_layers, &what);
            assert!(e.stats().reads_fanned_out > before, "{what}: no block's read was shared, so this test checked nothing new");
            // Layer 2 of three scattered blocks: one chunk of many extents.
            let layer2 = TransferOptions { layer_begin: 2, layer_end: 3, ..Default::default() };
            let three = [6, 1, 4];
            fill(&dev, 33);
            let before = e.stats().reads_fanned_out;
            assert_eq!(transfer(&e, &disk, &three, &dev, &three, &layer2), Status::Ok);
            let same: Vec<(u64, u64)> = three.iter().map(|&b| (b, b)).collect();
            check(&dev, 33, 31, &same, 2..3, &format!("{what}, layer 2"));
            assert!(e.stats().reads_fanned_out > before, "{what}: the layer's read was not shared");
            // Every block: more chunks than slots. The first ones find the ring idle, so
            // their reads are cut too, and parts of several chunks are in flight at once.
            fill(&dev, 34);
            let before = e.stats().reads_fanned_out;
            assert_eq!(transfer(&e, &disk, &all, &dev, &all, &Default::default()), Status::Ok);
            let same: Vec<(u64, u64)> = all.iter().map(|&b| (b, b)).collect();
            check(&dev, 34, 31, &same, 0..c.num_layers, &format!("{what}, every block"));
            assert!(e.stats().reads_fanned_out >= before + 2, "{what}: the first chunks of a request of many chunks were not cut in parts");
        }
    }
}
