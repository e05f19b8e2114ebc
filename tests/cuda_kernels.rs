//! The CUDA kernels (packed attention, fused silu*mul) against candle's portable ops, on a GPU
//! (built with `--features cuda`; skipped when no device is visible). Run on a GPU machine with
//! `cargo test --release --features cuda --test cuda_kernels`.
#![cfg(feature = "cuda")]

use candle_core::{DType, Tensor};
use layertap::engine::cuda::attention::{packed_attention, tiles_for, AttentionKernel};
use layertap::engine::layers::sdpa::{chunk_masks, sequence_attention};

mod common;

use common::cuda_device as device;

/// The largest absolute difference, in f32.
fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (a.to_dtype(DType::F32).unwrap(), b.to_dtype(DType::F32).unwrap());
    (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

fn rel(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    let num = (&a - &b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
    let den = b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
    num / den
}

/// One sink logit per head, some far above any score (every row's weight mostly on the sink),
/// some far below (no effect), the rest near the scores.
fn sinks(heads: usize, dev: &candle_core::Device) -> Tensor {
    let v: Vec<f32> = (0..heads).map(|h| [12.0, -30.0, 0.5, -1.25, 3.0][h % 5] + 0.1 * h as f32).collect();
    Tensor::new(v.as_slice(), dev).unwrap()
}

/// Kernel output for packed sequences equals, per sequence, the portable path in f32 on the same
/// (rounded) inputs, within the rounding of the probabilities to 16 bits; with GQA, head
/// dimensions 64, 128 and 256, bf16 and f16, with and without a sliding window, with and without
/// attention sinks, and lengths that straddle the 64-query tiles.
#[test]
fn kernel_matches_portable_attention() {
    let Some(dev) = device() else { return };
    let lens = [1usize, 7, 64, 65, 130, 1000, 33];
    let total: usize = lens.iter().sum();
    let seqs = packed(&lens);
    for dtype in [DType::BF16, DType::F16] {
        for (heads, kv, d) in [(8, 2, 128), (6, 6, 64), (9, 3, 64), (6, 1, 256)] {
            for (window, sink) in
                [(None, None), (Some(37), None), (None, Some(sinks(heads, &dev))), (Some(37), Some(sinks(heads, &dev)))]
            {
                let q = Tensor::randn(0f32, 1.0, (total, heads, d), &dev).unwrap().to_dtype(dtype).unwrap();
                let k = Tensor::randn(0f32, 1.0, (total, kv, d), &dev).unwrap().to_dtype(dtype).unwrap();
                let v = Tensor::randn(0f32, 1.0, (total, kv, d), &dev).unwrap().to_dtype(dtype).unwrap();
                let scale = 1.0 / (d as f64).sqrt();
                let (qf, kf, vf) =
                    (q.to_dtype(DType::F32).unwrap(), k.to_dtype(DType::F32).unwrap(), v.to_dtype(DType::F32).unwrap());
                for variant in AttentionKernel::ALL {
                    let t = tiles_for(&seqs, &dev, variant).unwrap();
                    let out = packed_attention(&q, &k, &v, &t, scale, window, sink.as_ref()).unwrap();
                    assert_eq!(out.dims(), &[total, heads, d]);
                    for &(s, l) in &seqs {
                        let masks = chunk_masks(l, window, 1024, &dev).unwrap();
                        let want = sequence_attention(
                            &qf.narrow(0, s, l).unwrap(),
                            &kf.narrow(0, s, l).unwrap(),
                            &vf.narrow(0, s, l).unwrap(),
                            scale,
                            &masks,
                            sink.as_ref(),
                        )
                        .unwrap();
                        let got = out.narrow(0, s, l).unwrap().reshape((l, heads * d)).unwrap();
                        let e = rel(&got, &want);
                        let with = sink.is_some();
                        assert!(
                            e < 1e-2,
                            "{variant:?} {dtype:?} h{heads}/{kv} d{d} window {window:?} sinks {with} len {l}: rel err {e}"
                        );
                    }
                }
            }
        }
    }
}

/// A sequence's attention output does not depend on what it is packed with: bitwise.
#[test]
fn kernel_is_batch_invariant() {
    let Some(dev) = device() else { return };
    for (heads, kv, d) in [(8, 2, 128), (6, 1, 256)] {
        let lens = [300usize, 77, 1200];
        let total: usize = lens.iter().sum();
        let q = Tensor::randn(0f32, 1.0, (total, heads, d), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let k = Tensor::randn(0f32, 1.0, (total, kv, d), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let v = Tensor::randn(0f32, 1.0, (total, kv, d), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let seqs = [(0, 300), (300, 77), (377, 1200)];
        for variant in AttentionKernel::ALL {
            let packed =
                packed_attention(&q, &k, &v, &tiles_for(&seqs, &dev, variant).unwrap(), 0.1, None, None).unwrap();
            for &(s, l) in &seqs {
                let alone = packed_attention(
                    &q.narrow(0, s, l).unwrap(),
                    &k.narrow(0, s, l).unwrap(),
                    &v.narrow(0, s, l).unwrap(),
                    &tiles_for(&[(0, l)], &dev, variant).unwrap(),
                    0.1,
                    None,
                    None,
                )
                .unwrap();
                let diff = max_abs_diff(&alone, &packed.narrow(0, s, l).unwrap());
                assert_eq!(diff, 0.0, "{variant:?} d{d}: sequence at {s} (len {l}) differs alone vs packed by {diff}");
            }
        }
    }
}

/// The kernel's variants give bitwise the same output (each query row meets the same key tiles
/// in the same order), with GQA, every head dimension, both 16-bit types, with and without a
/// sliding window and sinks, on lengths that straddle both tile heights.
#[test]
fn kernel_variants_agree_bitwise() {
    let Some(dev) = device() else { return };
    let lens = [1usize, 63, 64, 65, 127, 128, 129, 700, 2];
    let total: usize = lens.iter().sum();
    let seqs = packed(&lens);
    for dtype in [DType::BF16, DType::F16] {
        for (heads, kv, d) in [(8, 2, 128), (9, 3, 64), (6, 1, 256)] {
            for (window, sink) in [(None, None), (Some(37), None), (Some(200), Some(sinks(heads, &dev)))] {
                let q = Tensor::randn(0f32, 1.0, (total, heads, d), &dev).unwrap().to_dtype(dtype).unwrap();
                let k = Tensor::randn(0f32, 1.0, (total, kv, d), &dev).unwrap().to_dtype(dtype).unwrap();
                let v = Tensor::randn(0f32, 1.0, (total, kv, d), &dev).unwrap().to_dtype(dtype).unwrap();
                let run = |variant| {
                    let t = tiles_for(&seqs, &dev, variant).unwrap();
                    packed_attention(&q, &k, &v, &t, 0.08, window, sink.as_ref()).unwrap()
                };
                let first = run(AttentionKernel::Simple);
                for &variant in &AttentionKernel::ALL[1..] {
                    let diff = max_abs_diff(&first, &run(variant));
                    assert_eq!(diff, 0.0, "{variant:?} {dtype:?} h{heads}/{kv} d{d} window {window:?}: {diff}");
                }
            }
        }
    }
}

/// The fused `silu(gate) * up` equals candle's separate ops computed in f32, to the output's
/// rounding, for every dtype.
#[test]
fn silu_mul_matches_separate_ops() {
    let Some(dev) = device() else { return };
    let (rows, inter) = (37, 96);
    let gu = (Tensor::randn(0f32, 1.0, (rows, 2 * inter), &dev).unwrap() * 3.0).unwrap();
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 8e-3), (DType::F16, 1e-3)] {
        let x = gu.to_dtype(dtype).unwrap();
        let xf = x.to_dtype(DType::F32).unwrap();
        let want = (candle_nn::ops::silu(&xf.narrow(1, 0, inter).unwrap()).unwrap()
            * xf.narrow(1, inter, inter).unwrap())
        .unwrap();
        let got = layertap::engine::cuda::ops::silu_mul(&x).unwrap();
        assert_eq!(got.dims(), &[rows, inter]);
        let e = rel(&got, &want);
        assert!(e < tol, "{dtype:?}: rel err {e}");
    }
}

/// The fused q/k/v split with q/k norm and rotary embedding equals the separate ops computed in
/// f32 (split, RMSNorm, `rope_thd` on the rotary dims with f32 tables made on the host), to the
/// output's rounding; v and the output gate are copied exactly. The widths of Qwen3-8B (norms,
/// full rotary), Qwen3.5-27B (zero-centred norms as f32 `1 + w`, rotary on 64 of 256 dims, output
/// gate) and a Llama-like d64 model without norms, over three packed sequences.
#[test]
fn fused_qkv_rope_matches_separate_ops() {
    use layertap::engine::cuda::rope::QkvRope;
    let Some(dev) = device() else { return };
    let lens = [200usize, 1, 99];
    let positions: Vec<u32> = lens.iter().flat_map(|&l| 0..l as u32).collect();
    let t = positions.len();
    let pos = Tensor::new(positions.as_slice(), &dev).unwrap();
    for (nq, nkv, hd, rot, gated, norm) in [
        (32, 8, 128, 128, false, true),
        (24, 4, 256, 64, true, true),
        (9, 3, 64, 64, false, false),
        (8, 2, 128, 64, false, true),
        (4, 2, 256, 256, false, false),
    ] {
        let inv: Vec<f32> = (0..rot / 2).map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / rot as f32)).collect();
        let inv_t = Tensor::new(inv.as_slice(), &dev).unwrap();
        let (cos, sin): (Vec<f32>, Vec<f32>) = positions
            .iter()
            .flat_map(|&p| inv.iter().map(move |&f| ((p as f32 * f).cos(), (p as f32 * f).sin())))
            .unzip();
        let cos = Tensor::from_vec(cos, (t, rot / 2), &dev).unwrap();
        let sin = Tensor::from_vec(sin, (t, rot / 2), &dev).unwrap();
        let eps = 1e-6f32;
        let norms = norm.then(|| {
            let w = |s: f32| Tensor::randn(1f32, s, hd, &dev).unwrap();
            (w(0.3), w(0.5), eps)
        });
        let q_width = if gated { 2 * nq * hd } else { nq * hd };
        for dtype in [DType::BF16, DType::F16] {
            let qkv = (Tensor::randn(0f32, 1.0, (t, q_width + 2 * nkv * hd), &dev).unwrap() * 2.0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let op = QkvRope { heads: nq, kv_heads: nkv, head_dim: hd, rotary_dim: rot, gated, norms: norms.clone() };
            let (q, k, v, gate) = op.forward(&qkv, &pos, &inv_t).unwrap();

            let x = qkv.to_dtype(DType::F32).unwrap();
            let (q_ref, gate_ref) = if gated {
                let qg = x.narrow(1, 0, q_width).unwrap().reshape((t, nq, 2 * hd)).unwrap();
                (qg.narrow(2, 0, hd).unwrap(), Some(qg.narrow(2, hd, hd).unwrap().reshape((t, nq * hd)).unwrap()))
            } else {
                (x.narrow(1, 0, q_width).unwrap().reshape((t, nq, hd)).unwrap(), None)
            };
            let k_ref = x.narrow(1, q_width, nkv * hd).unwrap().reshape((t, nkv, hd)).unwrap();
            let v_ref = x.narrow(1, q_width + nkv * hd, nkv * hd).unwrap().reshape((t, nkv, hd)).unwrap();
            let finish = |x: &Tensor, w: Option<&Tensor>| {
                let x = match w {
                    Some(w) => candle_nn::ops::rms_norm(&x.contiguous().unwrap(), w, eps).unwrap(),
                    None => x.contiguous().unwrap(),
                };
                let r = candle_nn::rotary_emb::rope_thd(
                    &x.narrow(2, 0, rot).unwrap().contiguous().unwrap().unsqueeze(0).unwrap(),
                    &cos,
                    &sin,
                )
                .unwrap()
                .squeeze(0)
                .unwrap();
                Tensor::cat(&[r, x.narrow(2, rot, hd - rot).unwrap()], 2).unwrap()
            };
            let (qw, kw) = match &norms {
                Some((a, b, _)) => (Some(a), Some(b)),
                None => (None, None),
            };
            let tol = if dtype == DType::BF16 { 6e-3 } else { 1e-3 };
            let eq = rel(&q, &finish(&q_ref, qw));
            let ek = rel(&k, &finish(&k_ref, kw));
            assert!(eq < tol && ek < tol, "{dtype:?} {nq}/{nkv} d{hd} rot {rot}: q {eq}, k {ek}");
            assert_eq!(max_abs_diff(&v, &v_ref), 0.0, "{dtype:?} d{hd}: v is a copy");
            match (gate, gate_ref) {
                (Some(g), Some(r)) => assert_eq!(max_abs_diff(&g, &r), 0.0, "{dtype:?} d{hd}: the gate is a copy"),
                (None, None) => {}
                _ => panic!("gate returned {gated}: expected one exactly when gated"),
            }
        }
    }
}

/// The f32 residual-stream kernels equal candle's f32 ops: the add exactly, the norm to the
/// output's rounding.
#[test]
fn residual_kernels_match_f32_ops() {
    let Some(dev) = device() else { return };
    let (rows, cols) = (19, 576);
    let x = Tensor::randn(0f32, 2.0, (rows, cols), &dev).unwrap();
    let w = Tensor::randn(1f32, 0.3, cols, &dev).unwrap();
    for (dtype, tol) in [(DType::BF16, 8e-3), (DType::F16, 1e-3)] {
        let y = Tensor::randn(0f32, 1.0, (rows, cols), &dev).unwrap().to_dtype(dtype).unwrap();
        let sum = layertap::engine::cuda::ops::add_f32(&x, &y).unwrap();
        assert_eq!(sum.dtype(), DType::F32);
        let want = (&x + y.to_dtype(DType::F32).unwrap()).unwrap();
        let d = max_abs_diff(&sum, &want);
        assert_eq!(d, 0.0, "{dtype:?} add differs by {d}");
        let wd = w.to_dtype(dtype).unwrap();
        let normed = layertap::engine::cuda::ops::rms_norm_f32(&sum, &wd, 1e-6).unwrap();
        assert_eq!(normed.dtype(), dtype);
        let want = candle_nn::ops::rms_norm(&sum, &wd.to_dtype(DType::F32).unwrap(), 1e-6).unwrap();
        let e = rel(&normed, &want);
        assert!(e < tol, "{dtype:?} norm rel err {e}");
    }
}

/// The fused residual add + RMSNorm gives bitwise what the two kernels give (both outputs), for
/// both 16-bit types, with a weight of that type or an f32 one (the hybrids' zero-centred norms
/// keep `1 + w` in f32), on the 8B's width (4096), on widths that do not fill the block evenly and
/// on one that is not a multiple of 4 (the kernels' one-column path); the f32-weight norm is
/// candle's f32 RMSNorm rounded once (to within one rounding of the output);
/// `RmsNorm::add_forward` takes it and refuses nothing it should serve.
#[test]
fn fused_add_norm_is_bitwise_the_two_kernels() {
    use layertap::engine::cuda::ops::{add_f32, add_rms_norm_f32, rms_norm_f32_to};
    let Some(dev) = device() else { return };
    for (rows, cols) in [(33, 4096), (7, 576), (5, 1000), (3, 101), (9, 5120)] {
        let x = (Tensor::randn(0f32, 2.0, (rows, cols), &dev).unwrap() * 10.0).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let y = Tensor::randn(0f32, 1.0, (rows, cols), &dev).unwrap().to_dtype(dtype).unwrap();
            let w32 = Tensor::randn(1f32, 0.3, cols, &dev).unwrap();
            for w in [w32.to_dtype(dtype).unwrap(), w32.clone()] {
                let x0 = x.copy().unwrap();
                let (sum, normed) = add_rms_norm_f32(&x, &y, &w, 1e-6).unwrap();
                assert_eq!((sum.dtype(), normed.dtype()), (DType::F32, dtype));
                assert_eq!((sum.dims(), normed.dims()), (x.dims(), x.dims()));
                let want_sum = add_f32(&x, &y).unwrap();
                let want_norm = rms_norm_f32_to(&want_sum, &w, 1e-6, dtype).unwrap();
                let (ds, dn) = (max_abs_diff(&sum, &want_sum), max_abs_diff(&normed, &want_norm));
                let wt = w.dtype();
                assert_eq!((ds, dn), (0.0, 0.0), "{dtype:?} ({wt:?} weight) {rows}x{cols}: sum by {ds}, norm by {dn}");
                // The stream it was given is left as it was.
                assert_eq!(max_abs_diff(&x, &x0), 0.0);
                if wt == DType::F32 {
                    // candle's f32 RMSNorm, rounded: at most one rounding step of the output apart.
                    let reference = candle_nn::ops::rms_norm(&want_sum, &w, 1e-6).unwrap();
                    let got = normed.to_dtype(DType::F32).unwrap();
                    let step = (reference.abs().unwrap()
                        * if dtype == DType::BF16 { 1.0 / 128.0 } else { 1.0 / 1024.0 })
                    .unwrap();
                    let over = ((got - &reference).unwrap().abs().unwrap() - step).unwrap().max_all().unwrap();
                    let over = over.to_scalar::<f32>().unwrap();
                    assert!(over <= 1e-6, "{dtype:?} {rows}x{cols}: the f32-weight norm is {over} past one rounding");
                }
            }
        }
    }
    // Shapes that do not fit are refused, and a weight of another 16-bit type.
    let x = Tensor::zeros((4, 64), DType::F32, &dev).unwrap();
    let y = Tensor::zeros((4, 32), DType::BF16, &dev).unwrap();
    let w = Tensor::zeros(64, DType::BF16, &dev).unwrap();
    assert!(add_rms_norm_f32(&x, &y, &w, 1e-6).is_err());
    assert!(add_rms_norm_f32(&x, &x, &w, 1e-6).is_err());
    let y = Tensor::zeros((4, 64), DType::F16, &dev).unwrap();
    assert!(add_rms_norm_f32(&x, &y, &w, 1e-6).is_err());
    assert!(rms_norm_f32_to(&x, &w, 1e-6, DType::F16).is_err());
}

/// The device's f32 -> fp8 (E4M3) cast rounds as the host's does, over the whole finite range:
/// every fp8 value, the midpoints between neighbours (ties go to even), subnormals and random
/// values in [-448, 448].
#[test]
fn fp8_cast_rounds_like_the_host() {
    let Some(dev) = device() else { return };
    let mut v: Vec<f32> = Vec::new();
    let finite: Vec<f32> =
        (0u8..=255).map(|b| float8::F8E4M3::from_bits(b).to_f32()).filter(|x| x.is_finite()).collect();
    let mut sorted = finite.clone();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
    for w in sorted.windows(2) {
        v.extend([w[0], (w[0] + w[1]) / 2.0, w[0] + (w[1] - w[0]) * 0.25, w[0] + (w[1] - w[0]) * 0.75]);
    }
    v.extend(finite);
    let mut state = 1u64;
    for _ in 0..100_000 {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        v.push(((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 448.0);
    }
    let x = Tensor::new(v.as_slice(), &dev).unwrap();
    let q = layertap::engine::cuda::ops::f32_to_fp8(&x).unwrap();
    let got: Vec<u8> = q
        .to_device(&candle_core::Device::Cpu)
        .unwrap()
        .to_vec1::<float8::F8E4M3>()
        .unwrap()
        .iter()
        .map(|b| b.to_bits())
        .collect();
    for (i, (&x, &g)) in v.iter().zip(&got).enumerate() {
        let want = float8::F8E4M3::from_f32(x).to_bits();
        assert_eq!(g, want, "value {i}: {x} -> device {g:#04x}, host {want:#04x}");
    }
}

/// Deterministic noise: `n` values, roughly N(0, 1) (a sum of uniforms), scaled.
fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut uniform = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n).map(|_| ((0..4).map(|_| uniform()).sum::<f32>() - 2.0) * 1.732 * scale).collect()
}

/// One Gated DeltaNet layer's inputs after the projections: qkv `[T, conv_dim]`, b and a
/// `[T, value_heads]` (rounded to `dtype`), the conv weight `[conv_dim, 4]`, `-exp(A_log)` and
/// `dt_bias`, on `dev`. The decays are kept mild (g about -0.05 per token) so the recurrent state
/// carries across many chunks.
struct GdnCase {
    qkv: Tensor,
    b: Tensor,
    a: Tensor,
    conv: Tensor,
    neg_a: Tensor,
    dt_bias: Tensor,
}

impl GdnCase {
    /// Tokens `start..start + len` of the case alone (the weights shared).
    fn rows(&self, start: usize, len: usize) -> GdnCase {
        let part = |x: &Tensor| x.narrow(0, start, len).unwrap();
        GdnCase {
            qkv: part(&self.qkv),
            b: part(&self.b),
            a: part(&self.a),
            conv: self.conv.clone(),
            neg_a: self.neg_a.clone(),
            dt_bias: self.dt_bias.clone(),
        }
    }
}

fn gdn_case(d: &layertap::engine::config::LinearAttentionConfig, t: usize, dtype: DType, seed: u64) -> GdnCase {
    let cpu = candle_core::Device::Cpu;
    let c = d.conv_dim();
    let nv = d.num_value_heads;
    let mk = |v: Vec<f32>, shape: &[usize]| Tensor::from_vec(v, shape, &cpu).unwrap();
    let neg_a: Vec<f32> = noise(nv, seed + 4, 0.5).into_iter().map(|x| -0.05 * x.exp()).collect();
    GdnCase {
        qkv: mk(noise(t * c, seed, 1.0), &[t, c]).to_dtype(dtype).unwrap(),
        b: mk(noise(t * nv, seed + 1, 1.0), &[t, nv]).to_dtype(dtype).unwrap(),
        a: mk(noise(t * nv, seed + 2, 1.0), &[t, nv]).to_dtype(dtype).unwrap(),
        conv: mk(noise(c * d.conv_kernel, seed + 3, 0.5), &[c, d.conv_kernel]),
        neg_a: mk(neg_a, &[nv]),
        dt_bias: mk(noise(nv, seed + 5, 1.0), &[nv]),
    }
}

fn gdn_on(case: &GdnCase, dev: &candle_core::Device) -> GdnCase {
    let to = |x: &Tensor| x.to_device(dev).unwrap();
    GdnCase {
        qkv: to(&case.qkv),
        b: to(&case.b),
        a: to(&case.a),
        conv: to(&case.conv),
        neg_a: to(&case.neg_a),
        dt_bias: to(&case.dt_bias),
    }
}

fn gdn_kernel(
    case: &GdnCase,
    seqs: &[(usize, usize)],
    d: &layertap::engine::config::LinearAttentionConfig,
    products: layertap::engine::cuda::gdn::Products,
) -> Tensor {
    use layertap::engine::cuda::gdn as cuda_gdn;
    let dev = case.qkv.device();
    assert!(cuda_gdn::supported(dev, d));
    let tables = cuda_gdn::Tables::new(seqs, dev).unwrap();
    let w = cuda_gdn::GdnWeights { conv: &case.conv, neg_a: &case.neg_a, dt_bias: &case.dt_bias, products };
    let off = layertap::engine::profile::Profiler::off();
    cuda_gdn::forward(&case.qkv, &case.b, &case.a, &w, &tables, d, &off).unwrap()
}

fn gdn_dims(nk: usize, nv: usize, dk: usize, dv: usize) -> layertap::engine::config::LinearAttentionConfig {
    layertap::engine::config::LinearAttentionConfig {
        num_key_heads: nk,
        num_value_heads: nv,
        key_head_dim: dk,
        value_head_dim: dv,
        conv_kernel: 4,
        layout: layertap::engine::config::GdnLayout::Separate,
    }
}

const GDN_LENS: [usize; 8] = [1, 3, 63, 64, 65, 130, 300, 700];

fn packed(lens: &[usize]) -> Vec<(usize, usize)> {
    let mut at = 0;
    lens.iter()
        .map(|&l| {
            at += l;
            (at - l, l)
        })
        .collect()
}

/// The Gated DeltaNet kernels (conv + SiLU + l2norm + gates, the chunk-local solve, the scan)
/// equal the portable path on the CPU, sequence by sequence, for packed sequences that straddle
/// the 64-token chunks: the real head sizes (128, two value heads per key head) and odd ones
/// (key 32, value 48: a partial value slice), with f32 and bf16 inputs, and inputs that are
/// views into a wider projection output. The f32 kernels agree to f32 rounding; the tensor-core
/// kernels (TF32 operands, 11 significant bits, which bf16 models use) to TF32's.
#[test]
fn gdn_kernels_match_the_portable_path() {
    use layertap::engine::batch::GdnPlan;
    use layertap::engine::cuda::gdn::{tensor_cores_fit, Products};
    use layertap::engine::layers::gdn::{conv_taps, mix_portable};
    let Some(dev) = device() else { return };
    let seqs = packed(&GDN_LENS);
    let t: usize = GDN_LENS.iter().sum();
    let cpu_plan = GdnPlan::new(&seqs, 4, &candle_core::Device::Cpu).unwrap();
    for (i, d) in [gdn_dims(2, 4, 128, 128), gdn_dims(3, 3, 32, 48)].iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let case = gdn_case(d, t, dtype, 17 + i as u64);
            let taps = conv_taps(&case.conv).unwrap();
            let want =
                mix_portable(&case.qkv, &case.b, &case.a, &taps, &case.neg_a, &case.dt_bias, &cpu_plan, d).unwrap();
            let mut on = gdn_on(&case, &dev);
            // The kernels read rows of a wider tensor, as the fused projection hands them over.
            let wide = Tensor::cat(&[&on.qkv, &on.qkv.narrow(1, 0, 8).unwrap()], 1).unwrap();
            on.qkv = wide.narrow(1, 0, d.conv_dim()).unwrap();
            assert!(tensor_cores_fit(d));
            for (products, tol) in [(Products::F32, 2e-5), (Products::Tf32, 3e-3)] {
                let got = gdn_kernel(&on, &seqs, d, products).to_device(&candle_core::Device::Cpu).unwrap();
                assert_eq!(got.dims(), want.dims());
                let mut worst = 0f32;
                for &(start, len) in &seqs {
                    let e = rel(&got.narrow(0, start, len).unwrap(), &want.narrow(0, start, len).unwrap());
                    assert!(e < tol, "{d:?} {dtype:?} {products:?}: sequence of {len} tokens at {start}: rel err {e}");
                    worst = worst.max(e);
                }
                eprintln!(
                    "gdn kernels, {products:?} products, dk {} dv {}, {dtype:?} inputs: worst rel err {worst:.2e}",
                    d.key_head_dim, d.value_head_dim
                );
            }
        }
    }
}

