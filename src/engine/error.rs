//! Why the engine failed: loading, the caller's input, computation, device memory, cancellation.

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model could not be loaded; the message says what is wrong and how to fix it.
    #[error("{0}")]
    Load(String),
    /// The caller asked for something the model cannot do (layer out of range, token id too large).
    #[error("{0}")]
    InvalidInput(String),
    #[error("model computation failed: {0}")]
    Compute(candle_core::Error),
    /// The device ran out of memory; a smaller batch may fit. Candle reports CUDA's
    /// `CUDA_ERROR_OUT_OF_MEMORY` (and allocation failures) as text, so it is recognised there.
    #[error("the device ran out of memory: {0}")]
    OutOfMemory(String),
    /// Every request of the batch has gone, so the engine stopped between layers and its
    /// device work was abandoned. Not a failure: nobody is waiting for the result.
    #[error("the batch was cancelled after {layers_run} layers: every request in it has gone")]
    Cancelled { layers_run: usize },
}

impl EngineError {
    /// Whether a candle error's text says the device ran out of memory.
    pub fn is_out_of_memory_text(text: &str) -> bool {
        text.contains("CUDA_ERROR_OUT_OF_MEMORY")
            || text.contains("CUBLAS_STATUS_ALLOC_FAILED")
            || text.to_ascii_lowercase().contains("out of memory")
    }
}

impl From<candle_core::Error> for EngineError {
    /// Every candle error enters the engine's errors here, so an out-of-memory error is
    /// recognised wherever it surfaces (a kernel launch, an allocation, a copy to the host).
    fn from(e: candle_core::Error) -> Self {
        let text = e.to_string();
        if EngineError::is_out_of_memory_text(&text) {
            EngineError::OutOfMemory(one_line(&e))
        } else {
            EngineError::Compute(e)
        }
    }
}

/// A candle error's message on one line, without the backtrace candle may have attached (a
/// device error's backtrace is many lines of `<unknown>` frames, useless in a log line).
fn one_line(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => one_line(inner),
        candle_core::Error::Context { inner, context } => format!("{context}: {}", one_line(inner)),
        other => other.to_string().split('\n').map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("; "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_out_of_memory_error_is_one_line_without_its_backtrace() {
        let inner = candle_core::Error::Msg("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into());
        let e = candle_core::Error::WithBacktrace {
            inner: Box::new(inner),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        }
        .context("allocating 3 GiB");
        assert!(e.to_string().lines().count() > 2, "candle's own text carries the backtrace");
        match EngineError::from(e) {
            EngineError::OutOfMemory(m) => {
                assert_eq!(m, "allocating 3 GiB: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")")
            }
            other => panic!("not recognised as out of memory: {other}"),
        }
    }
}
