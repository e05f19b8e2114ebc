//! Fidelity of the engine against Hugging Face transformers on tiny random checkpoints of every
//! family and variant (tests/fixtures/tiny, made by scripts/make_fixtures.py), batch invariance
//! and early exit.

mod common;

use std::path::{Path, PathBuf};

use common::{fixtures, read_safetensors, rel_err};
use layertap::answer::LayerSet;
use layertap::engine::loader::ModelFiles;
use layertap::engine::{Batch, DType, Device, Engine, ModelEngine, OutDType};

const F32_TOLERANCE: f64 = 1e-5;

fn variants() -> Vec<PathBuf> {
    let v = common::fixture_models();
    assert!(v.len() >= 5, "expected the five tiny fixtures, found {v:?}");
    v
}

fn load(dir: &Path) -> (ModelEngine, usize) {
    let files = ModelFiles::locate(&dir.to_string_lossy()).expect("locate fixture");
    let m = files.load(&Device::Cpu, DType::F32).expect("load fixture");
    let n = m.info.num_layers;
    (m.engine, n)
}

/// Hidden states `[T, n_layers, H]` of sequences packed in one batch, per sequence.
fn run(engine: &mut ModelEngine, seqs: &[Vec<u32>], layers: &[usize]) -> Vec<Vec<f32>> {
    let mut cu = vec![0];
    for s in seqs {
        cu.push(cu.last().unwrap() + s.len());
    }
    let batch = Batch::new(seqs.concat(), cu.clone(), layers.to_vec());
    let taps = engine.forward(&batch).expect("forward");
    (0..seqs.len())
        .map(|i| taps.gather(cu[i], seqs[i].len(), layers, OutDType::Float32).expect("gather").to_f32())
        .collect()
}

#[test]
fn every_family_matches_transformers_at_every_index() {
    for dir in variants() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let (mut engine, n) = load(&dir);
        let reference = read_safetensors(&dir.join("reference.safetensors"));
        let all: Vec<usize> = (0..=n).collect();
        let mut worst = vec![0f64; n + 1];
        for i in 0.. {
            let Some(ids) = reference.get(&format!("seq{i}.input_ids")) else { break };
            let hs = &reference[&format!("seq{i}.hidden_states")];
            let (l1, t, h) = (hs.shape[0], hs.shape[1], hs.shape[2]);
            assert_eq!(l1, n + 1, "{name}: reference has {l1} hidden states for {n} layers");
            let seq: Vec<u32> = ids.i64.iter().map(|&x| x as u32).collect();
            let got = run(&mut engine, &[seq], &all).remove(0);
            for layer in 0..=n {
                let want = &hs.f32[layer * t * h..(layer + 1) * t * h];
                let ours: Vec<f32> = (0..t).flat_map(|r| got[(r * (n + 1) + layer) * h..][..h].to_vec()).collect();
                let e = rel_err(&ours, want);
                worst[layer] = worst[layer].max(e);
                assert!(e <= F32_TOLERANCE, "{name} seq{i} (T={t}) index {layer}: relative error {e:.3e}");
            }
        }
        let per_index: Vec<String> = worst.iter().map(|e| format!("{e:.1e}")).collect();
        println!("{name}: worst relative error per index 0..={n}: {}", per_index.join(" "));
    }
}

#[test]
fn packed_sequences_equal_solo_runs_bitwise() {
    for dir in variants() {
        let (mut engine, n) = load(&dir);
        let reference = read_safetensors(&dir.join("reference.safetensors"));
        let seqs: Vec<Vec<u32>> =
            (0..3).map(|i| reference[&format!("seq{i}.input_ids")].i64.iter().map(|&x| x as u32).collect()).collect();
        let layers = vec![n, 0, 1];
        let packed = run(&mut engine, &[seqs[2].clone(), seqs[0].clone(), seqs[1].clone()], &layers);
        let solo: Vec<Vec<f32>> =
            seqs.iter().map(|s| run(&mut engine, std::slice::from_ref(s), &layers).remove(0)).collect();
        for (p, s) in [(0, 2), (1, 0), (2, 1)] {
            assert_eq!(
                packed[p].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                solo[s].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{}: sequence {s} differs when packed",
                dir.display()
            );
        }
    }
}