/// Each sequence's Gated DeltaNet output is bit for bit the same packed with others as alone,
/// with the f32 and with the tensor-core kernels.
#[test]
fn gdn_kernels_are_batch_invariant() {
    use layertap::engine::cuda::gdn::Products;
    let Some(dev) = device() else { return };
    let d = gdn_dims(2, 4, 128, 128);
    let seqs = packed(&GDN_LENS);
    let t: usize = GDN_LENS.iter().sum();
    let case = gdn_on(&gdn_case(&d, t, DType::BF16, 5), &dev);
    for products in [Products::F32, Products::Tf32] {
        let all = gdn_kernel(&case, &seqs, &d, products);
        for &(start, len) in &seqs {
            let part = |x: &Tensor| x.narrow(0, start, len).unwrap();
            let alone = case.rows(start, len);
            let one = gdn_kernel(&alone, &[(0, len)], &d, products);
            let diff = max_abs_diff(&part(&all), &one);
            assert_eq!(diff, 0.0, "{products:?}: sequence of {len} tokens differs alone by {diff}");
        }
    }
}

/// The fused gated RMSNorm equals the separate f32 ops (`rms_norm(x) * w * silu(z)`), to the
/// output's rounding, with `z` a view into a wider projection output: through the warp-per-row
/// kernel (1, 2 and 8 groups of 4 columns a lane, a part-full warp at 48 columns) and through the
/// block-per-row one (a row stride, a start or a width that is not a multiple of 4).
#[test]
fn gdn_gated_norm_matches_separate_ops() {
    let Some(dev) = device() else { return };
    let t = 37;
    // (value heads, dv, extra columns of the projection output, z's first column)
    let cases = [
        (6, 128, 24, 0),
        (3, 48, 8, 4),
        (2, 256, 4, 0),
        (1, 1024, 0, 0),
        (6, 128, 3, 0),
        (4, 128, 8, 2),
        (3, 50, 2, 0),
    ];
    for (nv, dv, extra, first) in cases {
        let x = Tensor::randn(0f32, 1.5, (t, nv, dv), &dev).unwrap();
        let w = Tensor::randn(1f32, 0.3, dv, &dev).unwrap();
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 8e-3)] {
            let wide = Tensor::randn(0f32, 2.0, (t, nv * dv + extra), &dev).unwrap().to_dtype(dtype).unwrap();
            let z = wide.narrow(1, first, nv * dv).unwrap();
            let got = layertap::engine::cuda::gdn::gated_norm(&x, &z, &w, 1e-6).unwrap();
            assert_eq!((got.dims(), got.dtype()), (&[t, nv, dv][..], dtype));
            let zf = z.to_dtype(DType::F32).unwrap().reshape((t, nv, dv)).unwrap();
            let want = (candle_nn::ops::rms_norm(&x, &w, 1e-6).unwrap() * candle_nn::ops::silu(&zf).unwrap()).unwrap();
            let e = rel(&got, &want);
            assert!(
                e < tol,
                "{dtype:?}, {nv} heads of {dv}, z from column {first} of {}: rel err {e}",
                nv * dv + extra
            );
        }
    }
}

