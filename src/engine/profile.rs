//! Optional phase timing (`LAYERTAP_PROFILE=1`, [`crate::engine::EngineOptions::profile`]): synchronises the device after each phase of
//! every layer and adds up the seconds, for finding where time goes. Off by default: the
//! synchronisations cost throughput. In linear-attention layers "gdn_proj" is the Gated
//! DeltaNet's input projections and "gdn_core" everything from there to its output projection
//! (conv, gates, the delta rule, the gated norm); "o_proj_mlp" is the output projection and the
//! dense feed-forward block of every layer, "moe" the experts (router, experts, shared expert).
//! On CUDA, "gdn_kernels" is the Gated DeltaNet kernels' share of what would otherwise be
//! "gdn_core" (which keeps the gated norm), and "gdn_conv", "gdn_local", "gdn_scan" split
//! "gdn_kernels" by kernel (they add up to it; they are not extra time). "moe_route",
//! "moe_experts" and "moe_combine" split "moe" the same way on the experts' CUDA kernels.

use std::sync::Mutex;
use std::time::Instant;

use super::options::EngineOptions;

pub const PHASES: [&str; 15] = [
    "norm_qkv",
    "rope",
    "attention",
    "o_proj_mlp",
    "host_copy",
    "gdn_proj",
    "gdn_core",
    "moe",
    "gdn_kernels",
    "gdn_conv",
    "gdn_local",
    "gdn_scan",
    "moe_route",
    "moe_experts",
    "moe_combine",
];
/// The experts' phases on CUDA (bf16, f16): router and sort, the grouped projections, shared
/// expert and weighted sum. They split "moe" (they add up to it).
pub const MOE_ROUTE: usize = 12;
pub const MOE_EXPERTS: usize = 13;
pub const MOE_COMBINE: usize = 14;
static SECS: Mutex<[f64; PHASES.len()]> = Mutex::new([0.0; PHASES.len()]);

/// Whether this process times phases ([`EngineOptions::startup`]'s `profile`).
pub fn enabled() -> bool {
    EngineOptions::startup().profile
}

/// Ends a phase: waits for the device, then charges the time since `since` to `phase`.
pub fn mark(device: &candle_core::Device, phase: usize, since: &mut Instant) {
    if enabled() {
        let _ = device.synchronize();
        if let Ok(mut s) = SECS.lock() {
            s[phase] += since.elapsed().as_secs_f64();
        }
        *since = Instant::now();
    }
}

/// Charges `secs` to `phase` (for timings taken inside an operation).
pub fn add(phase: usize, secs: f64) {
    if let Ok(mut s) = SECS.lock() {
        s[phase] += secs;
    }
}

/// Seconds per phase so far, by name.
pub fn totals() -> Vec<(&'static str, f64)> {
    let s = SECS.lock().map(|s| *s).unwrap_or_default();
    PHASES.iter().copied().zip(s).collect()
}
