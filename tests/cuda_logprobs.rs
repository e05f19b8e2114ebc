//! Next-token log-probabilities on CUDA (`kernels/logprobs.cu`, the f32-output head matmul)
//! against the CPU path, the f32 reference: ties, k = 1 and k = 64, vocabularies that are not a
//! multiple of the kernel's block, rows past one logits chunk, and a model end to end against
//! transformers' references. Built with `--features cuda`; skipped when no device is visible.
//! `cargo test --release --features cuda --test cuda_logprobs -- --nocapture`.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use layertap::engine::cuda::logprobs::{logits_f32, top_k_logprobs};
use layertap::engine::logprobs::{chunk_rows, top_k, top_k_of_logits};

mod common;

use common::cuda_device as device;

/// Deterministic values in [-scale, scale).
fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn host<T: candle_core::WithDType>(t: &Tensor) -> Vec<T> {
    t.flatten_all().unwrap().to_device(&Device::Cpu).unwrap().to_vec1::<T>().unwrap()
}

/// The kernel's ids equal the host's exactly (ties by ascending id, including ties at the top,
/// inside the top k and across its cut), and its log-probabilities and target log-probabilities
/// are within 1e-5.
#[test]
fn kernel_top_k_equals_the_host_with_ties() {
    let Some(dev) = device() else { return };
    for vocab in [64usize, 1000, 4097, 49_152, 151_936] {
        let rows = 37;
        let mut v = noise(rows * vocab, vocab as u64, 8.0);
        for r in 0..rows {
            let row = &mut v[r * vocab..(r + 1) * vocab];
            // Ties: a run of equal maxima, and equal values scattered over the row (across the
            // threads' strides and around the 64th place).
            let top = 9.5;
            for i in [vocab - 1, r % vocab, vocab / 2, 3] {
                row[i] = top;
            }
            for j in 0..80 {
                row[(j * 97 + r * 13) % vocab] = 8.25;
            }
            if r % 5 == 0 {
                row.iter_mut().for_each(|x| *x = 1.0); // all equal
            }
        }
        let targets: Vec<i32> = (0..rows).map(|r| if r % 4 == 3 { -1 } else { ((r * 7919) % vocab) as i32 }).collect();
        let cpu = Tensor::from_vec(v.clone(), (rows, vocab), &Device::Cpu).unwrap();
        let gpu = cpu.to_device(&dev).unwrap();
        let t_gpu = Tensor::new(targets.as_slice(), &dev).unwrap();
        for k in [1usize, 5, 16, 64] {
            if k > vocab {
                continue;
            }
            let want = top_k_of_logits(&cpu, k, &targets).unwrap().to_host().unwrap();
            let (ids, lps, tgt) = top_k_logprobs(&gpu, k, &t_gpu).unwrap();
            assert_eq!(host::<u32>(&ids), want.ids, "vocab {vocab}, k {k}: ids");
            let lps = host::<f32>(&lps);
            let worst = lps.iter().zip(&want.logprobs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-5, "vocab {vocab}, k {k}: log-probabilities off by {worst}");
            for (r, (a, b)) in host::<f32>(&tgt).iter().zip(&want.target).enumerate() {
                assert_eq!(a.is_nan(), b.is_nan(), "row {r}");
                assert!(a.is_nan() || (a - b).abs() <= 1e-5, "vocab {vocab} row {r}: target {a} vs {b}");
            }
            eprintln!("vocab {vocab}, k {k}: max |lp - host| = {worst:e}");
        }
    }
}

