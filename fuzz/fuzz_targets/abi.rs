//! The C ABI with real work: one op in 256 creates layouts or engines or runs a transfer.
//!   cargo +nightly fuzz run abi fuzz/corpus/abi
#![no_main]
mod common;
libfuzzer_sys::fuzz_target!(|data: &[u8]| unsafe { common::run(data, true) });
