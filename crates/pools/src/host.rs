//! The host tier's pool: one host buffer (pinned on CUDA, plain memory on the CPU
//! backend; the device layer owns the memory, this is its bookkeeping) holding FULL pages,
//! SWA pages and recurrent states, split by what the workload demotes.
//!
//! **Layout: page-first frames.** The buffer is cut into equal *frames*, each as large as
//! the largest unit (a recurrent state, or a page of every FULL layer, or of every SWA
//! layer). A frame is lent to one kind on demand and cut into as many units of that kind
//! as fit; it returns to the free frames when its last unit is freed. A unit holds every
//! layer of its page contiguously (SGLang HiCache's `page_first`), so one page moves in
//! one copy of `page_bytes`, and units taken together from one frame are adjacent, so a
//! node's pages merge into runs of up to a frame ([`HostPool::runs`]): vLLM's offloading
//! connector found 0.5–2 MB transfers 4–5× faster than per-layer blocks of 8–72 KB.
//! Units of different sizes never share a frame, so frees leave no gap another kind
//! cannot use once the frame empties; the cost is a partly used frame per kind.
//!
//! Every call is all or nothing: a refused allocation or free changes nothing. The
//! pool's conservation ([`HostPool::conservation`]) holds after every call.

use crate::error::Error;
use std::collections::BTreeSet;

/// What a host unit holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HostKind {
    /// One page of FULL KV, every FULL layer.
    Full,
    /// One page of SWA KV, every SWA layer.
    Swa,
    /// One recurrent state (every recurrent layer's).
    State,
}

impl HostKind {
    /// Every kind, in index order.
    pub const ALL: [HostKind; 3] = [HostKind::Full, HostKind::Swa, HostKind::State];

    const fn index(self) -> usize {
        match self {
            HostKind::Full => 0,
            HostKind::Swa => 1,
            HostKind::State => 2,
        }
    }

    /// `full`, `swa` or `state`.
    pub const fn as_str(self) -> &'static str {
        match self {
            HostKind::Full => "full",
            HostKind::Swa => "swa",
            HostKind::State => "state",
        }
    }
}

impl std::fmt::Display for HostKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The sizes a host pool is built from. A unit size of 0 leaves that kind out (a model
/// without SWA, or without recurrent state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostPoolSpec {
    /// Bytes of the host buffer.
    pub total_bytes: u64,
    /// Bytes of one FULL page across every FULL layer.
    pub full_page_bytes: u64,
    /// Bytes of one SWA page across every SWA layer.
    pub swa_page_bytes: u64,
    /// Bytes of one recurrent state.
    pub state_bytes: u64,
}

impl HostPoolSpec {
    /// The unit size of `kind` (0: absent).
    pub const fn unit_bytes(&self, kind: HostKind) -> u64 {
        match kind {
            HostKind::Full => self.full_page_bytes,
            HostKind::Swa => self.swa_page_bytes,
            HostKind::State => self.state_bytes,
        }
    }
}

/// One unit of the host pool: `index` within frame `frame`. Its bytes are
/// [`HostPool::offset`] .. + [`HostPool::unit_bytes`] of its kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostBlock {
    /// The frame it lies in.
    pub frame: u32,
    /// Its index among its frame's units.
    pub index: u32,
}

/// A contiguous byte range of the host buffer: one copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRun {
    /// First byte.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

#[derive(Clone, Debug, Default)]
struct Frame {
    /// The kind it is lent to (`None`: free).
    kind: Option<HostKind>,
    /// Its units in use, one flag each (empty while free).
    used: Vec<bool>,
    /// How many of `used` are set.
    held: u32,
}

/// The host pool's bookkeeping: which units of which frames hold what.
#[derive(Clone, Debug)]
pub struct HostPool {
    spec: HostPoolSpec,
    frame_bytes: u64,
    frames: Vec<Frame>,
    /// Free frames, lowest lent first.
    free_frames: BTreeSet<u32>,
    /// Per kind, the frames lent to it with a unit free, lowest filled first.
    partial: [BTreeSet<u32>; 3],
    /// Per kind, the free units of the frames lent to it.
    spare: [u64; 3],
    /// Units held per kind.
    held: [u64; 3],
}

