//! Python's float functions, bit for bit: the policies' formulas must give the same doubles
//! in both engines, or their rankings (and with them the victims) drift apart.
//!
//! Python's `x ** y` on floats is C `pow` (after special cases that agree with `pow` for the
//! finite inputs used here) and `math.log2` is C `log2`. Rust's `powf` and `log2` lower to
//! the same libm calls, but LLVM may rewrite a call whose base is a known constant
//! (`pow(2.0, x)` into `exp2(x)`, which can differ in the last bit): `black_box` hides the
//! arguments so the call is always the plain libm one.

use std::hint::black_box;

/// `base ** exp` on Python floats.
#[inline]
pub fn pow(base: f64, exp: f64) -> f64 {
    black_box(base).powf(black_box(exp))
}

/// `math.exp(x)` for a finite float (C `exp`).
#[inline]
pub fn exp(x: f64) -> f64 {
    black_box(x).exp()
}

/// `math.log2(x)` for a positive finite float.
#[inline]
pub fn log2(x: f64) -> f64 {
    black_box(x).log2()
}

/// Python's `max(a, b)`: `a` unless `b` is strictly greater (the first maximum wins, so
/// `max(0.0, -0.0)` is `0.0`).
#[inline]
pub fn py_max(a: f64, b: f64) -> f64 {
    if b > a {
        b
    } else {
        a
    }
}

/// Python's `min(a, b)`: `a` unless `b` is strictly smaller.
#[inline]
pub fn py_min(a: f64, b: f64) -> f64 {
    if b < a {
        b
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Bits of CPython 3.11 on x86-64 glibc: `2.0 ** -0.37`, `math.log2(3.0)`,
    // `0.5 ** (1 / (0.25 * 7))` (a mixture's decay), `2.0 ** (-1e-5 * 12345)` (LRFU).
    #[test]
    fn matches_cpython() {
        assert_eq!(pow(2.0, -0.37).to_bits(), 4605144832673525547);
        assert_eq!(log2(3.0).to_bits(), 4609816855700290920);
        assert_eq!(pow(0.5, 1.0 / (0.25 * 7.0)).to_bits(), 4604236615151293374);
        assert_eq!(pow(2.0, -1e-5 * 12345.0).to_bits(), 4606443736423106137);
        assert_eq!(pow(2.0, 0.0), 1.0);
        assert_eq!(log2(1.0), 0.0);
        assert_eq!(py_max(0.0, -0.0).to_bits(), 0.0f64.to_bits());
        assert_eq!(py_min(1.0, 1.0), 1.0);
    }
}
