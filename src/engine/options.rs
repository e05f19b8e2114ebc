//! The engine's switches for comparing its kernels and measuring it, read from the environment
//! once at start-up ([`EngineOptions::from_env`]) and handed to the decoder when it is loaded, so
//! each layer picks its kernels then. Every switch defaults to what serves best; the variables
//! exist to compare against the alternative or to find where time goes.
//!
//! | variable | default | effect |
//! |---|---|---|
//! | `LAYERTAP_PROFILE=1` | off | time each phase of each layer ([`crate::engine::profile`]) |
//! | `LAYERTAP_F32_RESIDUAL=0` | on | residual stream in the compute dtype (CUDA, 16-bit models) |
//! | `LAYERTAP_FUSED_ADD_NORM=0` | on | residual add and RMSNorm as separate ops (CUDA) |
//! | `LAYERTAP_FUSED_ROPE=0` | on | q/k/v split, q/k norms and rotary as separate ops (CUDA) |
//! | `LAYERTAP_CUDA_ATTENTION=0` | on | the portable attention path on the GPU too |
//! | `LAYERTAP_ATTENTION_KERNEL=simple\|w4\|w8\|wide` | by head dim | the attention kernel's variant (CUDA) |
//! | `LAYERTAP_CUDA_GDN=0` | on | the portable Gated DeltaNet path on the GPU too |
//! | `LAYERTAP_GDN_TF32=0` | on | the Gated DeltaNet kernels' chunk products in f32 for 16-bit models |
//! | `LAYERTAP_CUDA_MOE=0` | on | one matmul chain per expert instead of the experts' kernels |
//! | `LAYERTAP_FP8_GEMM=0` | on | FP8 projections dequantised at load instead of FP8 GEMMs (CUDA) |
//! | `LAYERTAP_FP8_FUSED=0` | on | SiLU · up written in the compute dtype, then quantised for the FP8 down projection (CUDA) |
//! | `LAYERTAP_SPIN_WAIT=1` | off | threads waiting on the GPU spin instead of sleeping |
//! | `LAYERTAP_POOL_RELEASE=1` | off | the device's memory pool hands freed memory back at every synchronisation |
//!
//! Any other value of a variable leaves its default.

use std::sync::OnceLock;

/// The attention kernel's variants (`kernels/attention.cu`), as `LAYERTAP_ATTENTION_KERNEL`
/// names them. They give bitwise the same output: each query row meets the same key tiles in
/// the same order; they differ in how the tiles reach the tensor cores and in how many query
/// rows a block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernel {
    /// `simple`: the first kernel: 64 query rows per block, K/V tiles loaded through registers.
    Simple,
    /// `w4`: K/V tiles streamed by cp.async in two stages and read by ldmatrix; 4 warps, 64 rows.
    Pipelined4,
    /// `w8`: the same with 8 warps, 128 rows: each K/V tile serves twice as many queries.
    Pipelined8,
    /// `wide`: 128 rows, each warp holding 32 of them (two groups of 16 sharing every K/V
    /// fragment it reads), Q staged in shared memory; for head dim 256, 8 warps of 16 rows.
    Wide,
}

impl AttentionKernel {
    pub const ALL: [AttentionKernel; 4] =
        [AttentionKernel::Simple, AttentionKernel::Pipelined4, AttentionKernel::Pipelined8, AttentionKernel::Wide];

    /// The variant `LAYERTAP_ATTENTION_KERNEL` names: `simple`, `w4`, `w8` or `wide`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "simple" => Some(AttentionKernel::Simple),
            "w4" => Some(AttentionKernel::Pipelined4),
            "w8" => Some(AttentionKernel::Pipelined8),
            "wide" => Some(AttentionKernel::Wide),
            _ => None,
        }
    }

    /// The name [`AttentionKernel::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::Simple => "simple",
            AttentionKernel::Pipelined4 => "w4",
            AttentionKernel::Pipelined8 => "w8",
            AttentionKernel::Wide => "wide",
        }
    }

    /// The wide kernel for head dims 64 and 128 (measured on the dense 8B shape: +4 % end to end
    /// over the 4-warp pipelined kernel); the 4-warp pipelined kernel for 256 (Qwen3.5/3.6's
    /// full-attention layers), where the wide one has 8 warps of 16 rows and was not measured.
    pub fn default_for(head_dim: usize) -> Self {
        if head_dim == 256 {
            AttentionKernel::Pipelined4
        } else {
            AttentionKernel::Wide
        }
    }
}