impl HostPool {
    /// A pool for `spec`: frames as large as its largest unit (8-byte aligned), as many
    /// as the buffer holds. A spec without any unit, or a buffer smaller than one frame,
    /// or more frames than `u32` counts, is [`Error::BadConfig`].
    pub fn new(spec: HostPoolSpec) -> Result<HostPool, Error> {
        let largest = HostKind::ALL
            .iter()
            .map(|&k| spec.unit_bytes(k))
            .max()
            .unwrap_or(0);
        if largest == 0 {
            return Err(Error::BadConfig(
                "a host pool needs at least one unit size above 0".into(),
            ));
        }
        let frame_bytes = largest.div_ceil(8) * 8;
        let count = spec.total_bytes / frame_bytes;
        if count == 0 {
            return Err(Error::BadConfig(format!(
                "a host pool of {} bytes holds no frame of {frame_bytes} bytes",
                spec.total_bytes
            )));
        }
        let count = u32::try_from(count)
            .map_err(|_| Error::BadConfig(format!("{count} host frames do not fit u32 ids")))?;
        Ok(HostPool {
            spec,
            frame_bytes,
            frames: vec![Frame::default(); count as usize],
            free_frames: (0..count).collect(),
            partial: Default::default(),
            spare: [0; 3],
            held: [0; 3],
        })
    }

    /// The spec it was built from.
    pub fn spec(&self) -> HostPoolSpec {
        self.spec
    }

    /// Bytes of one frame.
    pub fn frame_bytes(&self) -> u64 {
        self.frame_bytes
    }

    /// Frames of the buffer.
    pub fn frame_count(&self) -> u32 {
        self.frames.len() as u32
    }

    /// Bytes of one unit of `kind` (0: absent).
    pub fn unit_bytes(&self, kind: HostKind) -> u64 {
        self.spec.unit_bytes(kind)
    }

    /// Units of `kind` one frame holds (0: absent).
    pub fn units_per_frame(&self, kind: HostKind) -> u32 {
        match self.unit_bytes(kind) {
            0 => 0,
            b => (self.frame_bytes / b) as u32,
        }
    }

    /// Units of `kind` in use.
    pub fn held(&self, kind: HostKind) -> u64 {
        self.held[kind.index()]
    }

    /// Bytes of `kind` in use.
    pub fn held_bytes(&self, kind: HostKind) -> u64 {
        self.held(kind) * self.unit_bytes(kind)
    }

    /// Frames no kind holds.
    pub fn free_frames(&self) -> u32 {
        self.free_frames.len() as u32
    }

    /// Units of `kind` an allocation can take now: the free units of the frames lent to
    /// it and every free frame's worth.
    pub fn available(&self, kind: HostKind) -> u64 {
        let per = u64::from(self.units_per_frame(kind));
        if per == 0 {
            return 0;
        }
        self.spare[kind.index()] + u64::from(self.free_frames()) * per
    }

    /// Whether allocations of `need[k]` units of kind [`HostKind::ALL`]`[k]` all fit
    /// together: kinds share the free frames, so each may fit alone and not all three.
    pub fn fits(&self, need: [u64; 3]) -> bool {
        let mut frames = 0u64;
        for (k, kind) in HostKind::ALL.iter().enumerate() {
            if need[k] == 0 {
                continue;
            }
            let per = u64::from(self.units_per_frame(*kind));
            if per == 0 {
                return false;
            }
            frames += need[k].saturating_sub(self.spare[k]).div_ceil(per);
        }
        frames <= u64::from(self.free_frames())
    }

    /// `block`'s number among every unit of `kind` the buffer could hold (`frame ×
    /// units per frame + index`): an id that fits a `u32` value of a tree.
    pub fn unit_id(&self, kind: HostKind, block: HostBlock) -> u32 {
        block.frame * self.units_per_frame(kind) + block.index
    }

    /// The block [`HostPool::unit_id`] numbered `id` (`None` for a kind the pool leaves
    /// out or an id past the buffer).
    pub fn block_of(&self, kind: HostKind, id: u32) -> Option<HostBlock> {
        let per = self.units_per_frame(kind);
        (per > 0 && id / per < self.frame_count()).then(|| HostBlock {
            frame: id / per,
            index: id % per,
        })
    }

    /// The buffer's geometry, to place units by id without the pool.
    pub fn geometry(&self) -> HostGeometry {
        HostGeometry {
            frame_bytes: self.frame_bytes,
            units_per_frame: HostKind::ALL.map(|k| self.units_per_frame(k)),
            unit_bytes: HostKind::ALL.map(|k| self.unit_bytes(k)),
        }
    }

    /// The first byte of `block` (of `kind`).
    pub fn offset(&self, kind: HostKind, block: HostBlock) -> u64 {
        u64::from(block.frame) * self.frame_bytes + u64::from(block.index) * self.unit_bytes(kind)
    }

