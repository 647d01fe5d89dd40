//! The lockstep property test's reference side: `unikv._unikv._reference_run` runs a
//! JSON list of lifecycle operations directly on the Rust facade ([`unikv::HybridCache`],
//! none of this crate's Python classes) and records, for each, what the Python API would
//! show: the value, or the exception's class and attributes, then every request's view
//! and the cache's counters. `tests/test_lockstep.py` drives the same operations through
//! `unikv.HybridCache` and compares the two records step by step.
//!
//! Where the binding refuses something before the facade sees it (a request or prefix
//! match already consumed, a request twice in one batch, a token id past `u32`), the
//! reference models the refusal: the same class, `request` = `None`.
//!
//! The operations (requests and matches are indices into the lists of those made so far):
//!
//! | op | fields | value |
//! |---|---|---|
//! | `new` | `model`, `memory`, `page_size`, `layout`, `checkpoint_interval`, optional `host_memory_bytes` | `{"page_size", "step"}` |
//! | `match` | `tokens` | `{"cached", "device", "host", "kv_hit", "prompt_len"}` |
//! | `can_admit` | `match`, `reserve` | a bool |
//! | `admit` | `match` | the request's id |
//! | `alloc_extend` | `req`, `n` | `null` |
//! | `alloc_decode` | `reqs`, `tokens` | `null` |
//! | `release_out_of_window` | `req` | tokens released |
//! | `cache_unfinished`, `cache_finished` | `req` | `null` |
//! | `release` | `req` | the request's tokens |
//! | `tokens` | `req` | the request's tokens |
//! | `step_boundary` | | `{"step", "text"}` |
//! | `evict_to_free` | `full_pages`, `swa_pages` | `null` |
//! | `stats` | | the counters |
//!
//! Each record is `{"value": v}` or `{"error": [class, {attribute: int or null}]}`,
//! with `"requests"` (per request `null` once consumed, else `[id, len,
//! remaining_prefill, cached_at_admission]`) and `"stats"` (the counters, `null`
//! without a cache; their `"host"` lists the host tier's figures, `null` without one).
//! An index past the lists records the error class `NoSuchIndex` (the Python side never
//! makes one, so it shows where the two sides' lists diverged).

use crate::errors::{Class, classify, guarded, invalid};
use pyo3::prelude::*;
use serde_json::{Map, Value, json};
use unikv::{Layout, ModelSpec, TokenId};

/// Runs the operations `ops` (a JSON list) on a facade cache and returns the records
/// (a JSON list, one per operation). A malformed operation raises `InvalidArgument`.
#[pyfunction]
pub fn _reference_run(py: Python<'_>, ops: &str) -> PyResult<String> {
    let ops: Vec<Value> =
        serde_json::from_str(ops).map_err(|e| invalid(format!("ops: not a JSON list: {e}")))?;
    let records = guarded(|| Ok(py.detach(|| Reference::default().run(&ops))))?;
    records
        .map(|r| Value::Array(r).to_string())
        .map_err(|e| invalid(format!("ops: {e}")))
}

/// The refusal an operation records: an exception class and its attributes.
struct Refusal {
    /// The class's name (`OutOfMemory`, `InvalidArgument`, ... or `NoSuchIndex`).
    class: &'static str,
    /// The exception's attributes.
    attrs: Vec<(&'static str, Option<u64>)>,
}

impl From<unikv::Error> for Refusal {
    fn from(e: unikv::Error) -> Refusal {
        let (class, attrs) = classify(&e);
        Refusal {
            class: class.name(),
            attrs,
        }
    }
}

impl Refusal {
    /// What the binding raises itself (through `errors::invalid`): `InvalidArgument`
    /// about no request.
    fn binding() -> Refusal {
        Refusal {
            class: Class::InvalidArgument.name(),
            attrs: vec![("request", None)],
        }
    }

    /// An index past the list it names.
    fn no_such_index() -> Refusal {
        Refusal {
            class: "NoSuchIndex",
            attrs: vec![],
        }
    }

