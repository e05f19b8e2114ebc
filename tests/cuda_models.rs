//! Every tiny fixture family (dense, Gated DeltaNet hybrids, MoE) on a GPU against the
//! transformers references: f32 at every index, and bf16 compute no further from the f32
//! reference than transformers' own bf16 run (where the fixture carries it). Built with
//! `--features cuda`; skipped when no device is visible. Run on a GPU machine with
//! `cargo test --release --features cuda --test cuda_models`.
#![cfg(feature = "cuda")]

mod common;

use common::{read_safetensors, rel_err};
use layertap::engine::loader::ModelFiles;
use layertap::engine::{Batch, ComputeDType, DType, Engine, OutDType, Output, Rows};

/// A fixture's reference tensors, its sequences, and their offsets packed in one batch.
fn reference_batch(
    dir: &std::path::Path,
) -> (std::collections::HashMap<String, common::Read>, Vec<Vec<u32>>, Vec<usize>) {
    let reference = read_safetensors(&dir.join("reference.safetensors"));
    let mut seqs = Vec::new();
    while let Some(ids) = reference.get(&format!("seq{}.input_ids", seqs.len())) {
        seqs.push(ids.i64.iter().map(|&x| x as u32).collect::<Vec<u32>>());
    }
    let mut cu = vec![0];
    for s in &seqs {
        cu.push(cu.last().unwrap() + s.len());
    }
    (reference, seqs, cu)
}