/// The non-finite screen on the GPU flags exactly the (row, layer) pairs the portable ops flag
/// on the CPU: +inf, -inf and NaN placed at a row's first, middle and last column, in bf16, f16
/// and f32, with hidden sizes that take the 16-byte loads (64) and that do not (37, 5), whole and
/// as a view that starts one row in.
#[test]
fn nonfinite_screen_matches_the_portable_ops() {
    use layertap::engine::output::nonfinite;
    let Some(dev) = device() else { return };
    let cpu = candle_core::Device::Cpu;
    for hidden in [64usize, 37, 5] {
        let (rows, layers) = (23usize, 3usize);
        let mut v = noise(rows * layers * hidden, 7 + hidden as u64, 3.0);
        let bad = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
        for (i, &(r, l, c)) in
            [(0, 0, 0), (4, 1, hidden / 2), (9, 2, hidden - 1), (22, 2, 0), (13, 0, hidden - 1)].iter().enumerate()
        {
            v[(r * layers + l) * hidden + c] = bad[i % 3];
        }
        // Large finite values stay finite in every dtype (f16's largest is 65504).
        v[(17 * layers + 1) * hidden] = 6.0e4;
        let x = Tensor::from_vec(v, (rows, layers, hidden), &cpu).unwrap();
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let xc = x.to_dtype(dtype).unwrap();
            let want = nonfinite(&xc).unwrap().to_vec2::<u8>().unwrap();
            assert_eq!(want.iter().flatten().map(|&f| f as usize).sum::<usize>(), 5, "{dtype:?} {hidden}");
            let got = nonfinite(&xc.to_device(&dev).unwrap()).unwrap().to_vec2::<u8>().unwrap();
            assert_eq!(got, want, "{dtype:?}, hidden {hidden}");
            // Rows 1.. of a view that starts one row in: an offset of `hidden` values.
            let tail = xc.to_device(&dev).unwrap().narrow(0, 1, rows - 1).unwrap();
            let got = nonfinite(&tail).unwrap().to_vec2::<u8>().unwrap();
            assert_eq!(got, want[1..].to_vec(), "{dtype:?}, hidden {hidden}, a view");
        }
    }
}

