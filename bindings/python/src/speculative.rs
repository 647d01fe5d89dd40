//! Speculative decoding from Python: what a cache is built to verify ([`Speculation`])
//! and the drafts and accepted tokens the verify calls take, converted to the facade's
//! `Draft` and `Accepted`.

use crate::errors::invalid;
use crate::tokens::token_ids;
use pyo3::prelude::*;
use unikv::TokenId;

/// What verify steps a cache is built for: the widest draft (`max_width` positions),
/// how many verifies a request may have unsettled (`max_in_flight`: 2 when counts arrive
/// a step late) and the verify batch (`max_batch`).
#[pyclass(module = "unikv", name = "Speculation", frozen, get_all)]
#[derive(Clone, Copy)]
pub struct Speculation {
    /// Positions of the widest draft (`k + 1` for a chain of `k`).
    pub max_width: u32,
    /// Unsettled verifies a request may have (1 or 2).
    pub max_in_flight: u32,
    /// Requests a verify step may hold.
    pub max_batch: u32,
}

#[pymethods]
impl Speculation {
    #[new]
    #[pyo3(signature = (*, max_width, max_in_flight = 1, max_batch = unikv::DEFAULT_VERIFY_BATCH))]
    fn new(max_width: u32, max_in_flight: u32, max_batch: u32) -> Speculation {
        Speculation {
            max_width,
            max_in_flight,
            max_batch,
        }
    }

    /// Chains of up to `k` draft tokens (`k + 1` positions a verify), counts settled in
    /// the step (`in_flight = 1`) or a step late (`2`).
    #[staticmethod]
    #[pyo3(signature = (k, *, in_flight = 1, max_batch = unikv::DEFAULT_VERIFY_BATCH))]
    fn chain(k: u32, in_flight: u32, max_batch: u32) -> Speculation {
        unikv::Speculation::chain(k)
            .in_flight(in_flight)
            .batch(max_batch)
            .into()
    }

    /// Draft trees of up to `nodes` nodes.
    #[staticmethod]
    #[pyo3(signature = (nodes, *, in_flight = 1, max_batch = unikv::DEFAULT_VERIFY_BATCH))]
    fn tree(nodes: u32, in_flight: u32, max_batch: u32) -> Speculation {
        unikv::Speculation::tree(nodes)
            .in_flight(in_flight)
            .batch(max_batch)
            .into()
    }

    fn __repr__(&self) -> String {
        format!(
            "Speculation(max_width={}, max_in_flight={}, max_batch={})",
            self.max_width, self.max_in_flight, self.max_batch
        )
    }
}

impl From<unikv::Speculation> for Speculation {
    fn from(s: unikv::Speculation) -> Speculation {
        Speculation {
            max_width: s.max_width,
            max_in_flight: s.max_in_flight,
            max_batch: s.max_batch,
        }
    }
}

impl From<Speculation> for unikv::Speculation {
    fn from(s: Speculation) -> unikv::Speculation {
        unikv::Speculation {
            max_width: s.max_width,
            max_in_flight: s.max_in_flight,
            max_batch: s.max_batch,
        }
    }
}

/// One request's draft: an int `k` (a chain of `k` tokens) or a parent array (a tree:
/// node 0's parent −1, every other node's an earlier node).
pub enum DraftArg {
    /// A chain.
    Chain(usize),
    /// A tree's parents.
    Tree(Vec<i32>),
}

impl DraftArg {
    /// The draft `value` describes.
    pub fn extract(value: &Bound<'_, PyAny>) -> PyResult<DraftArg> {
        if let Ok(k) = value.extract::<usize>() {
            return Ok(DraftArg::Chain(k));
        }
        value
            .extract::<Vec<i32>>()
            .map(DraftArg::Tree)
            .map_err(|_| {
                invalid(
                    "a draft: an int k (a chain of k tokens) or a list of parent indices (a tree)",
                )
            })
    }

    /// As the facade's draft.
    pub fn as_draft(&self) -> unikv::Draft<'_> {
        match self {
            DraftArg::Chain(k) => unikv::Draft::Chain { k: *k },
            DraftArg::Tree(parents) => unikv::Draft::Tree { parents },
        }
    }
}

/// One request's accepted positions: its accepted tokens (a chain: a list or buffer), or
/// `(path, tokens)` for a tree (the accepted nodes root first, and their tokens).
pub enum AcceptedArg {
    /// A chain's accepted tokens.
    Chain(Vec<TokenId>),
    /// A tree's accepted path and tokens.
    Tree(Vec<u32>, Vec<TokenId>),
}

impl AcceptedArg {
    /// The accepted positions `value` describes.
    pub fn extract(value: &Bound<'_, PyAny>) -> PyResult<AcceptedArg> {
        if let Ok((path, tokens)) = value.extract::<(Vec<u32>, Bound<'_, PyAny>)>() {
            return Ok(AcceptedArg::Tree(path, token_ids(&tokens)?));
        }
        Ok(AcceptedArg::Chain(token_ids(value)?))
    }

    /// As the facade's accepted positions.
    pub fn as_accepted(&self) -> unikv::Accepted<'_> {
        match self {
            AcceptedArg::Chain(tokens) => unikv::Accepted::chain(tokens),
            AcceptedArg::Tree(path, tokens) => unikv::Accepted::tree(path, tokens),
        }
    }
}
