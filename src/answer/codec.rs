//! The answer's format: a safetensors file (hidden states, ids, offsets, loss mask, metadata,
//! every tensor's checksum), optionally one zstd frame. Pure functions, meant to run off the
//! async runtime; how many answers encode at once, on how many threads, is the server's business.

use std::collections::HashMap;

use safetensors::tensor::Dtype;

use super::checksum::{xxh64_hex, CHECKSUM_ALGORITHM};
use crate::bufpool::AnswerBuf;
use crate::engine::OutDType;

fn st_dtype(d: OutDType) -> Dtype {
    match d {
        OutDType::Float32 => Dtype::F32,
        OutDType::Bfloat16 => Dtype::BF16,
        OutDType::Float16 => Dtype::F16,
        OutDType::Float8E4M3 => Dtype::F8_E4M3,
    }
}

fn le_i64(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn le_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn st_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "F32",
        Dtype::BF16 => "BF16",
        Dtype::F16 => "F16",
        Dtype::F8_E4M3 => "F8_E4M3",
        Dtype::I64 => "I64",
        _ => "U8",
    }
}

/// An answer whose hidden states are still in pieces (each sequence's rows, often a view into
/// its batch's host buffer): [`encode_answer`] writes it without first joining the pieces.
pub struct AnswerParts<'a> {
    pub dtype: OutDType,
    /// `[rows, n_layers, hidden]`.
    pub shape: Vec<usize>,
    /// The hidden states' bytes in row order.
    pub chunks: Vec<&'a [u8]>,
    /// `[rows, n_layers]` scales of fp8 hidden states.
    pub scale: Option<Vec<f32>>,
    pub input_ids: Vec<i64>,
    pub cu_seqlens: Vec<i64>,
    pub loss_mask: Vec<u8>,
    pub positions: Option<Vec<i64>>,
    /// Next-token log-probabilities of the rows, when asked.
    pub logprobs: Option<Logprobs>,
    pub metadata: HashMap<String, String>,
}

/// The top-k next-token log-probabilities of an answer's rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Logprobs {
    pub top_k: usize,
    /// `[rows, top_k]` token ids, best first.
    pub ids: Vec<i64>,
    /// `[rows, top_k]` their log-probabilities.
    pub logprobs: Vec<f32>,
    /// `[rows]` the log-probability of each row's next input token (NaN on an input's last
    /// token), when asked.
    pub target: Option<Vec<f32>>,
}

/// The bytes of `topk_ids`, `topk_logprobs` and (when asked) `target_logprobs`.
type LogprobBytes = (Vec<u8>, Vec<u8>, Option<Vec<u8>>);

/// The bytes of the tensors that follow the hidden states and their checksums, made once per
/// answer.
struct Small {
    hs_len: usize,
    ids: Vec<u8>,
    cu: Vec<u8>,
    scale: Option<Vec<u8>>,
    positions: Option<Vec<u8>>,
    /// `topk_ids`, `topk_logprobs`, `target_logprobs`.
    logprobs: Option<LogprobBytes>,
    /// xxh64 of each tensor other than the hidden states, in the order of `tensors`.
    sums: Vec<String>,
}

impl Small {
    /// Checks that the pieces and the scales fit the shape.
    fn of(a: &AnswerParts) -> std::io::Result<Small> {
        let hs_len: usize = a.chunks.iter().map(|c| c.len()).sum();
        let expect = a.shape.iter().product::<usize>() * a.dtype.size_in_bytes();
        if hs_len != expect {
            return Err(std::io::Error::other(format!(
                "hidden states hold {hs_len} bytes, shape {:?} needs {expect}",
                a.shape
            )));
        }
        let rows = a.shape.first().copied().unwrap_or(0);
        let width = a.shape.get(1).copied().unwrap_or(0);
        let scale = a.scale.as_deref().map(le_f32);
        if scale.as_ref().is_some_and(|s| s.len() != rows * width * 4) {
            return Err(std::io::Error::other("hidden_states_scale must hold one value per row and layer"));
        }
        if let Some(l) = &a.logprobs {
            let target_ok = l.target.as_ref().is_none_or(|t| t.len() == rows);
            if l.ids.len() != rows * l.top_k || l.logprobs.len() != rows * l.top_k || !target_ok {
                return Err(std::io::Error::other("log-probabilities must hold top_k values per row"));
            }
        }
        let mut small = Small {
            logprobs: a
                .logprobs
                .as_ref()
                .map(|l| (le_i64(&l.ids), le_f32(&l.logprobs), l.target.as_deref().map(le_f32))),
            hs_len,
            ids: le_i64(&a.input_ids),
            cu: le_i64(&a.cu_seqlens),
            scale,
            positions: a.positions.as_deref().map(le_i64),
            sums: Vec::new(),
        };
        small.sums = small.tensors(a)[1..].iter().map(|t| xxh64_hex([t.3])).collect();
        Ok(small)
    }

