//! The start-up self-check: the probe covers every kind of layer, healthy models pass it on
//! every fixture family, and a serving path with a fault (injected here, through an engine that
//! wraps the real one) fails it: readiness is refused under `enforce`, the figures reach
//! `/metrics` and `/v1/info`, and `warn` serves anyway.

mod common;

use std::time::Duration;

use common::{fixture_models, fixtures, limits, real_server_with, wait_ready};
use layertap::cli::SelfCheckMode;
use layertap::engine::loader::ModelFiles;
use layertap::engine::selfcheck::{check, tolerance, Probe, Reference, PROBE_LENGTHS};
use layertap::engine::{Batch, ComputeDType, DType, Device, Engine, EngineError, Taps};

#[test]
fn the_probe_reaches_the_first_layer_of_every_kind_and_stays_short() {
    let cfg = |m: &str| ModelFiles::locate(&fixtures().join(m).to_string_lossy()).unwrap().config().clone();
    // Dense: two layers, the final norm not reached.
    let dense = Probe::new(&cfg("tiny/qwen3_qknorm"));
    assert_eq!(dense.depth, 2);
    assert_eq!(dense.indices, vec![0, 1, 2]);
    // layer_types [lin, lin, lin, full]: the first full-attention layer is the fourth and last,
    // so the whole model runs and its final norm and pre-norm state are compared too.
    let hybrid = Probe::new(&cfg("tiny/qwen3_5_hybrid"));
    assert_eq!(hybrid.depth, 4);
    assert_eq!(hybrid.indices, vec![0, 1, 2, 3, 4, 5]);
    // Qwen3-MoE with decoder_sparse_step 2: dense layer 0, MoE layer 1; its tolerance allows
    // for routing flips, the dense models' does not.
    let moe = Probe::new(&cfg("tiny/qwen3_moe"));
    assert_eq!(moe.depth, 2);
    assert!(moe.routed && !dense.routed && !hybrid.routed);
    assert!(tolerance(ComputeDType::Bfloat16, true, false) > tolerance(ComputeDType::Bfloat16, false, false));
    // An FP8 checkpoint (declared, or quantised at load): 16-bit inputs round to other e4m3
    // values than the f32 reference's, so 16-bit compute is allowed more; f32 compute is not.
    let fp8 = Probe::new(&cfg("fp8/qwen3_f32_scales"));
    assert!(fp8.fp8 && !dense.fp8 && !hybrid.fp8 && !moe.fp8);
    assert_eq!(tolerance(ComputeDType::Bfloat16, false, true), 3.0 * tolerance(ComputeDType::Bfloat16, false, false));
    assert_eq!(tolerance(ComputeDType::Float32, false, true), tolerance(ComputeDType::Float32, false, false));
    assert_eq!(hybrid.tokens(), PROBE_LENGTHS.iter().sum::<usize>());
    assert!(hybrid.seqs.iter().flatten().all(|&t| (t as usize) < 512), "ids inside the vocabulary");
    assert_eq!(Probe::new(&cfg("tiny/qwen3_5_hybrid")).seqs, hybrid.seqs, "the same probe every time");
}

#[test]
fn every_family_passes_in_f32_and_bf16_and_the_truncated_reference_is_the_whole_model() {
    for dir in fixture_models() {
        let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap();
        let probe = Probe::new(files.config());
        // The portable reference (first layers only, the probe's embedding rows only) gives the
        // states the whole f32 model gives, each sequence alone.
        let portable = Reference::portable(&files, &probe).unwrap();
        let mut full = files.load(&Device::Cpu, DType::F32).unwrap().engine;
        let alone = Reference::from_engine(&mut full, &probe).unwrap();
        let r = check(&mut full, &probe, &alone, "cpu", ComputeDType::Float32).unwrap();
        let same = check(&mut full, &probe, &portable, "cpu", ComputeDType::Float32).unwrap();
        for (a, b) in r.errors.iter().zip(&same.errors) {
            assert!((a.1 - b.1).abs() < 1e-6, "{}: the truncated reference differs at index {}", dir.display(), a.0);
        }
        assert!(r.passed() && r.worst().1 < 1e-5, "{}: f32 packed against alone: {:?}", dir.display(), r.errors);
        let mut half = files.load(&Device::Cpu, DType::BF16).unwrap().engine;
        let b = check(&mut half, &probe, &portable, "cpu", ComputeDType::Bfloat16).unwrap();
        eprintln!("{}: bf16 on the CPU against the f32 reference: {:?}", dir.display(), b.errors);
        assert!(
            b.passed(),
            "{}: bf16 {:?} over {}",
            dir.display(),
            b.errors,
            tolerance(ComputeDType::Bfloat16, probe.routed, probe.fp8)
        );
        assert!(b.worst().1 > 1e-4, "bf16 is not f32: the comparison sees the rounding");
    }
}

/// The real engine with a fault in its packing: every sequence after the first gets a share of
/// the first sequence's last state added to it at every index past the embeddings (state leaking
/// across sequences, a bug of the kind this check is for). Sequences run alone are untouched.
struct Leaky(Box<dyn Engine>);