    /// Takes `n` units of `kind` into `out` (appended), filling the frames already lent to
    /// `kind` first, lowest frame and index first, so that units taken together are
    /// adjacent. [`Error::HostFull`] when fewer than `n` are available (nothing taken),
    /// [`Error::BadConfig`] for a kind the pool leaves out.
    pub fn alloc(
        &mut self,
        kind: HostKind,
        n: usize,
        out: &mut Vec<HostBlock>,
    ) -> Result<(), Error> {
        let per = self.units_per_frame(kind);
        if per == 0 {
            return Err(Error::BadConfig(format!(
                "the host pool holds no {kind} units"
            )));
        }
        let available = self.available(kind);
        if (n as u64) > available {
            return Err(Error::HostFull {
                kind: kind.as_str(),
                requested: n as u64,
                available,
            });
        }
        let k = kind.index();
        let mut left = n;
        while left > 0 {
            let f = match self.partial[k].first() {
                Some(&f) => f,
                None => {
                    let f = self
                        .free_frames
                        .pop_first()
                        .expect("available counted the free frames");
                    self.frames[f as usize] = Frame {
                        kind: Some(kind),
                        used: vec![false; per as usize],
                        held: 0,
                    };
                    self.partial[k].insert(f);
                    self.spare[k] += u64::from(per);
                    f
                }
            };
            let taken = self.take(f, left, out);
            left -= taken;
            self.spare[k] -= taken as u64;
            if self.frames[f as usize].held == per {
                self.partial[k].remove(&f);
            }
        }
        self.held[k] += n as u64;
        Ok(())
    }

    /// Takes up to `want` free units of frame `f` into `out`, lowest index first; returns
    /// how many it took.
    fn take(&mut self, f: u32, want: usize, out: &mut Vec<HostBlock>) -> usize {
        let frame = &mut self.frames[f as usize];
        let mut taken = 0;
        for (i, used) in frame.used.iter_mut().enumerate() {
            if taken == want {
                break;
            }
            if !*used {
                *used = true;
                taken += 1;
                out.push(HostBlock {
                    frame: f,
                    index: i as u32,
                });
            }
        }
        frame.held += taken as u32;
        taken
    }

    /// Frees `blocks` of `kind`; a frame whose last unit goes is free again. Every block
    /// is checked first: one outside the pool, of a frame lent to another kind, not in
    /// use, or named twice is [`Error::HostBadFree`] and nothing is freed.
    pub fn free(&mut self, kind: HostKind, blocks: &[HostBlock]) -> Result<(), Error> {
        let mut seen = std::collections::HashSet::with_capacity(blocks.len());
        for &b in blocks {
            let frame = self.frames.get(b.frame as usize);
            let live = frame.is_some_and(|f| {
                f.kind == Some(kind) && f.used.get(b.index as usize).copied().unwrap_or(false)
            });
            if !live || !seen.insert(b) {
                return Err(Error::HostBadFree {
                    kind: kind.as_str(),
                    frame: b.frame,
                    index: b.index,
                });
            }
        }
        let (k, per) = (kind.index(), u64::from(self.units_per_frame(kind)));
        for &b in blocks {
            let frame = &mut self.frames[b.frame as usize];
            frame.used[b.index as usize] = false;
            frame.held -= 1;
            self.spare[k] += 1;
            if frame.held == 0 {
                *frame = Frame::default();
                self.partial[k].remove(&b.frame);
                self.spare[k] -= per;
                self.free_frames.insert(b.frame);
            } else {
                self.partial[k].insert(b.frame);
            }
        }
        self.held[k] -= blocks.len() as u64;
        Ok(())
    }

    /// The copies that move `blocks` of `kind`, in order: adjacent units merge into one
    /// run (never across frames' ends that are not adjacent in the buffer).
    pub fn runs(&self, kind: HostKind, blocks: &[HostBlock]) -> Vec<HostRun> {
        let len = self.unit_bytes(kind);
        let mut runs: Vec<HostRun> = Vec::new();
        for &b in blocks {
            let offset = self.offset(kind, b);
            match runs.last_mut() {
                Some(r) if r.offset + r.len == offset => r.len += len,
                _ => runs.push(HostRun { offset, len }),
            }
        }
        runs
    }