    /// Name, dtype, shape and bytes of every tensor; the hidden states first here (with no bytes:
    /// they stay in pieces), last in the file (see `header`).
    fn tensors<'s>(&'s self, a: &'s AnswerParts) -> Vec<(&'static str, Dtype, Vec<usize>, &'s [u8])> {
        let rows = a.shape.first().copied().unwrap_or(0);
        let width = a.shape.get(1).copied().unwrap_or(0);
        let mut t: Vec<(&str, Dtype, Vec<usize>, &[u8])> = Vec::with_capacity(6);
        t.push(("hidden_states", st_dtype(a.dtype), a.shape.clone(), &[]));
        if let Some(s) = &self.scale {
            t.push(("hidden_states_scale", Dtype::F32, vec![rows, width], s));
        }
        t.push(("input_ids", Dtype::I64, vec![a.input_ids.len()], &self.ids));
        t.push(("cu_seqlens", Dtype::I64, vec![a.cu_seqlens.len()], &self.cu));
        t.push(("loss_mask", Dtype::U8, vec![a.loss_mask.len()], &a.loss_mask));
        if let Some(p) = &self.positions {
            t.push(("positions", Dtype::I64, vec![p.len() / 8], p));
        }
        if let (Some((ids, lps, target)), Some(l)) = (&self.logprobs, &a.logprobs) {
            t.push(("topk_ids", Dtype::I64, vec![rows, l.top_k], ids));
            t.push(("topk_logprobs", Dtype::F32, vec![rows, l.top_k], lps));
            if let Some(tg) = target {
                t.push(("target_logprobs", Dtype::F32, vec![rows], tg));
            }
        }
        t
    }

    /// The file's first bytes: the header's length, then the header (metadata with every
    /// tensor's checksum, `hs_sum` for the hidden states), padded so the data starts 8-byte
    /// aligned as the format recommends. Its length does not depend on the checksums' values.
    fn header(&self, a: &AnswerParts, hs_sum: &str) -> std::io::Result<Vec<u8>> {
        let tensors = self.tensors(a);
        let mut sums = serde_json::Map::new();
        sums.insert("hidden_states".into(), hs_sum.into());
        for ((name, ..), sum) in tensors[1..].iter().zip(&self.sums) {
            sums.insert((*name).into(), sum.as_str().into());
        }
        let mut metadata = a.metadata.clone();
        metadata.insert("checksum_algorithm".into(), CHECKSUM_ALGORITHM.into());
        metadata.insert("checksums".into(), serde_json::Value::Object(sums).to_string());
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), serde_json::to_value(&metadata)?);
        // In file order: the small tensors first, the hidden states last, so that a reader
        // streaming the answer knows `cu_seqlens` (each input's rows) before the states come and
        // can put each input's rows straight where they go.
        let mut at = 0;
        for (name, dtype, shape, bytes) in tensors[1..].iter().chain(&tensors[..1]) {
            let len = if *name == "hidden_states" { self.hs_len } else { bytes.len() };
            header.insert(
                (*name).into(),
                serde_json::json!({"dtype": st_name(*dtype), "shape": shape, "data_offsets": [at, at + len]}),
            );
            at += len;
        }
        let h = serde_json::to_vec(&serde_json::Value::Object(header))?;
        let padded = h.len().next_multiple_of(8);
        let mut out = Vec::with_capacity(8 + padded);
        out.extend_from_slice(&(padded as u64).to_le_bytes());
        out.extend_from_slice(&h);
        out.resize(8 + padded, b' ');
        Ok(out)
    }

    /// The size of the whole file.
    fn file_size(&self, a: &AnswerParts) -> std::io::Result<usize> {
        let rest: usize = self.tensors(a)[1..].iter().map(|t| t.3.len()).sum();
        Ok(self.header(a, PLACEHOLDER)?.len() + self.hs_len + rest)
    }

    /// The whole file, streamed: header (the states' checksum in a first pass), the small
    /// tensors, the states' pieces.
    fn write(&self, w: &mut impl std::io::Write, a: &AnswerParts) -> std::io::Result<()> {
        w.write_all(&self.header(a, &xxh64_hex(a.chunks.iter().copied()))?)?;
        self.write_rest(w, a)?;
        for c in &a.chunks {
            w.write_all(c)?;
        }
        Ok(())
    }

    fn write_rest(&self, w: &mut impl std::io::Write, a: &AnswerParts) -> std::io::Result<()> {
        for (_, _, _, bytes) in &self.tensors(a)[1..] {
            w.write_all(bytes)?;
        }
        Ok(())
    }
}

