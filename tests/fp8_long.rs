//! FP8 fidelity on long sequences, against float64 (tests/fixtures/fp8_long, made by
//! scripts/make_fp8_long_fixtures.py): a 256-wide random checkpoint in Qwen's block-wise FP8
//! layout, 130-token sequences, the states of transformers' own model run in float64 end to end
//! (the W8A8 activation quantisation included), and transformers-f32's distance from them.
//!
//! W8A8 is discontinuous: an activation within f32 noise of an e4m3 rounding boundary rounds one
//! way or the other under the last-bit differences of two correct f32 implementations, and that
//! token (and through attention every later one) moves by ~1e-2 on this checkpoint. No single
//! f32 run is the answer there, so the engine is measured as transformers-f32 is: its distance
//! from the float64 run, per index, and the token of its first rounding flip.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{edited_fixture, fixtures, read_safetensors, OwnedTensor, Read};
use layertap::engine::loader::ModelFiles;
use layertap::engine::{Batch, DType, Device, Engine, ModelEngine, OutDType};
use safetensors::tensor::Dtype;
use serde_json::Value;

const FIXTURE: &str = "fp8_long/qwen3_256";

/// Per index and token, `(|a - b|^2, |b|^2)` (L2 over the hidden size) of `a` and `b`
/// `[indices, T, H]`.
fn squares(a: &[f32], b: &[f32], indices: usize, t: usize, h: usize) -> Vec<Vec<(f64, f64)>> {
    let row = |o: usize| {
        a[o..o + h].iter().zip(&b[o..o + h]).fold((0f64, 0f64), |(n, d), (x, y)| {
            (n + (f64::from(*x) - f64::from(*y)).powi(2), d + f64::from(*y).powi(2))
        })
    };
    (0..indices).map(|l| (0..t).map(|r| row((l * t + r) * h)).collect()).collect()
}

/// `|a - b| / |b|` from [`squares`]; 0 where both rows are zero (the padding id's embedding).
fn distance((num, den): (f64, f64)) -> f64 {
    if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    }
}

/// The first token whose distance exceeds `flip` at some index, with the first such index;
/// `(t, 0)` when none does.
fn first_flip(dist: &[Vec<f64>], flip: f64) -> (usize, usize) {
    let t = dist[0].len();
    (0..t).find_map(|r| dist.iter().position(|d| d[r] > flip).map(|l| (r, l))).unwrap_or((t, 0))
}

/// The engine's states `[indices, T, H]` (index-major, as the reference) of one sequence.
fn states(engine: &mut ModelEngine, ids: &[u32], indices: usize, h: usize) -> Vec<f32> {
    let t = ids.len();
    let all: Vec<usize> = (0..indices).collect();
    let taps = engine.forward(&Batch::new(ids.to_vec(), vec![0, t], all.clone())).expect("forward");
    let got = taps.gather(0, t, &all, OutDType::Float32).expect("gather").to_f32();
    let mut out = vec![0f32; indices * t * h];
    for r in 0..t {
        for l in 0..indices {
            out[(l * t + r) * h..][..h].copy_from_slice(&got[(r * indices + l) * h..][..h]);
        }
    }
    out
}

struct Measured {
    /// Per index, sqrt(sum |x - h64|^2 / sum |h64|^2) over every token of every sequence.
    engine: Vec<f64>,
    f32: Vec<f64>,
    /// Per sequence, the first flip: token, index, and the float64 run's boundary gap of the
    /// decoder layer before that index at that token.
    engine_flips: Vec<(usize, usize, f64)>,
    f32_flips: Vec<(usize, usize, f64)>,
    /// The largest distance of any index and token before the sequence's first flip.
    engine_before: f64,
    f32_before: f64,
    t: usize,
}