/// Experts for a batch in which expert e has `counts[e]` of the `[T, k]` (token, slot) pairs
/// (`T = sum / k`), spread over the tokens; flattened token-major.
fn choices_with_counts(counts: &[usize], k: usize) -> (Vec<u32>, usize) {
    let pairs: Vec<u32> = counts.iter().enumerate().flat_map(|(e, &c)| std::iter::repeat_n(e as u32, c)).collect();
    assert_eq!(pairs.len() % k, 0);
    let t = pairs.len() / k;
    let mut idx = vec![0u32; pairs.len()];
    for (p, &e) in pairs.iter().enumerate() {
        idx[(p % t) * k + p / t] = e;
    }
    (idx, t)
}

fn u32s(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<u32>().unwrap()
}

/// The per-expert counts of the plan's tests: experts with no pairs, one, a full 64-row tile,
/// one row past it, several tiles, and counts that leave tiles part full.
const COUNTS: [usize; 9] = [0, 1, 64, 65, 0, 200, 7, 130, 13];

/// The device-side sort by expert: every (token, slot) pair gets its own row, inside its
/// expert's block (the blocks in expert order), the row's token is the pair's, and the tiles
/// cover each expert's rows exactly once in blocks of at most 64 or 128 rows (as asked); other
/// tile sizes are refused.
#[test]
fn moe_plan_sorts_pairs_by_expert() {
    use layertap::engine::cuda::moe::{plan, TILE_ROWS};
    let Some(dev) = device() else { return };
    let k = 4;
    let (idx, t) = choices_with_counts(&COUNTS, k);
    let idx_t = Tensor::from_vec(idx.clone(), (t, k), &dev).unwrap();
    for bm in TILE_ROWS {
        let p = plan(&idx_t, COUNTS.len(), bm).unwrap();
        assert_eq!(p.tile_rows, bm);
        let (tokens, row_of, tiles, n_tiles) = (u32s(&p.tokens), u32s(&p.row_of), u32s(&p.tiles), u32s(&p.n_tiles)[0]);
        let starts: Vec<usize> = COUNTS.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
        let mut seen = vec![false; t * k];
        for tok in 0..t {
            for j in 0..k {
                let r = row_of[j * t + tok] as usize;
                let e = idx[tok * k + j] as usize;
                assert!(!seen[r], "row {r} given twice");
                seen[r] = true;
                assert_eq!(tokens[r] as usize, tok, "row {r}");
                assert!((starts[e]..starts[e] + COUNTS[e]).contains(&r), "pair ({tok}, {j}) of expert {e} at row {r}");
            }
        }
        let want_tiles: usize = COUNTS.iter().map(|c| c.div_ceil(bm)).sum();
        assert_eq!(n_tiles as usize, want_tiles, "tiles of {bm}");
        let mut covered = vec![0u32; t * k];
        for tile in tiles.chunks(3).take(n_tiles as usize) {
            let (e, r0, n) = (tile[0] as usize, tile[1] as usize, tile[2] as usize);
            assert!((1..=bm).contains(&n), "tile {tile:?} of at most {bm}");
            assert!(r0 >= starts[e] && r0 + n <= starts[e] + COUNTS[e], "tile {tile:?} outside expert {e}");
            covered[r0..r0 + n].iter_mut().for_each(|c| *c += 1);
        }
        assert!(covered.iter().all(|&c| c == 1), "{covered:?}");
    }
    assert!(plan(&idx_t, COUNTS.len(), 32).is_err());
    assert!(plan(&idx_t, COUNTS.len(), 256).is_err());
}

