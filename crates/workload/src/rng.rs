//! A tiny deterministic PRNG (SplitMix64) for workload generation.
//!
//! The simulator must give the same report for the same seed on every machine, so it
//! uses its own generator instead of `rand` (whose streams may change between versions).
//! SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
//! OOPSLA 2014; the seeder of `xoshiro`) is 64 bits of state, passes BigCrush, and is
//! more than good enough to draw token ids and lengths.

/// The SplitMix64 generator: a 64-bit counter advanced by the golden-ratio increment and
/// scrambled by a finaliser. Equal seeds give equal streams.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

/// The golden-ratio increment of SplitMix64.
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl SplitMix64 {
    /// A generator whose stream is fixed by `seed`.
    pub const fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    /// A generator for one named purpose under `seed`: the name is hashed (FNV-1a) into
    /// the seed, so adding a new purpose (a new preset, say) never shifts the stream of
    /// an existing one.
    pub fn for_stream(seed: u64, name: &str) -> SplitMix64 {
        SplitMix64::new(mix(seed ^ fnv1a(name.as_bytes())))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix(self.state)
    }

    /// A uniform integer in `0..bound` (Lemire's multiply-and-reject, so no modulo bias).
    /// A `bound` of 0 gives 0.
    pub fn below(&mut self, bound: u64) -> u64 {
        if bound == 0 {
            return 0;
        }
        // Rejection threshold: 2^64 mod bound.
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let wide = u128::from(self.next_u64()) * u128::from(bound);
            // The low half decides rejection; the high half is the draw.
            if (wide as u64) >= threshold {
                return (wide >> 64) as u64;
            }
        }
    }

    /// A uniform integer in `lo..=hi` (`lo` when `hi < lo`).
    pub fn in_range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        match (hi - lo).checked_add(1) {
            Some(span) => lo + self.below(span),
            None => self.next_u64(), // the whole u64 range
        }
    }
}

/// SplitMix64's finaliser (a bijection on u64).
const fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a of `bytes`.
const fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xCBF2_9CE4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01B3);
        i += 1;
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_matches_the_reference_splitmix64() {
        // SplitMix64 seeded with 1234567: the test vector of Rosetta Code's
        // "Pseudo-random numbers/Splitmix64" task.
        let mut rng = SplitMix64::new(1_234_567);
        let expected = [
            6_457_827_717_110_365_317,
            3_203_168_211_198_807_973,
            9_817_491_932_198_370_423,
            4_593_380_528_125_082_431,
            16_408_922_859_458_223_821,
        ];
        for value in expected {
            assert_eq!(rng.next_u64(), value);
        }
    }

    #[test]
    fn equal_seeds_give_equal_streams_and_names_separate_them() {
        let a: Vec<u64> = {
            let mut r = SplitMix64::for_stream(7, "smoke");
            (0..16).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = SplitMix64::for_stream(7, "smoke");
            (0..16).map(|_| r.next_u64()).collect()
        };
        let c: Vec<u64> = {
            let mut r = SplitMix64::for_stream(7, "shared-prefix");
            (0..16).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn below_and_in_range_stay_in_bounds_and_cover_them() {
        let mut rng = SplitMix64::new(99);
        let mut seen = [false; 7];
        for _ in 0..1_000 {
            let v = rng.below(7);
            assert!(v < 7);
            seen[v as usize] = true;
            let w = rng.in_range(10, 12);
            assert!((10..=12).contains(&w));
        }
        assert!(seen.iter().all(|&s| s), "every value of 0..7 drawn");
        assert_eq!(rng.below(0), 0);
        assert_eq!(rng.below(1), 0);
        assert_eq!(rng.in_range(5, 5), 5);
        assert_eq!(rng.in_range(5, 3), 5);
        let _ = rng.in_range(0, u64::MAX); // no overflow
    }
}
