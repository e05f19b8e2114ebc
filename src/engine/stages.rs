//! The decoder's layers split into consecutive stages (`--pipeline N`), each on its own device:
//! the embeddings go with the first stage, the final norm and the output head with the last, and
//! the layers are cut where the stages' weight bytes come out most even. One stage holding
//! every layer is the ordinary single-device decoder.

use std::ops::Range;

use super::{Device, EngineError};

/// The weight bytes a split weighs: each decoder layer's, the embeddings' (with the first stage)
/// and the final norm's and output head's (with the last), as the checkpoint stores them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StageBytes {
    pub layers: Vec<u64>,
    pub first: u64,
    pub last: u64,
}

impl StageBytes {
    /// The bytes of the stage holding `layers`, the `k`-th of `n`.
    fn of(&self, layers: Range<usize>, k: usize, n: usize) -> u64 {
        let own: u64 = self.layers[layers].iter().sum();
        own + if k == 0 { self.first } else { 0 } + if k + 1 == n { self.last } else { 0 }
    }
}

/// One stage of a loaded decoder: the device its weights live on, the decoder layers it runs
/// (`0..num_layers` for a single stage) and its weight bytes as stored.
#[derive(Clone, Debug)]
pub struct Stage {
    pub device: Device,
    pub layers: Range<usize>,
    pub weight_bytes: u64,
}

/// A stage as `/v1/info` shows it: its device, the 1-based decoder layers it runs (`first..=last`,
/// the hidden-state indices they produce) and its weight bytes.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct StageLayout {
    pub device: String,
    pub first_layer: usize,
    pub last_layer: usize,
    pub weight_bytes: u64,
}

impl Stage {
    pub fn layout(&self) -> StageLayout {
        let device = match &self.device {
            Device::Cpu => "cpu".to_string(),
            Device::Cuda(_) => match self.device.location() {
                candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
                other => format!("{other:?}"),
            },
            other => format!("{:?}", other.location()),
        };
        StageLayout {
            device,
            first_layer: self.layers.start + 1,
            last_layer: self.layers.end,
            weight_bytes: self.weight_bytes,
        }
    }
}

/// The device of stage `k`.
pub fn device_of(stages: &[Stage], k: usize) -> Result<Device, EngineError> {
    stages
        .get(k)
        .map(|s| s.device.clone())
        .ok_or_else(|| EngineError::Load("a decoder needs at least one stage".into()))
}

/// Checks a pipeline of `stages` stages for a model of `layers` decoder layers: at least one
/// stage, and no more stages than layers (every stage runs at least one layer).
pub fn check_stages(stages: usize, layers: usize) -> Result<(), EngineError> {
    if stages < 1 {
        return Err(EngineError::Load(format!("--pipeline {stages}: a replica needs at least 1 stage")));
    }
    if stages > layers {
        return Err(EngineError::Load(format!(
            "--pipeline {stages}: the model has {layers} decoder layers, so at most {layers} stages (each stage runs \
             at least one layer)"
        )));
    }
    Ok(())
}

/// The layer ranges of `n` consecutive stages over `bytes.layers`, each non-empty, chosen so the
/// heaviest stage (its layers plus the embeddings on the first, the final norm and head on the
/// last) is as light as any split can make it; among such splits, the one cutting each boundary
/// as late as it can. Every layer lands in exactly one stage, in order.
pub fn split(bytes: &StageBytes, n: usize) -> Result<Vec<(Range<usize>, u64)>, EngineError> {
    let l = bytes.layers.len();
    check_stages(n, l)?;
    // best[k][j]: the lightest heaviest stage over stages 0..=k holding layers 0..j; cut[k][j]
    // where stage k starts in that split.
    let mut best = vec![vec![u64::MAX; l + 1]; n];
    let mut cut = vec![vec![0usize; l + 1]; n];
    for (j, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = bytes.of(0..j, 0, n);
    }
    for k in 1..n {
        for j in k + 1..=l {
            for i in k..j {
                let heaviest = best[k - 1][i].max(bytes.of(i..j, k, n));
                if heaviest <= best[k][j] {
                    (best[k][j], cut[k][j]) = (heaviest, i);
                }
            }
        }
    }
    let mut ranges = vec![0..0; n];
    let mut end = l;
    for k in (0..n).rev() {
        let start = if k == 0 { 0 } else { cut[k][end] };
        ranges[k] = start..end;
        end = start;
    }
    Ok(ranges.into_iter().enumerate().map(|(k, r)| (r.clone(), bytes.of(r, k, n))).collect())
}