/// The experts' grouped products on the device's plan, in tiles of 64 and of 128 rows: the SwiGLU
/// form (rows gathered from the tokens) gives the bits of the plain grouped matmul over the
/// sorted rows followed by `silu_mul`; both products equal one f32 matmul per expert over its
/// rows, in bf16 and f16, with reductions that are and are not multiples of the kernel's 32-wide
/// step; a row's result is the same bits when its expert's rows are a batch of their own, and
/// the same bits in tiles of 64 as in tiles of 128. On a 9.0 GPU (H100, H200) these are Hopper's
/// warpgroup kernels (asserted), elsewhere the mma.sync ones; the widest shape is the 35B-A3B's
/// (hidden 2,048, experts of 512: 32 and 8 slices of K).
#[test]
fn grouped_matmul_matches_a_matmul_per_expert() {
    use layertap::engine::cuda::moe::{grouped_matmul, grouped_swiglu, hopper_kernels, plan, TILE_ROWS};
    let Some(dev) = device() else { return };
    let cc = layertap::engine::cuda::fp8::compute_capability(&dev);
    let built_90 = layertap::engine::cuda::module::ARCHS.split([',', ' ']).any(|a| a == "90");
    assert_eq!(
        hopper_kernels(&dev),
        built_90 && cc == Some((9, 0)),
        "capability {cc:?}, built for {}",
        layertap::engine::cuda::module::ARCHS
    );
    let k = 4;
    let (idx, t) = choices_with_counts(&COUNTS, k);
    let starts: Vec<usize> = COUNTS.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
    let e = COUNTS.len();
    for (hidden, inter) in [(256, 384), (40, 24), (2048, 512)] {
        for dtype in [DType::BF16, DType::F16] {
            let x = Tensor::randn(0f32, 1.0, (t, hidden), &dev).unwrap().to_dtype(dtype).unwrap();
            let scale = 1.0 / (hidden as f64).sqrt();
            let gate_up = (Tensor::randn(0f32, 1.0, (e, 2 * inter, hidden), &dev).unwrap() * scale).unwrap();
            let gate_up = gate_up.to_dtype(dtype).unwrap();
            let down =
                (Tensor::randn(0f32, 1.0, (e, hidden, inter), &dev).unwrap() * 0.1).unwrap().to_dtype(dtype).unwrap();
            // Each tile size's SwiGLU and down outputs by (slot, token), to compare across plans.
            let mut by_pair: Vec<(Tensor, Tensor)> = Vec::new();
            for bm in TILE_ROWS {
                let p = plan(&Tensor::from_vec(idx.clone(), (t, k), &dev).unwrap(), e, bm).unwrap();
                let what = format!("{dtype:?} {hidden}x{inter}, tiles of {bm}");
                let act = grouped_swiglu(&x, &gate_up, &p).unwrap();
                assert_eq!(act.dims(), &[t * k, inter]);
                let sorted = x.index_select(&p.tokens, 0).unwrap();
                let gu = grouped_matmul(&sorted, &gate_up, &p).unwrap();
                let d = max_abs_diff(&act, &layertap::engine::cuda::ops::silu_mul(&gu).unwrap());
                assert_eq!(d, 0.0, "{what}: the fused SwiGLU differs from grouped_mm + silu_mul");
                let y = grouped_matmul(&act, &down, &p).unwrap();
                assert_eq!(y.dims(), &[t * k, hidden]);
                let f = |a: &Tensor| a.to_dtype(DType::F32).unwrap();
                for (ex, (&s, &c)) in starts.iter().zip(&COUNTS).enumerate().filter(|(_, (_, &c))| c > 0) {
                    let want =
                        f(&sorted.narrow(0, s, c).unwrap()).matmul(&f(&gate_up.get(ex).unwrap()).t().unwrap()).unwrap();
                    let err = rel(&gu.narrow(0, s, c).unwrap(), &want);
                    assert!(err < 4e-3, "{what} gate_up, expert {ex} ({c} rows): rel err {err}");
                    let want =
                        f(&act.narrow(0, s, c).unwrap()).matmul(&f(&down.get(ex).unwrap()).t().unwrap()).unwrap();
                    let err = rel(&y.narrow(0, s, c).unwrap(), &want);
                    assert!(err < 4e-3, "{what} down, expert {ex} ({c} rows): rel err {err}");
                }
                // Expert 5's rows alone, one slot per token: the same bits.
                let (s5, c5) = (starts[5], COUNTS[5]);
                let alone = plan(&Tensor::zeros((c5, 1), DType::U32, &dev).unwrap(), 1, bm).unwrap();
                let xa = sorted.narrow(0, s5, c5).unwrap();
                let act_a = grouped_swiglu(&xa, &gate_up.narrow(0, 5, 1).unwrap(), &alone).unwrap();
                let y_a = grouped_matmul(&act_a, &down.narrow(0, 5, 1).unwrap(), &alone).unwrap();
                let by_token = |m: &Tensor| m.index_select(&alone.row_of, 0).unwrap();
                let d = max_abs_diff(&by_token(&act_a), &act.narrow(0, s5, c5).unwrap());
                assert_eq!(d, 0.0, "{what}: a row's SwiGLU depends on its batch mates ({d})");
                let d = max_abs_diff(&by_token(&y_a), &y.narrow(0, s5, c5).unwrap());
                assert_eq!(d, 0.0, "{what}: a row's down projection depends on its batch mates ({d})");
                by_pair.push((act.index_select(&p.row_of, 0).unwrap(), y.index_select(&p.row_of, 0).unwrap()));
            }
            let ((act64, y64), (act128, y128)) = (&by_pair[0], &by_pair[1]);
            let (da, dy) = (max_abs_diff(act64, act128), max_abs_diff(y64, y128));
            assert_eq!((da, dy), (0.0, 0.0), "{dtype:?} {hidden}x{inter}: tiles of 64 and 128 differ");
        }
    }
}

