//! The answer: what a caller asks of it (layers, tokens, dtype), resolved and checked once, and
//! what comes back, assembled from the batches' rows and rendered. The HTTP handler, `layertap
//! extract`, `layertap bench` and `layertap bulk` all speak through this room; the engine never
//! sees a caller's names for layers or tokens.
//!
//! - [`layers`]: caller layer names resolved once into a [`LayerSet`];
//! - [`select`]: token selection (one parser for the API and `layertap bulk --tokens`);
//! - [`assemble`]: rows + inputs + layer set + selection + dtype → columns and metadata;
//! - [`codec`]: the format only (safetensors layout, zstd framing), with [`checksum`] (each
//!   tensor's xxh64 and its check).

pub mod assemble;
pub mod checksum;
pub mod codec;
pub mod layers;
pub mod select;

pub use assemble::{metadata, Assembly, Extraction, HiddenStatesJson, LogprobsAsk};
pub use codec::Logprobs;
pub use layers::{LayerRef, LayerSet, CONVENTION, FINAL_PRENORM};
pub use select::Selection;
