//! The start-up self-check: a fixed probe (a few sequences of different lengths) runs packed in
//! one batch through the serving path of each device, and each sequence alone through the
//! portable f32 path (the CPU), for the first layers of the model — as many as it takes to meet
//! every kind of layer it has. The relative error per hidden-state index says whether the
//! device computes what the model is: a checkpoint read wrongly, a kernel wrong for this shape or
//! state leaking between packed sequences shows as an error far above the compute dtype's noise.

use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use super::loader::ModelFiles;
use super::{Batch, ComputeDType, Engine, EngineError, ModelConfig, OutDType};

/// Lengths of the probe's sequences: one token, a few, and lengths past the Gated DeltaNet chunk
/// (64 tokens) and the attention kernels' 64- and 128-row tiles.
pub const PROBE_LENGTHS: [usize; 4] = [1, 5, 65, 129];

/// The largest relative error per index the self-check accepts for a compute dtype, set from
/// the figures measured with it (bench/RESULTS.md, "The start-up self-check"): bf16 and f16
/// carry their rounding through every layer; f32 only summation order. Where the probe's layers
/// route tokens to experts (`routed`), rounding also flips a few tokens' choice among experts
/// whose router scores nearly tie, and each flip moves that token's state by a whole expert's
/// share: measured on a random 35B-A3B-width model, whose near-uniform routers flip most, the
/// errors are a few times those of dense models, so the allowance is five times theirs.
///
/// Where the projections are FP8 (`fp8`: W8A8 with dynamic activation scales), a 16-bit input
/// rounds to another e4m3 value than the f32 reference's in a few per cent of its elements, each
/// such flip moving that element by up to a sixteenth, and a layer's output carries them on: on a
/// random 27B-width hybrid the bf16 path's distance from the f32 W8A8 path is 0.150 at index 4 on
/// the CPU (no CUDA kernel involved) and 0.151 on the H200, against 0.016–0.018 for the bf16
/// checkpoint of the same weights (bench/RESULTS.md, "FP8 at the 27B width at full depth"). So a
/// 16-bit compute dtype with FP8 projections is allowed three times the float allowance; a
/// defect (a misread scale, a wrong kernel) moves states by about their own size. f32 compute
/// quantises the same inputs as the reference and keeps its allowance.
pub fn tolerance(dtype: ComputeDType, routed: bool, fp8: bool) -> f64 {
    let dense = match dtype {
        ComputeDType::Float32 => 1e-3,
        ComputeDType::Float16 => 0.05,
        ComputeDType::Bfloat16 => 0.1,
    };
    let dense = if fp8 && dtype != ComputeDType::Float32 { 3.0 * dense } else { dense };
    if routed {
        5.0 * dense
    } else {
        dense
    }
}

/// What the probe runs: its sequences and the hidden-state indices compared.
#[derive(Clone, Debug)]
pub struct Probe {
    pub seqs: Vec<Vec<u32>>,
    /// Decoder layers the reference runs.
    pub depth: usize,
    /// Hidden-state indices compared: `0..=depth`, and the pre-norm final state when the
    /// reference runs the whole model.
    pub indices: Vec<usize>,
    /// Whether one of those layers routes tokens to experts (see [`tolerance`]).
    pub routed: bool,
    /// Whether the model's projections are FP8 (see [`tolerance`]).
    pub fp8: bool,
}

