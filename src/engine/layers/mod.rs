//! The building blocks of a decoder layer, with no knowledge of any model family: a family is
//! a choice of these per layer ([`crate::engine::config::LayerSpec`]).

pub mod attention;
pub mod cpu_attention;
pub mod cpu_ops;
pub mod delta_rule;
pub mod fp8;
pub mod gdn;
pub mod linear;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod mxfp4;
pub mod norm;
pub mod per_layer;
pub mod rope;
pub mod sdpa;