#[test]
fn every_fixture_family_matches_transformers_on_the_gpu() {
    let Some(dev) = common::cuda_device() else { return };
    let dirs = common::fixture_models();
    assert!(dirs.len() >= 10, "{dirs:?}");
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
        let (reference, seqs, cu) = reference_batch(&dir);
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

/// gpt-oss on the GPU (sinks in the attention kernel, YaRN's factor on the rotary tables, its
/// routing, biases and clamped experts one chain per expert, the MXFP4 experts dequantised at
/// load): in f32 every index within the CPU's bound of transformers-f32 (1e-5, or twice
/// transformers-f32's own distance from float64), and in bf16 as close to the f32 reference as
/// transformers' own bf16 run, for the MXFP4 release and its bf16 twin.
#[test]
#[ignore = "gpt-oss is still refused on a CUDA device (needs_beyond_cuda): lift that and run this with --include-ignored"]
fn gpt_oss_matches_transformers_on_the_gpu() {
    let Some(dev) = common::cuda_device() else { return };
    for name in ["gpt_oss_mxfp4", "gpt_oss_bf16"] {
        let dir = common::fixtures().join("gpt_oss").join(name);
        common::every_index_within_tolerance_on(&dir, name, &dev);
        common::bf16_close_to_reference(&dir, name, &dev);
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

/// On the GPU, for every family: the pre-norm final state matches transformers in f32; rows
/// selected and quantised on the device are the plain answer's rows (bitwise) and their fp8
/// values are those the format defines for them (quantised from the same bf16 states: at most
/// one step of E4M3 apart where the device's rounding of 448 / amax differs); the screen finds
/// nothing in a healthy model.
#[test]
fn selection_fp8_screen_and_prenorm_on_the_gpu() {
    let Some(dev) = common::cuda_device() else { return };
    for dir in common::fixture_models() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
        let (reference, seqs, cu) = reference_batch(&dir);
        let mut m = files.load(&dev, DType::F32).unwrap();
        let n = m.info.num_layers;
        let taps = m.engine.forward(&Batch::new(seqs.concat(), cu.clone(), vec![n + 1])).unwrap();
        for (i, s) in seqs.iter().enumerate() {
            let got = taps.gather(cu[i], s.len(), &[n + 1], OutDType::Float32).unwrap().to_f32();
            let e = rel_err(&got, &reference[&format!("seq{i}.final_prenorm")].f32);
            assert!(e <= 1e-5, "{name} seq{i}: final_prenorm {e:.3e} from transformers");
        }
        let mut m = files.load(&dev, DType::BF16).unwrap();
        let h = m.info.hidden_size;
        let layers = vec![1, n, n + 1];
        let total = *cu.last().unwrap();
        let full = m.engine.forward(&Batch::new(seqs.concat(), cu.clone(), layers.clone())).unwrap();
        assert!(full.nonfinite.iter().all(|&f| f == 0), "{name}: the screen flags a healthy model");
        let plain_rows: Vec<u32> = (0..total as u32).step_by(3).collect();
        let fp8_rows: Vec<u32> = (1..total as u32).step_by(2).collect();
        let mut batch = Batch::new(seqs.concat(), cu.clone(), layers.clone());
        batch.output =
            Output { plain: Rows::Only(plain_rows.clone()), fp8: Rows::Only(fp8_rows.clone()), ..Output::default() };
        let sel = m.engine.forward(&batch).unwrap();
        for (k, &r) in plain_rows.iter().enumerate() {
            let a = sel.gather(k, 1, &layers, OutDType::Bfloat16).unwrap();
            let b = full.gather(r as usize, 1, &layers, OutDType::Bfloat16).unwrap();
            assert_eq!(a.data, b.data, "{name}: plain row {r}");
        }
        let fp8 = sel.fp8.as_ref().expect("fp8 rows");
        let (mut off_by_one, mut values) = (0usize, 0usize);
        for (k, &r) in fp8_rows.iter().enumerate() {
            let x = full.gather(r as usize, 1, &layers, OutDType::Float32).unwrap().to_f32();
            for c in 0..layers.len() {
                let row = &x[c * h..(c + 1) * h];
                let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                let inv = 448.0 / amax.max(1e-30);
                let scale = fp8.scale[k * layers.len() + c];
                let want_scale = amax / 448.0;
                assert!(
                    (scale - want_scale).abs() <= want_scale * 2e-7,
                    "{name} row {r}: scale {scale} vs {want_scale}"
                );
                for (j, &v) in row.iter().enumerate() {
                    let want = float8::F8E4M3::from_f32(v * inv).to_bits();
                    let got = fp8.host.data[(k * layers.len() + c) * h + j];
                    values += 1;
                    if got != want {
                        // Same sign, neighbouring codes: a rounding tie decided the other way.
                        assert!(
                            (got ^ want) & 0x80 == 0 && (got as i16 - want as i16).abs() == 1,
                            "{name} row {r} layer {} value {j}: fp8 {got:#04x}, expected {want:#04x}",
                            layers[c]
                        );
                        off_by_one += 1;
                    }
                }
            }
        }
        assert!(off_by_one * 1000 <= values, "{name}: {off_by_one} of {values} fp8 values a step off");
        println!("{name}: fp8 on the GPU: {off_by_one} of {values} values one step from the host's rounding");
    }
}

/// The start-up self-check passes on the GPU for every family, in f32 and bf16, against the
/// portable f32 path (the figures are printed: they set the tolerances).
#[test]
fn the_selfcheck_passes_on_the_gpu_for_every_family() {
    use layertap::engine::selfcheck::{check, Probe, Reference};
    let Some(dev) = common::cuda_device() else { return };
    for dir in common::fixture_models() {
        let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
        let probe = Probe::new(files.config());
        let reference = Reference::portable(&files, &probe).unwrap();
        for (dtype, out) in [(DType::F32, ComputeDType::Float32), (DType::BF16, ComputeDType::Bfloat16)] {
            let mut m = files.load(&dev, dtype).unwrap();
            let r = check(&mut m.engine, &probe, &reference, "cuda:0", out).unwrap();
            eprintln!("selfcheck {} {:?}: {:?}", dir.display(), dtype, r.errors);
            assert!(r.passed(), "{}: {:?} {:?}", dir.display(), dtype, r.errors);
        }
    }
}

/// On CUDA the attention kernels keep the scores on chip: a long allowed input does not shrink
/// the batch budget there as it does on the portable path.
#[test]
fn the_batch_budget_counts_no_attention_scores_for_the_cuda_kernels() {
    let Some(dev) = common::cuda_device() else { return };
    // A head dim the CUDA attention kernels take (the tiny fixtures' are smaller).
    let cfg = layertap::engine::ModelConfig::from_hf_json(&serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 4,
        "vocab_size": 1000
    }))
    .unwrap();
    let gib = 1u64 << 30;
    let budget =
        |d: &layertap::engine::Device, longest| layertap::engine::tokens_for_memory(&cfg, d, DType::BF16, gib, longest);
    let (cuda, short) = (budget(&dev, 262_144), budget(&dev, 1024));
    let cpu = budget(&layertap::engine::Device::Cpu, 262_144);
    assert_eq!(cuda, short, "the longest input does not enter the CUDA budget");
    assert!(cpu < cuda, "{cpu} {cuda}");
}