/// The engine loaded from `model` (the fixture, or a copy of it) against the fixture's references.
fn measure(model: &Path) -> Measured {
    let dir = fixtures().join(FIXTURE);
    let facts: Value = serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let flip = facts["flip_threshold"].as_f64().unwrap();
    let files = ModelFiles::locate(&model.to_string_lossy()).expect("locate fixture");
    let m = files.load(&Device::Cpu, DType::F32).expect("load fixture");
    let mut engine = m.engine;
    let reference = read_safetensors(&dir.join("reference.safetensors"));
    let indices = m.info.num_layers + 1;
    let (mut ours, mut theirs) = (vec![(0f64, 0f64); indices], vec![(0f64, 0f64); indices]);
    let (mut engine_flips, mut f32_flips, mut t) = (vec![], vec![], 0);
    let (mut engine_before, mut f32_before) = (0f64, 0f64);
    for i in 0.. {
        let Some(ids) = reference.get(&format!("seq{i}.input_ids")) else { break };
        let h64: &Read = &reference[&format!("seq{i}.hidden_states")];
        let f32_dist = &reference[&format!("seq{i}.f32_distance")];
        assert_eq!(h64.shape[0], indices);
        let (len, h) = (h64.shape[1], h64.shape[2]);
        t = len;
        let ids: Vec<u32> = ids.i64.iter().map(|&x| x as u32).collect();
        let got = states(&mut engine, &ids, indices, h);
        let sq = squares(&got, &h64.f32, indices, len, h);
        let dist: Vec<Vec<f64>> = sq.iter().map(|d| d.iter().map(|&x| distance(x)).collect()).collect();
        // transformers-f32's per-token distances, and its squares on the same rows.
        let theirs_dist: Vec<Vec<f64>> = (0..indices)
            .map(|l| f32_dist.f32[l * len..(l + 1) * len].iter().map(|&d| f64::from(d)).collect())
            .collect();
        for (l, (sq, td)) in sq.iter().zip(&theirs_dist).enumerate() {
            for ((num, den), d) in sq.iter().zip(td) {
                ours[l].0 += num;
                ours[l].1 += den;
                theirs[l].0 += d * d * den;
                theirs[l].1 += den;
            }
        }
        let gap = &reference[&format!("seq{i}.boundary_gap")];
        let with_gap = |(r, l): (usize, usize)| {
            let g = if r < len && l > 0 { f64::from(gap.f32[(l - 1) * len + r]) } else { f64::NAN };
            (r, l, g)
        };
        let before =
            |d: &[Vec<f64>], (r, _): (usize, usize)| d.iter().flat_map(|x| &x[..r]).fold(0f64, |m, &e| m.max(e));
        engine_before = engine_before.max(before(&dist, first_flip(&dist, flip)));
        f32_before = f32_before.max(before(&theirs_dist, first_flip(&theirs_dist, flip)));
        engine_flips.push(with_gap(first_flip(&dist, flip)));
        f32_flips.push(with_gap(first_flip(&theirs_dist, flip)));
    }
    assert!(engine_flips.len() >= 4, "{} sequences", engine_flips.len());
    let ratio = |s: &[(f64, f64)]| s.iter().map(|(n, d)| (n / d).sqrt()).collect::<Vec<_>>();
    Measured { engine: ratio(&ours), f32: ratio(&theirs), engine_flips, f32_flips, engine_before, f32_before, t }
}

/// Where the engine falls outside what transformers-f32 achieves against float64, one line each.
///
/// Distance: per index, over every token of every sequence, at most 2x transformers-f32's own
/// distance (the project's rule where f32 itself drifts from float64) plus 1e-5 for the case of
/// no flip at all (both then lie ~4e-7 from float64; a flip adds ~1e-2). The factor 2 covers
/// flips that come at other tokens: after its first flip a sequence's states lie 1e-2 to 4e-2
/// from float64 whichever run flipped, so the distance is set by how much of the sequence follows
/// the first flip, and an engine flipping at its first token everywhere stays within 2x. So this
/// bound catches arithmetic that moves the states by more than a flip does (activations rounded
/// the wrong way by a whole step, or not quantised at all, at index 1), not a wrong one that moves
/// them by as much as a flip.
///
/// First flip: an engine whose W8A8 arithmetic is wrong departs from float64 at the first token
/// of every sequence; a right one only where one of its activations lies within f32 noise of an
/// e4m3 rounding boundary, and its f32 roundings and transformers' fall on different sides of
/// it: on this checkpoint 2 to 36 tokens in, mostly at the same token for both (the first layer's
/// exact ties decided alike). Which of two f32 runs flips first at a near tie is chance, so the
/// bound is on the mean over the sequences, and loose: the engine's mean first flip at least a
/// quarter of transformers-f32's. Were the engine's flips as frequent as transformers' but
/// independent of them (the first flip about geometric), six sequences would fall below that
/// with a probability of ~0.5%; an engine departing at the first token falls below it always.
///
/// Neither bound sees an error no larger than f32 noise (a scale a few ulps off flips at near
/// ties as f32 noise does) or one that only acts on exact ties (ties away from zero instead of to
/// even): the activation quantiser's own test (tests/fp8.rs) checks torch's bits for those.
fn failures(m: &Measured) -> Vec<String> {
    let mut out = Vec::new();
    for (l, (ours, theirs)) in m.engine.iter().zip(&m.f32).enumerate() {
        if *ours > 2.0 * theirs + 1e-5 {
            out.push(format!("index {l}: {ours:.3e} from float64, transformers-f32 {theirs:.3e}"));
        }
    }
    let mean = |f: &[(usize, usize, f64)]| f.iter().map(|x| x.0 as f64).sum::<f64>() / f.len() as f64;
    let (ours, theirs) = (mean(&m.engine_flips), mean(&m.f32_flips));
    if ours < theirs / 4.0 {
        out.push(format!("mean first flip at token {ours:.1}, transformers-f32 at {theirs:.1}"));
    }
    out
}