#[test]
fn layer_indices_resolve_like_python_and_reject_out_of_range() {
    let dir = variants().remove(0);
    let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
    let cfg = files.config();
    let n = cfg.num_hidden_layers;
    let resolve = |l: &[i64]| LayerSet::of_indices(l, n).map(|s| s.indices().to_vec());
    assert_eq!(resolve(&[-1, 2, -(n as i64) - 1]).unwrap(), vec![n, 2, 0]);
    for bad in [n as i64 + 1, -(n as i64) - 2] {
        let e = resolve(&[bad]).unwrap_err();
        assert!(e.contains("out of range"), "{e}");
    }
    assert!(resolve(&[]).is_err());
    assert!(resolve(&[0, -(n as i64) - 1]).unwrap_err().contains("twice"), "0 and -(n + 1) are the same layer");
}

#[test]
fn token_ids_past_the_vocabulary_are_an_input_error() {
    let dir = variants().remove(0);
    let (mut engine, n) = load(&dir);
    let vocab = engine.decoder.cfg.vocab_size as u32;
    let batch = Batch::new(vec![1, vocab], vec![0, 2], vec![n]);
    match engine.forward(&batch) {
        Err(layertap::engine::EngineError::InvalidInput(m)) => assert!(m.contains(&vocab.to_string()), "{m}"),
        other => panic!("expected an input error, got {:?}", other.map(|t| t.layers)),
    }
}

/// Copies a fixture with every weight of decoder layers `from..` set to NaN.
fn poisoned_copy(src: &Path, from: usize) -> tempfile::TempDir {
    let poison = move |tensors: &mut Vec<common::OwnedTensor>| {
        for (name, _, _, data) in tensors.iter_mut() {
            let layer = name
                .strip_prefix("model.layers.")
                .and_then(|r| r.split('.').next())
                .and_then(|i| i.parse::<usize>().ok());
            // The largest finite f32: the load accepts it (a NaN weight is refused at load), and
            // the layer's products overflow to infinities and NaNs.
            if layer.is_some_and(|l| l >= from) {
                *data = f32::MAX.to_le_bytes().repeat(data.len() / 4);
            }
        }
    };
    common::edited_fixture(src, poison, |_| {})
}

#[test]
fn layers_past_the_deepest_requested_index_are_not_run() {
    let src = fixtures().join("tiny/qwen3_qknorm");
    let reference = read_safetensors(&src.join("reference.safetensors"));
    let seq: Vec<u32> = reference["seq2.input_ids"].i64.iter().map(|&x| x as u32).collect();
    // Decoder layer index 1 (hidden_states[2]) onwards overflows: asking for index <= 1 must not
    // touch it.
    let dir = poisoned_copy(&src, 1);
    let (mut engine, n) = load(dir.path());
    let batch = Batch::new(seq.clone(), vec![0, seq.len()], vec![1, 0]);
    let taps = engine.forward(&batch).unwrap();
    assert_eq!(taps.layers_run, 1, "only decoder layer 1 should run");
    let got = taps.gather(0, seq.len(), &[1], OutDType::Float32).unwrap().to_f32();
    assert!(got.iter().all(|x| x.is_finite()), "a poisoned layer leaked into an earlier index");
    // The control: asking for a deeper index does run the poisoned layer.
    let batch = Batch::new(seq.clone(), vec![0, seq.len()], vec![n]);
    let taps = engine.forward(&batch).unwrap();
    assert_eq!(taps.layers_run, n);
    assert!(taps.gather(0, seq.len(), &[n], OutDType::Float32).unwrap().to_f32().iter().any(|x| !x.is_finite()));
}