/// The engine's switches. [`Default`] is what serves (every variable unset).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    /// `LAYERTAP_PROFILE=1`: synchronise the device after each phase of each layer and add up
    /// the seconds per phase ([`crate::engine::profile`]). Costs throughput.
    pub profile: bool,
    /// `LAYERTAP_F32_RESIDUAL=0` turns off: on CUDA, a bf16/f16 model keeps its residual stream
    /// in f32 and rounds each sublayer's output once (off: in the compute dtype, rounded at every
    /// add, as transformers does).
    pub f32_residual: bool,
    /// `LAYERTAP_FUSED_ADD_NORM=0` turns off: on CUDA, the residual add of the f32 stream and
    /// the RMSNorm after it in one kernel, bitwise the two ops (off: separate ops).
    pub fused_add_norm: bool,
    /// `LAYERTAP_FUSED_ROPE=0` turns off: on CUDA, the q/k/v split, the q/k norms and the
    /// rotary embedding in one kernel where it serves the shape (off: separate ops).
    pub fused_rope: bool,
    /// `LAYERTAP_CUDA_ATTENTION=0` turns off: attention over packed sequences in one CUDA kernel
    /// per layer (bf16/f16, head dims 64, 128, 256; off: the portable path, on the GPU too).
    pub cuda_attention: bool,
    /// `LAYERTAP_ATTENTION_KERNEL=simple|w4|w8|wide`: that variant of the attention kernel, for
    /// comparing them; unset (or any other value): [`AttentionKernel::default_for`] the head dim.
    pub attention_kernel: Option<AttentionKernel>,
    /// `LAYERTAP_CUDA_GDN=0` turns off: the Gated DeltaNet's CUDA kernels (off: the portable
    /// path, which the kernel tests compare against).
    pub cuda_gdn: bool,
    /// `LAYERTAP_GDN_TF32=0` turns off: for bf16/f16 models, the Gated DeltaNet kernels' chunk
    /// products on tensor cores with TF32 operands (off: every product in f32, as f32 models).
    pub gdn_tf32: bool,
    /// `LAYERTAP_CUDA_MOE=0` turns off: the experts' CUDA kernels for bf16/f16 mixture-of-experts
    /// layers (off: one matmul chain per expert, sorted on the host).
    pub cuda_moe: bool,
    /// `LAYERTAP_FP8_GEMM=0` turns off: on a GPU that runs block-scaled FP8 GEMMs, an FP8
    /// checkpoint's projections stay e4m3 and run on the FP8 tensor cores (off: dequantised at
    /// load into the compute dtype, each input quantised and dequantised before the matmul, as on
    /// GPUs without those GEMMs).
    pub fp8_gemm: bool,
    /// `LAYERTAP_FP8_FUSED=0` turns off: where the MLP's down projection runs on the FP8 tensor
    /// cores, `silu(gate) * up` is quantised straight from the gate and up projections' output
    /// in one kernel (off: written in the compute dtype, then quantised; the same bytes).
    pub fp8_fused: bool,
    /// `LAYERTAP_SPIN_WAIT=1`: host threads that wait on the GPU spin under the driver's default
    /// scheduling instead of sleeping (the device thread's waits and the result thread's).
    pub spin_wait: bool,
    /// `LAYERTAP_POOL_RELEASE=1`: the device's memory pool keeps its default release threshold,
    /// handing freed memory back to the driver at every synchronisation (default: kept mapped
    /// for the next batch).
    pub pool_release: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            profile: false,
            f32_residual: true,
            fused_add_norm: true,
            fused_rope: true,
            cuda_attention: true,
            attention_kernel: None,
            cuda_gdn: true,
            gdn_tf32: true,
            cuda_moe: true,
            fp8_gemm: true,
            fp8_fused: true,
            spin_wait: false,
            pool_release: false,
        }
    }
}

/// A boolean as variables and flags spell it: 1, true, yes, on, y, t (true) and 0, false, no,
/// off, n, f (false), in any case, spaces around ignored; `None` for anything else.
pub fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" | "y" | "t" => Some(true),
        "0" | "false" | "no" | "off" | "n" | "f" => Some(false),
        _ => None,
    }
}