/// The router's top k on the device equals softmax + sort on the portable path: the chosen
/// logits are the k largest (ties to the lower expert), best first, and the weights are the
/// softmax's (renormalised when asked), for several expert counts and k up to 32.
#[test]
fn moe_route_matches_softmax_top_k() {
    use layertap::engine::cuda::moe::route;
    let Some(dev) = device() else { return };
    let t = 300;
    for (e, k, norm) in [(256, 8, true), (64, 10, false), (8, 2, true), (40, 32, true), (1024, 8, false)] {
        for dtype in [DType::BF16, DType::F16] {
            let logits = (Tensor::randn(0f32, 1.0, (t, e), &dev).unwrap() * 2.0).unwrap().to_dtype(dtype).unwrap();
            let (idx, w) = route(&logits, k, norm).unwrap();
            assert_eq!(idx.dims(), &[t, k]);
            let (idx, w) = (idx.to_vec2::<u32>().unwrap(), w.to_vec2::<f32>().unwrap());
            let lf = logits.to_dtype(DType::F32).unwrap();
            let probs = candle_nn::ops::softmax_last_dim(&lf).unwrap().to_vec2::<f32>().unwrap();
            let lf = lf.to_vec2::<f32>().unwrap();
            for tok in 0..t {
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&a, &b| lf[tok][b].total_cmp(&lf[tok][a]).then(a.cmp(&b)));
                let want: Vec<u32> = order[..k].iter().map(|&c| c as u32).collect();
                assert_eq!(idx[tok], want, "{dtype:?} E={e} k={k} token {tok}");
                let sum: f32 = want.iter().map(|&c| probs[tok][c as usize]).sum();
                for (j, &c) in want.iter().enumerate() {
                    let p = probs[tok][c as usize] / if norm { sum } else { 1.0 };
                    let err = (w[tok][j] - p).abs() / p.abs().max(1e-30);
                    assert!(err < 2e-5, "{dtype:?} E={e} k={k} token {tok} slot {j}: {} vs {p}", w[tok][j]);
                }
            }
        }
    }
}