/// The decoder in stages on the GPU: two stages on one GPU (the same device: nothing moves, the
/// batch's context is kept, the stages take turns) give the states and log-probabilities of one
/// stage bitwise, in f32 and bf16, for every family; where a second GPU is visible, one stage on
/// each works on the batch's micro-batches at once and gives, bitwise, what one GPU gives for
/// those micro-batches one after the other (a matrix product of other rows may round otherwise).
#[test]
fn stages_over_gpus_give_the_states_of_one_bitwise() {
    let Some(dev) = common::cuda_device() else { return };
    let second = (layertap::engine::cuda_device_count() >= 2).then(|| layertap::engine::Device::new_cuda(1).unwrap());
    if second.is_none() {
        eprintln!("one GPU visible: stages over two GPUs skipped");
    }
    let options = layertap::engine::EngineOptions::startup();
    for dir in common::fixture_models() {
        let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
        let (_, seqs, cu) = reference_batch(&dir);
        for dtype in [DType::F32, DType::BF16] {
            let mut one = files.load(&dev, dtype).unwrap().engine;
            let n = one.decoder.cfg.num_hidden_layers;
            let mut batch = Batch::new(seqs.concat(), cu.clone(), (0..=n + 1).collect());
            batch.output = Output {
                logprobs: Some(layertap::engine::LogprobRows { rows: Rows::All, top_k: 4 }),
                ..Output::default()
            };
            let bits = |t: &layertap::engine::Taps| {
                let lp = t.logprobs.as_ref().unwrap();
                let f = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                (t.host.data.to_vec(), lp.ids.clone(), f(&lp.logprobs), f(&lp.target))
            };
            let want = bits(&one.forward(&batch).unwrap());
            // The same micro-batches, one after the other on one GPU.
            let mut parts_want = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for r in layertap::engine::stages::micro_batches(&cu, 2) {
                let sub_cu: Vec<usize> = cu[r.start..=r.end].iter().map(|&c| c - cu[r.start]).collect();
                let mut sub = Batch::new(seqs[r].concat(), sub_cu, batch.layers.clone());
                sub.output = batch.output.clone();
                let b = bits(&one.forward(&sub).unwrap());
                parts_want.0.extend(b.0);
                parts_want.1.extend(b.1);
                parts_want.2.extend(b.2);
                parts_want.3.extend(b.3);
            }
            let mut replicas = vec![vec![dev.clone(), dev.clone()]];
            replicas.extend(second.iter().map(|d| vec![dev.clone(), d.clone()]));
            for stages in replicas {
                let mut e = files.load_stages(&stages, dtype, options).unwrap().engine;
                let refs: Vec<_> = e.decoder.stages().iter().collect();
                let want = if layertap::engine::stages::overlap_between(&refs) { &parts_want } else { &want };
                let got = bits(&e.forward(&batch).unwrap());
                assert!(&got == want, "{} {dtype:?} over {:?}: differs from one stage", dir.display(), stages);
            }
        }
    }
}
