//! Speculative decoding in the engine of a speculative seed: decode steps become verify
//! steps (a chain of `k` drafts or a random draft tree per request) run through the
//! cache's verify metadata (built, translated with the device offsets of an earlier
//! unsettled verify, and checked against the host tables), the device's forward stamps
//! every verify position's KV and intermediate state at the translated ids,
//! `compact_accepted` moves a tree's accepted nodes to consecutive rows, and the host settles each step with what was accepted, on
//! time or a step late (the next verify already allocated), with aborts and retractions
//! mid-verify and faults injected into both calls; every checkpoint a settlement saves
//! is read back at once and must hold the accepted prefix's state at its position.
//! Wrong calls an engine could make
//! (settling twice, accepting more than a verify's width, a bad parent array) must be
//! typed errors that change nothing.

use super::{Running, Sim, injected};
use crate::outcome::Failure;
use crate::stamps::{HASH_START, hash_at, hash_next, kv_stamp, prefix_hashes, state_stamp};
use unikv::kernels::{ByteSpan, Device, HostSync, Readback};
use unikv::pools::Side;
use unikv::{
    Accepted, AcceptedFault, DeviceValues, Draft, Error, Request, TokenId, VerifyLayout,
    VerifyMetadata, VerifyOffsets,
};

/// One verify step of a request in flight, as the engine (and its device) knows it.
pub(super) struct InFlight {
    /// Positions it verifies.
    width: usize,
    /// A tree's parent array (`None` for a chain).
    parents: Option<Vec<i32>>,
    /// The accepted nodes' tokens in accepted order: a device value, which the host
    /// passes to `settle` when it settles. Empty until `compact_accepted` moved them to
    /// consecutive rows (until then the device has them at their nodes' rows).
    pub(super) accepted: Vec<TokenId>,
    /// A tree's accepted root-to-node path.
    path: Option<Vec<u32>>,
    /// The state stamp the forward wrote into each slot of the group (position `i`
    /// into slot `i`), or into each log entry under the replay rollback, on a recurrent
    /// model.
    pub(super) group_stamps: Vec<u8>,
    /// Under the replay rollback, where each position's log entry is: its lane's slot
    /// (virtual: compaction moves it) and the entry's index there.
    pub(super) log_entries: Vec<(unikv::pools::VirtualSlot, u64)>,
    /// Between the forward and the compaction of the accepted nodes.
    pub(super) uncompacted: Option<Uncompacted>,
}

/// A verify step whose forward ran and whose accepted nodes are not compacted yet.
pub(super) struct Uncompacted {
    /// Each node's prefix hash: its KV stamps are at the rows of its own position.
    pub(super) hashes: Vec<u64>,
    /// The accepted tokens, the device's once compacted.
    accepted: Vec<TokenId>,
}