    /// The record's `error` entry: `[class, {attribute: int or null}]`.
    fn to_json(&self) -> Value {
        let attrs: Map<String, Value> = self
            .attrs
            .iter()
            .map(|(name, n)| ((*name).to_string(), json!(n)))
            .collect();
        json!([self.class, attrs])
    }
}

/// A request as the binding's `Request` object holds it: consumed (`None`) by
/// `cache_finished` or `release`.
struct Slot {
    /// Its id, kept after it is consumed.
    id: u64,
    /// The facade's request, until consumed.
    inner: Option<unikv::Request>,
}

/// The facade cache and the requests and matches made on it, indexed as Python lists.
#[derive(Default)]
struct Reference {
    /// The cache, once `new` built one.
    cache: Option<unikv::HybridCache>,
    /// Every admitted request, in admission order.
    requests: Vec<Slot>,
    /// Every prefix match, `None` once admitted.
    matches: Vec<Option<unikv::PrefixMatch>>,
}

/// An operation's field, or a message naming it.
fn field<'a>(op: &'a Value, name: &str) -> Result<&'a Value, String> {
    op.get(name)
        .ok_or_else(|| format!("{op}: no field {name:?}"))
}

/// An operation's unsigned integer field.
fn uint(op: &Value, name: &str) -> Result<u64, String> {
    field(op, name)?
        .as_u64()
        .ok_or_else(|| format!("{op}: {name:?} is not an unsigned int"))
}

/// An operation's index field.
fn index(op: &Value, name: &str) -> Result<usize, String> {
    usize::try_from(uint(op, name)?).map_err(|e| format!("{op}: {name:?}: {e}"))
}

/// An operation's list-of-ints field, as `i64` (checked as token ids by [`token_ids`]).
fn ints(op: &Value, name: &str) -> Result<Vec<i64>, String> {
    field(op, name)?
        .as_array()
        .ok_or_else(|| format!("{op}: {name:?} is not a list"))?
        .iter()
        .map(|v| {
            v.as_i64()
                .ok_or_else(|| format!("{op}: {name:?}: {v} is not an int"))
        })
        .collect()
}

/// Token ids as `tokens::token_ids` converts a list: refused when one is not a `u32`.
fn token_ids(ids: &[i64]) -> Result<Vec<TokenId>, Refusal> {
    ids.iter()
        .map(|&v| {
            u32::try_from(v)
                .map(TokenId)
                .map_err(|_| Refusal::binding())
        })
        .collect()
}

/// What one operation gave: its value, or its refusal; `Err(String)` is a malformed op.
type Outcome = Result<Result<Value, Refusal>, String>;

impl Reference {
    /// Runs every operation, recording each.
    fn run(mut self, ops: &[Value]) -> Result<Vec<Value>, String> {
        ops.iter()
            .map(|op| {
                let outcome = self.apply(op)?;
                let mut record = Map::new();
                match outcome {
                    Ok(value) => record.insert("value".into(), value),
                    Err(refusal) => record.insert("error".into(), refusal.to_json()),
                };
                record.insert("requests".into(), self.request_views());
                record.insert("stats".into(), self.stats());
                Ok(Value::Object(record))
            })
            .collect()
    }

    /// Every request's view: `null` once consumed, else `[id, len, remaining_prefill,
    /// cached_at_admission]`.
    fn request_views(&self) -> Value {
        self.requests
            .iter()
            .map(|slot| match &slot.inner {
                None => Value::Null,
                Some(r) => json!([
                    slot.id,
                    r.len(),
                    r.remaining_prefill(),
                    r.cached_at_admission()
                ]),
            })
            .collect()
    }

    /// The counters `unikv.Stats` shows, `null` without a cache.
    fn stats(&self) -> Value {
        let Some(cache) = &self.cache else {
            return Value::Null;
        };
        let s = cache.stats();
        let side = |s: &unikv::SideStats| {
            json!([
                s.total_pages,
                s.available_pages,
                s.evictable_pages,
                s.protected_pages,
                s.held_pages
            ])
        };
        json!({
            "step": s.step,
            "full": side(&s.full),
            "swa": side(&s.swa),
            "mamba": side(&s.mamba),
            "live_requests": s.live_requests,
            "hit_tokens": s.hit_tokens,
            "host": s.host.map(|h| json!([
                h.total_bytes,
                h.full_bytes,
                h.swa_bytes,
                h.state_bytes,
                h.peak_bytes,
                h.hit_tokens,
                h.written_bytes,
                h.loaded_bytes,
                h.copies,
                h.largest_copy,
                h.refused_writes
            ])),
        })
    }

    /// The live request at index `k`, refused as the binding's `Request.get` refuses a
    /// consumed one.
    fn live(&self, k: usize) -> Result<&unikv::Request, Refusal> {
        let slot = self.requests.get(k).ok_or_else(Refusal::no_such_index)?;
        slot.inner.as_ref().ok_or_else(Refusal::binding)
    }