#[test]
fn half_precision_compute_stays_close_to_the_f32_reference() {
    for dir in variants() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
        let reference = read_safetensors(&dir.join("reference.safetensors"));
        let hs = &reference["seq2.hidden_states"];
        let (l1, t, h) = (hs.shape[0], hs.shape[1], hs.shape[2]);
        let seq: Vec<u32> = reference["seq2.input_ids"].i64.iter().map(|&x| x as u32).collect();
        // Where the fixture carries transformers' own bf16 run, the engine may be as far from
        // the f32 reference as transformers in bf16 is (with a margin): the small hybrids
        // amplify rounding more than the dense fixtures do.
        let hf_half = reference.get("seq2.hidden_states_bf16");
        for (dtype, out) in [(DType::BF16, OutDType::Bfloat16), (DType::F16, OutDType::Float32)] {
            let mut m = files.load(&Device::Cpu, dtype).unwrap();
            let layers: Vec<usize> = (0..l1).collect();
            let batch = Batch::new(seq.clone(), vec![0, t], layers.clone());
            let x = m.engine.forward(&batch).unwrap().gather(0, t, &layers, out).unwrap();
            assert_eq!(x.dtype, out, "the output dtype is the one asked for");
            let got = x.to_f32();
            for layer in 0..l1 {
                let want = &hs.f32[layer * t * h..(layer + 1) * t * h];
                let ours: Vec<f32> = (0..t).flat_map(|r| got[(r * l1 + layer) * h..][..h].to_vec()).collect();
                let e = rel_err(&ours, want);
                let allowed = hf_half.map_or(2e-2, |hf| {
                    let theirs = rel_err(&hf.f32[layer * t * h..(layer + 1) * t * h], want);
                    (1.5 * theirs).max(2e-2)
                });
                assert!(e <= allowed, "{name} {dtype:?} index {layer}: relative error {e:.3e} (allowed {allowed:.3e})");
            }
        }
    }
}

#[test]
fn the_batch_budget_grows_with_free_memory_and_counts_the_attention_chunk() {
    let files = ModelFiles::locate(&fixtures().join("tiny/qwen3_qknorm").to_string_lossy()).unwrap();
    let cfg = files.config();
    let gib = 1u64 << 30;
    let small = layertap::engine::tokens_for_memory(cfg, &Device::Cpu, DType::BF16, gib, 4096);
    let large = layertap::engine::tokens_for_memory(cfg, &Device::Cpu, DType::BF16, 8 * gib, 4096);
    assert!(small > 0 && large > 7 * small, "{small} {large}");
    assert!(
        layertap::engine::tokens_for_memory(cfg, &Device::Cpu, DType::F32, gib, 4096)
            < layertap::engine::tokens_for_memory(cfg, &Device::Cpu, DType::BF16, gib, 4096)
    );
    // Nothing fits when the attention scores of one chunk alone exceed the budget.
    assert_eq!(layertap::engine::tokens_for_memory(cfg, &Device::Cpu, DType::F32, 1 << 20, 1 << 20), 0);
    // Nor when the logits of one chunk of log-probability rows alone do.
    let logits = layertap::engine::logprobs::LOGITS_BUDGET_BYTES as u64;
    assert_eq!(layertap::engine::tokens_for_memory(cfg, &Device::Cpu, DType::BF16, logits, 16), 0);
}

/// Options are handed to the loader, not read from the environment there: every switch turned
/// away from its default, passed explicitly, loads and runs every family, and on the CPU (where
/// the switches choose only CUDA kernels) gives bitwise the default's states.
#[test]
fn options_passed_to_the_loader_leave_the_cpu_path_as_it_is() {
    use layertap::engine::{AttentionKernel, EngineOptions};
    let flipped = EngineOptions {
        profile: false,
        f32_residual: false,
        fused_add_norm: false,
        fused_rope: false,
        cuda_attention: false,
        attention_kernel: Some(AttentionKernel::Simple),
        cuda_gdn: false,
        gdn_tf32: false,
        cuda_moe: false,
        fp8_gemm: false,
        fp8_fused: false,
        spin_wait: true,
        pool_release: true,
    };
    assert_eq!(flipped.changed().len(), 12, "every switch but profile differs: {:?}", flipped.changed());
    let seqs = vec![vec![1u32, 5, 9, 2], vec![7, 3, 11]];
    for dir in variants() {
        let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
        let mut default = files.load_with(&Device::Cpu, DType::F32, &EngineOptions::default()).unwrap();
        let mut other = files.load_with(&Device::Cpu, DType::F32, &flipped).unwrap();
        let layers: Vec<usize> = (0..=default.info.num_layers).collect();
        let want = run(&mut default.engine, &seqs, &layers);
        let got = run(&mut other.engine, &seqs, &layers);
        assert_eq!(got, want, "{}", dir.display());
    }
}
