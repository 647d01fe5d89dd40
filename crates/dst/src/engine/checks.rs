//! What the engine checks after every step and every injected fault: every stamped KV
//! and state byte through the host tables, every running request's KV through the device
//! translation, and the allocator and the tree themselves.

use super::{Running, Sim};
use crate::outcome::Failure;
use crate::stamps::{HASH_START, hash_at, hash_next, kv_stamp, prefix_hashes, state_stamp};
use std::collections::HashMap;
use unikv::kernels::{ByteSpan, Device, HostSync, Readback, TableId};
use unikv::pools::{Side, VirtualSlot, VirtualToken};

/// The bytes of one token on one side, as kernels address them: `count` rows of `len`
/// bytes, `stride` bytes apart from `offset` (every layer's K and V row in the
/// page-major envelope; one span at page size 1, where they are consecutive).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Rows {
    offset: u64,
    stride: u64,
    count: u64,
    len: u64,
}

impl Rows {
    /// The rows as byte spans.
    pub(super) fn spans(self) -> impl Iterator<Item = ByteSpan> {
        (0..self.count).map(move |i| ByteSpan {
            offset: self.offset + i * self.stride,
            len: self.len,
        })
    }
}

/// Whether every byte of `bytes` is `want` (one comparison of the slice with itself
/// shifted by a byte, so a debug build does not loop byte by byte).
fn uniform(bytes: &[u8], want: u8) -> bool {
    match bytes.split_first() {
        Some((&first, rest)) => first == want && rest == &bytes[..rest.len()],
        None => true,
    }
}

impl Sim {
    pub(super) fn kv_sides(&self) -> Vec<Side> {
        if self.sc.model.swa_layers > 0 {
            vec![Side::Full, Side::Swa]
        } else {
            vec![Side::Full]
        }
    }

    /// The bytes of token `t` on `side` (its rows), through the host tables: `None`
    /// when its page is not bound.
    pub(super) fn token_rows(&self, side: Side, t: VirtualToken) -> Option<Rows> {
        let id = self.cache.allocator().kernel_id(side, t);
        (id > 0).then(|| self.id_rows(side, id))
    }

    /// The rows of the token with kernel id `id` on `side`: every layer's K and V row
    /// at [`KvGeometry::row_offset`](unikv::KvGeometry::row_offset) (`2 ×` the side's
    /// layers, the draft model's included on FULL), `page size × row bytes` apart.
    pub(super) fn id_rows(&self, side: Side, id: i32) -> Rows {
        let (count, len) = match side {
            Side::Full => (
                2 * u64::from(self.sc.model.full_envelope_layers()),
                self.geometry.full_row_bytes,
            ),
            _ => (
                2 * u64::from(self.sc.model.swa_layers),
                self.geometry.swa_row_bytes,
            ),
        };
        let offset = self.geometry.row_offset(side, id, 0, false);
        let stride = self.geometry.row_offset(side, id, 0, true) - offset;
        if stride == len {
            // Page size 1: the rows are consecutive, one span.
            Rows {
                offset,
                stride: count * len,
                count: 1,
                len: count * len,
            }
        } else {
            Rows {
                offset,
                stride,
                count,
                len,
            }
        }
    }

    /// The bytes of physical state slot `p`.
    pub(super) fn physical_slot_span(&self, p: u32) -> ByteSpan {
        ByteSpan {
            offset: self.geometry.slot_offset(p),
            len: self.geometry.slot_bytes,
        }
    }

    pub(super) fn slot_span(&self, slot: VirtualSlot) -> Result<ByteSpan, Failure> {
        let alloc = self.cache.allocator();
        let p = alloc
            .physical_slot(slot)
            .ok_or_else(|| self.fail(format!("state slot {slot:?} is not bound")))?;
        let env = alloc.grid(Side::Mamba).envelope;
        Ok(ByteSpan {
            offset: p as u64 * env,
            len: env,
        })
    }

    /// The whole buffer, read back once for a round of checks.
    pub(super) fn buffer_bytes(&self) -> Result<Vec<u8>, Failure> {
        let alloc = self.cache.allocator();
        let total = alloc.pool_map().total_bytes;
        self.dev
            .read_bytes(
                &HostSync::acquire("dst: the engine's read-back of every stamp"),
                alloc.buffer(),
                0,
                total,
            )
            .map_err(|e| self.fail(format!("reading the buffer: {e}")))
    }

    /// Whether every byte of `span` is `want`.
    pub(super) fn check_span(bytes: &[u8], span: ByteSpan, want: u8) -> bool {
        uniform(
            &bytes[span.offset as usize..(span.offset + span.len) as usize],
            want,
        )
    }

    /// Whether every byte of every row of `rows` is `want`.
    pub(super) fn check(bytes: &[u8], rows: Rows, want: u8) -> bool {
        rows.spans().all(|span| Self::check_span(bytes, span, want))
    }

