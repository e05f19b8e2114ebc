//! The teacher's next-token distribution for selected rows: the final-norm state of each row
//! through the output head (`lm_head`, or the embeddings where the model ties them), the f32
//! log-softmax over the whole vocabulary, its top `k` entries (descending log-probability, ties
//! by ascending id), and the log-probability of each row's actual next token.
//!
//! Everything of vocabulary size stays on the device: rows go through the head in chunks whose
//! `[rows, vocab]` f32 logits stay under [`LOGITS_BUDGET_BYTES`], and only `[rows, k]` ids and
//! log-probabilities and `[rows]` target log-probabilities come back.
//!
//! Precision. On the CPU (the reference path) everything is f32: the state as the model computes
//! it, the head widened to f32, an f32 matmul, the log-sum-exp accumulated in f64 and rounded
//! once. On CUDA the head and the state stay in the compute dtype; the matmul multiplies them
//! exactly and accumulates in f32 into f32 logits (cuBLAS, no reduced-precision reduction, no
//! TF32), and the log-softmax and top-k run in f32 in a kernel of ours
//! (`kernels/logprobs.cu`), whose `exp`/`log` are CUDA's fast intrinsics (a relative error near
//! 1e-7 on the log-sum-exp). A bf16 model's logits are therefore those of its bf16 state and
//! bf16 head with no rounding of the logits themselves.

use candle_core::{DType, Tensor};

use super::output::Rows;
use super::EngineError;

/// The largest `k` the engine computes (the CUDA kernel keeps at most this many candidates).
pub const MAX_TOP_K: usize = 64;

/// The most bytes of f32 logits one chunk of rows may hold on the device (the batch budget
/// reserves it; see [`super::tokens_for_memory`]).
pub const LOGITS_BUDGET_BYTES: usize = 256 << 20;

/// Rows per matmul on the CPU (see [`top_k`]).
const CPU_BLOCK: usize = 16;

/// Which rows of a batch get log-probabilities, and how many of the top entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogprobRows {
    /// Rows of the batch (every row, or some in ascending order).
    pub rows: Rows,
    /// Entries kept per row, `1..=MAX_TOP_K`.
    pub top_k: usize,
}

/// Log-probabilities of some rows, on the device or on the host.
pub struct TopK<I, F> {
    pub top_k: usize,
    /// `[rows, top_k]` token ids, best first.
    pub ids: I,
    /// `[rows, top_k]` their log-probabilities.
    pub logprobs: F,
    /// `[rows]` the log-probability of the row's next input token (NaN where the row is the last
    /// of its sequence).
    pub target: F,
}

/// Some rows' top-k ids `[rows, k]` (i64), log-probabilities `[rows, k]` and target
/// log-probabilities `[rows]`, as an answer holds them.
pub type RowsLogprobs = (Vec<i64>, Vec<f32>, Vec<f32>);

/// On the device: `ids` u32, the rest f32.
pub type DeviceTopK = TopK<Tensor, Tensor>;

/// In host memory.
pub type HostTopK = TopK<Vec<u32>, Vec<f32>>;

impl HostTopK {
    pub fn rows(&self) -> usize {
        self.target.len()
    }

    /// Rows `start..start + rows`, the first `k` entries of each (`k <= top_k`): ids as i64,
    /// log-probabilities, target log-probabilities.
    pub fn slice(&self, start: usize, rows: usize, k: usize) -> Result<RowsLogprobs, EngineError> {
        if start + rows > self.rows() || k > self.top_k {
            return Err(EngineError::InvalidInput(format!(
                "log-probability rows {start}..{} (top {k}) past the batch's {} rows (top {})",
                start + rows,
                self.rows(),
                self.top_k
            )));
        }
        let w = self.top_k;
        let mut ids = Vec::with_capacity(rows * k);
        let mut lps = Vec::with_capacity(rows * k);
        for r in start..start + rows {
            ids.extend(self.ids[r * w..r * w + k].iter().map(|&i| i64::from(i)));
            lps.extend_from_slice(&self.logprobs[r * w..r * w + k]);
        }
        Ok((ids, lps, self.target[start..start + rows].to_vec()))
    }
}

impl DeviceTopK {
    /// The host copy (small: `rows x k`).
    pub fn to_host(&self) -> Result<HostTopK, EngineError> {
        Ok(TopK {
            top_k: self.top_k,
            ids: self.ids.flatten_all()?.to_vec1::<u32>()?,
            logprobs: self.logprobs.flatten_all()?.to_vec1::<f32>()?,
            target: self.target.flatten_all()?.to_vec1::<f32>()?,
        })
    }
}

