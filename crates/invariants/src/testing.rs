//! Test-matrix settings shared by every crate's tests: read once from the environment.
//!
//! `cargo xtask test` runs the suite once per `UNIKV_TEST_PAGE_SIZE` in {1, 16, 256} (and
//! per `UNIKV_INVARIANT_CHECK` level). Tests read the page size here, as a default, and
//! never mutate the environment.

use std::sync::LazyLock;

/// The variable that names the page size of this cell of the test matrix.
pub const PAGE_SIZE_VAR: &str = "UNIKV_TEST_PAGE_SIZE";

static PAGE_SIZE: LazyLock<Option<u32>> = LazyLock::new(|| {
    let value = std::env::var(PAGE_SIZE_VAR).ok()?;
    match value.trim().parse::<u32>() {
        Ok(ps) if ps > 0 => Some(ps),
        _ => panic!("invalid {PAGE_SIZE_VAR}={value:?}: expected a positive integer"),
    }
});

/// The matrix cell's page size, if one is set.
pub fn matrix_page_size() -> Option<u32> {
    *PAGE_SIZE
}

/// The page sizes a page-size-parametric test should run at: `1` and `4` always (the
/// reference scenarios' pair), plus the matrix cell's page size when it is another one.
pub fn page_sizes() -> Vec<u32> {
    let mut sizes = vec![1, 4];
    if let Some(ps) = matrix_page_size()
        && !sizes.contains(&ps)
    {
        sizes.push(ps);
    }
    sizes
}
