//! layertap: hidden states of chosen layers of a decoder LLM, exact to Hugging Face transformers.
//!
//! Three layers, each depending only on the one below: [`http`] (parse, validate, admit, encode),
//! [`batching`] (a token-budgeted queue feeding one worker thread per device) and [`engine`]
//! (the model; the only module that uses candle).

pub mod batching;
pub mod bench;
pub mod bufpool;
pub mod bulk;
pub mod cli;
pub mod codec;
pub mod engine;
pub mod error;
pub mod extract;
pub mod gguf_tokenizer;
pub mod http;
pub mod metrics;
pub mod select;
pub mod server;
pub mod tokenizer;

pub use http::{app, AppState};
pub use server::run;