/// The batch rows `rows` names, and for each the id of its next input token (`-1` where the
/// row is the last of its sequence).
pub fn rows_and_targets(rows: &Rows, input_ids: &[u32], cu_seqlens: &[usize]) -> (Vec<u32>, Vec<i32>) {
    let picked: Vec<u32> = match rows {
        Rows::All => (0..input_ids.len() as u32).collect(),
        Rows::Only(r) => r.clone(),
    };
    let targets = picked
        .iter()
        .map(|&r| {
            let next = r as usize + 1;
            // The row's sequence ends at the first offset past it.
            let end = cu_seqlens.iter().copied().find(|&e| e > r as usize).unwrap_or(0);
            if next < end {
                input_ids[next] as i32
            } else {
                -1
            }
        })
        .collect();
    (picked, targets)
}

/// Rows per chunk so a chunk's f32 logits stay within [`LOGITS_BUDGET_BYTES`].
pub fn chunk_rows(vocab: usize) -> usize {
    (LOGITS_BUDGET_BYTES / (vocab.max(1) * 4)).max(1)
}

/// Top-`k` log-probabilities of the rows of `states` (`[rows, hidden]`, the final-norm output in
/// the compute dtype) through `head` (`[vocab, hidden]`), with `targets[i]` the next token of
/// row `i` (`-1`: none).
pub fn top_k(states: &Tensor, head: &Tensor, k: usize, targets: &[i32]) -> Result<DeviceTopK, EngineError> {
    top_k_capped(states, head, k, targets, None)
}

/// [`top_k`] with the logits softcapped first where `softcap` is given: `cap * tanh(logits /
/// cap)` in f32.
pub fn top_k_capped(
    states: &Tensor,
    head: &Tensor,
    k: usize,
    targets: &[i32],
    softcap: Option<f64>,
) -> Result<DeviceTopK, EngineError> {
    let (rows, hidden) = states.dims2()?;
    let (vocab, h2) = head.dims2()?;
    if hidden != h2 || targets.len() != rows || k == 0 || k > MAX_TOP_K.min(vocab) {
        return Err(EngineError::InvalidInput(format!(
            "log-probabilities: states {:?}, head {:?}, {} targets, k = {k} do not fit (k in 1..={})",
            states.dims(),
            head.dims(),
            targets.len(),
            MAX_TOP_K.min(vocab)
        )));
    }
    let device = states.device();
    if rows == 0 {
        return Ok(TopK {
            top_k: k,
            ids: Tensor::zeros((0, k), DType::U32, device)?,
            logprobs: Tensor::zeros((0, k), DType::F32, device)?,
            target: Tensor::zeros(0, DType::F32, device)?,
        });
    }
    let step = chunk_rows(vocab);
    let (mut ids, mut lps, mut tgt) = (Vec::new(), Vec::new(), Vec::new());
    for r0 in (0..rows).step_by(step) {
        let n = step.min(rows - r0);
        let x = states.narrow(0, r0, n)?;
        let t = &targets[r0..r0 + n];
        let part = chunk(&x, head, k, t, softcap)?;
        ids.push(part.ids);
        lps.push(part.logprobs);
        tgt.push(part.target);
    }
    Ok(TopK { top_k: k, ids: Tensor::cat(&ids, 0)?, logprobs: Tensor::cat(&lps, 0)?, target: Tensor::cat(&tgt, 0)? })
}

/// `cap * tanh(logits / cap)` where a cap is given.
fn capped(logits: Tensor, softcap: Option<f64>) -> candle_core::Result<Tensor> {
    match softcap {
        Some(cap) => (logits / cap)?.tanh()? * cap,
        None => Ok(logits),
    }
}

fn chunk(
    x: &Tensor,
    head: &Tensor,
    k: usize,
    targets: &[i32],
    softcap: Option<f64>,
) -> Result<DeviceTopK, EngineError> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let logits = capped(super::cuda::logprobs::logits_f32(x, head)?, softcap)?;
        let t = Tensor::new(targets, x.device())?;
        let (ids, logprobs, target) = super::cuda::logprobs::top_k_logprobs(&logits, k, &t)?;
        return Ok(TopK { top_k: k, ids, logprobs, target });
    }
    // Candle's CPU matmul sums in an order that depends on how many rows it multiplies: rows go
    // through in blocks of CPU_BLOCK (the last padded with zeros), so a row's log-probabilities
    // do not depend on how many rows share its batch or chunk.
    let x = x.to_dtype(DType::F32)?;
    let w = head.to_dtype(DType::F32)?;
    let rows = x.dim(0)?;
    let mut blocks = Vec::with_capacity(rows.div_ceil(CPU_BLOCK));
    for r0 in (0..rows).step_by(CPU_BLOCK) {
        let n = CPU_BLOCK.min(rows - r0);
        let mut b = x.narrow(0, r0, n)?;
        if n < CPU_BLOCK {
            b = Tensor::cat(&[&b, &Tensor::zeros((CPU_BLOCK - n, b.dim(1)?), DType::F32, b.device())?], 0)?;
        }
        blocks.push(b.matmul(&w.t()?)?.narrow(0, 0, n)?);
    }
    let logits = capped(Tensor::cat(&blocks, 0)?, softcap)?;
    top_k_of_logits(&logits, k, targets)
}