/// The stages of a replica on `devices` (one per stage, in order), split by `bytes`.
pub fn plan(bytes: &StageBytes, devices: &[Device]) -> Result<Vec<Stage>, EngineError> {
    Ok(split(bytes, devices.len())?
        .into_iter()
        .zip(devices)
        .map(|((layers, weight_bytes), device)| Stage { device: device.clone(), layers, weight_bytes })
        .collect())
}

/// Whether `stages` may work at once: each on a device of its own (a GPU's work queue is not
/// shared between stages), or all on the CPU.
pub fn overlap_between(stages: &[&Stage]) -> bool {
    stages.len() > 1
        && (stages.iter().all(|s| s.device.is_cpu())
            || stages.iter().enumerate().all(|(i, a)| stages[..i].iter().all(|b| !a.device.same_device(&b.device))))
}

/// The batch of `cu_seqlens` cut, on sequence boundaries, into micro-batches of about equal
/// tokens for `stages` stages to work on at once: twice as many as stages (so that the stages
/// idle for a smaller share of the batch while the pipeline fills and drains), at most one per
/// sequence; ranges of sequence indices. One range when one stage runs.
pub fn micro_batches(cu_seqlens: &[usize], stages: usize) -> Vec<std::ops::Range<usize>> {
    let seqs = cu_seqlens.len().saturating_sub(1);
    let want = if stages > 1 { (2 * stages).min(seqs) } else { 1 };
    if want < 2 {
        return std::iter::once(0..seqs).collect();
    }
    let mut parts = Vec::with_capacity(want);
    let mut start = 0;
    for s in 1..=seqs {
        let cut = parts.len() + 1;
        let left = seqs - s;
        // What is left of the batch, shared evenly by the micro-batches still to cut.
        let share = (cu_seqlens[seqs] - cu_seqlens[start]) as f64 / (want - parts.len()) as f64;
        let due = (cu_seqlens[s] - cu_seqlens[start]) as f64 >= share;
        if s == seqs || (due && cut < want) || left <= want - cut {
            parts.push(start..s);
            start = s;
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(layers: &[u64], first: u64, last: u64) -> StageBytes {
        StageBytes { layers: layers.to_vec(), first, last }
    }

    fn ranges(b: &StageBytes, n: usize) -> Vec<Range<usize>> {
        split(b, n).unwrap().into_iter().map(|(r, _)| r).collect()
    }

    #[test]
    fn equal_layers_split_evenly() {
        let b = bytes(&[10; 8], 0, 0);
        assert_eq!(ranges(&b, 1), vec![0..8]);
        assert_eq!(ranges(&b, 2), vec![0..4, 4..8]);
        assert_eq!(ranges(&b, 4), vec![0..2, 2..4, 4..6, 6..8]);
        assert_eq!(ranges(&b, 8).len(), 8);
    }

    /// The embeddings weigh on the first stage and the head on the last: they get fewer layers.
    #[test]
    fn the_ends_carry_the_embeddings_and_the_head() {
        let b = bytes(&[10; 8], 40, 0);
        assert_eq!(ranges(&b, 2), vec![0..2, 2..8]);
        let b = bytes(&[10; 8], 0, 40);
        assert_eq!(ranges(&b, 2), vec![0..6, 6..8]);
        let b = bytes(&[10; 8], 20, 20);
        let s = split(&b, 3).unwrap();
        assert_eq!(s.iter().map(|(r, _)| r.clone()).collect::<Vec<_>>(), vec![0..2, 2..6, 6..8]);
        assert_eq!(s.iter().map(|(_, b)| *b).collect::<Vec<_>>(), vec![40, 40, 40]);
    }

    #[test]
    fn refuses_zero_stages_and_more_stages_than_layers() {
        let b = bytes(&[1; 3], 0, 0);
        let e = split(&b, 0).unwrap_err().to_string();
        assert!(e.contains("--pipeline 0"), "{e}");
        let e = split(&b, 4).unwrap_err().to_string();
        assert!(e.contains("--pipeline 4") && e.contains("3 decoder layers"), "{e}");
    }

    /// Over many shapes: every layer in exactly one non-empty stage, in order, the bytes add up,
    /// and no other split has a lighter heaviest stage (checked against every split of 3).
    #[test]
    fn every_layer_in_exactly_one_stage_and_the_heaviest_is_minimal() {
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            seed >> 40
        };
        for _ in 0..200 {
            let l = 3 + (next() % 10) as usize;
            let b = bytes(&(0..l).map(|_| 1 + next() % 100).collect::<Vec<_>>(), next() % 200, next() % 200);
            for n in 1..=l.min(5) {
                let s = split(&b, n).unwrap();
                assert_eq!(s.len(), n);
                assert_eq!(s[0].0.start, 0);
                assert_eq!(s[n - 1].0.end, l);
                assert!(s.windows(2).all(|w| w[0].0.end == w[1].0.start));
                assert!(s.iter().all(|(r, _)| !r.is_empty()));
                let total: u64 = b.layers.iter().sum::<u64>() + b.first + b.last;
                assert_eq!(s.iter().map(|(_, b)| b).sum::<u64>(), total);
                if n == 3 {
                    let heaviest = s.iter().map(|(_, b)| *b).max().unwrap();
                    for i in 1..l - 1 {
                        for j in i + 1..l {
                            let other = [b.of(0..i, 0, 3), b.of(i..j, 1, 3), b.of(j..l, 2, 3)];
                            assert!(heaviest <= *other.iter().max().unwrap(), "{b:?}: {s:?} vs cuts {i},{j}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn micro_batches_cut_on_sequence_boundaries_evenly() {
        let cu = |lens: &[usize]| {
            let mut c = vec![0];
            for l in lens {
                c.push(c.last().unwrap() + l);
            }
            c
        };
        // One stage, or one sequence: no cut.
        let whole = |n: usize| std::iter::once(0..n).collect::<Vec<_>>();
        assert_eq!(micro_batches(&cu(&[5, 5, 5]), 1), whole(3));
        assert_eq!(micro_batches(&cu(&[40]), 4), whole(1));
        // Fewer sequences than twice the stages: one each.
        assert_eq!(micro_batches(&cu(&[3, 9, 4]), 2), vec![0..1, 1..2, 2..3]);
        // Twice the stages, of about equal tokens.
        assert_eq!(micro_batches(&cu(&[1; 12]), 2), vec![0..3, 3..6, 6..9, 9..12]);
        assert_eq!(micro_batches(&cu(&[8, 1, 1, 1, 1, 1, 1, 2]), 2), vec![0..1, 1..4, 4..7, 7..8]);
        for (lens, stages) in [(vec![7, 1, 30, 2, 2, 9, 4, 4, 1], 3), (vec![2; 5], 2), (vec![100, 1, 1, 1], 2)] {
            let parts = micro_batches(&cu(&lens), stages);
            assert_eq!(parts.len(), (2 * stages).min(lens.len()), "{lens:?}");
            assert_eq!(parts.first().unwrap().start, 0);
            assert_eq!(parts.last().unwrap().end, lens.len());
            assert!(parts.windows(2).all(|w| w[0].end == w[1].start) && parts.iter().all(|r| !r.is_empty()));
        }
    }
}