/// Writes `a` as a safetensors file (header, then hidden_states_scale, input_ids, cu_seqlens,
/// loss_mask, positions, topk_ids, topk_logprobs, target_logprobs, and hidden_states last),
/// streaming the hidden-state pieces. The metadata gains the
/// xxh64 of every tensor's bytes (`checksums`), computed in a first pass over them.
pub fn write_safetensors(w: &mut impl std::io::Write, a: &AnswerParts) -> std::io::Result<()> {
    Small::of(a)?.write(w, a)
}

/// A checksum's stand-in of the same length, for a header whose length is all that counts.
const PLACEHOLDER: &str = "0000000000000000";

/// Decompresses a zstd body. When the frame records its size (layertap's answers do) the
/// output is allocated once, at that size; otherwise, or when that fails (several frames, a size
/// that does not hold, one past `64 x` the body, which no answer reaches), it is read as a stream.
pub fn unzstd(body: &[u8]) -> std::io::Result<Vec<u8>> {
    if let Ok(Some(n)) = zstd::zstd_safe::get_frame_content_size(body) {
        if n <= (body.len() as u64).saturating_mul(64) {
            if let Ok(v) = zstd::bulk::decompress(body, n as usize) {
                return Ok(v);
            }
        }
    }
    zstd::stream::decode_all(body)
}

/// The size in bytes of the file [`write_safetensors`] writes for `a`.
pub fn safetensors_size(a: &AnswerParts) -> std::io::Result<u64> {
    Ok(Small::of(a)?.file_size(a)? as u64)
}

/// [`write_safetensors`] into memory in one pass over the hidden states: each block is copied,
/// then hashed while it is still in the cache, and the header, written first with a placeholder
/// checksum of the same length, is written again once the checksum is known. The same bytes.
fn write_in_one_pass(small: &Small, out: &mut AnswerBuf, a: &AnswerParts) -> std::io::Result<()> {
    use std::io::Write;
    /// Small enough to stay in a core's cache between the copy and the hash.
    const BLOCK: usize = 64 << 10;
    let placeholder = small.header(a, PLACEHOLDER)?;
    let start = out.len();
    out.write_all(&placeholder)?;
    small.write_rest(out, a)?;
    let mut h = xxhash_rust::xxh64::Xxh64::new(0);
    for c in &a.chunks {
        for block in c.chunks(BLOCK) {
            out.write_all(block)?;
            h.update(block);
        }
    }
    let header = small.header(a, &format!("{:016x}", h.digest()))?;
    if header.len() != placeholder.len() {
        return Err(std::io::Error::other("the answer's header changed length with its checksum"));
    }
    out[start..start + header.len()].copy_from_slice(&header);
    Ok(())
}

/// The answer's bytes: safetensors, zstd-compressed at `zstd_level` when given (on one thread),
/// written straight from the pieces.
pub fn encode_answer(a: &AnswerParts, zstd_level: Option<i32>) -> std::io::Result<Vec<u8>> {
    encode_answer_on(a, zstd_level, 1).map(AnswerBuf::into_vec)
}

thread_local! {
    /// Each encoding thread's zstd context, reused from answer to answer (a new one allocates
    /// and faults in its tables and window every time).
    static ZSTD: std::cell::RefCell<Option<zstd::zstd_safe::CCtx<'static>>> = const { std::cell::RefCell::new(None) };
}

