//! The bytes the engine stamps: a token's KV on each side and a recurrent state are a
//! byte of the hash of the token prefix they belong to, so a prefix hit must read the
//! same bytes.

use unikv::TokenId;
use unikv::pools::Side;

/// The stamp of a token's KV on `side`: a byte of the hash of the token and everything
/// before it (never 0, what zeroing writes).
pub(crate) fn kv_stamp(prefix_hash: u64, side: Side) -> u8 {
    let h = match side {
        Side::Full => prefix_hash,
        _ => prefix_hash.rotate_left(17) ^ 0x5a5a,
    };
    (h % 255) as u8 + 1
}

/// The recurrent state after `hash`'s prefix (never 0).
pub(crate) fn state_stamp(prefix_hash: u64) -> u8 {
    (prefix_hash.rotate_left(41) % 255) as u8 + 1
}

/// Extends a prefix hash by one token (FNV-1a over the token's bytes).
pub(crate) fn hash_next(h: u64, t: TokenId) -> u64 {
    let mut h = h;
    for b in t.0.to_le_bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

pub(crate) const HASH_START: u64 = 0xcbf2_9ce4_8422_2325;

/// The prefix hashes of `tokens`: entry `i` is the hash of `tokens[..=i]`.
pub(crate) fn prefix_hashes(tokens: &[TokenId]) -> Vec<u64> {
    let mut h = HASH_START;
    tokens
        .iter()
        .map(|&t| {
            h = hash_next(h, t);
            h
        })
        .collect()
}

/// The hash of the empty prefix or of `tokens[..len]`.
pub(crate) fn hash_at(hashes: &[u64], len: usize) -> u64 {
    if len == 0 {
        HASH_START
    } else {
        hashes[len - 1]
    }
}