impl EngineOptions {
    /// The switches as the `LAYERTAP_*` variables set them (see the fields).
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The switches as `var` reads the variables (`None`: unset). A switch takes the usual
    /// spellings ([`parse_bool`]); a value that is none of them leaves its default, with a warning.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let is = |name: &str, value: &str| {
            let want = value == "1";
            var(name).is_some_and(|v| match parse_bool(&v) {
                Some(b) => b == want,
                None => {
                    tracing::warn!(variable = name, value = %v, "not a boolean (1/0, true/false, yes/no, on/off): ignored");
                    false
                }
            })
        };
        EngineOptions {
            profile: is("LAYERTAP_PROFILE", "1"),
            f32_residual: !is("LAYERTAP_F32_RESIDUAL", "0"),
            fused_add_norm: !is("LAYERTAP_FUSED_ADD_NORM", "0"),
            fused_rope: !is("LAYERTAP_FUSED_ROPE", "0"),
            cuda_attention: !is("LAYERTAP_CUDA_ATTENTION", "0"),
            attention_kernel: var("LAYERTAP_ATTENTION_KERNEL").as_deref().and_then(AttentionKernel::parse),
            cuda_gdn: !is("LAYERTAP_CUDA_GDN", "0"),
            gdn_tf32: !is("LAYERTAP_GDN_TF32", "0"),
            cuda_moe: !is("LAYERTAP_CUDA_MOE", "0"),
            fp8_gemm: !is("LAYERTAP_FP8_GEMM", "0"),
            fp8_fused: !is("LAYERTAP_FP8_FUSED", "0"),
            spin_wait: is("LAYERTAP_SPIN_WAIT", "1"),
            pool_release: is("LAYERTAP_POOL_RELEASE", "1"),
        }
    }

    /// The options of this process: read from the environment the first time they are asked
    /// for, and logged then (one line naming the switches that differ from the defaults).
    pub fn startup() -> &'static EngineOptions {
        static OPTIONS: OnceLock<EngineOptions> = OnceLock::new();
        OPTIONS.get_or_init(|| {
            let o = EngineOptions::from_env();
            let changed = o.changed();
            if changed.is_empty() {
                tracing::info!("engine options: defaults");
            } else {
                tracing::info!(options = %changed.join(" "), "engine options differ from the defaults");
            }
            o
        })
    }

    /// The variables that set a switch away from its default, as `NAME=value`.
    pub fn changed(&self) -> Vec<String> {
        let d = EngineOptions::default();
        let mut out = Vec::new();
        let mut flag = |name: &str, on: bool, default: bool| {
            if on != default {
                out.push(format!("{name}={}", if on { 1 } else { 0 }));
            }
        };
        flag("LAYERTAP_PROFILE", self.profile, d.profile);
        flag("LAYERTAP_F32_RESIDUAL", self.f32_residual, d.f32_residual);
        flag("LAYERTAP_FUSED_ADD_NORM", self.fused_add_norm, d.fused_add_norm);
        flag("LAYERTAP_FUSED_ROPE", self.fused_rope, d.fused_rope);
        flag("LAYERTAP_CUDA_ATTENTION", self.cuda_attention, d.cuda_attention);
        flag("LAYERTAP_CUDA_GDN", self.cuda_gdn, d.cuda_gdn);
        flag("LAYERTAP_GDN_TF32", self.gdn_tf32, d.gdn_tf32);
        flag("LAYERTAP_CUDA_MOE", self.cuda_moe, d.cuda_moe);
        flag("LAYERTAP_FP8_GEMM", self.fp8_gemm, d.fp8_gemm);
        flag("LAYERTAP_FP8_FUSED", self.fp8_fused, d.fp8_fused);
        flag("LAYERTAP_SPIN_WAIT", self.spin_wait, d.spin_wait);
        flag("LAYERTAP_POOL_RELEASE", self.pool_release, d.pool_release);
        if let Some(k) = self.attention_kernel {
            out.push(format!("LAYERTAP_ATTENTION_KERNEL={}", k.name()));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)]) -> EngineOptions {
        EngineOptions::from_vars(|n| vars.iter().find(|(k, _)| *k == n).map(|(_, v)| v.to_string()))
    }

    /// Unset variables give the defaults; each variable moves only its own switch, and only
    /// with the value that turns it (any other value leaves the default).
    #[test]
    fn each_variable_sets_its_switch_and_nothing_else() {
        assert_eq!(from(&[]), EngineOptions::default());
        assert!(from(&[]).changed().is_empty());
        let all = [
            ("LAYERTAP_PROFILE", "1"),
            ("LAYERTAP_F32_RESIDUAL", "0"),
            ("LAYERTAP_FUSED_ADD_NORM", "0"),
            ("LAYERTAP_FUSED_ROPE", "0"),
            ("LAYERTAP_CUDA_ATTENTION", "0"),
            ("LAYERTAP_CUDA_GDN", "0"),
            ("LAYERTAP_GDN_TF32", "0"),
            ("LAYERTAP_CUDA_MOE", "0"),
            ("LAYERTAP_FP8_GEMM", "0"),
            ("LAYERTAP_FP8_FUSED", "0"),
            ("LAYERTAP_SPIN_WAIT", "1"),
            ("LAYERTAP_POOL_RELEASE", "1"),
            ("LAYERTAP_ATTENTION_KERNEL", "w8"),
        ];
        for (name, value) in all {
            let o = from(&[(name, value)]);
            assert_eq!(o.changed(), vec![format!("{name}={value}")], "{name}");
            let other = if value == "1" { "0" } else { "1" };
            assert_eq!(from(&[(name, other)]), EngineOptions::default(), "{name}={other}");
        }
        assert_eq!(from(&[("LAYERTAP_ATTENTION_KERNEL", "fast")]).attention_kernel, None);
        // The usual boolean spellings, in any case; anything else leaves the default.
        for on in ["true", "TRUE", "yes", "On", " 1 ", "y"] {
            assert!(from(&[("LAYERTAP_PROFILE", on)]).profile, "{on:?}");
        }
        for off in ["false", "No", "off", "0"] {
            assert!(!from(&[("LAYERTAP_CUDA_GDN", off)]).cuda_gdn, "{off:?}");
        }
        assert_eq!(from(&[("LAYERTAP_PROFILE", "maybe")]), EngineOptions::default());
        for k in AttentionKernel::ALL {
            assert_eq!(AttentionKernel::parse(k.name()), Some(k));
        }
    }
}