/// [`encode_answer`] on `threads` zstd threads (for a caller that holds them), into a buffer from [`crate::bufpool`] sized (from the file's exact size)
/// so that it never grows.
/// The bytes are the same as a fresh zstd encoder's with the same level, threads and pledged
/// size (the file's, which the frame header records).
pub fn encode_answer_on(a: &AnswerParts, zstd_level: Option<i32>, threads: usize) -> std::io::Result<AnswerBuf> {
    let small = Small::of(a)?;
    let size = small.file_size(a)?;
    match zstd_level {
        None => {
            let mut out = crate::bufpool::take(size);
            write_in_one_pass(&small, &mut out, a)?;
            Ok(out)
        }
        Some(level) => {
            // zstd's bound on its output: the input, plus its block and frame overheads.
            let mut out = crate::bufpool::take(size + size / 128 + (64 << 10));
            ZSTD.with(|cell| -> std::io::Result<()> {
                let mut slot = cell.borrow_mut();
                if slot.is_none() {
                    *slot = Some(
                        zstd::zstd_safe::CCtx::try_create()
                            .ok_or_else(|| std::io::Error::other("cannot create a zstd context"))?,
                    );
                }
                let Some(ctx) = slot.as_mut() else { unreachable!("created above") };
                let mut enc = zstd::stream::write::Encoder::with_context(&mut out, ctx);
                enc.set_parameter(zstd::zstd_safe::CParameter::CompressionLevel(level))?;
                enc.set_parameter(zstd::zstd_safe::CParameter::NbWorkers(if threads > 1 {
                    threads as u32
                } else {
                    0
                }))?;
                // The frame header records the file's size, so a decoder can allocate its output
                // once (Python's zstandard decompresses in one call only then).
                enc.set_pledged_src_size(Some(size as u64))?;
                small.write(&mut enc, a)?;
                enc.finish()?;
                Ok(())
            })?;
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::checksum::verify_checksums;
    use safetensors::tensor::TensorView;

    fn parts(chunks: Vec<&[u8]>) -> AnswerParts<'_> {
        AnswerParts {
            dtype: OutDType::Bfloat16,
            shape: vec![3, 2, 4],
            chunks,
            scale: None,
            input_ids: vec![5, 6, 7],
            cu_seqlens: vec![0, 1, 3],
            loss_mask: vec![1, 0, 1],
            positions: None,
            logprobs: None,
            metadata: HashMap::from([("model".to_string(), "m".to_string())]),
        }
    }

    /// The streamed writer produces a file the safetensors library reads back to the same
    /// tensors as the library's own serialiser, however the rows are split.
    #[test]
    fn streamed_answer_reads_back_like_the_library_serialiser() {
        let hs: Vec<u8> = (0..48u8).collect();
        let (ids, cu) = (le_i64(&[5, 6, 7]), le_i64(&[0, 1, 3]));
        let views = vec![
            ("hidden_states", TensorView::new(Dtype::BF16, vec![3, 2, 4], &hs).unwrap()),
            ("input_ids", TensorView::new(Dtype::I64, vec![3], &ids).unwrap()),
            ("cu_seqlens", TensorView::new(Dtype::I64, vec![3], &cu).unwrap()),
            ("loss_mask", TensorView::new(Dtype::U8, vec![3], &[1u8, 0, 1]).unwrap()),
        ];
        let reference = safetensors::tensor::serialize(views, None).unwrap();
        let (a, b) = hs.split_at(16);
        for zstd in [None, Some(3)] {
            let bytes = encode_answer(&parts(vec![a, b]), zstd).unwrap();
            let raw = if zstd.is_some() { zstd::decode_all(&bytes[..]).unwrap() } else { bytes };
            let ours = safetensors::SafeTensors::deserialize(&raw).unwrap();
            let theirs = safetensors::SafeTensors::deserialize(&reference).unwrap();
            let mut names = ours.names();
            names.sort();
            assert_eq!(names, vec!["cu_seqlens", "hidden_states", "input_ids", "loss_mask"]);
            for n in names {
                let (o, t) = (ours.tensor(n).unwrap(), theirs.tensor(n).unwrap());
                assert_eq!((o.dtype(), o.shape(), o.data()), (t.dtype(), t.shape(), t.data()), "{n}");
            }
            let (_, meta) = safetensors::SafeTensors::read_metadata(&raw).unwrap();
            assert_eq!(meta.metadata().as_ref().and_then(|m| m.get("model")).map(String::as_str), Some("m"));
            verify_checksums(&raw).unwrap();
        }
    }

    /// fp8 answers carry their scales and a selection its positions, each a tensor the
    /// library reads with the right dtype and shape.
    #[test]
    fn fp8_scales_and_positions_are_tensors_of_their_own() {
        let hs: Vec<u8> = (0..24u8).collect();
        let mut p = parts(vec![&hs]);
        p.dtype = OutDType::Float8E4M3;
        p.scale = Some(vec![0.5, 1.0, 1.5, 2.0, 2.5, 3.0]);
        p.positions = Some(vec![4, 0, 1]);
        let raw = encode_answer(&p, None).unwrap();
        let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
        let h = st.tensor("hidden_states").unwrap();
        assert_eq!((h.dtype(), h.shape(), h.data()), (Dtype::F8_E4M3, &[3usize, 2, 4][..], &hs[..]));
        let s = st.tensor("hidden_states_scale").unwrap();
        assert_eq!((s.dtype(), s.shape()), (Dtype::F32, &[3usize, 2][..]));
        assert_eq!(s.data(), &le_f32(&[0.5, 1.0, 1.5, 2.0, 2.5, 3.0])[..]);
        let pos = st.tensor("positions").unwrap();
        assert_eq!((pos.dtype(), pos.shape(), pos.data()), (Dtype::I64, &[3usize][..], &le_i64(&[4, 0, 1])[..]));
        verify_checksums(&raw).unwrap();
        p.scale = Some(vec![1.0; 5]);
        assert!(encode_answer(&p, None).is_err(), "one scale per row and layer");
    }

    /// The checksums are xxh64 as other implementations compute it, and a changed byte in
    /// any tensor is caught and named.
    #[test]
    fn checksums_catch_a_changed_byte_in_any_tensor() {
        // Reference values of xxh64 with seed 0 (the algorithm's published test vectors).
        assert_eq!(xxh64_hex([&b""[..]]), "ef46db3751d8e999");
        assert_eq!(xxh64_hex([&b"a"[..], &b"bc"[..]]), "44bc2cf5ad770999");
        let hs: Vec<u8> = (0..48u8).collect();
        let raw = encode_answer(&parts(vec![&hs]), None).unwrap();
        verify_checksums(&raw).unwrap();
        let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
        let header = 8 + u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&raw).unwrap();
        for name in ["hidden_states", "input_ids", "cu_seqlens", "loss_mask"] {
            let (start, _) = meta.info(name).unwrap().data_offsets;
            assert!(!st.tensor(name).unwrap().data().is_empty());
            let mut bad = raw.clone();
            bad[header + start] ^= 0x01;
            let e = verify_checksums(&bad).unwrap_err();
            assert!(e.contains(name) && e.contains("corrupt"), "{e}");
        }
    }

    /// The hidden states come last in the data section, every other tensor (`cu_seqlens`
    /// among them) before them: a reader streaming the answer learns each input's rows before
    /// the states arrive. Both writers (streamed and one-pass).
    #[test]
    fn the_hidden_states_come_last_in_the_file() {
        let hs: Vec<u8> = (0..48u8).collect();
        let p = parts(vec![&hs[..20], &hs[20..]]);
        let mut streamed = Vec::new();
        write_safetensors(&mut streamed, &p).unwrap();
        for raw in [encode_answer(&p, None).unwrap(), streamed] {
            let (n, meta) = safetensors::SafeTensors::read_metadata(&raw).unwrap();
            let body = raw.len() - 8 - n;
            let (start, end) = meta.info("hidden_states").unwrap().data_offsets;
            assert_eq!((start, end), (body - hs.len(), body), "the states end the file");
            assert_eq!(&raw[8 + n + start..], &hs[..]);
            for name in ["input_ids", "cu_seqlens", "loss_mask"] {
                assert!(meta.info(name).unwrap().data_offsets.1 <= start, "{name} before the states");
            }
        }
    }

    /// A deterministic answer of `rows` rows of 5 layers of 1,024 bf16 values, in pieces of
    /// uneven sizes (some far larger than the one-pass writer's block), with scales and positions.
    fn big_parts(hs: &[u8], rows: usize) -> AnswerParts<'_> {
        let cuts = [0, 1, 70_001, 200_000, hs.len() / 2 + 3, hs.len()];
        let mut p = parts(cuts.windows(2).map(|w| &hs[w[0]..w[1]]).collect());
        p.shape = vec![rows, 5, 1024];
        p.input_ids = (0..rows as i64).collect();
        p.cu_seqlens = vec![0, rows as i64 / 3, rows as i64];
        p.loss_mask = (0..rows).map(|i| (i % 2) as u8).collect();
        p.positions = Some((0..rows as i64).map(|i| i * 2).collect());
        p
    }

    fn states(rows: usize) -> Vec<u8> {
        let mut x = 0x2545f4914f6cdd1du64;
        (0..rows * 5 * 1024)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // bf16 of moderate values: a sign, a narrow exponent, a random mantissa.
                let bits = ((x >> 48) as u16 & 0x807f) | 0x3e00 | ((x as u16 & 3) << 7);
                bits.to_le_bytes()
            })
            .collect()
    }

    /// The one-pass identity writer (copy and hash each block, header rewritten at the end)
    /// gives exactly the bytes of the two-pass streaming writer.
    #[test]
    fn the_one_pass_identity_answer_is_the_streamed_file() {
        let rows = 300;
        let hs = states(rows);
        let p = big_parts(&hs, rows);
        let mut streamed = Vec::new();
        write_safetensors(&mut streamed, &p).unwrap();
        let one_pass = encode_answer_on(&p, None, 1).unwrap();
        assert_eq!(one_pass.len(), streamed.len());
        assert!(one_pass[..] == streamed[..], "the same bytes");
        verify_checksums(&one_pass).unwrap();
    }

    /// The thread's reused zstd context gives the bytes a new encoder gives, whatever level
    /// and thread count the previous answer on that thread used.
    #[test]
    fn a_reused_zstd_context_compresses_like_a_new_encoder() {
        let rows = 1200;
        let hs = states(rows);
        let p = big_parts(&hs, rows);
        for (level, threads) in [(1, 1), (3, 2), (-3, 1), (1, 3), (1, 1), (5, 1)] {
            let mut fresh = zstd::stream::Encoder::new(Vec::new(), level).unwrap();
            if threads > 1 {
                fresh.multithread(threads as u32).unwrap();
            }
            let mut file = Vec::new();
            write_safetensors(&mut file, &p).unwrap();
            assert_eq!(safetensors_size(&p).unwrap(), file.len() as u64);
            fresh.set_pledged_src_size(Some(file.len() as u64)).unwrap();
            write_safetensors(&mut fresh, &p).unwrap();
            let fresh = fresh.finish().unwrap();
            let reused = encode_answer_on(&p, Some(level), threads).unwrap();
            assert!(reused[..] == fresh[..], "level {level} on {threads} threads: the same bytes");
            let recorded = zstd::zstd_safe::get_frame_content_size(&reused).unwrap();
            assert_eq!(recorded, Some(file.len() as u64), "the frame records the file's size");
            verify_checksums(&zstd::decode_all(&reused[..]).unwrap()).unwrap();
        }
    }

    /// Answers decode in one allocation; frames without a recorded size, and several frames
    /// one after the other, still decode whole.
    #[test]
    fn unzstd_reads_sized_unsized_and_concatenated_frames() {
        let rows = 200;
        let hs = states(rows);
        let p = big_parts(&hs, rows);
        let mut file = Vec::new();
        write_safetensors(&mut file, &p).unwrap();
        let answer = encode_answer_on(&p, Some(1), 1).unwrap();
        assert_eq!(unzstd(&answer).unwrap(), file);
        let no_size = zstd::stream::encode_all(&file[..], 1).unwrap();
        assert_eq!(zstd::zstd_safe::get_frame_content_size(&no_size).unwrap(), None);
        assert_eq!(unzstd(&no_size).unwrap(), file);
        let mut two = answer.to_vec();
        two.extend_from_slice(&zstd::bulk::compress(b"tail", 1).unwrap());
        let mut both = file.clone();
        both.extend_from_slice(b"tail");
        assert_eq!(unzstd(&two).unwrap(), both, "every frame, not only the first");
        assert!(unzstd(b"not zstd").is_err());
    }

    /// Pieces that do not add up to the shape are refused, not written.
    #[test]
    fn mismatched_pieces_are_an_error() {
        let hs = [0u8; 40];
        assert!(encode_answer(&parts(vec![&hs]), None).is_err());
    }
}
