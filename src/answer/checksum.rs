//! The checksum every answer carries for each of its tensors (xxh64 in the safetensors
//! metadata), and the check a reader runs: the server writes them, `layertap bulk` and the
//! clients verify them.

use std::collections::HashMap;

/// The checksum every answer carries for each of its tensors (metadata `checksum_algorithm`).
pub const CHECKSUM_ALGORITHM: &str = "xxh64";

/// The xxh64 (seed 0) of bytes given in pieces, as 16 lowercase hex digits.
pub fn xxh64_hex<'a>(pieces: impl IntoIterator<Item = &'a [u8]>) -> String {
    let mut h = xxhash_rust::xxh64::Xxh64::new(0);
    for p in pieces {
        h.update(p);
    }
    format!("{:016x}", h.digest())
}

/// Checks every tensor of a safetensors file against the checksums in its metadata; the error
/// names the first tensor that does not match (or why the file cannot be checked).
pub fn verify_checksums(file: &[u8]) -> Result<(), String> {
    let st = safetensors::SafeTensors::deserialize(file).map_err(|e| format!("not a safetensors file: {e}"))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(file).map_err(|e| format!("unreadable header: {e}"))?;
    let meta = meta.metadata().clone().unwrap_or_default();
    match meta.get("checksum_algorithm").map(String::as_str) {
        Some(CHECKSUM_ALGORITHM) => {}
        Some(other) => return Err(format!("unknown checksum algorithm {other:?}")),
        None => return Err("the file carries no checksums".into()),
    }
    let sums: HashMap<String, String> = meta
        .get("checksums")
        .and_then(|c| serde_json::from_str(c).ok())
        .ok_or_else(|| "the file's \"checksums\" metadata is missing or not a JSON object".to_string())?;
    for (name, t) in st.tensors() {
        let want = sums.get(&name).ok_or_else(|| format!("tensor {name:?} has no checksum"))?;
        let got = xxh64_hex([t.data()]);
        if &got != want {
            return Err(format!("tensor {name:?} is corrupt: its xxh64 is {got}, the file says {want}"));
        }
    }
    Ok(())
}