/// The head's logits in f32 from bf16 (and f16, f32) inputs: the host's f32 matmul of the same
/// values, to f32 accumulation order.
#[test]
fn head_logits_are_f32_products_of_the_inputs() {
    let Some(dev) = device() else { return };
    let (rows, vocab, hidden) = (70, 3001, 576);
    let x = Tensor::from_vec(noise(rows * hidden, 1, 1.0), (rows, hidden), &Device::Cpu).unwrap();
    let w = Tensor::from_vec(noise(vocab * hidden, 2, 0.1), (vocab, hidden), &Device::Cpu).unwrap();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let (xd, wd) = (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap());
        let want = xd.to_dtype(DType::F32).unwrap().matmul(&wd.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap();
        let got = logits_f32(&xd.to_device(&dev).unwrap(), &wd.to_device(&dev).unwrap()).unwrap();
        assert_eq!(got.dtype(), DType::F32);
        let worst = host::<f32>(&got).iter().zip(host::<f32>(&want)).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        // |logit| reaches ~3; f32 accumulation of 576 products in another order.
        assert!(worst <= 1e-5, "{dtype:?}: {worst}");
        eprintln!("{dtype:?}: max |logit - host f32| = {worst:e}");
    }
}

/// The whole device path (chunks of rows, head, kernel) for a bf16 model against the CPU path on
/// the same bf16 values widened to f32, past one chunk of rows of a Qwen-sized vocabulary.
#[test]
fn bf16_rows_past_one_chunk_match_the_cpu_path() {
    let Some(dev) = device() else { return };
    let (vocab, hidden) = (151_936, 256);
    let rows = chunk_rows(vocab) + 59;
    let x = Tensor::from_vec(noise(rows * hidden, 3, 1.0), (rows, hidden), &Device::Cpu).unwrap();
    let w = Tensor::from_vec(noise(vocab * hidden, 4, 0.2), (vocab, hidden), &Device::Cpu).unwrap();
    let (x, w) = (x.to_dtype(DType::BF16).unwrap(), w.to_dtype(DType::BF16).unwrap());
    let targets: Vec<i32> = (0..rows).map(|r| if r % 9 == 0 { -1 } else { (r * 31) as i32 }).collect();
    let want = top_k(&x, &w, 64, &targets).unwrap().to_host().unwrap();
    let got = top_k(&x.to_device(&dev).unwrap(), &w.to_device(&dev).unwrap(), 64, &targets).unwrap().to_host().unwrap();
    let worst = got.logprobs.iter().zip(&want.logprobs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let differing = got.ids.iter().zip(&want.ids).filter(|(a, b)| a != b).count();
    eprintln!("{rows} rows: max |lp - cpu| = {worst:e}, {differing} of {} ids differ", want.ids.len());
    assert!(worst <= 1e-4, "{worst}");
    // Ids differ only where two log-probabilities are within the error of each other.
    assert!(differing * 100 <= want.ids.len(), "{differing}");
}

/// A model on the GPU in f32 gives transformers' log-probabilities (the tiny fixtures'
/// references), as the CPU path does, within 1e-4.
#[test]
fn fixtures_on_the_gpu_match_transformers() {
    use layertap::engine::loader::ModelFiles;
    use layertap::engine::{Batch, Engine, LogprobRows, Rows};
    let Some(dev) = device() else { return };
    for dir in common::fixture_models() {
        let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
        let n = files.config().num_hidden_layers;
        for dtype in [DType::F32, DType::BF16] {
            let mut engine = files.load(&dev, dtype).unwrap().engine;
            let r = common::read_safetensors(&dir.join("logprobs.safetensors"));
            let mut worst = 0f32;
            for s in 0..3 {
                let Some(ids) = r.get(&format!("seq{s}.input_ids")) else { continue };
                let ids: Vec<u32> = ids.i64.iter().map(|&x| x as u32).collect();
                let pos: Vec<u32> = r[&format!("seq{s}.positions")].i64.iter().map(|&x| x as u32).collect();
                let mut batch = Batch::pack([&ids[..]], [n]);
                batch.output.logprobs = Some(LogprobRows { rows: Rows::Only(pos.clone()), top_k: 16 });
                let lp = engine.forward(&batch).unwrap().logprobs.unwrap();
                let want = &r[&format!("seq{s}.topk_logprobs")].f32;
                worst = lp.logprobs.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(worst, f32::max);
            }
            eprintln!("{} {dtype:?}: max |lp - transformers f32| = {worst:e}", dir.display());
            if dtype == DType::F32 {
                assert!(worst <= 1e-4, "{}: {worst}", dir.display());
            }
        }
    }
}