    /// Takes the request at index `k` (as `Request.take` does, before the facade call).
    fn take(&mut self, k: usize) -> Result<unikv::Request, Refusal> {
        let slot = self
            .requests
            .get_mut(k)
            .ok_or_else(Refusal::no_such_index)?;
        slot.inner.take().ok_or_else(Refusal::binding)
    }

    /// Runs one operation.
    fn apply(&mut self, op: &Value) -> Outcome {
        let name = field(op, "op")?
            .as_str()
            .ok_or_else(|| format!("{op}: \"op\" is not a string"))?;
        if name == "new" {
            return self.new_cache(op);
        }
        let Some(cache) = self.cache.as_mut() else {
            return Err(format!("{op}: no cache (the first op is \"new\")"));
        };
        Ok(match name {
            "match" => {
                let tokens = ints(op, "tokens")?;
                token_ids(&tokens).map(|tokens| {
                    let hit = cache.match_prefix(tokens);
                    let value = json!({
                        "cached": hit.cached_tokens(),
                        "device": hit.device_tokens(),
                        "host": hit.host_tokens(),
                        "kv_hit": hit.kv_hit_tokens(),
                        "prompt_len": hit.prompt_len(),
                    });
                    self.matches.push(Some(hit));
                    value
                })
            }
            "can_admit" => {
                let (m, reserve) = (index(op, "match")?, index(op, "reserve")?);
                match self.matches.get(m) {
                    None => Err(Refusal::no_such_index()),
                    Some(None) => Err(Refusal::binding()),
                    Some(Some(hit)) => Ok(json!(cache.can_admit(hit, reserve))),
                }
            }
            "admit" => {
                let m = index(op, "match")?;
                match self.matches.get_mut(m).map(Option::take) {
                    None => Err(Refusal::no_such_index()),
                    Some(None) => Err(Refusal::binding()),
                    Some(Some(hit)) => match cache.admit(hit) {
                        Ok(req) => {
                            let id = req.id();
                            self.requests.push(Slot {
                                id,
                                inner: Some(req),
                            });
                            Ok(json!(id))
                        }
                        Err(e) => Err(e.into()),
                    },
                }
            }
            "alloc_extend" => {
                let (k, n) = (index(op, "req")?, index(op, "n")?);
                self.with_live(k, |cache, req| {
                    cache.alloc_extend(req, n).map(|()| Value::Null)
                })
            }
            "alloc_decode" => {
                let reqs: Vec<usize> = field(op, "reqs")?
                    .as_array()
                    .ok_or_else(|| format!("{op}: \"reqs\" is not a list"))?
                    .iter()
                    .map(|v| {
                        v.as_u64()
                            .and_then(|k| usize::try_from(k).ok())
                            .ok_or_else(|| format!("{op}: \"reqs\": {v} is not an index"))
                    })
                    .collect::<Result<_, _>>()?;
                let tokens = ints(op, "tokens")?;
                self.alloc_decode(&reqs, &tokens)
            }
            "release_out_of_window" => {
                let k = index(op, "req")?;
                self.with_live(k, |cache, req| {
                    cache.release_out_of_window(req).map(|n| json!(n))
                })
            }
            "cache_unfinished" => {
                let k = index(op, "req")?;
                self.with_live(k, |cache, req| {
                    cache.cache_unfinished(req).map(|()| Value::Null)
                })
            }
            "cache_finished" => {
                let k = index(op, "req")?;
                self.take(k).and_then(|req| {
                    self.cache_mut()
                        .cache_finished(req)
                        .map(|()| Value::Null)
                        .map_err(Refusal::from)
                })
            }
            "release" => {
                let k = index(op, "req")?;
                self.take(k).and_then(|req| {
                    self.cache_mut()
                        .release(req)
                        .map(|tokens| json!(tokens.iter().map(|t| t.0).collect::<Vec<_>>()))
                        .map_err(Refusal::from)
                })
            }
            "tokens" => {
                let k = index(op, "req")?;
                self.live(k)
                    .map(|req| json!(req.tokens().iter().map(|t| t.0).collect::<Vec<_>>()))
            }
            "step_boundary" => cache
                .step_boundary()
                .map(|report| json!({"step": report.step, "text": format!("{report:?}")}))
                .map_err(Refusal::from),
            "evict_to_free" => {
                let (full, swa) = (index(op, "full_pages")?, index(op, "swa_pages")?);
                cache
                    .evict_to_free(full, swa)
                    .map(|()| Value::Null)
                    .map_err(Refusal::from)
            }
            "stats" => Ok(self.stats()),
            other => return Err(format!("unknown op {other:?}")),
        })
    }