/// The largest verify batch: the verify metadata's tables are sized for it once, when
/// the cache is built (the engine runs at most 7 requests).
pub(super) const VERIFY_BATCH: usize = 8;

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
            let shapes: Vec<(usize, Option<Vec<i32>>)> = drafts
                .iter()
                .map(|draft| match draft {
                    Draft::Tree { parents } => (draft.width(), Some(parents.to_vec())),
                    Draft::Chain { .. } => (draft.width(), None),
                })
                .collect();
            let mut meta = self
                .verify_meta
                .take()
                .ok_or_else(|| self.fail("a speculative seed without verify metadata"))?;
            let result = self.verify_batch(&mut meta, &batch, shapes);
            self.verify_meta = Some(meta);
            result?;
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

    /// One verify step of `batch` (allocated by `alloc_verify`, with `shapes` its
    /// widths and trees) as an engine runs it on the device: builds the verify metadata
    /// and uploads the device offsets (each request's earlier unsettled verify's accepted
    /// count and one past its last accepted node), translates it, checks every
    /// translated id against the host tables, runs the forward at those ids, uploads the
    /// accepted paths and compacts the accepted nodes with one `compact_accepted` for
    /// the batch. The three cache calls run with a fault maybe armed: a faulted one must
    /// change nothing, and its retry must succeed.
    fn verify_batch(
        &mut self,
        meta: &mut VerifyMetadata,
        batch: &[usize],
        shapes: Vec<(usize, Option<Vec<i32>>)>,
    ) -> Result<(), Failure> {
        let (b, w) = (VERIFY_BATCH, self.max_width());
        if batch.len() > b {
            return Err(self.fail(format!("a verify batch of {} requests", batch.len())));
        }
        let values = self
            .values
            .ok_or_else(|| self.fail("a speculative seed without a device value table"))?;
        // The device offsets, as the accept kernel of the earlier step left them.
        let mut offsets = vec![0i32; 2 * b];
        let mut late = false;
        for (m, &i) in batch.iter().enumerate() {
            if let Some(earlier) = self.running[i].verifies.back() {
                late = true;
                let a = earlier.accepted.len();
                offsets[m] = a as i32;
                offsets[b + m] = earlier
                    .path
                    .as_ref()
                    .map_or(a, |p| p.last().map_or(a, |&n| n as usize + 1))
                    as i32;
            }
        }
        let faults_before = self.out.faults;
        let built = self.call("build_verify_metadata", |s| {
            let reqs: Vec<&Request> = batch.iter().map(|&i| &s.running[i].req).collect();
            s.cache.build_verify_metadata(meta, &reqs)
        })?;
        if built.is_none() {
            return Err(self.fail("build_verify_metadata ran short of memory"));
        }
        self.out.verify_metadata_builds += 1;
        self.dev
            .upload_table(values, 0, &offsets)
            .map_err(|e| self.fail(format!("uploading the verify offsets: {e}")))?;
        let at = |at| DeviceValues { table: values, at };
        // With nothing unsettled the offsets are zeros: the engine may pass them or not.
        let device_offsets = (late || self.chance(500)).then_some(VerifyOffsets {
            accepted: at(0),
            last_node: at(b),
        });
        let translated = self.call("translate_verify", |s| {
            s.cache.translate_verify(meta, device_offsets)
        })?;
        if translated.is_none() {
            return Err(self.fail("translate_verify ran short of memory"));
        }
        let l = meta.layout();
        let (_, outputs) = meta
            .tables()
            .ok_or_else(|| self.fail("verify metadata without tables"))?;
        let out = self
            .dev
            .read_table(
                &HostSync::acquire("dst: reading the verify ids back"),
                outputs,
                0,
                l.outputs_len,
            )
            .map_err(|e| self.fail(format!("reading the verify ids: {e}")))?;
        let widths: Vec<usize> = shapes.iter().map(|(width, _)| *width).collect();
        let inputs = meta.inputs().to_vec();
        match self.sc.replay {
            None => self.check_verify_ids(&l, &out, batch, &widths, &offsets[b..])?,
            Some(_) => self.check_log_ids(&l, &inputs, &out, batch, &widths)?,
        }
        let mut paths = vec![-1i32; b * w];
        for (m, (&i, (width, parents))) in batch.iter().zip(shapes).enumerate() {
            let ids = Translated {
                l: &l,
                inputs: &inputs,
                out: &out,
                m,
            };
            let path = self.verify_forward(ids, i, width, parents, offsets[b + m])?;
            paths[m * w..m * w + path.len()].copy_from_slice(&path);
        }
        // The accept kernel's paths (a chain's `0, 1, …` moves nothing), then one
        // fixed-shape copy of every tree's accepted nodes to consecutive rows.
        self.dev
            .upload_table(values, 2 * b, &paths)
            .map_err(|e| self.fail(format!("uploading the accepted paths: {e}")))?;
        let compacted = self.call("compact_accepted", |s| {
            s.cache.compact_accepted(meta, at(2 * b))
        })?;
        if compacted.is_none() {
            return Err(self.fail("compact_accepted ran short of memory"));
        }
        self.out.compactions += 1;
        self.out.verify_call_faults += (self.out.faults - faults_before) as u64;
        for &i in batch {
            if let Some(v) = self.running[i].verifies.back_mut()
                && let Some(u) = v.uncompacted.take()
            {
                v.accepted = u.accepted;
            }
        }
        Ok(())
    }

    /// The translated verify ids against the host: for each request of `batch` and
    /// position `j` below its width, the FULL (and SWA) write id is the kernel id of the
    /// row the position writes (the rows after what the device knows), the sink past its
    /// width and for padding requests; on a recurrent model the input state is the
    /// physical slot at `last_node[m]` of `[running, group…]` and the state after
    /// position `j` the physical slot of group slot `j`.
    fn check_verify_ids(
        &mut self,
        l: &VerifyLayout,
        out: &[i32],
        batch: &[usize],
        widths: &[usize],
        last_node: &[i32],
    ) -> Result<(), Failure> {
        let w = l.width;
        let sides = self.kv_sides();
        let mut checked = 0u64;
        let mut wrong = |what: String, got: i32, want: i32| -> Option<String> {
            checked += 1;
            (got != want).then(|| format!("{what}: the device says {got}, the host {want}"))
        };
        let mut failures: Vec<String> = Vec::new();
        let alloc = self.cache.allocator();
        for m in 0..l.max_batch {
            let Some(&i) = batch.get(m) else {
                // A padding request: every id the sink.
                for side in &sides {
                    let at = if *side == Side::Full {
                        l.write_full
                    } else {
                        l.write_swa
                    };
                    for j in 0..w {
                        failures.extend(wrong(
                            format!("padding request {m}'s {side:?} write id {j}"),
                            out[at + m * w + j],
                            0,
                        ));
                    }
                }
                if l.slots_per_request > 0 {
                    failures.extend(wrong(
                        format!("padding request {m}'s input state"),
                        out[l.state_in + m],
                        0,
                    ));
                    for j in 0..w {
                        failures.extend(wrong(
                            format!("padding request {m}'s state {j}"),
                            out[l.state_out + m * w + j],
                            0,
                        ));
                    }
                }
                continue;
            };
            let r = &self.running[i];
            let id = r.req.id();
            let base = r.device_tokens().len();
            let row = r.req.row();
            for side in &sides {
                let at = if *side == Side::Full {
                    l.write_full
                } else {
                    l.write_swa
                };
                for j in 0..w {
                    let want = if j < widths[m] {
                        match row.get(base + j).map(|&t| alloc.kernel_id(*side, t)) {
                            Some(k) if k > 0 => k,
                            _ => {
                                failures.push(format!(
                                    "request {id}'s verify position {j} (row {}) has no {side:?} page",
                                    base + j
                                ));
                                continue;
                            }
                        }
                    } else {
                        0 // past the draft: the sink, whatever the offset
                    };
                    failures.extend(wrong(
                        format!("request {id}'s {side:?} write id {j} (row {})", base + j),
                        out[at + m * w + j],
                        want,
                    ));
                }
            }
            if l.slots_per_request > 0 {
                // The input: the running slot, or the earlier unsettled verify's group
                // at its last accepted node; the outputs: the newest verify's own group.
                let groups = r.req.state_groups();
                let earlier: &[_] = match groups.len() {
                    2.. => groups[groups.len() - 2],
                    _ => &[],
                };
                let newest = groups.last().copied().unwrap_or(&[]);
                let inputs: Vec<_> = r
                    .req
                    .state_slot()
                    .into_iter()
                    .chain(earlier.iter().copied())
                    .collect();
                let physical = |slots: &[unikv::pools::VirtualSlot], k: usize| {
                    slots
                        .get(k)
                        .and_then(|&s| alloc.physical_slot(s))
                        .map_or(-1, |p| p as i32)
                };
                failures.extend(wrong(
                    format!(
                        "request {id}'s input state (node {} of [running, earlier group…])",
                        last_node[m]
                    ),
                    out[l.state_in + m],
                    physical(&inputs, last_node[m] as usize),
                ));
                for j in 0..w {
                    let want = if j < widths[m] {
                        physical(newest, j)
                    } else {
                        0
                    };
                    failures.extend(wrong(
                        format!("request {id}'s state after position {j}"),
                        out[l.state_out + m * w + j],
                        want,
                    ));
                    // A verify never reads a state slot it writes.
                    if want > 0 && want == out[l.state_in + m] {
                        failures.push(format!(
                            "request {id}'s verify reads the slot it writes at {j}"
                        ));
                    }
                }
            }
        }
        self.out.verify_ids_checked += checked;
        match failures.first() {
            Some(f) => Err(self.fail(format!("translate_verify: {f} ({} such)", failures.len()))),
            None => Ok(()),
        }
    }

    /// The translated state ids under the replay rollback: each request's input is its
    /// running slot; each position's entry of its newest lane is the physical slot of
    /// the entry's slot in the inputs (a slot of the lane's block), the earlier lane's
    /// likewise; no two positions of the batch log into the same entry, and no entry lies
    /// in a running slot.
    fn check_log_ids(
        &mut self,
        l: &VerifyLayout,
        inputs: &[i32],
        out: &[i32],
        batch: &[usize],
        widths: &[usize],
    ) -> Result<(), Failure> {
        let (w, s) = (l.width, l.slots_per_request);
        let alloc = self.cache.allocator();
        let physical = |v: i32| {
            alloc
                .physical_slot(unikv::pools::VirtualSlot(v as u32))
                .map_or(-1, |p| p as i32)
        };
        let mut failures: Vec<String> = Vec::new();
        let mut entries = std::collections::HashSet::new();
        let mut running = std::collections::HashSet::new();
        for (m, &i) in batch.iter().enumerate() {
            let r = &self.running[i];
            let id = r.req.id();
            let want_in = r.req.state_slot().and_then(|v| alloc.physical_slot(v));
            if want_in.map(|p| p as i32) != Some(out[l.state_in + m]) {
                failures.push(format!(
                    "request {id}'s input state is {}, not its running slot {want_in:?}",
                    out[l.state_in + m]
                ));
            }
            running.insert(out[l.state_in + m]);
            let lane = r.req.state_group();
            for j in 0..widths[m] {
                let at = m * s + s - w + j;
                let (slot, index) = (out[l.state_out + m * w + j], inputs[l.entries + at]);
                if slot != physical(inputs[l.slots + at])
                    || !lane.iter().any(|v| v.0 as i32 == inputs[l.slots + at])
                {
                    failures.push(format!("request {id}'s log entry {j} is in slot {slot}"));
                }
                if !entries.insert((slot, index)) {
                    failures.push(format!(
                        "request {id}'s log entry {j} ({slot}, {index}) is another position's"
                    ));
                }
            }
            if r.verifies.len() > 1 && l.prev_out < l.outputs_len {
                for j in 0..w {
                    let at = m * s + 1 + j;
                    if out[l.prev_out + m * w + j] != physical(inputs[l.slots + at]) {
                        failures.push(format!("request {id}'s earlier log entry {j}"));
                    }
                }
            }
            self.out.verify_ids_checked += 1 + widths[m] as u64;
        }
        if let Some(&(slot, _)) = entries.iter().find(|(slot, _)| running.contains(slot)) {
            failures.push(format!("a log entry lies in running slot {slot}"));
        }
        match failures.first() {
            Some(f) => Err(self.fail(format!("translate_verify: {f} ({} such)", failures.len()))),
            None => Ok(()),
        }
    }

    /// The device's forward of the batch's `m`-th request (`running[i]`'s newest verify
    /// step, `width` positions, a tree's `parents`), at the ids `translate_verify` wrote
    /// into `out`: it reads the input state (checked: the state after what the device
    /// knows, at `last_node` of `[running, group…]`), writes each node's KV at its write
    /// ids and the state after it into its group slot, and the target chooses the
    /// accepted nodes. Returns the accepted path the accept kernel writes (a chain's
    /// `0, 1, …`); the nodes stay at their rows until `compact_accepted`.
    fn verify_forward(
        &mut self,
        ids: Translated<'_>,
        i: usize,
        width: usize,
        parents: Option<Vec<i32>>,
        last_node: i32,
    ) -> Result<Vec<i32>, Failure> {
        let Translated { l, inputs, out, m } = ids;
        let nodes = self.fresh_tokens(width);
        let r = &self.running[i];
        let known = r.device_tokens();
        let known_hashes = prefix_hashes(&known);
        let start = known_hashes.last().copied().unwrap_or(HASH_START);
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
        let buffer = self.cache.allocator().buffer();
        let w = l.width;
        let mut fills: Vec<(Vec<ByteSpan>, u8)> = Vec::new();
        for (j, &h) in hashes.iter().enumerate() {
            for side in self.kv_sides() {
                let at = if side == Side::Full {
                    l.write_full
                } else {
                    l.write_swa
                };
                let rows = self.id_rows(side, out[at + m * w + j]);
                fills.push((rows.spans().collect(), kv_stamp(h, side)));
            }
        }
        let mut group_stamps = Vec::new();
        let mut log_entries = Vec::new();
        if let (true, Some(replay)) = (l.slots_per_request > 0, self.sc.state_replay()) {
            // Replay rollback: the running state is the settled one, and an earlier
            // unsettled verify's entry at its last accepted node is replayed from it.
            let s = l.slots_per_request;
            let settled = r.req.settled_len();
            let running = if settled == 0 {
                0
            } else {
                state_stamp(hash_at(&known_hashes, settled))
            };
            let mut reads = vec![(
                ByteSpan {
                    offset: self.geometry.slot_offset(out[l.state_in + m] as u32),
                    len: self.geometry.slot_bytes,
                },
                running,
                "its running slot".to_string(),
            )];
            if let Some(earlier) = r.verifies.back() {
                let n = (last_node as usize).wrapping_sub(1);
                let want = earlier
                    .group_stamps
                    .get(n)
                    .copied()
                    .ok_or_else(|| self.fail(format!("a last accepted node {last_node}")))?;
                let slot = out[l.prev_out + m * w + n] as u32;
                let index = inputs[l.entries + m * s + 1 + n] as u64;
                reads.push((
                    ByteSpan {
                        offset: self.geometry.slot_offset(slot) + index * replay.log_bytes,
                        len: replay.log_bytes,
                    },
                    want,
                    format!("the earlier verify's log entry {n}"),
                ));
            }
            let id = r.req.id();
            for (span, want, what) in reads {
                self.check_input(id, span, want, &what)?;
            }
            for (j, &h) in hashes.iter().enumerate() {
                group_stamps.push(state_stamp(h));
                let slot = out[l.state_out + m * w + j] as u32;
                let index = inputs[l.entries + m * s + s - w + j] as u64;
                let virtual_slot =
                    unikv::pools::VirtualSlot(inputs[l.slots + m * s + s - w + j] as u32);
                log_entries.push((virtual_slot, index));
                let span = ByteSpan {
                    offset: self.geometry.slot_offset(slot) + index * replay.log_bytes,
                    len: replay.log_bytes,
                };
                fills.push((vec![span], state_stamp(h)));
            }
        } else if l.slots_per_request > 0 {
            // The state the forward starts from: the running one, or the earlier
            // verify's at its last accepted node.
            let want = match r.verifies.back() {
                Some(earlier) => earlier
                    .group_stamps
                    .get((last_node as usize).wrapping_sub(1))
                    .copied()
                    .ok_or_else(|| self.fail(format!("a last accepted node {last_node}")))?,
                None if r.state_len == 0 => 0,
                None => state_stamp(hash_at(&known_hashes, r.state_len)),
            };
            let span = self.physical_slot_span(out[l.state_in + m] as u32);
            let id = r.req.id();
            self.check_input(id, span, want, "its input slot")?;
            for (j, &h) in hashes.iter().enumerate() {
                group_stamps.push(state_stamp(h));
                let span = self.physical_slot_span(out[l.state_out + m * w + j] as u32);
                fills.push((vec![span], state_stamp(h)));
            }
        }
        for (spans, value) in fills {
            self.dev
                .fill_spans(buffer, &spans, value)
                .map_err(|e| self.fail(format!("stamping a verify: {e}")))?;
        }
        // What the target accepts: a chain's prefix (all rejected, all accepted or
        // between), a tree's root-to-node path.
        let (path, tree_path) = match &parents {
            None => {
                let a = match self.rng.below(4) {
                    0 => 1,
                    1 => width,
                    _ => self.rng.in_range(1, width as u64) as usize,
                };
                ((0..a as u32).collect::<Vec<u32>>(), None)
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
                self.out.tree_verifies += 1;
                (path.clone(), Some(path))
            }
        };
        let accepted = path.iter().map(|&n| nodes[n as usize]).collect();
        self.out.verifies += 1;
        self.running[i].verifies.push_back(InFlight {
            width,
            parents,
            accepted: Vec::new(),
            path: tree_path,
            group_stamps,
            log_entries,
            uncompacted: Some(Uncompacted { hashes, accepted }),
        });
        Ok(path.iter().map(|&n| n as i32).collect())
    }

    /// Reads what a verify forward starts from — `span` of the buffer, `what` for the
    /// message — and fails unless every byte is the stamp `want`.
    fn check_input(
        &mut self,
        id: u64,
        span: ByteSpan,
        want: u8,
        what: &str,
    ) -> Result<(), Failure> {
        let got = self
            .dev
            .read_bytes(
                &HostSync::acquire("dst: the verify forward reads its input state"),
                self.cache.allocator().buffer(),
                span.offset,
                span.len,
            )
            .map_err(|e| self.fail(format!("reading the input state: {e}")))?;
        self.out.stamps_checked += 1;
        if got.iter().all(|&b| b == want) {
            return Ok(());
        }
        Err(self.fail(format!(
            "request {id}'s verify reads the state {} from {what}, not {want}",
            got.first().copied().unwrap_or(0)
        )))
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
        for ((&i, late), &from) in idx.iter().zip(late).zip(&settled_before) {
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
            self.out.replay_settles += u64::from(self.sc.replay.is_some());
            self.out.accepted_tokens += a as u64;
        }
        self.check_settled_checkpoints(idx, &settled_before)?;
        match struck {
            Some(e) => self.check_bytes(&format!("after a fault in settle ({e})")),
            None => Ok(()),
        }
    }

    /// The checkpoints a settlement of `running[idx]` saved — those it holds at the
    /// positions the accepted tokens crossed, past `from[k]` settled tokens — each read
    /// through the host tables at once: its slot holds the state after the accepted
    /// prefix at its position (what settling copied out of the verify's scratch group).
    fn check_settled_checkpoints(&mut self, idx: &[usize], from: &[usize]) -> Result<(), Failure> {
        let mut saved = Vec::new();
        for (&i, &from) in idx.iter().zip(from) {
            let req = &self.running[i].req;
            let crossed = from + 1..=req.settled_len();
            saved.extend(
                req.held_checkpoints()
                    .filter(|w| crossed.contains(&w.at_len))
                    .map(|w| (i, w)),
            );
        }
        if saved.is_empty() {
            return Ok(());
        }
        let bytes = self.buffer_bytes()?;
        for (i, w) in saved {
            let req = &self.running[i].req;
            let hashes = prefix_hashes(&req.tokens()[..w.at_len]);
            let want = state_stamp(hash_at(&hashes, w.at_len));
            let span = self.slot_span(w.slot)?;
            self.out.stamps_checked += 1;
            self.out.settled_checkpoints_checked += 1;
            self.out.replayed_checkpoints_checked += u64::from(self.sc.replay.is_some());
            if !Self::check_span(&bytes, span, want) {
                let got = bytes[span.offset as usize];
                return Err(self.fail(format!(
                    "request {}'s settlement saved a checkpoint at {} tokens whose slot holds the state {got}, not the accepted prefix's {want}",
                    req.id(),
                    w.at_len
                )));
            }
        }
        Ok(())
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
/// One request's view of a verify's translated outputs, read back: the layout, the
/// outputs table, and the request's index in the batch.
#[derive(Clone, Copy)]
struct Translated<'a> {
    l: &'a VerifyLayout,
    /// The inputs table's host image (the entries' indices).
    inputs: &'a [i32],
    out: &'a [i32],
    m: usize,
}

fn batch_reqs<'a>(running: &'a mut [Running], idx: &[usize]) -> Vec<&'a mut Request> {
    let mut slots: Vec<Option<&'a mut Request>> =
        running.iter_mut().map(|r| Some(&mut r.req)).collect();
    idx.iter().filter_map(|&i| slots[i].take()).collect()
}
