//! C handles and the Rust objects behind them, in the rustls-ffi style: every cast
//! between a `kvx_*` pointer and its object goes through these traits, so ownership is
//! written once per handle type instead of once per function.
//!
//! - `kvx_engine` is an `Arc::into_raw` pointer: the caller holds one reference and each
//!   open store another, so a store's engine lives until the store is closed;
//!   `kvx_engine_destroy` shuts the engine down at once all the same.
//! - `kvx_layout` and `kvx_request` are `Arc::into_raw` pointers: the caller holds one
//!   reference, requests in flight hold others, and the object lives until the last one.
//! - `kvx_store` and `kvx_store_request` are `Box`es: the caller owns them outright.

use super::boundary::null;
use super::store::{StoreCall, StoreHandle};
use super::types::{kvx_blob, kvx_engine, kvx_layout, kvx_request, kvx_store, kvx_store_request};
use crate::engine::{Engine, Request};
use crate::error::Result;
use crate::memory::Layout;
use std::sync::Arc;

/// A C handle type and the Rust object it stands for.
pub trait Handle: Sized {
    type Object;

    /// The object behind `p`, for the duration of a call; `KVX_ERR_INVALID_ARG` naming
    /// the argument when it is NULL.
    ///
    /// # Safety
    /// A non-NULL `p` must have come from this handle type's constructor and not be freed.
    unsafe fn borrow<'a>(p: *const Self, name: &str) -> Result<&'a Self::Object> {
        (p as *const Self::Object).as_ref().ok_or_else(|| null(name))
    }
}

/// A handle that owns its object (`Box`).
pub trait BoxHandle: Handle {
    fn into_c(o: Self::Object) -> *mut Self {
        Box::into_raw(Box::new(o)) as *mut Self
    }

    /// Drops the object; NULL is a no-op.
    ///
    /// # Safety
    /// As `borrow`; `p` is not used again.
    unsafe fn free(p: *mut Self) {
        if !p.is_null() {
            drop(Box::from_raw(p as *mut Self::Object));
        }
    }
}

/// A handle that holds one reference to a shared object (`Arc`).
pub trait ArcHandle: Handle {
    fn into_c(o: Arc<Self::Object>) -> *mut Self {
        Arc::into_raw(o) as *mut Self
    }

    /// The handle C was given for `o` (the same pointer `into_c` returned).
    fn of(o: &Self::Object) -> *mut Self {
        o as *const Self::Object as *mut Self
    }

    /// A new reference to the object, the caller's own left in place.
    ///
    /// # Safety
    /// As `borrow`.
    unsafe fn clone_arc(p: *const Self, name: &str) -> Result<Arc<Self::Object>> {
        if p.is_null() {
            return Err(null(name));
        }
        Arc::increment_strong_count(p as *const Self::Object);
        Ok(Arc::from_raw(p as *const Self::Object))
    }

    /// Drops the caller's reference; NULL is a no-op.
    ///
    /// # Safety
    /// As `borrow`; `p` is not used again.
    unsafe fn free(p: *mut Self) {
        if !p.is_null() {
            drop(Arc::from_raw(p as *const Self::Object));
        }
    }
}

impl Handle for kvx_engine {
    type Object = Engine;
}
impl ArcHandle for kvx_engine {}

impl Handle for kvx_layout {
    type Object = Layout;
}
impl ArcHandle for kvx_layout {}

impl Handle for kvx_request {
    type Object = Request;
}
impl ArcHandle for kvx_request {}

impl Handle for kvx_blob {
    type Object = Vec<u8>;
}
impl BoxHandle for kvx_blob {}

impl Handle for kvx_store {
    type Object = StoreHandle;
}
impl BoxHandle for kvx_store {}

impl Handle for kvx_store_request {
    type Object = StoreCall;
}
impl BoxHandle for kvx_store_request {}