/// The weighted sum over the slots, with and without the shared expert, equals the same sums
/// in f32 on the host to the output's rounding.
#[test]
fn moe_combine_matches_the_weighted_sum() {
    use layertap::engine::cuda::moe::{combine, plan};
    let Some(dev) = device() else { return };
    let k = 4;
    let (idx, t) = choices_with_counts(&COUNTS, k);
    let h = 2112; // past one pass of the block's 256 threads x 8 columns
    let p = plan(&Tensor::from_vec(idx, (t, k), &dev).unwrap(), COUNTS.len(), 64).unwrap();
    let row_of = u32s(&p.row_of);
    for (dtype, tol) in [(DType::BF16, 5e-3), (DType::F16, 7e-4)] {
        let ys = Tensor::randn(0f32, 1.0, (t * k, h), &dev).unwrap().to_dtype(dtype).unwrap();
        let w = Tensor::rand(0f32, 1.0, (t, k), &dev).unwrap();
        let sh = Tensor::randn(0f32, 1.0, (t, h), &dev).unwrap().to_dtype(dtype).unwrap();
        let x = Tensor::randn(0f32, 1.0, (t, h), &dev).unwrap().to_dtype(dtype).unwrap();
        let gate = (Tensor::randn(0f32, 1.0, (1, h), &dev).unwrap() * 0.03).unwrap().to_dtype(dtype).unwrap();
        let f = |a: &Tensor| a.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        let (ysf, wf, shf, xf, gf) = (f(&ys), f(&w), f(&sh), f(&x), f(&gate));
        for with_shared in [false, true] {
            let got = if with_shared {
                combine(&ys, &p, &w, Some((&sh, &x, &gate))).unwrap()
            } else {
                combine(&ys, &p, &w, None).unwrap()
            };
            assert_eq!(got.dims(), &[t, h]);
            let mut want = vec![0f32; t * h];
            for tok in 0..t {
                let dot: f32 = (0..h).map(|c| xf[tok][c] * gf[0][c]).sum();
                let sig = 1.0 / (1.0 + (-dot).exp());
                for c in 0..h {
                    let mut a = 0f32;
                    for j in 0..k {
                        a += wf[tok][j] * ysf[row_of[j * t + tok] as usize][c];
                    }
                    if with_shared {
                        a += shf[tok][c] * sig;
                    }
                    want[tok * h + c] = a;
                }
            }
            let want = Tensor::from_vec(want, (t, h), &dev).unwrap();
            let e = rel(&got, &want);
            assert!(e < tol, "{dtype:?} shared {with_shared}: rel err {e}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Long batches: sizes past the 32-bit indices of candle's kernels (2^31, 2^32 elements) and past
// the 65,535 blocks of grid z. Each test compares rows at the start and the end of the large
// result with the same op on those rows alone (where 32-bit indices are exact), bit for bit.
// Run with `cargo test --release --features cuda --test cuda_kernels -- long_`.

/// `a` and `b` (small: a few rows) are bitwise equal: compared on the host as f32, which holds
/// every bf16, f16, fp8 and u8 value exactly.
fn assert_same(a: &Tensor, b: &Tensor, what: &str) {
    let host = |x: &Tensor| {
        let x = x.contiguous().unwrap().to_device(&candle_core::Device::Cpu).unwrap();
        x.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let (a, b) = (host(a), host(b));
    let bad = a.iter().zip(&b).position(|(x, y)| x.to_bits() != y.to_bits());
    assert!(bad.is_none(), "{what}: element {bad:?} differs");
}

/// The scan launches over slices of the sequence table: a batch of 70,000 sequences (past grid
/// z's 65,535) gives every sequence, on both sides of the 65,535th, the bits it has alone.
#[test]
fn long_gdn_scan_takes_more_than_65535_sequences() {
    use layertap::engine::cuda::gdn::Products;
    let Some(dev) = device() else { return };
    let d = gdn_dims(1, 2, 16, 16);
    let lens: Vec<usize> = (0..70_000).map(|i| 1 + i % 3).collect();
    let seqs = packed(&lens);
    let t: usize = lens.iter().sum();
    let case = gdn_on(&gdn_case(&d, t, DType::BF16, 23), &dev);
    for products in [Products::F32, Products::Tf32] {
        let all = gdn_kernel(&case, &seqs, &d, products);
        for i in [0usize, 1, 65_534, 65_535, 65_536, 69_999] {
            let (start, len) = seqs[i];
            let part = |x: &Tensor| x.narrow(0, start, len).unwrap();
            let alone = case.rows(start, len);
            let one = gdn_kernel(&alone, &[(0, len)], &d, products);
            assert_same(&part(&all), &one, &format!("{products:?}: sequence {i}"));
        }
    }
}

/// The taps of 262,144 tokens x 5 layers x 4,096 (5.4 G elements, past 2^32) stacked, gathered,
/// screened and quantised to fp8: the first and last rows equal the same ops on those rows
/// alone, and an infinity in the last row is flagged.
#[test]
fn long_stacked_taps_past_2_pow_32() {
    use layertap::engine::cuda::ops::{copy_rows, stack_rows};
    use layertap::engine::output::{prepare, Output, Rows};
    let Some(dev) = device() else { return };
    let (t, h, layers) = (262_144usize, 4_096usize, 5usize);
    let base = {
        let body = Tensor::randn(0f32, 1.0, (t - 1, h), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let inf = Tensor::full(f32::INFINITY, (1, h), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        Tensor::cat(&[&body, &inf], 0).unwrap()
    };
    let parts: Vec<Tensor> = (0..layers).map(|l| base.affine(1.0, l as f64).unwrap()).collect();
    drop(base);
    let stacked = stack_rows(&parts).unwrap();
    assert_eq!(stacked.dims(), &[t, layers, h]);
    let ends = [0usize, 1, t - 2, t - 1];
    for &r in &ends {
        let small: Vec<Tensor> = parts.iter().map(|p| p.narrow(0, r, 1).unwrap()).collect();
        assert_same(&stacked.narrow(0, r, 1).unwrap(), &Tensor::stack(&small, 1).unwrap(), &format!("stacked row {r}"));
    }
    drop(parts);

    let pick = [t - 1, 0, t - 2, 5];
    let idx = Tensor::new(pick.map(|r| r as u32).as_slice(), &dev).unwrap();
    let flat = stacked.reshape((t, layers * h)).unwrap();
    let gathered = copy_rows(&flat, Some(&idx)).unwrap();
    for (i, &r) in pick.iter().enumerate() {
        assert_same(&gathered.narrow(0, i, 1).unwrap(), &flat.narrow(0, r, 1).unwrap(), &format!("gathered row {r}"));
    }
    drop((flat, gathered));

    let out = Output { plain: Rows::Only(ends.map(|r| r as u32).to_vec()), fp8: Rows::All, ..Output::default() };
    let got = prepare(&stacked, &out).unwrap();
    let plain = got.plain.expect("selected rows");
    let fp8 = got.fp8.expect("every row in fp8");
    assert_eq!(fp8.states.dims(), &[t, layers, h]);
    for (i, &r) in ends.iter().enumerate() {
        assert_same(
            &plain.states.narrow(0, i, 1).unwrap(),
            &stacked.narrow(0, r, 1).unwrap(),
            &format!("plain row {r}"),
        );
    }
    let flags = plain.nonfinite.to_dtype(DType::U32).unwrap().to_vec2::<u32>().unwrap();
    assert_eq!(flags, vec![vec![0; layers], vec![0; layers], vec![0; layers], vec![1; layers]]);
    for r0 in [0usize, t - 2] {
        let want = prepare(&stacked.narrow(0, r0, 2).unwrap(), &Output::all_fp8()).unwrap().fp8.unwrap();
        let at = |x: &Tensor| x.narrow(0, r0, 2).unwrap();
        assert_same(&at(&fp8.states), &want.states, &format!("fp8 rows {r0}.."));
        assert_same(&at(fp8.scale.as_ref().unwrap()), want.scale.as_ref().unwrap(), &format!("scales {r0}.."));
        assert_same(&at(&fp8.nonfinite), &want.nonfinite, &format!("flags {r0}.."));
    }
    let last = fp8.nonfinite.narrow(0, t - 1, 1).unwrap().to_dtype(DType::U32).unwrap().to_vec2::<u32>().unwrap();
    assert_eq!(last, vec![vec![1; layers]], "the infinity in the last row");
}

/// The fused projection of the 27B hybrid's Gated DeltaNet (10,240 + 6,144 + 48 + 48 columns) at
/// 262,144 tokens: 4.3 G elements, past 2^32. Its parts are the columns of the fused output,
/// bit for bit, at the first and last rows.
#[test]
fn long_fused_projection_parts_past_2_pow_32() {
    use layertap::engine::layers::linear::{Linear, Projections};
    let Some(dev) = device() else { return };
    let (t, k) = (262_144usize, 16usize);
    let widths = [10_240usize, 6_144, 48, 48];
    let x = Tensor::randn(0f32, 1.0, (t, k), &dev).unwrap().to_dtype(DType::BF16).unwrap();
    let linears: Vec<Linear> = widths
        .iter()
        .map(|&w| {
            let weight = Tensor::randn(0f32, 0.3, (w, k), &dev).unwrap().to_dtype(DType::BF16).unwrap();
            Linear::from_weight(weight, None).unwrap()
        })
        .collect();
    let proj = Projections::new(linears, true).unwrap();
    let parts = proj.forward(&x).unwrap();
    let joined = proj.joined(&x).unwrap().expect("fused");
    assert_eq!(joined.dims(), &[t, widths.iter().sum::<usize>()]);
    let mut at = 0;
    for (part, &w) in parts.iter().zip(&widths) {
        assert_eq!(part.dims(), &[t, w]);
        assert!(part.is_contiguous());
        for r in [0usize, 1, t - 2, t - 1] {
            let want = joined.narrow(0, r, 1).unwrap().narrow(1, at, w).unwrap();
            assert_same(&part.narrow(0, r, 1).unwrap(), &want, &format!("columns {at}.. of row {r}"));
        }
        at += w;
    }
}

/// The embedding gather of 1,048,576 tokens x 4,608 (4.8 G elements), then candle's cast and
/// RMSNorm over it in slices of rows: the first and last rows are those of each op on the rows
/// alone.
#[test]
fn long_gather_cast_and_norm_past_2_pow_32() {
    use layertap::engine::cuda::ops::copy_rows;
    use layertap::engine::large::map_rows;
    let Some(dev) = device() else { return };
    let (t, h, vocab) = (1_048_576usize, 4_608usize, 1_000usize);
    let table = Tensor::randn(0f32, 1.0, (vocab, h), &dev).unwrap().to_dtype(DType::BF16).unwrap();
    let ids: Vec<u32> = (0..t).map(|i| ((i * 7_919 + 13) % vocab) as u32).collect();
    let ids = Tensor::new(ids.as_slice(), &dev).unwrap();
    let x = copy_rows(&table, Some(&ids)).unwrap();
    assert_eq!(x.dims(), &[t, h]);
    let ends = [0usize, 1, t - 2, t - 1];
    for &r in &ends {
        let want = table.index_select(&ids.narrow(0, r, 1).unwrap(), 0).unwrap();
        assert_same(&x.narrow(0, r, 1).unwrap(), &want, &format!("embedding row {r}"));
    }
    let xf = map_rows(&x, |x| x.to_dtype(DType::F32)).unwrap();
    assert_eq!(xf.dims(), &[t, h]);
    for &r in &ends {
        let want = x.narrow(0, r, 1).unwrap().to_dtype(DType::F32).unwrap();
        assert_same(&xf.narrow(0, r, 1).unwrap(), &want, &format!("f32 row {r}"));
    }
    drop(xf);
    let w = Tensor::randn(1f32, 0.2, h, &dev).unwrap().to_dtype(DType::BF16).unwrap();
    let normed = map_rows(&x, |x| candle_nn::ops::rms_norm(x, &w, 1e-6)).unwrap();
    for &r in &ends {
        let want = candle_nn::ops::rms_norm(&x.narrow(0, r, 1).unwrap(), &w, 1e-6).unwrap();
        assert_same(&normed.narrow(0, r, 1).unwrap(), &want, &format!("normed row {r}"));
    }
}

/// MXFP4 weights dequantised on the GPU, written transposed (`[in, rows]`), give exactly the CPU's
/// values ([`layertap::engine::layers::mxfp4::dequantise`]) in f32 and bf16 (every e2m1 value
/// times a power of two is exact in both), for every nibble and scales from 2^-127 to 2^127.
#[test]
fn mxfp4_dequantises_on_the_gpu_as_on_the_cpu() {
    use layertap::engine::cuda::ops::mxfp4_dequantise;
    use layertap::engine::layers::mxfp4::dequantise;
    let Some(dev) = device() else { return };
    let (rows, inp) = (37usize, 96usize);
    let blocks: Vec<u8> = (0..rows * inp / 2).map(|i| (i * 37 + i / 7) as u8).collect();
    let scales: Vec<u8> = (0..rows * inp / 32).map(|i| [0u8, 1, 100, 127, 128, 200, 254][i % 7]).collect();
    let cpu = dequantise(&blocks, &scales).unwrap(); // [rows, in]
    let b = Tensor::from_slice(&blocks, (rows, inp / 2), &dev).unwrap();
    let s = Tensor::from_slice(&scales, (rows, inp / 32), &dev).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let gpu = mxfp4_dequantise(&b, &s, dtype).unwrap();
        assert_eq!(gpu.dims(), &[inp, rows]);
        let gpu = gpu.to_dtype(DType::F32).unwrap().t().unwrap().contiguous().unwrap().flatten_all().unwrap();
        let gpu = gpu.to_vec1::<f32>().unwrap();
        for (j, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
            assert_eq!(
                g.to_bits(),
                c.to_bits(),
                "{dtype:?}: element {j} ({} of row {}): {g:e} vs {c:e}",
                j % inp,
                j / inp
            );
        }
    }
}