    /// The pool's conservation: every frame is free (no unit in use) or lent to a kind the
    /// pool holds with its flags counted right and at least one unit in use; the free set
    /// names exactly the free frames; per kind, the partly used frames, their free units
    /// and the units in use are what the frames hold. O(frames); `Err` names the first
    /// breach.
    pub fn conservation(&self) -> Result<(), String> {
        let mut held = [0u64; 3];
        let mut spare = [0u64; 3];
        let mut partial: [BTreeSet<u32>; 3] = Default::default();
        let mut free = BTreeSet::new();
        for (i, f) in self.frames.iter().enumerate() {
            let set = f.used.iter().filter(|&&u| u).count() as u32;
            match f.kind {
                None => {
                    if !f.used.is_empty() || f.held != 0 {
                        return Err(format!("host frame {i} is free but holds units"));
                    }
                    free.insert(i as u32);
                }
                Some(kind) => {
                    if f.used.len() as u32 != self.units_per_frame(kind) {
                        return Err(format!("host frame {i} ({kind}) has the wrong unit count"));
                    }
                    if set != f.held || set == 0 {
                        return Err(format!(
                            "host frame {i} ({kind}) counts {} units in use, its flags {set}",
                            f.held
                        ));
                    }
                    held[kind.index()] += u64::from(set);
                    let left = f.used.len() as u64 - u64::from(set);
                    spare[kind.index()] += left;
                    if left > 0 {
                        partial[kind.index()].insert(i as u32);
                    }
                }
            }
        }
        if free != self.free_frames {
            return Err(format!(
                "the host free-frame set names {} frames, {} are free",
                self.free_frames.len(),
                free.len()
            ));
        }
        if partial != self.partial || spare != self.spare {
            return Err("the host pool's partly used frames are not the recorded ones".into());
        }
        if held != self.held {
            return Err(format!(
                "host units in use recorded {:?}, the frames hold {held:?}",
                self.held
            ));
        }
        Ok(())
    }
}

/// Byte geometry of a host buffer: unit `u` of a kind lies in frame
/// `u / units_per_frame`, at index `u % units_per_frame` (kinds in [`HostKind::ALL`]
/// order: FULL pages, SWA pages, states), as [`HostPool::unit_id`] numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostGeometry {
    /// Bytes of one frame.
    pub frame_bytes: u64,
    /// Units of each kind a frame holds (0 for a kind the buffer leaves out).
    pub units_per_frame: [u32; 3],
    /// Bytes of one unit of each kind.
    pub unit_bytes: [u64; 3],
}

