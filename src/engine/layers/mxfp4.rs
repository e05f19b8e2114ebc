//! MXFP4 weights (the OCP microscaling format gpt-oss's experts are released in), dequantised
//! exactly: each block of 32 e2m1 values (two a byte, the low nibble first) shares one E8M0 scale
//! `2^(s - 127)`. An e2m1 value times a power of two has at most two significant bits, so every
//! weight is exactly an f32 (and a bf16) value: the dequantised weights are the released ones.

use rayon::prelude::*;

/// Values per block (one scale each).
pub const BLOCK: usize = 32;
/// Bytes per block.
pub const BLOCK_BYTES: usize = BLOCK / 2;

/// The e2m1 value of each nibble: sign bit, two exponent bits, one mantissa bit.
const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// The E8M0 scale byte that means NaN.
pub const NAN_SCALE: u8 = 0xFF;

/// `2^(s - 127)` for an E8M0 byte other than [`NAN_SCALE`], exactly (`2^-127` is an f32 subnormal).
fn scale_value(s: u8) -> f32 {
    (2f64).powi(s as i32 - 127) as f32
}

/// `Err` naming the first scale that is NaN ([`NAN_SCALE`]).
pub fn check_scales(scales: &[u8]) -> Result<(), String> {
    match scales.iter().position(|&s| s == NAN_SCALE) {
        Some(at) => Err(format!("scale {at} is 0xFF, which E8M0 defines as NaN")),
        None => Ok(()),
    }
}

/// The f32 values of `blocks` (`rows * groups` blocks of [`BLOCK_BYTES`] bytes, row-major) with
/// their `scales` (`rows * groups` bytes): `[rows, groups * 32]` row-major. `Err` with the index
/// of the first scale that is NaN ([`NAN_SCALE`]), or where the lengths do not match.
pub fn dequantise(blocks: &[u8], scales: &[u8]) -> Result<Vec<f32>, String> {
    if blocks.len() != scales.len() * BLOCK_BYTES {
        return Err(format!("{} bytes of blocks for {} scales (16 bytes a block)", blocks.len(), scales.len()));
    }
    check_scales(scales)?;
    let mut out = vec![0f32; scales.len() * BLOCK];
    out.par_chunks_mut(BLOCK).zip(blocks.par_chunks(BLOCK_BYTES)).zip(scales.par_iter()).for_each(|((o, b), &s)| {
        let scale = scale_value(s);
        for (pair, &byte) in o.chunks_exact_mut(2).zip(b) {
            pair[0] = E2M1[(byte & 0x0F) as usize] * scale;
            pair[1] = E2M1[(byte >> 4) as usize] * scale;
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Low nibble first, the LUT's sign bit, the scale a power of two; a whole block each.
    #[test]
    fn blocks_dequantise_to_their_exact_values() {
        let mut blocks = vec![0u8; 2 * BLOCK_BYTES];
        blocks[0] = 0x71; // 0.5 then 6
        blocks[1] = 0x9F; // -6 then -0.5
        blocks[BLOCK_BYTES + 15] = 0x2A; // last byte of block 1: -1 then 1
        let out = dequantise(&blocks, &[127 + 3, 0]).unwrap();
        assert_eq!(out.len(), 2 * BLOCK);
        assert_eq!(&out[..4], &[0.5 * 8.0, 6.0 * 8.0, -6.0 * 8.0, -0.5 * 8.0]);
        assert!(out[4..BLOCK].iter().all(|&x| x == 0.0));
        // Scale byte 0: 2^-127, a subnormal, times -1 and 1, exactly.
        let tiny = f32::from_bits(1 << 22);
        assert_eq!(tiny, 2f32.powi(-127));
        assert_eq!(&out[2 * BLOCK - 2..], &[-tiny, tiny]);
        // Every value is a bf16 value.
        assert!(out.iter().all(|&x| half::bf16::from_f32(x).to_f32() == x));
    }

    #[test]
    fn a_nan_scale_or_a_short_block_is_refused() {
        let e = dequantise(&[0u8; 2 * BLOCK_BYTES], &[127, NAN_SCALE]).unwrap_err();
        assert!(e.contains("scale 1 is 0xFF"), "{e}");
        assert!(dequantise(&[0u8; BLOCK_BYTES + 1], &[127]).is_err());
    }
}
