//! The CLI's mock engine and replay stream, for tests that replay the trace beside the test
//! harness (which `src/tools/mod.rs` would include a second time).

#[path = "../../src/tools/stream.rs"]
pub mod stream;
#[path = "../../src/tools/trace.rs"]
pub mod trace;
