//! Benchmarks of the tree's hot operations (divan): `match_prefix` of a 100K-token prompt,
//! insert of 8K tokens (fresh, and as a duplicate split at a cursor), a running request's
//! next 512 tokens after 100K (from the root and from its locked node), evicting 1K
//! leaves. Page sizes 1 and 256, window 128 (gpt-oss-20b's).
//!
//! Run with `cargo bench -p unikv-radix`.

use divan::{Bencher, black_box};
use unikv_radix::{Component, InsertRequest, RadixTree, TokenId, TreeConfig, VirtualToken};

fn main() {
    divan::main();
}

const WINDOW: usize = 128;

/// A pseudo-random key (xorshift) whose first token is the seed, so that keys of
/// different seeds never share a page.
fn key(len: usize, seed: u32) -> Vec<TokenId> {
    let mut x = seed.wrapping_mul(2_654_435_761).max(1);
    (0..len)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            TokenId(if i == 0 { 100_000 + seed } else { x % 50_000 })
        })
        .collect()
}

fn row(len: usize, base: u32) -> Vec<VirtualToken> {
    (base..base + len as u32).map(VirtualToken).collect()
}

fn tree(ps: u32) -> RadixTree {
    RadixTree::new(TreeConfig::swa(ps, WINDOW)).unwrap()
}

/// Match a 100K-token prompt that is fully cached (one long path built by 25 requests of
/// 4K tokens each extending the previous one).
#[divan::bench(args = [1, 256])]
fn match_prefix_100k(bencher: Bencher, ps: u32) {
    let len = 102_400;
    let k = key(len, 1);
    let mut t = tree(ps);
    for step in 1..=25 {
        let end = step * len / 25;
        let prev = (step - 1) * len / 25;
        let values = row(end, 1_000);
        t.insert(InsertRequest::new(&k[..end], &values).prev_prefix_len(prev))
            .unwrap();
    }
    assert_eq!(t.match_prefix(&k).len.get(), len);
    bencher.bench_local(|| black_box(t.match_prefix(black_box(&k))));
}

/// Insert 8K fresh tokens under a 100-request tree.
#[divan::bench(args = [1, 256])]
fn insert_8k_fresh(bencher: Bencher, ps: u32) {
    let len = 8_192;
    bencher
        .with_inputs(|| {
            let mut t = tree(ps);
            for i in 0..100 {
                let k = key(512, 1_000 + i);
                t.insert(InsertRequest::new(&k, &row(512, i * 512)))
                    .unwrap();
            }
            (t, key(len, 7), row(len, 1_000_000))
        })
        .bench_local_values(|(mut t, k, v)| {
            black_box(
                t.insert(InsertRequest::new(&k, &v).window_cursor(4_096))
                    .unwrap(),
            )
        });
}

/// Insert 8K tokens that the tree already holds: every slice is a duplicate, split at the
/// cursor into FULL-only and two-sided frees.
#[divan::bench(args = [1, 256])]
fn insert_8k_duplicate(bencher: Bencher, ps: u32) {
    let len = 8_192;
    bencher
        .with_inputs(|| {
            let mut t = tree(ps);
            let k = key(len, 7);
            t.insert(InsertRequest::new(&k, &row(len, 0))).unwrap();
            (t, k, row(len, 1_000_000))
        })
        .bench_local_values(|(mut t, k, v)| {
            black_box(
                t.insert(InsertRequest::new(&k, &v).window_cursor(4_096))
                    .unwrap(),
            )
        });
}

/// A running request that holds a lock at the end of its 100K cached tokens (a path of
/// 25 nodes) caches its next page-aligned 512 tokens: from the root, claiming the prefix
/// (`prev_prefix_len`), and from the locked node (`InsertRequest::after`).
#[divan::bench(args = [("root", 1), ("root", 256), ("after", 1), ("after", 256)])]
fn insert_512_more_after_100k(bencher: Bencher, (walk, ps): (&str, u32)) {
    let (len, more) = (102_400, 512);
    let k = key(len + more, 1);
    let v = row(len + more, 1_000);
    bencher
        .with_inputs(|| {
            let mut t = tree(ps);
            let mut lock = None;
            for step in 1..=25 {
                let (prev, end) = ((step - 1) * len / 25, step * len / 25);
                let out = t
                    .insert(InsertRequest::new(&k[..end], &v[..end]).prev_prefix_len(prev))
                    .unwrap();
                if step == 25 {
                    lock = Some(t.lock(out.node).unwrap());
                }
            }
            (t, lock.unwrap())
        })
        .bench_local_values(|(mut t, lock)| {
            let insert = match walk {
                "root" => InsertRequest::new(&k, &v).prev_prefix_len(len),
                _ => InsertRequest::after(lock, len, &k[len..], &v[len..]),
            };
            black_box(t.insert(insert.window_cursor(len)).unwrap());
            t
        });
}

/// Evict 1K leaves (LRU, FULL) from a tree of 2K leaves of one page-aligned window each.
#[divan::bench(args = [1, 256])]
fn evict_1k_leaves(bencher: Bencher, ps: u32) {
    let leaf = WINDOW.div_ceil(ps as usize) * ps as usize;
    bencher
        .with_inputs(|| {
            let mut t = tree(ps);
            for i in 0..2_000u32 {
                let k = key(leaf, 10 + i);
                t.insert(InsertRequest::new(&k, &row(leaf, i * leaf as u32)))
                    .unwrap();
            }
            t
        })
        .bench_local_values(|mut t| {
            let (actions, released) =
                t.evict_until(Component::Full, |r| r.full.get() >= 1_000 * leaf);
            assert_eq!(actions.len(), 1_000);
            black_box(released);
            t
        });
}

/// `sanity_check` (what the facade's step boundary runs at `Strict`) of the tree 256
/// finished 2K-token conversations leave: a shared 1K-token system prompt, then 256
/// branches of 1K tokens, each split into a tombstone part and a live last window.
#[divan::bench(args = [1, 256])]
fn sanity_check_256_conversations(bencher: Bencher, ps: u32) {
    let mut t = tree(ps);
    let system = key(1024, 1);
    for i in 0..256u32 {
        let mut k = system.clone();
        k.extend(key(1024, 10 + i));
        let cursor = 2048 - WINDOW.div_ceil(ps as usize) * ps as usize;
        t.insert(InsertRequest::new(&k, &row(2048, i * 2048)).window_cursor(cursor))
            .unwrap();
    }
    bencher.bench_local(|| black_box(&t).sanity_check().unwrap());
}
