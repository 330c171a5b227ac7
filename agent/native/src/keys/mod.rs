//! Engine keys' synthetic tokens (`kvpool_agent/dataplane/keys.py`), compiled.
//!
//! A data-plane store or lookup turns each engine key of a chain into one block of tokens:
//! `w = min(tokens_per_block, 16)` little-endian 32-bit words of a personalised BLAKE2b
//! digest of the key (`4 * w` bytes), then filler token 0. In Python that is one digest
//! object per key and a numpy pass (about 2 µs a key); here the digests run four at a time
//! (`blake2b_simd::many`) and the tokens come out in one buffer. Python's `hashlib` is the
//! specification: the tests compare the two on random keys.

#[cfg(feature = "python")]
pub mod py;

use blake2b_simd::many::{hash_many, HashManyJob};
use blake2b_simd::Params;

/// Most 32-bit digest words a block carries (64 bytes of BLAKE2b, its longest digest).
pub const DIGEST_WORDS: usize = 16;
/// The token of a block's positions past its digest words.
pub const FILLER_TOKEN: u32 = 0;
/// Longest BLAKE2b personalisation.
pub const MAX_PERSON_BYTES: usize = 16;

/// The synthetic tokens of a chain of keys, first block first: `tokens_per_block` per key
/// (`tokens_per_block` >= 1, `person` at most 16 bytes; the caller checks both).
pub fn chain_tokens<K: AsRef<[u8]>>(
    keys: &[K],
    tokens_per_block: usize,
    person: &[u8],
) -> Vec<u32> {
    assert!(tokens_per_block >= 1 && person.len() <= MAX_PERSON_BYTES);
    let words = tokens_per_block.min(DIGEST_WORDS);
    let mut params = Params::new();
    params.hash_length(4 * words).personal(person);
    let mut jobs: Vec<HashManyJob> = keys
        .iter()
        .map(|k| HashManyJob::new(&params, k.as_ref()))
        .collect();
    hash_many(jobs.iter_mut());
    let mut out = vec![FILLER_TOKEN; keys.len() * tokens_per_block];
    for (job, block) in jobs.iter().zip(out.chunks_exact_mut(tokens_per_block)) {
        let digest = job.to_hash();
        for (token, word) in block.iter_mut().zip(digest.as_bytes().chunks_exact(4)) {
            *token = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_block_per_key_filler_after_the_digest() {
        let keys: [&[u8]; 3] = [b"a", b"bb", b"a"];
        let out = chain_tokens(&keys, 20, b"p");
        assert_eq!(out.len(), 60);
        assert_eq!(out[..20], out[40..]); // same key, same block
        assert_ne!(out[..16], out[20..36]);
        assert!(out[16..20].iter().all(|&t| t == FILLER_TOKEN));
        // Fewer tokens than digest words: the digest is that many words long, not a prefix
        // of the longer one (BLAKE2b's length is a parameter of the hash).
        let short = chain_tokens(&keys[..1], 2, b"p");
        assert_eq!(short.len(), 2);
        assert_ne!(short[..], out[..2]);
    }

    #[test]
    fn matches_a_single_digest_and_a_known_vector() {
        let single = Params::new()
            .hash_length(8)
            .personal(b"kvpool-key-v2")
            .hash(b"key");
        let want: Vec<u32> = single
            .as_bytes()
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect();
        assert_eq!(chain_tokens(&[b"key"], 2, b"kvpool-key-v2"), want);
        // BLAKE2b-512 of "abc" (RFC 7693, appendix A), unpersonalised: the crate is BLAKE2b.
        let abc = chain_tokens(&[b"abc"], 16, b"");
        assert_eq!(abc[0].to_le_bytes(), [0xBA, 0x80, 0xA5, 0x3F]);
    }
}