impl Engine for Leaky {
    fn forward(&mut self, batch: &Batch) -> Result<Taps, EngineError> {
        let mut taps = self.0.forward(batch)?;
        if batch.cu_seqlens.len() > 2 {
            let [rows, width, hidden] = taps.host.shape[..] else { panic!("taps are 3-D") };
            let mut v = taps.host.to_f32();
            let first_end = batch.cu_seqlens[1];
            for l in 0..width {
                if batch.layers[l] == 0 {
                    continue;
                }
                let leak: Vec<f32> = (0..hidden).map(|j| v[((first_end - 1) * width + l) * hidden + j]).collect();
                for r in first_end..rows {
                    for j in 0..hidden {
                        v[(r * width + l) * hidden + j] += 0.5 * leak[j];
                    }
                }
            }
            taps.host = layertap::engine::HostTensor::from_f32(&v, vec![rows, width, hidden]).to_dtype(taps.host.dtype);
        }
        Ok(taps)
    }
}

/// `/v1/info` once the self-check has reported.
async fn info_after_check(base: &str) -> serde_json::Value {
    let c = common::client();
    for _ in 0..400 {
        if let Ok(r) = c.get(format!("{base}/v1/info")).send().await {
            let v: serde_json::Value = r.json().await.unwrap();
            if !v["selfcheck"].is_null() {
                return v;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the self-check never reported");
}

fn metric(text: &str, series: &str) -> f64 {
    let line = text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("{series} in /metrics"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test]
async fn a_fault_in_the_serving_path_fails_the_check_and_readiness_is_refused() {
    let (running, base) =
        real_server_with("tiny/qwen3_qknorm", limits(), SelfCheckMode::Enforce, |e| Box::new(Leaky(e)));
    let info = info_after_check(&base).await;
    let sc = &info["selfcheck"];
    assert_eq!(sc["passed"], false, "{sc}");
    assert_eq!(sc["mode"], "enforce");
    assert_eq!(sc["worst_device"], "cpu");
    assert!(sc["worst_relative_error"].as_f64().unwrap() > sc["tolerance"].as_f64().unwrap(), "{sc}");
    let c = common::client();
    // Readiness stays refused, saying why.
    for _ in 0..10 {
        let r = c.get(format!("{base}/ready")).send().await.unwrap();
        assert_eq!(r.status(), 503);
        assert_eq!(r.json::<serde_json::Value>().await.unwrap()["status"], "selfcheck_failed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = c.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    let embeddings = metric(&text, "layertap_selfcheck_relative_error{device=\"cpu\",index=\"0\"}");
    let layer1 = metric(&text, "layertap_selfcheck_relative_error{device=\"cpu\",index=\"1\"}");
    assert!(embeddings < 1e-6, "the fault leaves the embeddings alone: {embeddings}");
    assert!(layer1 > 0.01, "and shows past them: {layer1}");
    assert!(metric(&text, "layertap_selfcheck_seconds{device=\"cpu\"}") > 0.0);
    running.shutdown.cancel();
}

#[tokio::test]
async fn warn_serves_a_failed_check_and_a_healthy_engine_passes_under_enforce() {
    let (warned, base) = real_server_with("tiny/qwen3_qknorm", limits(), SelfCheckMode::Warn, |e| Box::new(Leaky(e)));
    wait_ready(&base).await;
    assert_eq!(info_after_check(&base).await["selfcheck"]["passed"], false);
    warned.shutdown.cancel();
    let (healthy, base) = real_server_with("tiny/qwen3_5_hybrid", limits(), SelfCheckMode::Enforce, |e| e);
    wait_ready(&base).await;
    let sc = info_after_check(&base).await["selfcheck"].clone();
    assert_eq!(sc["passed"], true, "{sc}");
    assert!(sc["worst_relative_error"].as_f64().unwrap() < 1e-5, "{sc}");
    assert_eq!(sc["devices_checked"], 1);
    healthy.shutdown.cancel();
}

/// The binary in bf16 on the CPU: the reference is the portable f32 path, computed on its own
/// thread while the device loads, and the check passes with bf16's figures.
#[tokio::test]
async fn the_binary_checks_bf16_against_the_f32_reference_computed_beside_the_load() {
    let (mut child, base) =
        common::serve_binary(&fixtures().join("tiny/qwen3_next_per_expert"), &["--dtype", "bf16"], |_| {}).await;
    let sc = info_after_check(&base).await["selfcheck"].clone();
    child.kill().unwrap();
    let _ = child.wait();
    assert_eq!(sc["passed"], true, "{sc}");
    assert_eq!(sc["tolerance"], tolerance(ComputeDType::Bfloat16, true, false), "a routed model's allowance: {sc}");
    let worst = sc["worst_relative_error"].as_f64().unwrap();
    assert!(worst > 1e-4 && worst < 0.1, "bf16 rounding, seen against f32: {sc}");
}
