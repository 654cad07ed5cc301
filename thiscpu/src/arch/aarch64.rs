//! aarch64: not written yet; the x86_64 file lists the items every architecture exports.
compile_error!("thiscpu's aarch64 support is not written yet");
