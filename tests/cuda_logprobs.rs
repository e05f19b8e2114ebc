//! Next-token log-probabilities on CUDA (`kernels/logprobs.cu`, the f32-output head matmul)
//! against the CPU path, the f32 reference: ties, k = 1 and k = 64, vocabularies that are not a
//! multiple of the kernel's block, rows of heavy ties, signed zeros, NaN and -inf against a sort,
//! rows past one logits chunk, and a model end to end against transformers' references. Built with `--features cuda`; skipped when no device is visible.
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

/// The kernel's top k of each row of `rows` against a sort of the row: every id must match, and
/// every log-probability be the value less the row's log-sum-exp (NaN past the values that are not
/// NaN). The log-sum-exp is the host's where the row has no NaN; where it has, the kernel's is NaN
/// or, when the NaNs only meet NaN and -inf in its reduction, that of the rest, so it is taken from
/// the kernel's first finite entry and only the selection and the other entries are checked.
fn check_rows(dev: &Device, vocab: usize, rows: &[f32], targets: &[i32], k: usize, what: &dyn Fn(usize) -> String) {
    let n = targets.len();
    let cpu = Tensor::from_vec(rows.to_vec(), (n, vocab), &Device::Cpu).unwrap();
    let (ids, lps, tgt) = top_k_logprobs(&cpu.to_device(dev).unwrap(), k, &Tensor::new(targets, dev).unwrap()).unwrap();
    let (ids, lps, tgt) = (host::<u32>(&ids), host::<f32>(&lps), host::<f32>(&tgt));
    let on_host = top_k_of_logits(&cpu, k, targets).unwrap().to_host().unwrap();
    let close = |a: f32, b: f32| (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= 1e-5;
    for r in 0..n {
        let row = &rows[r * vocab..(r + 1) * vocab];
        let (got, got_lp) = (&ids[r * k..(r + 1) * k], &lps[r * k..(r + 1) * k]);
        // The ids that are not NaN by descending value (-0 equal to +0), equal values by ascending
        // id; past them id 0.
        let mut want: Vec<usize> = (0..vocab).filter(|&i| !row[i].is_nan()).collect();
        want.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        want.truncate(k);
        let mut want_ids: Vec<u32> = want.iter().map(|&i| i as u32).collect();
        want_ids.resize(k, 0);
        assert_eq!(got, want_ids, "{}, k {k}: ids", what(r));
        let lse = if row.iter().any(|v| v.is_nan()) {
            match want.iter().position(|&i| row[i].is_finite()) {
                Some(j) => f64::from(row[want[j]]) - f64::from(got_lp[j]),
                None => f64::NAN,
            }
        } else {
            assert_eq!(&on_host.ids[r * k..(r + 1) * k], got, "{}, k {k}: the host's ids", what(r));
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            f64::from(max) + row.iter().map(|&v| (f64::from(v) - f64::from(max)).exp()).sum::<f64>().ln()
        };
        for (j, &g) in got_lp.iter().enumerate() {
            let lp = want.get(j).map_or(f32::NAN, |&i| (f64::from(row[i]) - lse) as f32);
            assert!(close(g, lp), "{}, k {k}: log-probability {j}: {g} vs {lp}", what(r));
        }
        let t = targets[r];
        let want_t = if t >= 0 && (t as usize) < vocab { (f64::from(row[t as usize]) - lse) as f32 } else { f32::NAN };
        assert!(close(tgt[r], want_t), "{}: target {} vs {want_t}", what(r), tgt[r]);
    }
}

/// Exact selection on hard rows: values from a handful (ties across the cut, many times over), all
/// equal, +0 and -0 mixed (equal, so by id), NaN sprinkled (never selected), fewer than k values
/// that are not NaN (the slots past them get id 0 and NaN), -inf mixed in and selected (ranked
/// last, by id), all -inf, all NaN; k from 1 to 64; vocabularies below the kernel's block of 256
/// and not a multiple of it, and odd ones, whose rows do not start 16-byte aligned.
#[test]
fn kernel_top_k_is_exact_with_heavy_ties_zeros_nan_and_infinities() {
    let Some(dev) = device() else { return };
    const KINDS: [&str; 10] = [
        "a handful of values",
        "two values",
        "all equal",
        "+0 and -0",
        "NaN sprinkled",
        "fewer than k not NaN",
        "-inf mixed in",
        "-inf selected",
        "all -inf",
        "all NaN",
    ];
    for vocab in [1usize, 3, 70, 200, 255, 257, 1000, 4099, 151_936] {
        let rows = 2 * KINDS.len();
        let mut v = noise(rows * vocab, 7 + vocab as u64, 8.0);
        let pick = noise(rows * vocab, 11 + vocab as u64, 1.0);
        // An index into a list of m choices, from the second noise.
        let choose = |i: usize, m: usize| (((pick[i] + 1.0) * 0.5 * m as f32) as usize).min(m - 1);
        for r in 0..rows {
            let base = r * vocab;
            for i in 0..vocab {
                let x = &mut v[base + i];
                *x = match r % KINDS.len() {
                    0 => [-1.0, 0.0, 2.5, 3.0, 7.0][choose(base + i, 5)],
                    1 => [1.0, 2.0][choose(base + i, 2)],
                    2 => -3.5,
                    3 => [0.0, -0.0, -0.0, -1.5][choose(base + i, 4)],
                    4 => [*x, *x, f32::NAN, -f32::NAN][choose(base + i, 4)],
                    5 | 9 => f32::NAN,
                    6 => [*x, f32::NEG_INFINITY, f32::NEG_INFINITY][choose(base + i, 3)],
                    7 | 8 => f32::NEG_INFINITY,
                    _ => *x,
                };
            }
            let row = &mut v[base..base + vocab];
            match r % KINDS.len() {
                // A few positive values above the zeros, the rest of the top k zeros of both signs.
                3 => (0..5).for_each(|j| row[(j * 37 + r) % vocab] = 0.25),
                // Three values (fewer where the vocabulary is smaller); the rest NaN.
                5 => [vocab - 1, 0, vocab / 2].iter().for_each(|&i| row[i] = 1.0 + i as f32 * 1e-3),
                7 => [vocab / 3, vocab - 1].iter().for_each(|&i| row[i] = -2.0),
                _ => {}
            }
        }
        let targets: Vec<i32> = (0..rows).map(|r| if r % 3 == 2 { -1 } else { ((r * 7919) % vocab) as i32 }).collect();
        for k in [1usize, 2, 7, 33, 64] {
            if k <= vocab {
                check_rows(&dev, vocab, &v, &targets, k, &|r| {
                    format!("vocab {vocab}, row {r} ({})", KINDS[r % KINDS.len()])
                });
            }
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
