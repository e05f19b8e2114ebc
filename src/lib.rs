//! layertap: hidden states of chosen layers of a decoder LLM, exact to Hugging Face transformers.
//!
//! A request walks down and its answer back up, each room depending only on those below it:
//! [`http`] (parse, admit, send) → [`answer`] (the caller's layers and tokens resolved once; the
//! answer assembled and encoded) → [`batching`] (a token-budgeted queue feeding one worker thread
//! per device) → [`engine`] (the model; the only module that uses candle), and back.
//! [`tokenizer`] turns inputs into ids; [`bulk`] is a client of the HTTP API; [`server`] wires
//! the rooms together.

pub mod answer;
pub mod batching;
pub mod bench;
pub mod bufpool;
pub mod bulk;
pub mod cli;
pub mod engine;
pub mod error;
pub mod http;
pub mod metrics;
pub mod server;
pub mod signal;
pub mod tokenizer;

pub use http::{app, AppState};
pub use server::run;
