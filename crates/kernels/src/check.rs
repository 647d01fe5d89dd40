//! Host-side argument checks shared by every backend, and the scalar rules (translate,
//! gather, windows, row gathers) that the CPU backend applies and the CUDA kernels mirror.
//!
//! Every check here uses only host-known values (handles, lengths, offsets), so a
//! backend runs them all before issuing any work: an op that fails has changed nothing.

use crate::{
    ByteSpan, BytesId, Error, HostBytesId, HostCopy, LaneTranslate, RowGather, SpanMove, TableId,
    TableScatter, TableSpans, Translate, WindowTranslate,
};

/// `[start, start + len)` lies inside `[0, total)`; `kind`/`id` name the buffer.
fn range(
    op: &'static str,
    kind: &'static str,
    id: u32,
    start: u64,
    len: u64,
    total: u64,
) -> Result<(), Error> {
    match start.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        end => Err(Error::OutOfBounds {
            op,
            kind,
            id,
            start,
            end: end.unwrap_or(u64::MAX),
            len: total,
        }),
    }
}

/// `[offset, offset + len)` lies inside a byte buffer of `total` bytes.
pub(crate) fn bytes_range(
    op: &'static str,
    buf: BytesId,
    offset: u64,
    len: u64,
    total: u64,
) -> Result<(), Error> {
    range(op, "bytes", buf.0, offset, len, total)
}

/// `[offset, offset + len)` lies inside a table of `total` entries.
pub(crate) fn table_range(
    op: &'static str,
    table: TableId,
    offset: usize,
    len: usize,
    total: usize,
) -> Result<(), Error> {
    range(
        op,
        "table",
        table.0,
        offset as u64,
        len as u64,
        total as u64,
    )
}

