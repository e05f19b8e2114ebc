//! Optional phase timing (`LAYERTAP_PROFILE=1`: [`EngineOptions::profile`]): synchronises the
//! device after each phase of every layer and adds up the seconds, for finding where time goes.
//! Off by default: the synchronisations cost throughput. In linear-attention layers "gdn_proj" is the Gated
//! DeltaNet's input projections and "gdn_core" everything from there to its output projection
//! (conv, gates, the delta rule, the gated norm); "o_proj_mlp" is the output projection and the
//! dense feed-forward block of every layer, "moe" the experts (router, experts, shared expert).
//! On CUDA, "gdn_kernels" is the Gated DeltaNet kernels' share of what would otherwise be
//! "gdn_core" (which keeps the gated norm), and "gdn_conv", "gdn_local", "gdn_scan" split
//! "gdn_kernels" by kernel (they add up to it; they are not extra time). "moe_route",
//! "moe_experts" and "moe_combine" split "moe" the same way on the experts' CUDA kernels.
//! A forward pass marks its phases on a [`Profiler`] by [`Phase`].

use std::cell::Cell;
use std::sync::Mutex;
use std::time::Instant;

use candle_core::Device;

use super::options::EngineOptions;

/// A phase of the work, as the totals name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    NormQkv,
    Rope,
    Attention,
    OProjMlp,
    HostCopy,
    GdnProj,
    GdnCore,
    Moe,
    /// The Gated DeltaNet kernels' share of what would otherwise be [`Phase::GdnCore`].
    GdnKernels,
    /// [`Phase::GdnConv`], [`Phase::GdnLocal`] and [`Phase::GdnScan`] split [`Phase::GdnKernels`]
    /// by kernel (they add up to it).
    GdnConv,
    GdnLocal,
    GdnScan,
    /// The experts' phases on CUDA (bf16, f16): router and sort, the grouped projections, shared
    /// expert and weighted sum. They split [`Phase::Moe`] (they add up to it).
    MoeRoute,
    MoeExperts,
    MoeCombine,
}

impl Phase {
    pub const ALL: [Phase; 15] = [
        Phase::NormQkv,
        Phase::Rope,
        Phase::Attention,
        Phase::OProjMlp,
        Phase::HostCopy,
        Phase::GdnProj,
        Phase::GdnCore,
        Phase::Moe,
        Phase::GdnKernels,
        Phase::GdnConv,
        Phase::GdnLocal,
        Phase::GdnScan,
        Phase::MoeRoute,
        Phase::MoeExperts,
        Phase::MoeCombine,
    ];

    /// The phase's name in the totals.
    pub fn name(self) -> &'static str {
        match self {
            Phase::NormQkv => "norm_qkv",
            Phase::Rope => "rope",
            Phase::Attention => "attention",
            Phase::OProjMlp => "o_proj_mlp",
            Phase::HostCopy => "host_copy",
            Phase::GdnProj => "gdn_proj",
            Phase::GdnCore => "gdn_core",
            Phase::Moe => "moe",
            Phase::GdnKernels => "gdn_kernels",
            Phase::GdnConv => "gdn_conv",
            Phase::GdnLocal => "gdn_local",
            Phase::GdnScan => "gdn_scan",
            Phase::MoeRoute => "moe_route",
            Phase::MoeExperts => "moe_experts",
            Phase::MoeCombine => "moe_combine",
        }
    }
}

static SECS: Mutex<[f64; Phase::ALL.len()]> = Mutex::new([0.0; Phase::ALL.len()]);

/// Whether this process times phases ([`EngineOptions::startup`]'s `profile`).
pub fn enabled() -> bool {
    EngineOptions::startup().profile
}

/// The phase clock of one forward pass (held by its [`crate::engine::batch::BatchCtx`]): each
/// [`Profiler::mark`] waits for the device and charges the time since the previous mark (or
/// [`Profiler::restart`]) to a phase. Off, it does nothing and costs nothing.
pub struct Profiler(Option<Clock>);

struct Clock {
    device: Device,
    since: Cell<Instant>,
}

impl Profiler {
    /// A clock for `device`, running from now when `on`.
    pub fn new(device: &Device, on: bool) -> Self {
        Profiler(on.then(|| Clock { device: device.clone(), since: Cell::new(Instant::now()) }))
    }

    /// A clock that never runs.
    pub fn off() -> Self {
        Profiler(None)
    }

    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Starts the next phase now, charging nothing for the time before (between layers).
    pub fn restart(&self) {
        if let Some(c) = &self.0 {
            c.since.set(Instant::now());
        }
    }

    /// Ends a phase: waits for the device, then charges the time since the last mark to `phase`.
    pub fn mark(&self, phase: Phase) {
        if let Some(c) = &self.0 {
            let _ = c.device.synchronize();
            add(phase, c.since.get().elapsed().as_secs_f64());
            c.since.set(Instant::now());
        }
    }

    /// A clock of its own, running from now, for phases that split one of this clock's: its
    /// marks leave this clock's phase running.
    pub fn nested(&self) -> Profiler {
        Profiler(self.0.as_ref().map(|c| Clock { device: c.device.clone(), since: Cell::new(Instant::now()) }))
    }
}

/// Ends a phase timed outside a forward pass (the benchmark's copy to the host), when this
/// process times phases: waits for the device, then charges the time since `since` to `phase`.
pub fn mark(device: &Device, phase: Phase, since: &mut Instant) {
    if enabled() {
        let _ = device.synchronize();
        add(phase, since.elapsed().as_secs_f64());
        *since = Instant::now();
    }
}

/// Charges `secs` to `phase` (for timings taken inside an operation).
pub fn add(phase: Phase, secs: f64) {
    if let Ok(mut s) = SECS.lock() {
        s[phase as usize] += secs;
    }
}

/// Seconds per phase so far, by name.
pub fn totals() -> Vec<(&'static str, f64)> {
    let s = SECS.lock().map(|s| *s).unwrap_or_default();
    Phase::ALL.iter().map(|p| p.name()).zip(s).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Phase::ALL` lists every phase once, in declaration order, so `phase as usize` indexes it.
    #[test]
    fn phases_are_listed_in_order() {
        for (i, p) in Phase::ALL.iter().enumerate() {
            assert_eq!(*p as usize, i, "{}", p.name());
        }
    }
}