fn report(m: &Measured) {
    let fmt = |v: &[f64]| v.iter().map(|e| format!("{e:.2e}")).collect::<Vec<_>>().join(" ");
    println!("distance from float64 per index: layertap {}, transformers-f32 {}", fmt(&m.engine), fmt(&m.f32));
    for (who, flips) in [("layertap", &m.engine_flips), ("transformers-f32", &m.f32_flips)] {
        let at: Vec<String> = flips.iter().map(|(t, l, g)| format!("{t} (index {l}, gap {g:.1e})")).collect();
        println!("first flip per sequence of {} tokens, {who}: {}", m.t, at.join(", "));
    }
    println!(
        "largest distance before the first flip: layertap {:.1e}, transformers-f32 {:.1e}",
        m.engine_before, m.f32_before
    );
}

#[test]
fn fp8_states_on_long_sequences_are_as_close_to_float64_as_transformers_f32() {
    let m = measure(&fixtures().join(FIXTURE));
    report(&m);
    // The fixture measures something: transformers-f32 flips, and not at once.
    let flipped = m.f32_flips.iter().filter(|f| f.0 < m.t).count();
    let mean = m.f32_flips.iter().map(|f| f.0).sum::<usize>() as f64 / m.f32_flips.len() as f64;
    assert!(flipped >= m.f32_flips.len() / 2 && mean >= 4.0, "{:?}", m.f32_flips);
    let failed = failures(&m);
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// The bounds have teeth: the same checkpoint with its weights dequantised to f32 and its
/// activations left unquantised (W8A16, what an engine that skipped the activation quantisation
/// computes) fails both.
#[test]
fn an_engine_that_skips_the_activation_quantisation_fails_both_bounds() {
    let copy = edited_fixture(&fixtures().join(FIXTURE), dequantise, |c| {
        c.as_object_mut().unwrap().remove("quantization_config");
    });
    let m = measure(copy.path());
    report(&m);
    let failed = failures(&m);
    assert!(failed.iter().any(|f| f.starts_with("index ")), "{failed:?}");
    assert!(failed.iter().any(|f| f.starts_with("mean first flip")), "{failed:?}");
}

/// Each F8_E4M3 weight of a checkpoint replaced by its f32 dequantisation (`q * scale` per 128 x
/// 128 block, the scales f32 as in this fixture), the scales dropped.
fn dequantise(ts: &mut Vec<OwnedTensor>) {
    let f32s = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    let scales: HashMap<String, (Dtype, Vec<f32>)> = ts
        .iter()
        .filter(|t| t.0.ends_with(".weight_scale_inv"))
        .map(|t| (t.0.trim_end_matches("_scale_inv").to_string(), (t.1, f32s(&t.3))))
        .collect();
    ts.retain(|t| !t.0.ends_with(".weight_scale_inv"));
    for (name, dtype, shape, bytes) in ts.iter_mut().filter(|t| t.1 == Dtype::F8_E4M3) {
        let (sdtype, scale) = &scales[name.as_str()];
        assert_eq!(*sdtype, Dtype::F32, "{name}");
        let (k, kb) = (shape[1], shape[1].div_ceil(128));
        let w = bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| float8::F8E4M3::from_bits(b).to_f32() * scale[(i / k / 128) * kb + (i % k) / 128]);
        *bytes = w.flat_map(f32::to_le_bytes).collect();
        *dtype = Dtype::F32;
    }
}
