//! Versioning, status names and the dlopen entry point: `kvx_get_api` returns a static,
//! append-only table of every function, so a plugin host resolves one symbol.

use super::boundary::*;
use super::engine::*;
use super::layout::*;
use super::logger::*;
use super::remote::*;
use super::slots::*;
use super::store::*;
use super::transfer::*;
use super::types::*;
use crate::error::Status;
use std::ffi::{c_char, c_void, CString};
use std::sync::LazyLock;

/// `(KVX_ABI_MAJOR << 16) | KVX_ABI_MINOR` of the loaded library.
#[no_mangle]
pub extern "C" fn kvx_abi_version() -> u32 {
    (KVX_ABI_MAJOR << 16) | KVX_ABI_MINOR
}

/// e.g. "kvxfer 1.4.0 abi 1.4 (cuda: driver 13.0)" or "... (cuda: none)". Static; never NULL.
#[no_mangle]
pub extern "C" fn kvx_version_string() -> *const c_char {
    static S: LazyLock<CString> = LazyLock::new(|| {
        let cuda = crate::gpu::cuda::driver_version().map_or("none".to_string(), |v| format!("driver {v}"));
        CString::new(format!("kvxfer {} abi {KVX_ABI_MAJOR}.{KVX_ABI_MINOR} (cuda: {cuda})", env!("CARGO_PKG_VERSION"))).unwrap()
    });
    // The first call builds the string (asking the CUDA driver): inside the boundary.
    infallible(c"kvxfer".as_ptr(), || S.as_ptr())
}

/// The constant's name ("KVX_ERR_IO"), or "KVX_UNKNOWN_STATUS". Static; never NULL.
#[no_mangle]
pub extern "C" fn kvx_status_str(s: kvx_status) -> *const c_char {
    static NAMES: LazyLock<Vec<CString>> = LazyLock::new(|| Status::ALL.iter().map(|s| CString::new(s.name()).unwrap()).collect());
    match Status::from_code(s) {
        Some(st) => NAMES[st.code() as usize].as_ptr(),
        None => c"KVX_UNKNOWN_STATUS".as_ptr(),
    }
}

/// The calling thread's message for its last failed call; "" when there was none. Never
/// NULL; valid until this thread's next failing kvxfer call.
#[no_mangle]
pub extern "C" fn kvx_last_error() -> *const c_char {
    last_error_ptr()
}