    /// One running request: every token's FULL bytes, its SWA bytes from its window
    /// cursor on (and wherever still live), and its state, through the host tables.
    pub(super) fn check_request(&mut self, r: &Running, when: &str) -> Result<(), Failure> {
        let bytes = self.buffer_bytes()?;
        self.check_request_in(&bytes, r, when)
    }

    pub(super) fn check_request_in(
        &mut self,
        bytes: &[u8],
        r: &Running,
        when: &str,
    ) -> Result<(), Failure> {
        // The tokens whose KV the rows hold: the settled ones, then (mid-verify) what
        // each unsettled verify step accepted, which the device knows; the rows past
        // them are reserved and unchecked (rejected nodes, or room for a worst case).
        let hashes = prefix_hashes(&r.device_tokens());
        // Attention reads every token's FULL KV and the last window's SWA KV behind the
        // settled rows (every verify position's window starts there or later), and the
        // cache promises SWA from the cursor on.
        let window_start = r
            .req
            .settled_len()
            .saturating_sub(self.sc.model.window as usize);
        let swa_from = r.req.window_cursor().min(window_start);
        for (pos, t) in r.req.row().iter().enumerate() {
            for side in self.kv_sides() {
                let span = self.token_rows(side, *t);
                let required = side == Side::Full || pos >= swa_from;
                match span {
                    None if required => {
                        return Err(self.fail(format!(
                            "{when}: request {} row {pos} has no {side:?} page",
                            r.req.id()
                        )));
                    }
                    None => {}
                    Some(_) if pos >= hashes.len() => {}
                    Some(span) => {
                        self.out.stamps_checked += 1;
                        if !Self::check(bytes, span, kv_stamp(hashes[pos], side)) {
                            return Err(self.fail(format!(
                                "{when}: request {} row {pos} (t{}) lost its {side:?} bytes",
                                r.req.id(),
                                t.0
                            )));
                        }
                    }
                }
            }
        }
        if let Some(u) = r.verifies.back().and_then(|v| v.uncompacted.as_ref()) {
            // Between the newest verify's forward and its compaction, every node's KV is
            // at the row of its own position, after what the device knows.
            for (j, &h) in u.hashes.iter().enumerate() {
                let pos = hashes.len() + j;
                for side in self.kv_sides() {
                    let Some(rows) = r.req.row().get(pos).and_then(|&t| self.token_rows(side, t))
                    else {
                        return Err(self.fail(format!(
                            "{when}: request {} verify row {pos} has no {side:?} page",
                            r.req.id()
                        )));
                    };
                    self.out.stamps_checked += 1;
                    if !Self::check(bytes, rows, kv_stamp(h, side)) {
                        return Err(self.fail(format!(
                            "{when}: request {}'s verify node {j} (row {pos}) lost its {side:?} bytes before its compaction",
                            r.req.id()
                        )));
                    }
                }
            }
        }
        if let (Some(v), Some(replay)) = (r.verifies.back(), self.sc.state_replay()) {
            // Replay rollback: the running slot holds the settled state (a verify writes
            // none; each settlement commits), and the newest forward's lane its log
            // entries.
            if let Some(slot) = r.req.state_slot() {
                let span = self.slot_span(slot)?;
                let settled = r.req.settled_len();
                let want = if settled == 0 {
                    0
                } else {
                    state_stamp(hash_at(&hashes, settled))
                };
                self.out.stamps_checked += 1;
                if !Self::check_span(bytes, span, want) {
                    return Err(self.fail(format!(
                        "{when}: request {}'s running slot lost its settled state mid-verify",
                        r.req.id()
                    )));
                }
            }
            for (j, (&(slot, index), &want)) in
                v.log_entries.iter().zip(&v.group_stamps).enumerate()
            {
                let slot_span = self.slot_span(slot)?;
                let span = ByteSpan {
                    offset: slot_span.offset + index * replay.log_bytes,
                    len: replay.log_bytes,
                };
                self.out.stamps_checked += 1;
                if !Self::check_span(bytes, span, want) {
                    return Err(self.fail(format!(
                        "{when}: request {}'s log entry {j} lost what its verify wrote",
                        r.req.id()
                    )));
                }
            }
        } else if let Some(v) = r.verifies.back() {
            // Mid-verify the newest forward's scratch group holds the state after each of
            // its nodes (the cache may hold a newer verify whose forward has not run: the
            // groups line up oldest first).
            let groups = r.req.state_groups();
            let group = groups
                .get(r.verifies.len() - 1)
                .map_or_else(Vec::new, |g| g.to_vec());
            for (j, (&slot, &want)) in group.iter().zip(&v.group_stamps).enumerate() {
                let span = self.slot_span(slot)?;
                self.out.stamps_checked += 1;
                if !Self::check_span(bytes, span, want) {
                    return Err(self.fail(format!(
                        "{when}: request {}'s state after verify node {j} is not in its group slot",
                        r.req.id()
                    )));
                }
            }
        } else if let Some(slot) = r.req.state_slot() {
            let span = self.slot_span(slot)?;
            let want = if r.state_len == 0 {
                0
            } else {
                state_stamp(hash_at(&hashes, r.state_len))
            };
            self.out.stamps_checked += 1;
            if !Self::check_span(bytes, span, want) {
                return Err(self.fail(format!(
                    "{when}: request {}'s state (after {} tokens) is not in its slot",
                    r.req.id(),
                    r.state_len
                )));
            }
        }
        Ok(())
    }