impl Probe {
    /// The probe for a model: fixed pseudo-random token ids in its vocabulary, and the fewest
    /// leading layers that include every kind of layer (mixer and feed-forward) the model has,
    /// at least two.
    pub fn new(cfg: &ModelConfig) -> Self {
        let n = cfg.num_hidden_layers;
        let mut seen = Vec::new();
        let mut depth = n.min(2);
        for (i, spec) in cfg.layers.iter().enumerate() {
            if !seen.contains(spec) {
                seen.push(*spec);
                depth = depth.max(i + 1);
            }
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let vocab = cfg.vocab_size as u64;
        // A model computed only for sequences up to a length is probed with sequences within it.
        let longest = cfg.max_sequence_tokens().map_or(usize::MAX, |(max, _)| max);
        let seqs = PROBE_LENGTHS
            .iter()
            .map(|&len| {
                (0..len.min(longest))
                    .map(|_| {
                        // xorshift64*: the same ids on every machine.
                        state ^= state >> 12;
                        state ^= state << 25;
                        state ^= state >> 27;
                        (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as u32 % vocab as u32
                    })
                    .collect()
            })
            .collect();
        let mut indices: Vec<usize> = (0..=depth).collect();
        if depth == n {
            indices.push(n + 1);
        }
        let routed = cfg.layers[..depth].iter().any(|l| l.ffn.has_moe());
        // MXFP4 weights are dequantised exactly: only FP8 quantises activations.
        let fp8 =
            cfg.quantization.as_ref().is_some_and(|q| !matches!(q, super::config::quant::Quantization::Mxfp4 { .. }));
        Probe { seqs, depth, indices, routed, fp8 }
    }

    pub fn tokens(&self) -> usize {
        self.seqs.iter().map(Vec::len).sum()
    }
}

/// The probe's states from the reference path: per index, every probe token's row, in f32.
#[derive(Clone, Debug)]
pub struct Reference {
    /// `states[k]`: `[tokens, hidden]` of `probe.indices[k]`, sequences in order.
    states: Vec<Vec<f32>>,
    pub seconds: f64,
}

impl Reference {
    /// The portable f32 path on the CPU: the model's first `probe.depth` layers, loaded in f32
    /// with only the probe's embedding rows, each sequence run alone.
    pub fn portable(files: &ModelFiles, probe: &Probe) -> Result<Self, EngineError> {
        let start = Instant::now();
        let n = files.config().num_hidden_layers;
        let mut tokens: Vec<u32> = probe.seqs.iter().flatten().copied().collect();
        tokens.sort_unstable();
        tokens.dedup();
        let mut engine = files.load_prefix_f32(probe.depth, &tokens)?;
        let loaded = start.elapsed().as_secs_f64();
        // The truncated decoder's last layer output is its pre-norm final state.
        let truncated = probe.depth < n;
        let engine_index = |i: usize| if truncated && i == probe.depth { probe.depth + 1 } else { i };
        let local = |seq: &[u32]| seq.iter().map(|t| tokens.binary_search(t).unwrap_or(0) as u32).collect::<Vec<_>>();
        let mut r = Self::run(&mut engine, probe, local, engine_index)?;
        r.seconds = start.elapsed().as_secs_f64();
        tracing::debug!(load_seconds = loaded, run_seconds = r.seconds - loaded, "self-check reference computed");
        Ok(r)
    }

    /// `engine` itself, each sequence alone: for a serving path that already is the portable
    /// f32 path (the CPU in f32), so that no second copy of the weights is loaded.
    pub fn from_engine(engine: &mut dyn Engine, probe: &Probe) -> Result<Self, EngineError> {
        let start = Instant::now();
        let mut r = Self::run(engine, probe, <[u32]>::to_vec, |i| i)?;
        r.seconds = start.elapsed().as_secs_f64();
        Ok(r)
    }

    fn run(
        engine: &mut dyn Engine,
        probe: &Probe,
        ids: impl Fn(&[u32]) -> Vec<u32>,
        engine_index: impl Fn(usize) -> usize,
    ) -> Result<Self, EngineError> {
        let layers: Vec<usize> = probe.indices.iter().map(|&i| engine_index(i)).collect();
        let mut states = vec![Vec::new(); layers.len()];
        for seq in &probe.seqs {
            let taps = engine.forward(&Batch::new(ids(seq), vec![0, seq.len()], layers.clone()))?;
            for (k, s) in states.iter_mut().enumerate() {
                s.extend(taps.gather(0, seq.len(), &layers[k..k + 1], OutDType::Float32)?.to_f32());
            }
        }
        Ok(Reference { states, seconds: 0.0 })
    }
}

/// The portable reference shared by every device of a server: computed once, on a thread of its
/// own started with the server ([`SharedReference::start`]), so that it runs on the CPU while the
/// devices load their models; or, where none was started, by the first device to ask.
#[derive(Default)]
pub struct SharedReference {
    cell: OnceLock<Result<Reference, String>>,
    job: Mutex<Option<JoinHandle<Result<Reference, String>>>>,
}

impl SharedReference {
    /// Starts computing the reference of `files` on a thread of its own.
    pub fn start(files: Arc<ModelFiles>) -> Self {
        let job = std::thread::Builder::new().name("layertap-selfcheck".into()).spawn(move || {
            let probe = Probe::new(files.config());
            Reference::portable(&files, &probe).map_err(|e| e.to_string())
        });
        let shared = SharedReference::default();
        match job {
            Ok(j) => *shared.job.lock().unwrap_or_else(|p| p.into_inner()) = Some(j),
            Err(e) => {
                let _ = shared.cell.set(Err(format!("cannot start the self-check's reference thread: {e}")));
            }
        }
        shared
    }

    /// The reference: the thread's result once it has ended, or computed now by the first caller
    /// where no thread was started.
    pub fn get(&self, files: &ModelFiles, probe: &Probe) -> &Result<Reference, String> {
        self.cell.get_or_init(|| {
            let job = self.job.lock().ok().and_then(|mut j| j.take());
            match job {
                Some(j) => j.join().unwrap_or_else(|_| Err("the self-check's reference computation panicked".into())),
                None => Reference::portable(files, probe).map_err(|e| e.to_string()),
            }
        })
    }
}

/// One device's self-check: the relative error of its serving path per index.
#[derive(Clone, Debug)]
pub struct Report {
    pub device: String,
    pub dtype: ComputeDType,
    /// `(index, ||serving - reference|| / ||reference||)` over the probe's tokens; infinite where
    /// the serving path returned a non-finite value.
    pub errors: Vec<(usize, f64)>,
    pub tolerance: f64,
    /// The serving path's share: the probe through the device, and the comparison.
    pub seconds: f64,
    /// How long the reference took to compute (on the CPU, for every device at once).
    pub reference_seconds: f64,
    /// How long this device, once loaded, waited for the reference: with the probe, what the
    /// check added to its start.
    pub waited_seconds: f64,
    /// The first index where the reference itself (the portable f32 path) is not finite: then
    /// the checkpoint's own values overflow or are damaged, whatever the serving path does.
    pub reference_nonfinite: Option<usize>,
}

impl Report {
    /// The worst index and its error.
    pub fn worst(&self) -> (usize, f64) {
        self.errors.iter().copied().fold((0, 0.0), |w, e| if e.1 > w.1 || e.1.is_nan() { e } else { w })
    }

    pub fn passed(&self) -> bool {
        self.errors.iter().all(|&(_, e)| e <= self.tolerance)
    }
}

/// The probe packed in one batch through `serving`, compared index by index with `reference`.
pub fn check(
    serving: &mut dyn Engine,
    probe: &Probe,
    reference: &Reference,
    device: &str,
    dtype: ComputeDType,
) -> Result<Report, EngineError> {
    let start = Instant::now();
    let ids: Vec<u32> = probe.seqs.iter().flatten().copied().collect();
    let mut cu = vec![0];
    for s in &probe.seqs {
        cu.push(cu.last().copied().unwrap_or(0) + s.len());
    }
    let t = ids.len();
    let taps = serving.forward(&Batch::new(ids, cu, probe.indices.clone()))?;
    let errors = probe
        .indices
        .iter()
        .enumerate()
        .map(|(k, &index)| {
            let got = taps.gather(0, t, &[index], OutDType::Float32)?.to_f32();
            Ok((index, relative_error(&got, &reference.states[k])))
        })
        .collect::<Result<Vec<_>, EngineError>>()?;
    Ok(Report {
        device: device.into(),
        dtype,
        errors,
        tolerance: tolerance(dtype, probe.routed, probe.fp8),
        seconds: start.elapsed().as_secs_f64(),
        reference_seconds: reference.seconds,
        waited_seconds: 0.0,
        reference_nonfinite: probe
            .indices
            .iter()
            .zip(&reference.states)
            .find(|(_, s)| s.iter().any(|v| !v.is_finite()))
            .map(|(&i, _)| i),
    })
}

/// `||a - b|| / ||b||` in f64 (`||a - b||` where `b` is zero); infinite when `a` holds a
/// non-finite value or the lengths differ.
pub fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() || a.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        diff += (x as f64 - y as f64).powi(2);
        norm += (y as f64).powi(2);
    }
    if norm > 0.0 {
        (diff / norm).sqrt()
    } else {
        diff.sqrt()
    }
}
