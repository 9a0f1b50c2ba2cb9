//! kvxfer moves LLM KV-cache blocks between GPU memory, host memory and disk, through a
//! pipelined ring of pinned bounce slots, behind a stable C ABI (`include/kvxfer.h`).
//!
//! Module map (dependencies point downward; `layering` below enforces it):
//! - [`ffi`]: the C ABI only — handles, C codes, panic boundary, dlopen table.
//! - [`store`]: a KV tier keyed by the runtime's block keys, over the engine's transfers.
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
pub mod shared;
pub mod store;

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
        ("store", &["shared", "engine", "memory", "file", "layout", "host", "fault", "error"]),
        ("shared", &["layout", "error"]),
        ("engine", &["memory", "remote", "file", "io", "gpu", "layout", "host", "error"]),
        ("memory", &["remote", "file", "gpu", "layout", "host", "error"]),
        ("remote", &["io", "gpu", "layout", "error"]),
        ("file", &["io", "gpu", "layout", "host", "fault", "error"]),
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

    /// Inside the engine, arrows run worker (the threads) → router (where a chunk goes
    /// next) → fanout (cutting a read) → chunk: a file never names a module before it in
    /// this order, so the stage files cannot import each other in a circle.
    const ENGINE_ORDER: &[&str] = &["worker", "router", "fanout", "chunk"];

    /// The words of `names` that `text` uses as a path: next to `::`, or in a `use`.
    fn paths_naming(text: &str, names: &[&str]) -> Vec<String> {
        let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        let mut uses: Vec<std::ops::Range<usize>> = Vec::new();
        let mut at = 0;
        for line in text.split_inclusive('\n') {
            let code = line.trim_start();
            if ["use ", "pub use ", "pub(super) use ", "pub(crate) use "].iter().any(|p| code.starts_with(p)) {
                let start = at + line.len() - code.len();
                uses.push(start..start + text[start..].find(';').unwrap_or(text.len() - start));
            }
            at += line.len();
        }
        let mut found = Vec::new();
        for name in names {
            for (i, _) in text.match_indices(name) {
                let (before, after) = (&text[..i], &text[i + name.len()..]);
                if before.ends_with(is_ident) || after.starts_with(is_ident) {
                    continue;
                }
                let in_use = uses.iter().any(|u| u.contains(&i));
                if in_use || before.trim_end_matches([' ', '{']).ends_with("::") || after.starts_with("::") {
                    found.push(name.to_string());
                }
            }
        }
        found
    }

    #[test]
    fn engine_stage_files_import_one_way() {
        let engine = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine");
        let mut wrong = Vec::new();
        for (i, module) in ENGINE_ORDER.iter().enumerate() {
            let text = std::fs::read_to_string(engine.join(format!("{module}.rs"))).unwrap();
            for name in paths_naming(&text, &ENGINE_ORDER[..i]) {
                wrong.push(format!("engine/{module}.rs names {name}"));
            }
        }
        assert!(wrong.is_empty(), "arrows inside the engine must run {}:\n{}", ENGINE_ORDER.join(" → "), wrong.join("\n"));
    }

    #[test]
    fn a_path_to_a_module_is_seen_however_it_is_written() {
        for text in [
            "use super::worker::Job;",
            "use super::{chunk::Chunk, router};",
            "super::router::issue_copy(r)",
            "use super::{\n    worker,\n};",
            "x = router::f();",
            "pub(super) use super::worker as w;",
        ] {
            assert!(!paths_naming(text, &["worker", "router"]).is_empty(), "{text}");
        }
        for text in [
            "use super::chunk::Chunk;\nfn f(router: &Router) { router.advance(c) } // an I/O worker",
            "Router::read_done",
            "io_worker(r)",
            "// because the worker, a router;",
        ] {
            assert!(paths_naming(text, &["worker", "router"]).is_empty(), "{text}");
        }
    }
}
