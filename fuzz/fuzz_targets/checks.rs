//! The same argument space through the checks only (fast): configs, struct reads,
//! transfer validation (Engine::check) and the layout math.
//!   cargo +nightly fuzz run checks fuzz/corpus/abi -- -runs=10000000
#![no_main]
mod common;
libfuzzer_sys::fuzz_target!(|data: &[u8]| unsafe { common::run(data, false) });
