//! Dtypes: the one a model computes in ([`ComputeDType`]: float32, bfloat16 or float16) and the
//! ones an answer can hold ([`OutDType`]: those, or fp8 quantised after the taps are taken).

use candle_core::DType;

/// Output dtypes a caller can ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutDType {
    #[serde(alias = "f32")]
    Float32,
    #[serde(alias = "bf16")]
    Bfloat16,
    #[serde(alias = "f16")]
    Float16,
    /// 8-bit floats (E4M3, finite only, max 448) with one f32 scale per token per layer; only
    /// ever produced by the engine (quantised on the device after the taps are taken).
    #[serde(rename = "float8_e4m3fn", alias = "fp8", alias = "f8_e4m3")]
    Float8E4M3,
}

impl OutDType {
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(OutDType::Float32),
            "bf16" | "bfloat16" => Some(OutDType::Bfloat16),
            "f16" | "float16" => Some(OutDType::Float16),
            "fp8" | "f8_e4m3" | "float8_e4m3fn" => Some(OutDType::Float8E4M3),
            _ => None,
        }
    }

    pub fn candle(self) -> DType {
        match self {
            OutDType::Float32 => DType::F32,
            OutDType::Bfloat16 => DType::BF16,
            OutDType::Float16 => DType::F16,
            OutDType::Float8E4M3 => DType::F8E4M3,
        }
    }

    pub fn from_candle(d: DType) -> Self {
        match d {
            DType::BF16 => OutDType::Bfloat16,
            DType::F16 => OutDType::Float16,
            DType::F8E4M3 => OutDType::Float8E4M3,
            _ => OutDType::Float32,
        }
    }

    pub fn size_in_bytes(self) -> usize {
        self.candle().size_in_bytes()
    }

    /// The name used in safetensors metadata and the API ("float32", …).
    pub fn name(self) -> &'static str {
        match self {
            OutDType::Float32 => "float32",
            OutDType::Bfloat16 => "bfloat16",
            OutDType::Float16 => "float16",
            OutDType::Float8E4M3 => "float8_e4m3fn",
        }
    }
}

impl std::str::FromStr for OutDType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        OutDType::parse(s).ok_or_else(|| {
            format!("unknown dtype {s:?}; use f32, bf16, f16 or fp8 (or float32, bfloat16, float16, float8_e4m3fn)")
        })
    }
}

/// The dtype a model computes in (the default dtype of its answers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDType {
    Float32,
    Bfloat16,
    Float16,
}

impl ComputeDType {
    /// The same dtype as an answer's.
    pub fn out(self) -> OutDType {
        match self {
            ComputeDType::Float32 => OutDType::Float32,
            ComputeDType::Bfloat16 => OutDType::Bfloat16,
            ComputeDType::Float16 => OutDType::Float16,
        }
    }

    pub fn candle(self) -> DType {
        self.out().candle()
    }

    /// The compute dtype of a candle dtype the engine loads models in (f32 for any other).
    pub fn from_candle(d: DType) -> Self {
        match d {
            DType::BF16 => ComputeDType::Bfloat16,
            DType::F16 => ComputeDType::Float16,
            _ => ComputeDType::Float32,
        }
    }

    /// "float32", "bfloat16" or "float16".
    pub fn name(self) -> &'static str {
        self.out().name()
    }
}

impl std::str::FromStr for ComputeDType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.parse::<OutDType>()? {
            OutDType::Float32 => Ok(ComputeDType::Float32),
            OutDType::Bfloat16 => Ok(ComputeDType::Bfloat16),
            OutDType::Float16 => Ok(ComputeDType::Float16),
            OutDType::Float8E4M3 => Err("fp8 is an output dtype only (answers quantised after the taps are \
                 taken); compute in f32, bf16 or f16"
                .into()),
        }
    }
}