/// `out` is neither of the tables an op reads (a parallel kernel must not write what it
/// reads).
pub(crate) fn distinct_output(
    op: &'static str,
    out: TableId,
    inputs: &[(&'static str, TableId)],
) -> Result<(), Error> {
    match inputs.iter().find(|(_, t)| *t == out) {
        Some((name, _)) => Err(Error::BadArguments {
            op,
            reason: format!("the output table {} is also the `{name}` input", out.0),
        }),
        None => Ok(()),
    }
}

/// Every index of a scatter is inside a table of `total` entries.
pub(crate) fn scatter(table: TableId, entries: &[(u32, i32)], total: usize) -> Result<(), Error> {
    // One pass without an early exit (a page-size-1 upload is millions of entries; a
    // search branches on each); only a failing scatter looks for its first offender.
    let Ok(limit) = u32::try_from(total) else {
        return Ok(()); // every `u32` index is inside
    };
    if !entries
        .iter()
        .fold(false, |over, &(i, _)| over | (i >= limit))
    {
        return Ok(());
    }
    match entries.iter().find(|(i, _)| *i as usize >= total) {
        Some(&(i, _)) => table_range("scatter_table", table, i as usize, 1, total),
        None => Ok(()),
    }
}

/// Every index of every scatter is inside its table, whose length `len` gives.
pub(crate) fn scatters(
    scatters: &[TableScatter<'_>],
    len: impl Fn(TableId) -> Result<usize, Error>,
) -> Result<(), Error> {
    scatters
        .iter()
        .try_for_each(|s| scatter(s.table, s.entries, len(s.table)?))
}

/// Every span of every copy lies inside its table, whose length `len` gives, and inside
/// its host values. O(spans), nothing per entry: the common case, every span inside, is
/// one branch-free pass per copy; only a refusal looks for the span to name.
pub(crate) fn table_spans(
    copies: &[TableSpans<'_>],
    len: impl Fn(TableId) -> Result<usize, Error>,
) -> Result<(), Error> {
    const OP: &str = "copy_table_spans";
    for c in copies {
        let total = len(c.table)? as u64;
        let bound = total.min(c.values.len() as u64);
        let end = |&(start, n): &(u32, u32)| u64::from(start) + u64::from(n);
        if c.spans.iter().map(end).fold(0, u64::max) <= bound {
            continue;
        }
        for &(start, n) in c.spans {
            let (start, n) = (u64::from(start), u64::from(n));
            range(OP, "table", c.table.0, start, n, total)?;
            range(
                OP,
                "host values",
                c.table.0,
                start,
                n,
                c.values.len() as u64,
            )?;
        }
    }
    Ok(())
}

/// Every translation's arguments (as [`translate`], with the table lengths `len` gives),
/// and no translation's output is another's input or output. Returns each one's
/// `(page_size, stride)`, in order, through `each`.
pub(crate) fn translates(
    all: &[Translate],
    len: impl Fn(TableId) -> Result<usize, Error>,
    mut each: impl FnMut(usize, (i32, i32)),
) -> Result<(), Error> {
    for (i, args) in all.iter().enumerate() {
        len(args.v2p)?;
        each(i, translate(args, len(args.ids)?, len(args.out)?)?);
        for (j, other) in all.iter().enumerate().filter(|&(j, _)| j != i) {
            if [other.v2p, other.ids, other.out].contains(&args.out) {
                return Err(Error::BadArguments {
                    op: "translate",
                    reason: format!(
                        "the output table {} of translation {i} is also a table of translation {j}",
                        args.out.0
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Every span is inside a buffer of `total` bytes.
pub(crate) fn fill(buf: BytesId, spans: &[ByteSpan], total: u64) -> Result<(), Error> {
    spans
        .iter()
        .try_for_each(|s| bytes_range("fill_spans", buf, s.offset, s.len, total))
}

/// A non-empty range of a move: (start, end, index of the move in the call).
type MoveRange = (u64, u64, usize);

/// The non-empty destination (`dst`) or source ranges of `moves`, in call order.
fn move_ranges(moves: &[SpanMove], dst: bool) -> impl Iterator<Item = MoveRange> + Clone + '_ {
    moves
        .iter()
        .enumerate()
        .filter(|(_, m)| m.len > 0)
        .map(move |(i, m)| {
            let start = if dst { m.dst } else { m.src };
            (start, start + m.len, i)
        })
}

/// Every source and destination is inside a buffer of `total` bytes, and no destination
/// overlaps another destination or any source (its own or another move's); empty moves
/// are ignored and sources may overlap each other. O(k log k) for `k` moves and nothing
/// per byte: two linear walks over the destinations and the sources in start order. The
/// pools emit both already in that order (each side's compaction ascends, SWA below
/// FULL), and then nothing is copied or allocated; otherwise both are sorted first.
pub(crate) fn moves(buf: BytesId, moves: &[SpanMove], total: u64) -> Result<(), Error> {
    for m in moves {
        bytes_range("move_spans", buf, m.src, m.len, total)?;
        bytes_range("move_spans", buf, m.dst, m.len, total)?;
    }
    // No overflow in the ends: checked just above.
    let in_order = |dst| move_ranges(moves, dst).is_sorted_by_key(|r| r.0);
    if in_order(true) && in_order(false) {
        return disjoint(buf, move_ranges(moves, true), move_ranges(moves, false));
    }
    let sorted = |dst| {
        let mut ranges: Vec<MoveRange> = move_ranges(moves, dst).collect();
        ranges.sort_by_key(|r| r.0);
        ranges
    };
    let (dsts, srcs) = (sorted(true), sorted(false));
    disjoint(buf, dsts.iter().copied(), srcs.iter().copied())
}

/// The overlap check of [`moves`] over destinations and sources in start order.
fn disjoint(
    buf: BytesId,
    dsts: impl Iterator<Item = MoveRange> + Clone,
    srcs: impl Iterator<Item = MoveRange>,
) -> Result<(), Error> {
    let overlap = |dst: MoveRange, other: MoveRange, other_kind| {
        Err(Error::OverlappingMoves {
            buf: buf.0,
            dst_move: dst.2,
            dst: dst.0..dst.1,
            other_move: other.2,
            other_kind,
            other: other.0..other.1,
        })
    };
    // In start order, two destinations overlap only if two neighbours do.
    let mut prev: Option<MoveRange> = None;
    for d in dsts.clone() {
        if let Some(p) = prev.filter(|p| d.0 < p.1) {
            return overlap(d, p, "destination");
        }
        prev = Some(d);
    }
    // The destinations are now disjoint, so their ends ascend too: for sources in start
    // order, the first destination ending after the source's start only moves forward,
    // and the source overlaps a destination exactly when that one starts before its end.
    let mut dsts = dsts.peekable();
    for s in srcs {
        while dsts.next_if(|d| d.1 <= s.0).is_some() {}
        match dsts.peek() {
            Some(&d) if d.0 < s.1 => return overlap(d, s, "source"),
            Some(_) => {}
            None => break,
        }
    }
    Ok(())
}

/// Which buffer a host-tier copy call writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyInto {
    /// The host buffer ([`Device::copy_device_to_host`](crate::Device::copy_device_to_host)).
    Host,
    /// The device byte buffer ([`Device::copy_host_to_device`](crate::Device::copy_host_to_device)).
    Device,
}

impl CopyInto {
    /// The op's name.
    pub(crate) const fn op(self) -> &'static str {
        match self {
            CopyInto::Host => "copy_device_to_host",
            CopyInto::Device => "copy_host_to_device",
        }
    }
}

/// `[offset, offset + len)` lies inside a host buffer of `total` bytes.
pub(crate) fn host_range(
    op: &'static str,
    host: HostBytesId,
    offset: u64,
    len: u64,
    total: u64,
) -> Result<(), Error> {
    range(op, "host bytes", host.0, offset, len, total)
}

/// A host-tier copy call's arguments: both handles are known (looked up by `buf_len` and
/// `host_len`, in the call's argument order: the source first), each copy's device range,
/// then its host range, lies inside its buffer (copy by copy, in call order), and no two
/// non-empty copies write overlapping ranges of the destination. O(k) when the
/// destinations ascend (the pools emit them so), O(k log k) otherwise; nothing per byte.
pub(crate) fn host_copies(
    into: CopyInto,
    buf: BytesId,
    host: HostBytesId,
    copies: &[HostCopy],
    buf_len: impl FnOnce(BytesId) -> Result<u64, Error>,
    host_len: impl FnOnce(HostBytesId) -> Result<u64, Error>,
) -> Result<(), Error> {
    let op = into.op();
    let (buf_len, host_len) = match into {
        CopyInto::Host => {
            let buf_len = buf_len(buf)?;
            (buf_len, host_len(host)?)
        }
        CopyInto::Device => {
            let host_len = host_len(host)?;
            (buf_len(buf)?, host_len)
        }
    };
    for c in copies {
        bytes_range(op, buf, c.device, c.len, buf_len)?;
        host_range(op, host, c.host, c.len, host_len)?;
    }
    // Non-empty destinations as (start, end, index); no overflow: checked just above.
    let destinations = copies
        .iter()
        .enumerate()
        .filter(|(_, c)| c.len > 0)
        .map(|(i, c)| {
            let start = match into {
                CopyInto::Host => c.host,
                CopyInto::Device => c.device,
            };
            (start, start + c.len, i)
        });
    let id = match into {
        CopyInto::Host => host.0,
        CopyInto::Device => buf.0,
    };
    let disjoint = |ranges: &mut dyn Iterator<Item = (u64, u64, usize)>| {
        // In start order, two ranges overlap only if two neighbours do.
        let mut prev: Option<(u64, u64, usize)> = None;
        for d in ranges {
            if let Some(p) = prev.filter(|p| d.0 < p.1) {
                return Err(Error::OverlappingCopies {
                    op,
                    id,
                    copy: d.2 as u32,
                    dst: d.0..d.1,
                    other_copy: p.2 as u32,
                    other: p.0..p.1,
                });
            }
            prev = Some(d);
        }
        Ok(())
    };
    if destinations.clone().is_sorted_by_key(|r| r.0) {
        return disjoint(&mut destinations.clone());
    }
    let mut sorted: Vec<(u64, u64, usize)> = destinations.collect();
    sorted.sort_by_key(|r| r.0);
    disjoint(&mut sorted.into_iter())
}

/// `gather_table`'s host-known arguments: `indices` and `out` hold `n` entries and `out`
/// is a table of its own.
pub(crate) fn gather(
    src: TableId,
    indices: (TableId, usize),
    n: usize,
    out: (TableId, usize),
) -> Result<(), Error> {
    distinct_output(
        "gather_table",
        out.0,
        &[("src", src), ("indices", indices.0)],
    )?;
    table_range("gather_table", indices.0, 0, n, indices.1)?;
    table_range("gather_table", out.0, 0, n, out.1)
}

/// The value `gather_table` writes for one index: `src[index]`, or `0` outside `src`.
pub(crate) fn gather_one(src: &[i32], index: i32) -> i32 {
    usize::try_from(index)
        .ok()
        .and_then(|i| src.get(i))
        .copied()
        .unwrap_or(0)
}

/// `translate`'s host-known arguments, given the lengths of `ids` and `out`.
/// Returns `(page_size, stride)` as the `i32`s the arithmetic uses.
pub(crate) fn translate(
    args: &Translate,
    ids_len: usize,
    out_len: usize,
) -> Result<(i32, i32), Error> {
    let bad = |reason: String| Error::BadArguments {
        op: "translate",
        reason,
    };
    distinct_output(
        "translate",
        args.out,
        &[("v2p", args.v2p), ("ids", args.ids)],
    )?;
    let (page_size, stride) = translation_scalars("translate", args.page_size, args.stride)?;
    if args.n > args.out_width {
        return Err(bad(format!(
            "n = {} is larger than out_width = {}",
            args.n, args.out_width
        )));
    }
    table_range("translate", args.ids, 0, args.n, ids_len)?;
    table_range("translate", args.out, 0, args.out_width, out_len)?;
    Ok((page_size, stride))
}

/// The kernel id of one virtual token id (see [`Translate`]): the sink (`0`) for
/// `id <= 0`, a page outside `v2p`, or a page that is unbound or tombstoned
/// (`v2p <= 0`); otherwise `v2p[page] * stride + offset` in wrapping `i32` arithmetic.
pub(crate) fn translate_one(v2p: &[i32], id: i32, page_size: i32, stride: i32) -> i32 {
    if id <= 0 {
        return 0;
    }
    match v2p.get((id / page_size) as usize) {
        Some(&phys) if phys > 0 => phys.wrapping_mul(stride).wrapping_add(id % page_size),
        _ => 0,
    }
}

/// `page_size` and `stride` as the `i32`s the translation arithmetic uses.
fn translation_scalars(op: &'static str, page_size: u32, stride: u32) -> Result<(i32, i32), Error> {
    let bad = |reason: String| Error::BadArguments { op, reason };
    let page_size = i32::try_from(page_size)
        .ok()
        .filter(|&ps| ps > 0)
        .ok_or_else(|| bad(format!("page size {page_size} is not in 1..=i32::MAX")))?;
    let stride =
        i32::try_from(stride).map_err(|_| bad(format!("stride {stride} does not fit in i32")))?;
    Ok((page_size, stride))
}

/// `count × each` entries, or a refusal naming the product that overflows.
fn entries(op: &'static str, count: usize, each: usize) -> Result<usize, Error> {
    count.checked_mul(each).ok_or_else(|| Error::BadArguments {
        op,
        reason: format!("{count} × {each} entries overflow"),
    })
}

/// Every window's arguments (see [`WindowTranslate`]), with the table lengths `len`
/// gives: its tables are long enough, no output is an input table of the call, and no
/// two outputs overlap. Returns each one's `(page_size, stride)`, in order.
pub(crate) fn windows(
    all: &[WindowTranslate],
    len: impl Fn(TableId) -> Result<usize, Error>,
) -> Result<Vec<(i32, i32)>, Error> {
    const OP: &str = "translate_windows";
    let mut scalars = Vec::with_capacity(all.len());
    for w in all {
        len(w.v2p)?;
        scalars.push(translation_scalars(OP, w.page_size, w.stride)?);
        table_range(
            OP,
            w.ids,
            w.ids_at,
            entries(OP, w.batch, w.rows)?,
            len(w.ids)?,
        )?;
        table_range(OP, w.starts, w.starts_at, w.batch, len(w.starts)?)?;
        if let Some((lens, at)) = w.lens {
            table_range(OP, lens, at, w.batch, len(lens)?)?;
        }
        table_range(
            OP,
            w.out,
            w.out_at,
            entries(OP, w.batch, w.width)?,
            len(w.out)?,
        )?;
    }
    let out = |w: &WindowTranslate| (w.out_at, w.out_at + w.batch * w.width); // checked above
    for (i, w) in all.iter().enumerate() {
        for (j, other) in all.iter().enumerate() {
            let lens = other.lens.map(|(t, _)| ("lens", t));
            let input = [
                ("v2p", other.v2p),
                ("ids", other.ids),
                ("starts", other.starts),
            ];
            if let Some((name, _)) = input.iter().chain(&lens).find(|(_, t)| *t == w.out) {
                return Err(Error::BadArguments {
                    op: OP,
                    reason: format!(
                        "the output table {} of window {i} is the `{name}` input of window {j}",
                        w.out.0
                    ),
                });
            }
            let (a, b) = (out(w), out(other));
            if j > i && w.out == other.out && a.0 < a.1 && b.0 < b.1 && a.0 < b.1 && b.0 < a.1 {
                return Err(Error::BadArguments {
                    op: OP,
                    reason: format!(
                        "the outputs of windows {i} ({}..{}) and {j} ({}..{}) overlap in table {}",
                        a.0, a.1, b.0, b.1, w.out.0
                    ),
                });
            }
        }
    }
    Ok(scalars)
}

/// The kernel id a window writes at `j` for one request (see [`WindowTranslate`]): the
/// translation of `row[start + bias + j]`, or the sink when that is outside `row` or `j`
/// is at or past the request's live length `len`.
pub(crate) fn window_one(
    v2p: &[i32],
    row: &[i32],
    start: i32,
    bias: i32,
    len: i32,
    j: usize,
    (page_size, stride): (i32, i32),
) -> i32 {
    if j as i64 >= i64::from(len) {
        return 0;
    }
    let s = i64::from(start) + i64::from(bias) + j as i64;
    usize::try_from(s)
        .ok()
        .and_then(|s| row.get(s))
        .map_or(0, |&id| translate_one(v2p, id, page_size, stride))
}

/// Every lane translation's arguments (see [`LaneTranslate`]), with the table lengths
/// `len` gives: its tables are long enough, `v2p` and `rows` are not an output table, and
/// no output range overlaps an input range of the call or another output. Returns each
/// one's stride as the `i32` the arithmetic uses, in order.
pub(crate) fn lanes(
    all: &[LaneTranslate],
    len: impl Fn(TableId) -> Result<usize, Error>,
) -> Result<Vec<i32>, Error> {
    const OP: &str = "translate_lanes";
    let mut strides = Vec::with_capacity(all.len());
    for t in all {
        len(t.v2p)?;
        if t.lane_len == 0 {
            return Err(Error::BadArguments {
                op: OP,
                reason: "lanes of 0 entries".to_string(),
            });
        }
        len(t.rows)?;
        strides.push(translation_scalars(OP, 1, t.stride)?.1);
        table_range(OP, t.lanes.0, t.lanes.1, t.batch, len(t.lanes.0)?)?;
        if let Some((firsts, at)) = t.firsts {
            table_range(OP, firsts, at, t.batch, len(firsts)?)?;
        }
        let starts = t.batch.checked_add(1).ok_or_else(|| Error::BadArguments {
            op: OP,
            reason: format!("a batch of {} overflows", t.batch),
        })?;
        table_range(OP, t.starts.0, t.starts.1, starts, len(t.starts.0)?)?;
        table_range(OP, t.out, t.out_at, t.out_len, len(t.out)?)?;
    }
    // Ranges are checked inside their tables above, so the ends cannot overflow.
    let overlaps = |a: (TableId, usize, usize), b: (TableId, usize, usize)| {
        a.0 == b.0 && a.1 < a.1 + a.2 && b.1 < b.1 + b.2 && a.1 < b.1 + b.2 && b.1 < a.1 + a.2
    };
    for (i, t) in all.iter().enumerate() {
        let out = (t.out, t.out_at, t.out_len);
        for (j, other) in all.iter().enumerate() {
            if let Some(name) = [("v2p", other.v2p), ("rows", other.rows)]
                .iter()
                .find(|(_, table)| *table == t.out)
                .map(|(name, _)| name)
            {
                return Err(Error::BadArguments {
                    op: OP,
                    reason: format!(
                        "the output table {} of translation {i} is the `{name}` input of translation {j}",
                        t.out.0
                    ),
                });
            }
            let inputs = [
                Some(("lanes", (other.lanes.0, other.lanes.1, other.batch))),
                other.firsts.map(|(f, at)| ("firsts", (f, at, other.batch))),
                Some(("starts", (other.starts.0, other.starts.1, other.batch + 1))),
            ];
            if let Some((name, _)) = inputs.iter().flatten().find(|(_, r)| overlaps(out, *r)) {
                return Err(Error::BadArguments {
                    op: OP,
                    reason: format!(
                        "the output of translation {i} overlaps the `{name}` input of translation {j}"
                    ),
                });
            }
            if j > i && overlaps(out, (other.out, other.out_at, other.out_len)) {
                return Err(Error::BadArguments {
                    op: OP,
                    reason: format!("the outputs of translations {i} and {j} overlap"),
                });
            }
        }
    }
    Ok(strides)
}

/// One request's run of a lane translation (see [`LaneTranslate`]) into `out`, the
/// translation's output (`out_len` entries from `out_at`): lane `lane`, first entry
/// `first`, output range `start..end` (device values). Writes every output index of the
/// run inside `out`, and only those: the work is bounded by the output, whatever the
/// device values.
pub(crate) fn lane_run(
    lane_len: usize,
    stride: i32,
    v2p: &[i32],
    rows: &[i32],
    (lane, first, start, end): (i32, i32, i32, i32),
    out: &mut [i32],
) {
    let (first, start, end) = (i64::from(first), i64::from(start), i64::from(end));
    let out_len = out.len() as i64;
    // The run's `j` whose output `start + j` is inside `out`.
    let from = (-start).max(0);
    let to = (end - start).min(out_len - start);
    if from >= to {
        return;
    }
    // Of those, the `j` whose entry `first + j` is inside the lane.
    let lane_len_i = lane_len as i64;
    let in_lo = (-first).max(from).min(to);
    let in_hi = (lane_len_i - first).min(to).max(in_lo);
    let at = |j: i64| (start + j) as usize; // inside `out` for from <= j <= to
    out[at(from)..at(in_lo)].fill(0);
    out[at(in_hi)..at(to)].fill(0);
    let window = &mut out[at(in_lo)..at(in_hi)];
    let lanes = rows.len() / lane_len;
    match usize::try_from(lane).ok().filter(|&l| l < lanes) {
        // Non-empty: `first + in_lo` is then inside the lane.
        Some(l) if !window.is_empty() => {
            let src = &rows[l * lane_len + (first + in_lo) as usize..][..window.len()];
            for (o, &page) in window.iter_mut().zip(src) {
                // `translate_one` at page size 1, without its division.
                *o = match usize::try_from(page).ok().and_then(|p| v2p.get(p)) {
                    Some(&phys) if page > 0 && phys > 0 => phys.wrapping_mul(stride),
                    _ => 0,
                };
            }
        }
        _ => window.fill(0),
    }
}

/// `gather_rows`' host-known arguments (see [`RowGather`]), given the lengths of `ids`
/// and `path`.
pub(crate) fn row_gather(args: &RowGather, ids_len: usize, path_len: usize) -> Result<(), Error> {
    const OP: &str = "gather_rows";
    if args.page_size == 0 {
        return Err(Error::BadArguments {
            op: OP,
            reason: "page size 0".to_string(),
        });
    }
    // The highest row offset a kernel id may name: exact in u64, so no kernel wraps.
    let highest = (u64::from(args.rows_per_token) * u64::from(args.page_size))
        .checked_add(1 << 31)
        .and_then(|rows| rows.checked_mul(args.row_bytes));
    if highest.is_none() {
        return Err(Error::BadArguments {
            op: OP,
            reason: format!(
                "{} rows of {} bytes, {} tokens per page: a row's offset overflows u64",
                args.rows_per_token, args.row_bytes, args.page_size
            ),
        });
    }
    let n = entries(OP, args.batch, args.width)?;
    table_range(OP, args.ids, args.ids_at, n, ids_len)?;
    table_range(OP, args.path, args.path_at, n, path_len)
}

/// Every gather of a call (as [`row_gather`]), with the lengths `bytes` and `table` give.
pub(crate) fn row_gathers(
    all: &[RowGather],
    bytes: impl Fn(BytesId) -> Result<u64, Error>,
    table: impl Fn(TableId) -> Result<usize, Error>,
) -> Result<(), Error> {
    all.iter().try_for_each(|g| {
        bytes(g.buf)?;
        row_gather(g, table(g.ids)?, table(g.path)?)
    })
}

/// Where a token's rows lie (the geometry of a [`RowGather`]): row `l < per_token` of
/// kernel id `k` is the `row_bytes` bytes at `(k + l × page_size) × row_bytes`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenRows {
    pub(crate) page_size: u64,
    pub(crate) per_token: u64,
    pub(crate) row_bytes: u64,
}

impl From<&RowGather> for TokenRows {
    fn from(args: &RowGather) -> TokenRows {
        TokenRows {
            page_size: u64::from(args.page_size),
            per_token: u64::from(args.rows_per_token),
            row_bytes: args.row_bytes,
        }
    }
}

/// One request's copies of a [`RowGather`], in the order they must run: `(src, dst, len)`
/// byte ranges of a buffer of `total` bytes, given its `width` kernel ids and path.
pub(crate) fn gathered_rows(
    rows: TokenRows,
    ids: &[i32],
    path: &[i32],
    total: u64,
    mut copy: impl FnMut(u64, u64, u64),
) {
    let row = |id: i32, l: u64| {
        let at = (id as u64 + l * rows.page_size) * rows.row_bytes;
        Some(at).filter(|at| at + rows.row_bytes <= total)
    };
    for (i, &p) in path.iter().enumerate() {
        let Some(&src) = usize::try_from(p).ok().and_then(|p| ids.get(p)) else {
            break;
        };
        let dst = ids[i];
        if dst == src || dst <= 0 || src <= 0 {
            continue;
        }
        for l in 0..rows.per_token {
            if let (Some(s), Some(d)) = (row(src, l), row(dst, l)) {
                copy(s, d, rows.row_bytes);
            }
        }
    }
}
