//! Speculative decoding in the engine of a speculative seed: decode steps become verify
//! steps (a chain of `k` drafts or a random draft tree per request), the device's forward
//! stamps every verify position's KV and intermediate state and moves a tree's accepted
//! nodes to consecutive rows, and the host settles each step with what was accepted, on
//! time or a step late (the next verify already allocated), with aborts and retractions
//! mid-verify and faults injected into both calls. Wrong calls an engine could make
//! (settling twice, accepting more than a verify's width, a bad parent array) must be
//! typed errors that change nothing.

use super::{Running, Sim, injected};
use crate::outcome::Failure;
use crate::stamps::{HASH_START, hash_next, kv_stamp, prefix_hashes, state_stamp};
use unikv::kernels::{ByteSpan, Device, SpanMove};
use unikv::{Accepted, AcceptedFault, Draft, Error, Request, TokenId};

/// One verify step of a request in flight, as the engine (and its device) knows it.
pub(super) struct InFlight {
    /// Positions it verifies.
    width: usize,
    /// A tree's parent array (`None` for a chain).
    parents: Option<Vec<i32>>,
    /// The accepted nodes' tokens in accepted order: a device value, which the host
    /// passes to `settle` when it settles.
    pub(super) accepted: Vec<TokenId>,
    /// A tree's accepted root-to-node path.
    path: Option<Vec<u32>>,
    /// The state stamp the forward wrote into each slot of the group (position `i`
    /// into slot `i`), on a recurrent model.
    pub(super) group_stamps: Vec<u8>,
}

impl Sim {
    fn max_width(&self) -> usize {
        self.sc.speculation.map_or(1, |s| s.max_width as usize)
    }

    fn max_in_flight(&self) -> usize {
        self.sc.speculation.map_or(1, |s| s.max_in_flight as usize)
    }

    /// A random draft of at most the cache's width: a chain of `k` drafts, or (on a
    /// seed that drafts trees) a tree whose every node's parent comes before it.
    fn random_draft(&mut self) -> Option<Vec<i32>> {
        let max = self.max_width();
        if self.sc.draft_trees && self.chance(500) {
            let n = self.rng.in_range(1, max as u64) as usize;
            Some(
                (0..n)
                    .map(|i| {
                        if i == 0 {
                            -1
                        } else if self.chance(300) {
                            // A chain-like step: the node before.
                            i as i32 - 1
                        } else {
                            self.rng.below(i as u64) as i32
                        }
                    })
                    .collect(),
            )
        } else {
            None
        }
    }

