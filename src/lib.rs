//! kvxfer moves LLM KV-cache blocks between GPU memory, host memory and disk, through a
//! pipelined ring of pinned bounce slots, behind a stable C ABI (`include/kvxfer.h`).
//!
//! Module map (dependencies point downward; `layering` below enforces it):
//! - [`ffi`]: the C ABI only — handles, C codes, panic boundary, dlopen table.
//! - [`engine`]: Engine, request queue, planner, bounce ring, stage threads, completion.
//! - [`memory`]: layouts over device, pinned, host, disk and mapped storage.
//! - [`file`](mod@file): a disk layout's file, its checksum sidecar, a mapped file.
//! - [`io`]: disk I/O ports.
//! - [`gpu`]: the device behind a trait: CUDA, or the emulated device.
//! - [`layout`], [`host`], [`fault`], [`error`]: block math, host memory, test faults, statuses.

pub mod engine;
pub mod error;
pub mod fault;
pub mod ffi;
pub mod file;
pub mod gpu;
pub mod host;
pub mod io;
pub mod layout;
pub mod memory;
pub mod remote;

pub use engine::{Engine, EngineConfig, IoBackend, OnComplete, Request, Stats, TransferOptions};
pub use error::{Error, Result, Status};
pub use file::DiskFlags;
pub use gpu::Device;
pub use layout::{LayoutConfig, LayoutKind};
pub use memory::{Layout, StorageKind};

/// The module map of `docs/architecture.md#module-map`, enforced: each module names only
/// the modules it may import (`crate::x` anywhere in its files), so no cycle or C type
/// creeps below `ffi`.
#[cfg(test)]
mod layering {
    const ALLOWED: &[(&str, &[&str])] = &[
        ("engine", &["memory", "remote", "file", "io", "gpu", "layout", "host", "error"]),
        ("memory", &["remote", "file", "gpu", "layout", "host", "error"]),
        ("remote", &["io", "gpu", "layout", "error"]),
        ("file", &["io", "gpu", "layout", "host", "error"]),
        ("io", &["gpu", "host", "fault", "error"]),
        ("gpu", &["host", "fault", "error"]),
        ("layout.rs", &["error"]),
        ("host.rs", &["error"]),
        ("fault.rs", &["error"]),
        ("error.rs", &[]),
    ];

    fn files(p: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        if p.is_dir() {
            for e in std::fs::read_dir(p).unwrap() {
                files(&e.unwrap().path(), out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p.to_path_buf());
        }
    }

    #[test]
    fn modules_import_only_what_the_readme_allows() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut wrong = Vec::new();
        for (module, allowed) in ALLOWED {
            let own = module.trim_end_matches(".rs");
            let mut fs = Vec::new();
            files(&src.join(module), &mut fs);
            assert!(!fs.is_empty(), "src/{module} not found");
            for f in fs {
                let text = std::fs::read_to_string(&f).unwrap();
                for (i, _) in text.match_indices("crate::") {
                    let name: String = text[i + 7..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    if name != own && !allowed.contains(&name.as_str()) {
                        wrong.push(format!("{} imports crate::{name}", f.strip_prefix(&src).unwrap().display()));
                    }
                }
            }
        }
        assert!(wrong.is_empty(), "imports docs/architecture.md's module map does not allow:\n{}", wrong.join("\n"));
    }
}