/// Top-`k` log-probabilities of f32 `logits` `[rows, vocab]` computed on the host (the CPU
/// path, and the reference the CUDA kernel is tested against).
pub fn top_k_of_logits(logits: &Tensor, k: usize, targets: &[i32]) -> Result<DeviceTopK, EngineError> {
    let (rows, vocab) = logits.dims2()?;
    let device = logits.device().clone();
    let values = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let (mut ids, mut lps, mut tgt) = (Vec::with_capacity(rows * k), Vec::with_capacity(rows * k), Vec::new());
    for r in 0..rows {
        let row = &values[r * vocab..(r + 1) * vocab];
        let (picked, lse) = top_k_row(row, k);
        for &i in &picked {
            ids.push(i as u32);
            lps.push((f64::from(row[i]) - lse) as f32);
        }
        tgt.push(match targets.get(r) {
            Some(&t) if t >= 0 && (t as usize) < vocab => (f64::from(row[t as usize]) - lse) as f32,
            _ => f32::NAN,
        });
    }
    Ok(TopK {
        top_k: k,
        ids: Tensor::from_vec(ids, (rows, k), &device)?,
        logprobs: Tensor::from_vec(lps, (rows, k), &device)?,
        target: Tensor::from_vec(tgt, rows, &device)?,
    })
}

/// The `k` best ids of one row (descending value, ties by ascending id) and its log-sum-exp.
fn top_k_row(row: &[f32], k: usize) -> (Vec<usize>, f64) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&v| (f64::from(v) - f64::from(max)).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    // `a` ranks before `b`: larger value, or the same value and a smaller id.
    let before = |a: usize, b: usize| row[a] > row[b] || (row[a] == row[b] && a < b);
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    for i in 0..row.len() {
        if best.len() == k && !before(i, best[k - 1]) {
            continue;
        }
        let at = best.iter().position(|&b| before(i, b)).unwrap_or(best.len());
        best.insert(at, i);
        best.truncate(k);
    }
    (best, lse)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn top_k_is_sorted_with_ties_by_id_and_targets_read_the_next_token() {
        let row = [1.0f32, 3.0, 3.0, -2.0, 3.0, 0.5];
        let logits = Tensor::from_vec(row.to_vec(), (1, 6), &Device::Cpu).unwrap();
        let t = top_k_of_logits(&logits, 4, &[3]).unwrap().to_host().unwrap();
        assert_eq!(t.ids, vec![1, 2, 4, 0]);
        let lse = row.iter().map(|&v| f64::from(v).exp()).sum::<f64>().ln();
        for (j, &i) in t.ids.iter().enumerate() {
            assert!((f64::from(t.logprobs[j]) - (f64::from(row[i as usize]) - lse)).abs() < 1e-6);
        }
        assert!((f64::from(t.target[0]) - (-2.0 - lse)).abs() < 1e-6);
        let none = top_k_of_logits(&logits, 1, &[-1]).unwrap().to_host().unwrap();
        assert_eq!(none.ids, vec![1]);
        assert!(none.target[0].is_nan());
    }

    #[test]
    fn targets_stop_at_each_sequence_end() {
        let ids = [10, 11, 12, 20, 21];
        let (rows, t) = rows_and_targets(&Rows::All, &ids, &[0, 3, 5]);
        assert_eq!(rows, vec![0, 1, 2, 3, 4]);
        assert_eq!(t, vec![11, 12, -1, 21, -1]);
        let (rows, t) = rows_and_targets(&Rows::Only(vec![1, 2, 3]), &ids, &[0, 3, 5]);
        assert_eq!(rows, vec![1, 2, 3]);
        assert_eq!(t, vec![12, -1, 21]);
    }

    #[test]
    fn chunks_give_the_rows_computed_together() {
        let head = Tensor::randn(0f32, 1.0, (50, 8), &Device::Cpu).unwrap();
        let x = Tensor::randn(0f32, 1.0, (21, 8), &Device::Cpu).unwrap();
        let targets: Vec<i32> = (0..21).map(|r| if r % 6 == 5 { -1 } else { r }).collect();
        let whole = top_k(&x, &head, 5, &targets).unwrap().to_host().unwrap();
        let mut parts = Vec::new();
        for r in 0..21 {
            parts.push(
                chunk(&x.narrow(0, r, 1).unwrap(), &head, 5, &targets[r..r + 1], None).unwrap().to_host().unwrap(),
            );
        }
        assert_eq!(whole.ids, parts.iter().flat_map(|p| p.ids.clone()).collect::<Vec<_>>());
        assert_eq!(whole.logprobs, parts.iter().flat_map(|p| p.logprobs.clone()).collect::<Vec<_>>());
    }
}
