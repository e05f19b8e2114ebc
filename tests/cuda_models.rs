//! Every tiny fixture family (dense, Gated DeltaNet hybrids, MoE) on a GPU against the
//! transformers references: f32 at every index, and bf16 compute no further from the f32
//! reference than transformers' own bf16 run (where the fixture carries it). Built with
//! `--features cuda`; skipped when no device is visible. Run on a GPU machine with
//! `cargo test --release --features cuda --test cuda_models`.
#![cfg(feature = "cuda")]

mod common;

use common::{read_safetensors, rel_err};
use layertap::engine::loader::ModelFiles;
use layertap::engine::{Batch, DType, Engine, OutDType};

#[test]
fn every_fixture_family_matches_transformers_on_the_gpu() {
    let Some(dev) = common::cuda_device() else { return };
    let dirs = common::fixture_models();
    assert!(dirs.len() >= 10, "{dirs:?}");
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
        let reference = read_safetensors(&dir.join("reference.safetensors"));
        let mut seqs = Vec::new();
        while let Some(ids) = reference.get(&format!("seq{}.input_ids", seqs.len())) {
            seqs.push(ids.i64.iter().map(|&x| x as u32).collect::<Vec<u32>>());
        }
        let mut cu = vec![0];
        for s in &seqs {
            cu.push(cu.last().unwrap() + s.len());
        }
        for dtype in [DType::F32, DType::BF16] {
            let mut m = files.load(&dev, dtype).unwrap();
            let n = m.info.num_layers;
            let all: Vec<usize> = (0..=n).collect();
            // Every sequence packed in one batch.
            let batch = Batch::new(seqs.concat(), cu.clone(), all.clone());
            let taps = m.engine.forward(&batch).unwrap();
            let mut worst = 0f64;
            for (i, s) in seqs.iter().enumerate() {
                if dtype == DType::BF16 && i != 2 {
                    continue;
                }
                let got = taps.gather(cu[i], s.len(), &all, OutDType::Float32).unwrap().to_f32();
                let hs = &reference[&format!("seq{i}.hidden_states")];
                let (t, h) = (hs.shape[1], hs.shape[2]);
                for layer in 0..=n {
                    let want = &hs.f32[layer * t * h..(layer + 1) * t * h];
                    let ours: Vec<f32> = (0..t).flat_map(|r| got[(r * (n + 1) + layer) * h..][..h].to_vec()).collect();
                    let e = rel_err(&ours, want);
                    worst = worst.max(e);
                    let allowed = if dtype == DType::F32 {
                        1e-5
                    } else {
                        reference.get("seq2.hidden_states_bf16").map_or(2e-2, |hf| {
                            (1.5 * rel_err(&hf.f32[layer * t * h..(layer + 1) * t * h], want)).max(2e-2)
                        })
                    };
                    assert!(e <= allowed, "{name} {dtype:?} seq{i} index {layer}: {e:.3e} > {allowed:.3e}");
                }
            }
            println!("{name} {dtype:?}: worst relative error {worst:.3e}");
        }
    }
}

/// The copy of the taps to the host runs on its own stream: it must wait for the kernels that
/// wrote them. Asking a subset of layers of a large batch (the batch's own work still running
/// when it is launched, its pinned buffer reused on the later runs) gives exactly the bits the
/// same indices have when every layer is asked.
#[test]
fn a_subset_of_layers_is_copied_only_once_computed() {
    let Some(dev) = common::cuda_device() else { return };
    for dir in common::fixture_models() {
        let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
        let mut m = files.load(&dev, DType::BF16).unwrap();
        let (n, vocab) = (m.info.num_layers, m.info.vocab_size as u64);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) % vocab) as u32
        };
        let (seqs, len) = (8, 2048);
        let ids: Vec<u32> = (0..seqs * len).map(|_| next()).collect();
        let cu: Vec<usize> = (0..=seqs).map(|i| i * len).collect();
        let total = ids.len();
        let run = |m: &mut layertap::engine::LoadedModel, layers: Vec<usize>, pick: &[usize]| {
            let batch = Batch::new(ids.clone(), cu.clone(), layers);
            let taps = m.engine.forward(&batch).unwrap();
            let v = taps.gather(0, total, pick, OutDType::Float32).unwrap().to_f32();
            v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
        };
        let pick = [1, n];
        let want = run(&mut m, (0..=n).collect(), &pick);
        for k in 0..3 {
            let got = run(&mut m, pick.to_vec(), &pick);
            let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "{}: run {k}: {differ} of {} values differ", dir.display(), want.len());
        }
    }
}
