//! Where `layertap bulk` puts a sample's file.
//!
//! A plain-layout name is the id made safe for a file name and, after it, the xxh64 of the exact
//! id: ids that look alike once made safe (`a/b` and `a b`, ids that differ only past the first
//! characters kept or only in non-ASCII letters, an empty and a blank id) still get files of their
//! own. The manifest keeps the exact id and the file's path, and every reader goes by the path
//! recorded, so folders written with other names read as they are.

use std::path::PathBuf;

use crate::answer::checksum::xxh64_hex;
use crate::cli::BulkLayout;

use super::input::Sample;

/// Input rows per `shard-NNNNN` folder of the plain layout.
pub(super) const SHARD_SIZE: usize = 1000;

/// Characters of the id kept in its file name (the hash after them tells ids apart).
const STEM_CHARS: usize = 100;

/// The plain layout's file name for a sample id: its ASCII letters, digits, '-', '_' and '.' (any
/// other character as '_', at most [`STEM_CHARS`] of them, '_' first where it would start with
/// '.' or '-' or be empty), '-', and the xxh64 (seed 0) of the id's UTF-8 bytes in 16 hex digits.
pub(super) fn file_name(id: &str) -> String {
    let mut stem: String = id
        .chars()
        .take(STEM_CHARS)
        .map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' })
        .collect();
    if stem.is_empty() || stem.starts_with(['.', '-']) {
        stem.insert(0, '_');
    }
    format!("{stem}-{}.safetensors", xxh64_hex([id.as_bytes()]))
}

/// Where a sample's file goes, relative to `--out`.
pub(super) fn relative_path(layout: BulkLayout, s: &Sample) -> PathBuf {
    match layout {
        BulkLayout::Plain => PathBuf::from(format!("shard-{:05}", s.index / SHARD_SIZE)).join(file_name(&s.id)),
        BulkLayout::Speculators => PathBuf::from(format!("hs_{}.safetensors", s.index)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_alike_once_made_safe_get_names_of_their_own() {
        let long = "x".repeat(130);
        let ids = [
            "a/b".to_string(),
            "a b".into(),
            "a_b".into(),
            "é".into(),
            "è".into(),
            "日本".into(),
            "".into(),
            " ".into(),
            "_".into(),
            format!("{long}1"),
            format!("{long}2"),
            ".hidden".into(),
            "-flag".into(),
        ];
        let names: Vec<String> = ids.iter().map(|id| file_name(id)).collect();
        let distinct: std::collections::HashSet<String> = names.iter().map(|n| n.to_ascii_lowercase()).collect();
        assert_eq!(distinct.len(), ids.len(), "{names:?}");
        for n in &names {
            assert!(n.len() < 200 && !n.starts_with(['.', '-']) && !n.contains('/'), "{n}");
            assert!(n.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)), "{n}");
        }
        assert_eq!(file_name("a/b"), format!("a_b-{}.safetensors", xxh64_hex([b"a/b".as_slice()])));
    }
}
