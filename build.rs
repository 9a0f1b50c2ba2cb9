//! Generates the C header from `src/ffi` with cbindgen into OUT_DIR. The committed
//! `include/kvxfer.h` is compared with it by a test (so drift fails `make test`);
//! `KVX_WRITE_HEADER=1 cargo build` (what `make header` runs) rewrites the committed one.

use std::path::PathBuf;

fn main() {
    let crate_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("kvxfer.h");
    println!("cargo:rerun-if-changed=src/ffi");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-env-changed=KVX_WRITE_HEADER");
    // The ABI's major.minor is the crate's version's (Cargo.toml); a test checks
    // src/ffi/types.rs against it. The shared library is versioned by ABI major
    // (binaries record libkvxfer.so.1).
    let abi_major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap();
    let abi_minor = std::env::var("CARGO_PKG_VERSION_MINOR").unwrap();
    println!("cargo:rustc-env=KVX_CARGO_ABI_MAJOR={abi_major}");
    println!("cargo:rustc-env=KVX_CARGO_ABI_MINOR={abi_minor}");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libkvxfer.so.{abi_major}");
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/ffi/types.rs"))
        .with_src(crate_dir.join("src/ffi/engine.rs"))
        .with_src(crate_dir.join("src/ffi/layout.rs"))
        .with_src(crate_dir.join("src/ffi/transfer.rs"))
        .with_src(crate_dir.join("src/ffi/logger.rs"))
        .with_src(crate_dir.join("src/ffi/remote.rs"))
        .with_src(crate_dir.join("src/ffi/store.rs"))
        .with_src(crate_dir.join("src/ffi/slots.rs"))
        .with_src(crate_dir.join("src/ffi/api.rs"))
        .generate()
        .expect("cbindgen could not generate the header");
    bindings.write_to_file(&out);
    if std::env::var_os("KVX_WRITE_HEADER").is_some() {
        std::fs::copy(&out, crate_dir.join("include/kvxfer.h")).expect("writing include/kvxfer.h");
    }
}