    /// A decode step of a speculative seed: settles what must be settled before the
    /// next verify, allocates one verify step for every decoding request, runs its
    /// forward, maybe aborts or retracts a request mid-verify, and settles on time or
    /// leaves a step to settle late. Sometimes a plain decode step instead (when nothing
    /// is in flight), and sometimes a wrong call that must change nothing.
    pub(super) fn verify(&mut self) -> Result<(), Failure> {
        let decoding = |r: &Running| r.req.remaining_prefill() == 0 && r.to_decode > 0;
        if self.chance(150) && self.running.iter().all(|r| r.verifies.is_empty()) {
            return self.decode();
        }
        // A request with as many steps in flight as the cache allows settles its oldest.
        let full: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].verifies.len() >= self.max_in_flight())
            .collect();
        self.settle(&full)?;
        if self.chance(40) {
            self.bad_draft()?;
        }
        loop {
            let batch: Vec<usize> = (0..self.running.len())
                .filter(|&i| decoding(&self.running[i]))
                .collect();
            if batch.is_empty() {
                break;
            }
            let k_max = self.max_width() - 1;
            let parents: Vec<Option<Vec<i32>>> =
                batch.iter().map(|_| self.random_draft()).collect();
            let ks: Vec<usize> = batch
                .iter()
                .map(|_| self.rng.in_range(0, k_max as u64) as usize)
                .collect();
            let drafts: Vec<Draft<'_>> = parents
                .iter()
                .zip(&ks)
                .map(|(p, &k)| match p {
                    Some(parents) => Draft::Tree { parents },
                    None => Draft::Chain { k },
                })
                .collect();
            let before = self.engine_view();
            let done = self.call("alloc_verify", |s| {
                let mut reqs = batch_reqs(&mut s.running, &batch);
                s.cache.alloc_verify(&mut reqs, &drafts)
            })?;
            if done.is_none() {
                // Short of memory after eviction: every request as it was.
                if self.engine_view() != before {
                    return Err(self.fail("alloc_verify ran short and changed a request"));
                }
                if self.running.len() <= 1 {
                    break;
                }
                self.retract()?;
                continue;
            }
            self.out.verify_steps += 1;
            for (&i, draft) in batch.iter().zip(&drafts) {
                let parents = match draft {
                    Draft::Tree { parents } => Some(parents.to_vec()),
                    Draft::Chain { .. } => None,
                };
                self.verify_forward(i, draft.width(), parents)?;
            }
            break;
        }
        // An abort or a retraction mid-verify.
        for retract in [false, true] {
            if !self.chance(if retract { 30 } else { 40 }) {
                continue;
            }
            let in_flight: Vec<usize> = (0..self.running.len())
                .filter(|&i| !self.running[i].verifies.is_empty())
                .collect();
            if in_flight.is_empty() {
                continue;
            }
            let k = in_flight[self.rng.below(in_flight.len() as u64) as usize];
            let r = self.running.remove(k);
            if retract {
                self.out.mid_verify_retractions += 1;
                let prompt = r.req.tokens()[..r.prompt_len].to_vec();
                self.waiting.insert(0, (prompt, r.to_decode));
            } else {
                self.out.mid_verify_aborts += 1;
            }
            self.release(r)?;
        }
        // Settle on time, or leave the step in flight to settle late (while the cache
        // allows another step in flight; else the next step settles it first).
        let late = self.max_in_flight() > 1;
        let settling: Vec<usize> = (0..self.running.len())
            .filter(|&i| !self.running[i].verifies.is_empty())
            .collect();
        let settling: Vec<usize> = settling
            .into_iter()
            .filter(|_| !(late && self.chance(400)))
            .collect();
        self.settle(&settling)?;
        if self.chance(40) {
            self.bad_settle(&settling)?;
        }
        Ok(())
    }

    /// The device's forward of `running[i]`'s newest verify step, with `width`
    /// positions (a tree's `parents`): its nodes' KV at the rows that follow what earlier
    /// steps accepted (the kernels read those counts on the device), the state after
    /// each node into the slot group, the target's choice of accepted nodes, and the
    /// fixed-shape device copy that moves a tree's accepted nodes to consecutive rows.
    fn verify_forward(
        &mut self,
        i: usize,
        width: usize,
        parents: Option<Vec<i32>>,
    ) -> Result<(), Failure> {
        let nodes = self.fresh_tokens(width);
        let r = &self.running[i];
        let known = r.device_tokens();
        let base = known.len();
        let start = prefix_hashes(&known).last().copied().unwrap_or(HASH_START);
        // Node `j`'s hash: its path from the root after the known tokens.
        let mut hashes: Vec<u64> = Vec::with_capacity(width);
        for (j, &t) in nodes.iter().enumerate() {
            let parent = match &parents {
                Some(p) => p[j],
                None => j as i32 - 1,
            };
            let h = if parent < 0 {
                start
            } else {
                hashes[parent as usize]
            };
            hashes.push(hash_next(h, t));
        }
        let alloc = self.cache.allocator();
        let buffer = alloc.buffer();
        let row = r.req.row()[base..base + width].to_vec();
        let mut fills: Vec<(Vec<ByteSpan>, u8)> = Vec::new();
        for (&t, &h) in row.iter().zip(&hashes) {
            for side in self.kv_sides() {
                let rows = self.token_rows(side, t).ok_or_else(|| {
                    self.fail(format!("a verify row t{} has no {side:?} page", t.0))
                })?;
                fills.push((rows.spans().collect(), kv_stamp(h, side)));
            }
        }
        let group = r.req.state_group().to_vec();
        let mut group_stamps = Vec::new();
        if r.req.state_slot().is_some() {
            if group.len() < width {
                return Err(self.fail(format!(
                    "a verify of {width} positions on a slot group of {}",
                    group.len()
                )));
            }
            for (&slot, &h) in group.iter().zip(&hashes) {
                group_stamps.push(state_stamp(h));
                fills.push((vec![self.slot_span(slot)?], state_stamp(h)));
            }
        }
        for (spans, value) in fills {
            self.dev
                .fill_spans(buffer, &spans, value)
                .map_err(|e| self.fail(format!("stamping a verify: {e}")))?;
        }
        // What the target accepts: a chain's prefix (all rejected, all accepted or
        // between), a tree's root-to-node path.
        let (accepted, path) = match &parents {
            None => {
                let a = match self.rng.below(4) {
                    0 => 1,
                    1 => width,
                    _ => self.rng.in_range(1, width as u64) as usize,
                };
                (nodes[..a].to_vec(), None)
            }
            Some(p) => {
                let mut path = vec![0u32];
                loop {
                    let last = *path.last().unwrap_or(&0) as i32;
                    let children: Vec<u32> = (0..p.len())
                        .filter(|&c| p[c] == last)
                        .map(|c| c as u32)
                        .collect();
                    if children.is_empty() || self.chance(250) {
                        break;
                    }
                    path.push(children[self.rng.below(children.len() as u64) as usize]);
                }
                let tokens = path.iter().map(|&n| nodes[n as usize]).collect();
                // The device copy: accepted node `path[j]` to row `base + j`, in path
                // order (a node is never moved onto a row a later move reads: the path
                // ascends).
                for (j, &n) in path.iter().enumerate() {
                    if n as usize == j {
                        continue;
                    }
                    for side in self.kv_sides() {
                        let (Some(src), Some(dst)) = (
                            self.token_rows(side, row[n as usize]),
                            self.token_rows(side, row[j]),
                        ) else {
                            return Err(self.fail("a tree node's row has no page"));
                        };
                        let moves: Vec<SpanMove> = src
                            .spans()
                            .zip(dst.spans())
                            .map(|(s, d)| SpanMove {
                                src: s.offset,
                                dst: d.offset,
                                len: s.len,
                            })
                            .collect();
                        self.dev
                            .move_spans(buffer, &moves)
                            .map_err(|e| self.fail(format!("moving a tree node: {e}")))?;
                    }
                }
                self.out.tree_verifies += 1;
                (tokens, Some(path))
            }
        };
        self.out.verifies += 1;
        self.running[i].verifies.push_back(InFlight {
            width,
            parents,
            accepted,
            path,
            group_stamps,
        });
        Ok(())
    }

    /// Settles the oldest verify step of each of `running[idx]` in one call, with a
    /// fault maybe armed. A fault either changed nothing (the call is retried) or struck
    /// after the settlement took effect (copying checkpoints out, as `settle` documents:
    /// then it stands, without those checkpoints).
    fn settle(&mut self, idx: &[usize]) -> Result<(), Failure> {
        if idx.is_empty() {
            return Ok(());
        }
        let before = self.engine_view();
        let owned: Vec<(Vec<TokenId>, Option<Vec<u32>>)> = idx
            .iter()
            .map(|&i| {
                let v = &self.running[i].verifies[0];
                (v.accepted.clone(), v.path.clone())
            })
            .collect();
        let accepted: Vec<Accepted<'_>> = owned
            .iter()
            .map(|(tokens, path)| match path {
                Some(path) => Accepted::tree(path, tokens),
                None => Accepted::chain(tokens),
            })
            .collect();
        let late: Vec<bool> = idx
            .iter()
            .map(|&i| self.running[i].verifies.len() > 1)
            .collect();
        let settled_before: Vec<usize> = idx
            .iter()
            .map(|&i| self.running[i].req.settled_len())
            .collect();
        self.maybe_arm();
        let first = {
            let mut reqs = batch_reqs(&mut self.running, idx);
            self.cache.settle(&mut reqs, &accepted)
        };
        let fired = self.disarm();
        let mut struck = None;
        match first {
            Ok(()) => {}
            Err(e) if fired && injected(&e) => {
                self.out.faults += 1;
                let after = self.engine_view();
                if after == before {
                    // Refused before anything changed: settle again.
                    let mut reqs = batch_reqs(&mut self.running, idx);
                    self.cache
                        .settle(&mut reqs, &accepted)
                        .map_err(|e| self.fail(format!("settle after a fault: {e}")))?;
                } else {
                    // It took effect for every request of the batch, or it is a bug.
                    let took_effect = idx.iter().all(|&i| {
                        let r = &self.running[i];
                        r.req.unsettled_verifies() + 1 == r.verifies.len()
                    });
                    if !took_effect {
                        return Err(self.fail(format!(
                            "settle failed with {e} and settled only part of its batch"
                        )));
                    }
                    self.out.settle_faults_after_effect += 1;
                }
                self.cache
                    .allocator()
                    .verify()
                    .map_err(|v| self.fail(format!("settle failed with {e}; verify: {v}")))?;
                struck = Some(e);
            }
            Err(e) => return Err(self.fail(format!("settle: {e}"))),
        }
        for ((&i, late), from) in idx.iter().zip(late).zip(settled_before) {
            let r = &mut self.running[i];
            let Some(v) = r.verifies.pop_front() else {
                continue;
            };
            let a = v.accepted.len();
            let (id, settled) = (r.req.id(), r.req.settled_len());
            if settled != from + a || r.req.tokens()[from..] != v.accepted[..] {
                return Err(self.fail(format!(
                    "request {id} settled {a} accepted tokens from row {from} to {settled} rows"
                )));
            }
            let r = &mut self.running[i];
            r.to_decode = r.to_decode.saturating_sub(a);
            if r.verifies.is_empty() {
                r.state_len = r.req.settled_len();
            }
            self.out.settles += 1;
            self.out.late_settles += u64::from(late);
            self.out.accepted_tokens += a as u64;
        }
        match struck {
            Some(e) => self.check_bytes(&format!("after a fault in settle ({e})")),
            None => Ok(()),
        }
    }

    /// Wrong settlements: settling a request with nothing in flight (settling twice)
    /// and accepting more than a verify's width. Each must be its typed error and change
    /// nothing.
    fn bad_settle(&mut self, just_settled: &[usize]) -> Result<(), Failure> {
        let twice = just_settled
            .iter()
            .copied()
            .find(|&i| i < self.running.len() && self.running[i].verifies.is_empty());
        if let Some(i) = twice {
            let tokens = self.fresh_tokens(1);
            self.refused("settling twice", &[i], &[Accepted::chain(&tokens)], |e| {
                matches!(e, Error::NothingToSettle { .. })
            })?;
        }
        let pending = (0..self.running.len()).find(|&i| !self.running[i].verifies.is_empty());
        if let Some(i) = pending {
            let v = &self.running[i].verifies[0];
            let width = v.width;
            let tree = v.parents.is_some();
            let tokens = self.fresh_tokens(width + 1);
            let path: Vec<u32> = (0..=width as u32).collect();
            let acc = if tree {
                Accepted::tree(&path, &tokens)
            } else {
                Accepted::chain(&tokens)
            };
            self.refused("accepting more than the width", &[i], &[acc], |e| {
                matches!(
                    e,
                    Error::BadAccepted {
                        reason: AcceptedFault::Count,
                        ..
                    }
                )
            })?;
        }
        Ok(())
    }

    /// A verify with a bad parent array (a node whose parent is itself, or a root with a
    /// parent): a typed error that changes nothing.
    fn bad_draft(&mut self) -> Result<(), Failure> {
        let Some(i) = (0..self.running.len()).find(|&i| {
            let r = &self.running[i];
            r.req.remaining_prefill() == 0 && r.verifies.len() < self.max_in_flight()
        }) else {
            return Ok(());
        };
        let parents: &[i32] = if self.max_width() >= 2 {
            &[-1, 1]
        } else {
            &[0]
        };
        let before = (self.engine_view(), self.cache.stats());
        let result = {
            let mut reqs = batch_reqs(&mut self.running, &[i]);
            self.cache
                .alloc_verify(&mut reqs, &[Draft::Tree { parents }])
        };
        match result {
            Err(Error::BadDraftTree { .. }) => {}
            other => {
                return Err(self.fail(format!(
                    "a bad parent array {parents:?} gave {other:?}, not BadDraftTree"
                )));
            }
        }
        if (self.engine_view(), self.cache.stats()) != before {
            return Err(self.fail("a refused bad parent array changed the cache"));
        }
        self.out.refused_calls += 1;
        Ok(())
    }

    /// Calls `settle` for `running[idx]` with `accepted`, which must fail as `expected`
    /// says and change nothing.
    fn refused(
        &mut self,
        what: &str,
        idx: &[usize],
        accepted: &[Accepted<'_>],
        expected: impl Fn(&Error) -> bool,
    ) -> Result<(), Failure> {
        let before = (self.engine_view(), self.cache.stats());
        let result = {
            let mut reqs = batch_reqs(&mut self.running, idx);
            self.cache.settle(&mut reqs, accepted)
        };
        match result {
            Err(e) if expected(&e) => {}
            other => return Err(self.fail(format!("{what} gave {other:?}"))),
        }
        if (self.engine_view(), self.cache.stats()) != before {
            return Err(self.fail(format!("{what}: a refused settle changed the cache")));
        }
        self.out.refused_calls += 1;
        Ok(())
    }
}

/// The requests `running[idx]`, in `idx`'s order, for a batched call.
fn batch_reqs<'a>(running: &'a mut [Running], idx: &[usize]) -> Vec<&'a mut Request> {
    let mut slots: Vec<Option<&'a mut Request>> =
        running.iter_mut().map(|r| Some(&mut r.req)).collect();
    idx.iter().filter_map(|&i| slots[i].take()).collect()
}