/// Every function of ABI 1: the 1.0 functions, then each minor's additions
/// (`docs/c-api.md#loading-kvxfer-as-a-plugin`). Append-only: new functions go at the end
/// and raise `struct_size`; a caller built against an older table reads only its prefix.
#[repr(C)]
pub struct kvx_api {
    pub struct_size: u32,
    pub abi_major: u32,
    pub abi_minor: u32,
    pub abi_version: extern "C" fn() -> u32,
    pub version_string: extern "C" fn() -> *const c_char,
    pub status_str: extern "C" fn(kvx_status) -> *const c_char,
    pub last_error: extern "C" fn() -> *const c_char,
    pub engine_config_init: unsafe extern "C" fn(*mut kvx_engine_config),
    pub engine_create: unsafe extern "C" fn(*const kvx_engine_config, *mut *mut kvx_engine) -> kvx_status,
    pub engine_destroy: unsafe extern "C" fn(*mut kvx_engine),
    pub engine_device: unsafe extern "C" fn(*const kvx_engine, *mut i32) -> kvx_status,
    pub layout_config_init: unsafe extern "C" fn(*mut kvx_layout_config),
    pub layout_create_device: unsafe extern "C" fn(*mut kvx_engine, *const kvx_layout_config, *mut *mut kvx_layout) -> kvx_status,
    pub layout_create_host: unsafe extern "C" fn(*mut kvx_engine, *const kvx_layout_config, u32, *mut *mut kvx_layout) -> kvx_status,
    pub layout_create_disk:
        unsafe extern "C" fn(*mut kvx_engine, *const kvx_layout_config, *const c_char, u32, *mut *mut kvx_layout) -> kvx_status,
    pub layout_register_device:
        unsafe extern "C" fn(*mut kvx_engine, *const kvx_layout_config, *const u64, usize, *mut *mut kvx_layout) -> kvx_status,
    pub layout_register_host:
        unsafe extern "C" fn(*mut kvx_engine, *const kvx_layout_config, *const *mut c_void, usize, u32, *mut *mut kvx_layout) -> kvx_status,
    pub layout_block_bytes: unsafe extern "C" fn(*const kvx_layout, *mut u64) -> kvx_status,
    pub layout_base: unsafe extern "C" fn(*const kvx_layout, u64, *mut u64) -> kvx_status,
    pub layout_destroy: unsafe extern "C" fn(*mut kvx_layout),
    pub transfer_options_init: unsafe extern "C" fn(*mut kvx_transfer_options),
    pub transfer_submit: unsafe extern "C" fn(
        *mut kvx_engine,
        *const kvx_layout,
        *const u64,
        *const kvx_layout,
        *const u64,
        usize,
        *const kvx_transfer_options,
        *mut *mut kvx_request,
    ) -> kvx_status,
    pub request_wait: unsafe extern "C" fn(*mut kvx_request, u64) -> kvx_status,
    pub request_poll: unsafe extern "C" fn(*const kvx_request) -> kvx_status,
    pub request_cancel: unsafe extern "C" fn(*mut kvx_request) -> kvx_status,
    pub request_error: unsafe extern "C" fn(*const kvx_request) -> *const c_char,
    pub request_release: unsafe extern "C" fn(*mut kvx_request),
    pub engine_stats: unsafe extern "C" fn(*const kvx_engine, *mut kvx_stats) -> kvx_status,
    pub set_logger: unsafe extern "C" fn(kvx_log_fn, *mut c_void, u32) -> kvx_status,
    /// ABI 1.1.
    pub engine_io_backend: unsafe extern "C" fn(*const kvx_engine, *mut u32) -> kvx_status,
    /// ABI 1.1.
    pub engine_config_get: unsafe extern "C" fn(*const kvx_engine, *mut kvx_engine_config) -> kvx_status,
    /// ABI 1.3.
    pub engine_export: unsafe extern "C" fn(*mut kvx_engine, *const *const kvx_layout, usize, *mut *mut kvx_blob) -> kvx_status,
    /// ABI 1.3.
    pub blob_bytes: unsafe extern "C" fn(*const kvx_blob, *mut usize) -> *const u8,
    /// ABI 1.3.
    pub blob_destroy: unsafe extern "C" fn(*mut kvx_blob),
    /// ABI 1.3.
    pub engine_import: unsafe extern "C" fn(*mut kvx_engine, *const u8, usize, u32, *mut *mut kvx_layout, usize, *mut usize) -> kvx_status,
    /// ABI 1.4.
    pub store_config_init: unsafe extern "C" fn(*mut kvx_store_config),
    /// ABI 1.4.
    pub store_open: unsafe extern "C" fn(*mut kvx_engine, *const c_char, *const kvx_store_config, *mut *mut kvx_store) -> kvx_status,
    /// ABI 1.4.
    pub store_close: unsafe extern "C" fn(*mut kvx_store),
    /// ABI 1.4.
    pub store_lookup: unsafe extern "C" fn(*mut kvx_store, *const kvx_key, usize, u32, *mut u8, *mut usize) -> kvx_status,
    /// ABI 1.4.
    pub store_release_leases: unsafe extern "C" fn(*mut kvx_store, *const kvx_key, usize) -> kvx_status,
    /// ABI 1.4.
    pub store_put: unsafe extern "C" fn(
        *mut kvx_store,
        *const kvx_layout,
        *const u64,
        *const kvx_key,
        usize,
        *const kvx_transfer_options,
        *mut *mut kvx_store_request,
    ) -> kvx_status,
    /// ABI 1.4.
    pub store_get: unsafe extern "C" fn(
        *mut kvx_store,
        *const kvx_key,
        usize,
        *const kvx_layout,
        *const u64,
        *const kvx_transfer_options,
        *mut *mut kvx_store_request,
    ) -> kvx_status,
    /// ABI 1.4.
    pub store_remove: unsafe extern "C" fn(*mut kvx_store, *const kvx_key, usize, *mut kvx_status) -> kvx_status,
    /// ABI 1.4.
    pub store_stats: unsafe extern "C" fn(*mut kvx_store, *mut kvx_store_counters) -> kvx_status,
    /// ABI 1.4.
    pub store_request_wait: unsafe extern "C" fn(*mut kvx_store_request, u64) -> kvx_status,
    /// ABI 1.4.
    pub store_request_poll: unsafe extern "C" fn(*const kvx_store_request) -> kvx_status,
    /// ABI 1.4.
    pub store_request_key_status: unsafe extern "C" fn(*const kvx_store_request, usize, *mut kvx_status) -> kvx_status,
    /// ABI 1.4.
    pub store_request_key_error: unsafe extern "C" fn(*const kvx_store_request, usize) -> *const c_char,
    /// ABI 1.4.
    pub store_request_error: unsafe extern "C" fn(*const kvx_store_request) -> *const c_char,
    /// ABI 1.4.
    pub store_request_release: unsafe extern "C" fn(*mut kvx_store_request),
    /// ABI 1.5.
    pub engine_completion_fd: unsafe extern "C" fn(*const kvx_engine, *mut i32) -> kvx_status,
    /// ABI 1.5.
    pub store_lease_slots: unsafe extern "C" fn(*mut kvx_store, *const kvx_key, usize, *mut kvx_slot_handle, *mut u8) -> kvx_status,
    /// ABI 1.5.
    pub store_reserve_slots: unsafe extern "C" fn(*mut kvx_store, *const kvx_key, usize, *mut kvx_slot_handle, *mut u32) -> kvx_status,
    /// ABI 1.5.
    pub store_commit_slots: unsafe extern "C" fn(*mut kvx_store, *const kvx_slot_handle, usize, *mut kvx_status) -> kvx_status,
    /// ABI 1.5.
    pub store_abort_slots: unsafe extern "C" fn(*mut kvx_store, *const kvx_slot_handle, usize) -> kvx_status,
    /// ABI 1.5.
    pub store_read_slots: unsafe extern "C" fn(
        *mut kvx_store,
        *const kvx_slot_handle,
        usize,
        *const kvx_layout,
        *const u64,
        *const kvx_transfer_options,
        *mut *mut kvx_store_request,
    ) -> kvx_status,
    /// ABI 1.5.
    pub store_write_slots: unsafe extern "C" fn(
        *mut kvx_store,
        *const kvx_layout,
        *const u64,
        *const kvx_slot_handle,
        usize,
        *const kvx_transfer_options,
        *mut *mut kvx_store_request,
    ) -> kvx_status,
    /// ABI 1.6.
    pub store_lease: unsafe extern "C" fn(*mut kvx_store, *const kvx_key, usize, *mut u64, *mut usize) -> kvx_status,
    /// ABI 1.6.
    pub store_release: unsafe extern "C" fn(*mut kvx_store, *const u64, usize) -> kvx_status,
    /// ABI 1.7.
    pub shared_config_init: unsafe extern "C" fn(*mut kvx_shared_config),
}