    /// After a step: the allocator verifies, the tree is sane, the bytes hold.
    pub(super) fn check_everything(&mut self) -> Result<(), Failure> {
        self.cache
            .allocator()
            .verify()
            .map_err(|e| self.fail(format!("verify: {e}")))?;
        self.cache
            .tree()
            .sanity_check()
            .map_err(|e| self.fail(format!("tree sanity: {e}")))?;
        self.check_bytes("after the step")?;
        self.check_translation()
    }

    /// Every running request's and every cached prefix's bytes, through the host tables.
    pub(super) fn check_bytes(&mut self, when: &str) -> Result<(), Failure> {
        let bytes = self.buffer_bytes()?;
        let running = std::mem::take(&mut self.running);
        let result = running
            .iter()
            .try_for_each(|r| self.check_request_in(&bytes, r, when));
        self.running = running;
        result?;
        // The prefix cache: every node's FULL bytes, its SWA bytes while live, its state.
        let mut hashes: HashMap<_, u64> = HashMap::new();
        let mut failures = Vec::new();
        let mut checked = 0u64;
        for n in self.cache.tree().nodes() {
            let mut h = n.parent.map_or(HASH_START, |p| hashes[&p]);
            for (t, v) in n.key.iter().zip(n.value) {
                h = hash_next(h, *t);
                for side in self.kv_sides() {
                    if side == Side::Swa && !n.swa_live {
                        continue;
                    }
                    match self.token_rows(side, VirtualToken(v.0)) {
                        Some(span) => {
                            checked += 1;
                            if !Self::check(&bytes, span, kv_stamp(h, side)) {
                                failures.push(format!("cached t{} lost its {side:?} bytes", v.0));
                            }
                        }
                        None => failures.push(format!("cached t{} has no {side:?} page", v.0)),
                    }
                }
            }
            if let Some(slot) = n.mamba {
                let span = self.slot_span(VirtualSlot(slot.0))?;
                checked += 1;
                if !Self::check_span(&bytes, span, state_stamp(h)) {
                    failures.push(format!(
                        "the cached state at position {} is wrong",
                        n.start.0 + n.key.len()
                    ));
                }
            }
            hashes.insert(n.id, h);
        }
        self.out.stamps_checked += checked;
        match failures.first() {
            Some(f) => Err(self.fail(format!("{when}: {f} ({} such)", failures.len()))),
            None => Ok(()),
        }
    }

    /// Every running request's row read back through the device translation (mirror
    /// upload and translate kernel): each kernel id names the page the host tables name.
    pub(super) fn check_translation(&mut self) -> Result<(), Failure> {
        let longest = self.running.iter().map(|r| r.req.len()).max().unwrap_or(0);
        if longest == 0 {
            return Ok(());
        }
        let (ids, out) = self.tables_for(longest)?;
        let sync = HostSync::acquire("dst: reading kernel ids back");
        for i in 0..self.running.len() {
            let row: Vec<i32> = self.running[i]
                .req
                .row()
                .iter()
                .map(|t| t.0 as i32)
                .collect();
            for side in self.kv_sides() {
                self.dev
                    .upload_table(ids, 0, &row)
                    .map_err(|e| self.fail(format!("uploading ids: {e}")))?;
                self.cache
                    .translate(side, ids, row.len(), out, row.len())
                    .map_err(|e| self.fail(format!("translate {side:?}: {e}")))?;
                let kernel = self
                    .dev
                    .read_table(&sync, out, 0, row.len())
                    .map_err(|e| self.fail(format!("reading kernel ids: {e}")))?;
                let alloc = self.cache.allocator();
                for (pos, (&k, t)) in kernel.iter().zip(self.running[i].req.row()).enumerate() {
                    let host = alloc.kernel_id(side, *t);
                    if k != host {
                        return Err(self.fail(format!(
                            "request {} row {pos} on {side:?}: the device translated t{} to {k}, the host tables say {host}",
                            self.running[i].req.id(),
                            t.0
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    pub(super) fn tables_for(&mut self, n: usize) -> Result<(TableId, TableId), Failure> {
        if let Some((ids, out, len)) = self.tables
            && len >= n
        {
            return Ok((ids, out));
        }
        let len = n.next_power_of_two();
        let alloc = |s: &Sim| {
            s.dev
                .alloc_table(len, 0)
                .map_err(|e| s.fail(format!("a table: {e}")))
        };
        let (ids, out) = (alloc(self)?, alloc(self)?);
        self.tables = Some((ids, out, len));
        Ok((ids, out))
    }
}
