//! CPython's hashes of ints and tuples, so that the compiled engine keys its blocks exactly
//! as the Python engine does (`packed.block_key`: `hash((parent_key, tuple(tokens)))`).
//!
//! Events, ghosts, the eviction policies and the miss-ratio curve all see these keys; with
//! the same keys the two engines are interchangeable down to the last counter. The formulas
//! are CPython's (`Objects/longobject.c: long_hash`, `Objects/tupleobject.c: tuplehash`, the
//! xxHash-based one of CPython 3.8 and later) on a 64-bit build.

const MODULUS: u64 = (1 << 61) - 1; // _PyHASH_MODULUS
const XXPRIME_1: u64 = 11400714785074694791;
const XXPRIME_2: u64 = 14029467366897019727;
const XXPRIME_5: u64 = 2870177450012600261;

/// `hash(v)` of a Python int.
#[inline]
pub fn hash_int(v: i64) -> i64 {
    let negative = v < 0;
    let mut h = (v.unsigned_abs() % MODULUS) as i64;
    if negative {
        h = -h;
    }
    if h == -1 {
        -2
    } else {
        h
    }
}

/// `hash(v)` of a non-negative Python int below 2**64 (a token id).
#[inline]
pub fn hash_uint(v: u64) -> i64 {
    (v % MODULUS) as i64 // never -1: non-negative
}

/// The tuple hash of items whose own hashes are `lanes`.
#[inline]
pub fn hash_tuple_of(lanes: impl ExactSizeIterator<Item = i64>) -> i64 {
    let len = lanes.len() as u64;
    let mut acc = XXPRIME_5;
    for lane in lanes {
        acc = acc.wrapping_add((lane as u64).wrapping_mul(XXPRIME_2));
        acc = acc.rotate_left(31);
        acc = acc.wrapping_mul(XXPRIME_1);
    }
    acc = acc.wrapping_add(len ^ (XXPRIME_5 ^ 3527539));
    if acc == u64::MAX {
        return 1546275796;
    }
    acc as i64
}

/// `hash((parent_key, tuple(tokens)))`: the key of the block `tokens` below `parent_key`.
#[inline]
pub fn block_key(parent_key: i64, tokens: &[u64]) -> i64 {
    let inner = hash_tuple_of(tokens.iter().map(|&t| hash_uint(t)));
    hash_tuple_of([hash_int(parent_key), inner].into_iter())
}

/// `block_key` of tokens that all fit in 32 bits (the packed form).
#[inline]
pub fn block_key_u32(parent_key: i64, tokens: &[u32]) -> i64 {
    let inner = hash_tuple_of(tokens.iter().map(|&t| t as i64));
    hash_tuple_of([hash_int(parent_key), inner].into_iter())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Values printed by CPython 3.11 (64-bit):
    //   hash(()) == 5740354900026072187, hash((1, 2)) == -3550055125485641917,
    //   hash(2**61 - 1) == 0, hash(-1) == -2, hash((0, (1, 2, 3))) == -8655844216579489799
    #[test]
    fn matches_cpython() {
        assert_eq!(hash_tuple_of(std::iter::empty()), 5740354900026072187);
        assert_eq!(hash_tuple_of([1i64, 2].into_iter()), -3550055125485641917);
        assert_eq!(hash_int((1 << 61) - 1), 0);
        assert_eq!(hash_int(-1), -2);
        assert_eq!(block_key(0, &[1, 2, 3]), -8655844216579489799);
        assert_eq!(block_key_u32(0, &[1, 2, 3]), -8655844216579489799);
    }
}