static API: kvx_api = kvx_api {
    struct_size: std::mem::size_of::<kvx_api>() as u32,
    abi_major: KVX_ABI_MAJOR,
    abi_minor: KVX_ABI_MINOR,
    abi_version: kvx_abi_version,
    version_string: kvx_version_string,
    status_str: kvx_status_str,
    last_error: kvx_last_error,
    engine_config_init: kvx_engine_config_init,
    engine_create: kvx_engine_create,
    engine_destroy: kvx_engine_destroy,
    engine_device: kvx_engine_device,
    layout_config_init: kvx_layout_config_init,
    layout_create_device: kvx_layout_create_device,
    layout_create_host: kvx_layout_create_host,
    layout_create_disk: kvx_layout_create_disk,
    layout_register_device: kvx_layout_register_device,
    layout_register_host: kvx_layout_register_host,
    layout_block_bytes: kvx_layout_block_bytes,
    layout_base: kvx_layout_base,
    layout_destroy: kvx_layout_destroy,
    transfer_options_init: kvx_transfer_options_init,
    transfer_submit: kvx_transfer_submit,
    request_wait: kvx_request_wait,
    request_poll: kvx_request_poll,
    request_cancel: kvx_request_cancel,
    request_error: kvx_request_error,
    request_release: kvx_request_release,
    engine_stats: kvx_engine_stats,
    set_logger: kvx_set_logger,
    engine_io_backend: kvx_engine_io_backend,
    engine_config_get: kvx_engine_config_get,
    engine_export: kvx_engine_export,
    blob_bytes: kvx_blob_bytes,
    blob_destroy: kvx_blob_destroy,
    engine_import: kvx_engine_import,
    store_config_init: kvx_store_config_init,
    store_open: kvx_store_open,
    store_close: kvx_store_close,
    store_lookup: kvx_store_lookup,
    store_release_leases: kvx_store_release_leases,
    store_put: kvx_store_put,
    store_get: kvx_store_get,
    store_remove: kvx_store_remove,
    store_stats: kvx_store_stats,
    store_request_wait: kvx_store_request_wait,
    store_request_poll: kvx_store_request_poll,
    store_request_key_status: kvx_store_request_key_status,
    store_request_key_error: kvx_store_request_key_error,
    store_request_error: kvx_store_request_error,
    store_request_release: kvx_store_request_release,
    engine_completion_fd: kvx_engine_completion_fd,
    store_lease_slots: kvx_store_lease_slots,
    store_reserve_slots: kvx_store_reserve_slots,
    store_commit_slots: kvx_store_commit_slots,
    store_abort_slots: kvx_store_abort_slots,
    store_read_slots: kvx_store_read_slots,
    store_write_slots: kvx_store_write_slots,
    store_lease: kvx_store_lease,
    store_release: kvx_store_release,
    shared_config_init: kvx_shared_config_init,
};

/// The function table for ABI major `abi_major`, or NULL for any other major (the caller
/// should then refuse to load this library). Static; never freed.
#[no_mangle]
pub extern "C" fn kvx_get_api(abi_major: u32) -> *const kvx_api {
    if abi_major == KVX_ABI_MAJOR {
        &API
    } else {
        set_last_error(&format!("ABI major {abi_major} requested; this library implements {KVX_ABI_MAJOR}"));
        std::ptr::null()
    }
}
