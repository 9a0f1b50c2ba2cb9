//! The C ABI (`docs/c-api.md`): opaque handles, status codes, the panic boundary, thread-local
//! error messages, versioned structs and the dlopen table. Nothing below this module
//! knows about C; nothing here does real work.

#![allow(non_camel_case_types)]
// The pointer contract of every `unsafe extern "C"` function is the C one, written once
// in the header's conventions and per declaration, not repeated as `# Safety` sections.
#![allow(clippy::missing_safety_doc)]
// `kvx_transfer_submit`'s arguments are the C API's, fixed by the ABI.
#![allow(clippy::too_many_arguments)]

pub mod api;
pub mod boundary;
pub mod convert;
pub mod engine;
pub mod handle;
pub mod layout;
pub mod logger;
pub mod remote;
pub mod slots;
pub mod store;
pub mod transfer;
pub mod types;

pub use types::*;

#[cfg(test)]
mod tests {
    #[test]
    fn committed_header_matches_the_rust_code() {
        let fresh = include_str!(concat!(env!("OUT_DIR"), "/kvxfer.h"));
        let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/kvxfer.h")).unwrap();
        assert!(fresh == committed, "include/kvxfer.h differs from src/ffi; run `make header` and commit it");
    }

    #[test]
    fn abi_version_is_the_crate_versions_major_and_minor() {
        let crate_abi = (env!("KVX_CARGO_ABI_MAJOR").parse::<u32>().unwrap(), env!("KVX_CARGO_ABI_MINOR").parse::<u32>().unwrap());
        assert_eq!(
            crate_abi,
            (super::types::KVX_ABI_MAJOR, super::types::KVX_ABI_MINOR),
            "Cargo.toml's version {} and the ABI (src/ffi/types.rs) differ in major.minor: bump them together",
            env!("CARGO_PKG_VERSION")
        );
    }

    #[test]
    fn status_constants_match_the_rust_statuses() {
        use super::types::*;
        use crate::error::Status;
        let c = [
            KVX_OK,
            KVX_PENDING,
            KVX_ERR_INVALID_ARG,
            KVX_ERR_OUT_OF_RANGE,
            KVX_ERR_INCOMPATIBLE,
            KVX_ERR_UNSUPPORTED,
            KVX_ERR_NO_DEVICE,
            KVX_ERR_CUDA,
            KVX_ERR_IO,
            KVX_ERR_NO_MEMORY,
            KVX_ERR_TIMEOUT,
            KVX_ERR_CANCELLED,
            KVX_ERR_SHUTDOWN,
            KVX_ERR_BUSY,
            KVX_ERR_INTEGRITY,
            KVX_ERR_VERSION,
            KVX_ERR_INTERNAL,
            KVX_ERR_REMOTE,
            KVX_ERR_NOT_FOUND,
        ];
        assert_eq!(c.len(), Status::ALL.len(), "every status has its KVX_ constant");
        for (s, code) in Status::ALL.iter().zip(c) {
            assert_eq!(s.code(), code, "{}", s.name());
        }
    }
}