    /// The cache (only called after `apply` found one).
    fn cache_mut(&mut self) -> &mut unikv::HybridCache {
        self.cache.as_mut().expect("apply checked the cache")
    }

    /// Runs `f` on the cache and the live request at index `k`.
    fn with_live(
        &mut self,
        k: usize,
        f: impl FnOnce(&mut unikv::HybridCache, &mut unikv::Request) -> Result<Value, unikv::Error>,
    ) -> Result<Value, Refusal> {
        let cache = self.cache.as_mut().expect("apply checked the cache");
        let slot = self
            .requests
            .get_mut(k)
            .ok_or_else(Refusal::no_such_index)?;
        let req = slot.inner.as_mut().ok_or_else(Refusal::binding)?;
        f(cache, req).map_err(Refusal::from)
    }

    /// A decode step for the requests at `reqs`, checked in the binding's order: the
    /// token ids, their count, a request twice, a consumed request; then the facade.
    fn alloc_decode(&mut self, reqs: &[usize], tokens: &[i64]) -> Result<Value, Refusal> {
        let next = token_ids(tokens)?;
        if next.len() != reqs.len() {
            return Err(Refusal::binding());
        }
        if reqs.iter().any(|&k| k >= self.requests.len()) {
            return Err(Refusal::no_such_index());
        }
        let mut seen = vec![false; self.requests.len()];
        for &k in reqs {
            if std::mem::replace(&mut seen[k], true) {
                return Err(Refusal::binding());
            }
        }
        let cache = self.cache.as_mut().expect("apply checked the cache");
        // Every live request, borrowed once; the batch takes its own in batch order (each
        // index once, checked above, so `None` here means consumed).
        let mut live: Vec<Option<&mut unikv::Request>> = self
            .requests
            .iter_mut()
            .map(|slot| slot.inner.as_mut())
            .collect();
        let mut batch = Vec::with_capacity(reqs.len());
        for &k in reqs {
            batch.push(live[k].take().ok_or_else(Refusal::binding)?);
        }
        cache
            .alloc_decode(&mut batch, &next)
            .map(|()| Value::Null)
            .map_err(Refusal::from)
    }

    /// Builds the cache as `unikv.HybridCache(...)` does for a catalogue model.
    fn new_cache(&mut self, op: &Value) -> Outcome {
        let model = field(op, "model")?
            .as_str()
            .ok_or_else(|| format!("{op}: \"model\" is not a string"))?;
        let memory = uint(op, "memory")?;
        let page_size = u32::try_from(uint(op, "page_size")?).map_err(|e| e.to_string())?;
        let layout = match field(op, "layout")?.as_str() {
            Some("unified") => Layout::Unified,
            Some("static") => Layout::Static {
                swa_full_tokens_ratio: 0.8,
            },
            _ => return Ok(Err(Refusal::binding())),
        };
        let checkpoint_interval = match op.get("checkpoint_interval") {
            None | Some(Value::Null) => None,
            Some(_) => {
                Some(u32::try_from(uint(op, "checkpoint_interval")?).map_err(|e| e.to_string())?)
            }
        };
        let host_memory_bytes = match op.get("host_memory_bytes") {
            None => 0,
            Some(_) => uint(op, "host_memory_bytes")?,
        };
        let Some(spec) = ModelSpec::by_name(model) else {
            return Ok(Err(Refusal::binding()));
        };
        let mut builder = unikv::HybridCache::builder()
            .model(spec)
            .page_size(page_size)
            .memory_bytes(memory)
            .layout(layout)
            .host_memory_bytes(host_memory_bytes);
        if let Some(n) = checkpoint_interval {
            builder = builder.checkpoint_interval(n);
        }
        self.requests.clear();
        self.matches.clear();
        self.cache = None;
        Ok(match builder.build() {
            Ok(cache) => {
                let value = json!({"page_size": cache.page_size(), "step": cache.step()});
                self.cache = Some(cache);
                Ok(value)
            }
            Err(e) => Err(e.into()),
        })
    }
}