impl HostGeometry {
    /// Byte offset of unit `unit` of `kind` (`None` for a kind the buffer leaves out);
    /// the same as [`HostPool::offset`] of the block [`HostPool::block_of`] gives.
    pub fn offset(&self, kind: HostKind, unit: u32) -> Option<u64> {
        let k = kind as usize;
        let per = self.units_per_frame[k];
        (per > 0).then(|| {
            u64::from(unit / per) * self.frame_bytes + u64::from(unit % per) * self.unit_bytes[k]
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(total: u64) -> HostPool {
        HostPool::new(HostPoolSpec {
            total_bytes: total,
            full_page_bytes: 100,
            swa_page_bytes: 40,
            state_bytes: 400,
        })
        .unwrap()
    }

    /// The geometry places every unit id where the pool's own offset does.
    #[test]
    fn the_geometry_places_each_unit_where_the_pool_does() {
        let p = pool(10_000);
        let g = p.geometry();
        for kind in HostKind::ALL {
            let per = p.units_per_frame(kind);
            for id in 0..per * p.frame_count() {
                let block = p.block_of(kind, id).unwrap();
                assert_eq!(
                    g.offset(kind, id),
                    Some(p.offset(kind, block)),
                    "{kind:?} {id}"
                );
            }
        }
        let no_swa = HostPool::new(HostPoolSpec {
            total_bytes: 10_000,
            full_page_bytes: 100,
            swa_page_bytes: 0,
            state_bytes: 0,
        })
        .unwrap();
        assert_eq!(no_swa.geometry().offset(HostKind::Swa, 0), None);
    }

    #[test]
    fn frames_are_as_large_as_the_largest_unit_and_each_kind_packs_its_own() {
        let p = pool(4_000);
        assert_eq!((p.frame_bytes(), p.frame_count()), (400, 10));
        assert_eq!(
            HostKind::ALL.map(|k| p.units_per_frame(k)),
            [4, 10, 1],
            "full, swa, state"
        );
        assert_eq!(HostKind::ALL.map(|k| p.available(k)), [40, 100, 10]);
        // Alone each fits; together they need more frames than there are.
        assert!(p.fits([40, 0, 0]) && p.fits([0, 0, 10]) && !p.fits([4, 0, 10]));
        assert!(p.fits([4, 10, 8]) && !p.fits([1, 0, 0].map(|_| 41)));
        let b = HostBlock { frame: 3, index: 2 };
        assert_eq!(p.unit_id(HostKind::Full, b), 14);
        assert_eq!(p.block_of(HostKind::Full, 14), Some(b));
        assert_eq!(p.block_of(HostKind::Full, 40), None);
        assert_eq!(
            p.block_of(HostKind::State, 9),
            Some(HostBlock { frame: 9, index: 0 })
        );
    }

    #[test]
    fn units_taken_together_are_adjacent_and_merge_into_runs() {
        let mut p = pool(4_000);
        let mut full = Vec::new();
        p.alloc(HostKind::Full, 6, &mut full).unwrap();
        // Frames 0 and 1 are adjacent in the buffer: one run of 600 bytes.
        assert_eq!(
            p.runs(HostKind::Full, &full),
            [HostRun {
                offset: 0,
                len: 600
            }]
        );
        let mut state = Vec::new();
        p.alloc(HostKind::State, 1, &mut state).unwrap();
        assert_eq!(p.offset(HostKind::State, state[0]), 800);
        // The FULL frame 1 has two units left: taken before a new frame.
        let mut more = Vec::new();
        p.alloc(HostKind::Full, 3, &mut more).unwrap();
        assert_eq!(
            p.runs(HostKind::Full, &more),
            [
                HostRun {
                    offset: 600,
                    len: 200
                },
                HostRun {
                    offset: 1_200,
                    len: 100
                }
            ]
        );
        p.conservation().unwrap();
    }

    #[test]
    fn a_refused_call_changes_nothing() {
        let mut p = pool(800);
        let mut blocks = Vec::new();
        p.alloc(HostKind::State, 1, &mut blocks).unwrap();
        let before = format!("{p:?}");
        let mut none = Vec::new();
        assert!(matches!(
            p.alloc(HostKind::Full, 5, &mut none),
            Err(Error::HostFull {
                kind: "full",
                requested: 5,
                available: 4
            })
        ));
        assert!(none.is_empty());
        let stale = HostBlock { frame: 1, index: 0 };
        for bad in [
            vec![blocks[0], blocks[0]],
            vec![stale],
            vec![HostBlock { frame: 9, index: 0 }],
        ] {
            assert!(matches!(
                p.free(HostKind::State, &bad),
                Err(Error::HostBadFree { .. })
            ));
        }
        // The right block, the wrong kind.
        assert!(matches!(
            p.free(HostKind::Full, &blocks),
            Err(Error::HostBadFree { .. })
        ));
        assert_eq!(format!("{p:?}"), before);
        p.free(HostKind::State, &blocks).unwrap();
        assert_eq!((p.free_frames(), p.held(HostKind::State)), (2, 0));
        p.conservation().unwrap();
    }

    #[test]
    fn an_emptied_frame_goes_back_to_every_kind() {
        let mut p = pool(400);
        let mut swa = Vec::new();
        p.alloc(HostKind::Swa, 10, &mut swa).unwrap();
        assert_eq!(p.available(HostKind::State), 0);
        p.free(HostKind::Swa, &swa[..9]).unwrap();
        assert_eq!(
            p.available(HostKind::State),
            0,
            "one SWA unit keeps the frame"
        );
        p.free(HostKind::Swa, &swa[9..]).unwrap();
        assert_eq!(p.available(HostKind::State), 1);
        p.conservation().unwrap();
    }

    #[test]
    fn a_pool_without_units_or_room_is_refused_and_an_absent_kind_is_a_typed_error() {
        let none = HostPoolSpec {
            total_bytes: 1 << 20,
            full_page_bytes: 0,
            swa_page_bytes: 0,
            state_bytes: 0,
        };
        assert!(matches!(HostPool::new(none), Err(Error::BadConfig(_))));
        let small = HostPoolSpec {
            total_bytes: 7,
            full_page_bytes: 8,
            ..none
        };
        assert!(matches!(HostPool::new(small), Err(Error::BadConfig(_))));
        let mut full_only = HostPool::new(HostPoolSpec {
            total_bytes: 64,
            full_page_bytes: 8,
            ..none
        })
        .unwrap();
        assert!(matches!(
            full_only.alloc(HostKind::State, 1, &mut Vec::new()),
            Err(Error::BadConfig(_))
        ));
        assert_eq!(full_only.available(HostKind::State), 0);
    }
}
