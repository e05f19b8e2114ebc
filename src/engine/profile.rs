//! Optional phase timing (`LAYERTAP_PROFILE=1`): synchronises the device after each phase of
//! every layer and adds up the seconds, for finding where time goes. Off by default: the
//! synchronisations cost throughput. In linear-attention layers the whole Gated DeltaNet up to
//! its output projection counts as "attention" (the token mixer); "o_proj_mlp" is the output
//! projection and the feed-forward block (dense or experts) of every layer.

use std::sync::{Mutex, OnceLock};
use std::time::Instant;

pub const PHASES: [&str; 5] = ["norm_qkv", "rope", "attention", "o_proj_mlp", "host_copy"];
static ON: OnceLock<bool> = OnceLock::new();
static SECS: Mutex<[f64; 5]> = Mutex::new([0.0; 5]);

pub fn enabled() -> bool {
    *ON.get_or_init(|| std::env::var("LAYERTAP_PROFILE").is_ok_and(|v| v == "1"))
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

/// Seconds per phase so far, by name.
pub fn totals() -> Vec<(&'static str, f64)> {
    let s = SECS.lock().map(|s| *s).unwrap_or_default();
    PHASES.iter().copied().zip(s).collect()
}
