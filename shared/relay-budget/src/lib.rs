//! What one input costs in memory, measured: a counting global allocator,
//! the decoders relay runs on what it takes from outside ([`targets`]), and
//! the check of the budget [`relay_core::limits`] states: at most
//! [`MEMORY_PER_WIRE_BYTE`] bytes held per byte on the wire, plus
//! [`MEMORY_PER_INPUT`].
//!
//! A test binary or fuzz target installs [`Counting`] as its global
//! allocator, then measures each input with [`peak_during`]. Counts are per
//! thread, so tests running in parallel threads do not see each other's
//! allocations; a measured section must not hand work to another thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use relay_core::limits::{MEMORY_PER_INPUT, MEMORY_PER_WIRE_BYTE};

pub mod targets;

/// The system allocator, counting the bytes each thread holds and the most
/// it held since [`peak_during`] began.
pub struct Counting;

thread_local! {
    /// Bytes allocated by this thread and not yet freed (a block freed by
    /// another thread than the one that allocated it moves the count of the
    /// thread that frees it).
    static HELD: Cell<isize> = const { Cell::new(0) };
    /// The most `HELD` has been since the last reset.
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn grew(by: usize) {
    // `try_with`: an allocation while the thread's locals are torn down is
    // not counted. Const-initialized `Cell`s allocate nothing themselves.
    let _ = HELD.try_with(|held| {
        let now = held.get().saturating_add(isize::try_from(by).unwrap_or(isize::MAX));
        held.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

fn shrank(by: usize) {
    let _ = HELD.try_with(|held| held.set(held.get().saturating_sub(isize::try_from(by).unwrap_or(isize::MAX))));
}

// SAFETY: every call is passed on to `System` unchanged, with the caller's
// layout and pointer; the counting around it touches only thread-locals
// that never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc`, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract for `realloc`, passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Counted as a move: a growing buffer that cannot grow in place
            // is copied, and for a moment both blocks are held.
            grew(new_size);
            shrank(layout.size());
        }
        p
    }
}

/// What `f` returned, and the most bytes this thread held beyond what it
/// held before while `f` ran (what `f` returns still counts).
pub fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = HELD.with(Cell::get);
    PEAK.with(|p| p.set(before));
    let out = f();
    let peak = PEAK.with(Cell::get);
    (out, usize::try_from(peak - before).unwrap_or(0))
}

/// The budget of an input of `wire` bytes: [`MEMORY_PER_WIRE_BYTE`] ×
/// `wire` + [`MEMORY_PER_INPUT`].
pub fn budget(wire: usize) -> usize {
    allowance(MEMORY_PER_WIRE_BYTE, wire)
}

fn allowance(per_byte: usize, wire: usize) -> usize {
    wire.saturating_mul(per_byte).saturating_add(MEMORY_PER_INPUT)
}

/// The decoders whose memory is over the budget today, each held to the
/// most it may take per wire byte until it is brought within the budget,
/// so that it gets no worse meanwhile (a little above the worst measured);
/// every other target is held to the budget itself. Why each is over: see
/// [`targets`].
pub const OVER_BUDGET: &[(&str, usize)] = &[
    (targets::ENVELOPE, 320),
    (targets::JSONB, 320),
    (targets::JSON_SCHEMA, 192),
    (targets::AVRO, 320),
    (targets::PROTOBUF, 256),
    (targets::TEMPLATE, 768),
];

/// apache-avro reserves room for the items a block claims, up to its
/// allocation cap (64 MiB, `relay-registry`'s `MAX_ALLOCATION_BYTES`), before
/// it reads one: room a legitimate 960 KiB array of small longs needs; a
/// map's hash table rounds its room up to a power of two, so up to twice
/// that. Read to its end only, a value claiming items it does not hold then
/// fails at once (each item must cost bytes), instead of decoding a million nulls.
pub const AVRO_RESERVATION: usize = 2 * 64 * 1024 * 1024;

/// The most `target` may hold for an input of `wire` bytes: [`budget`], or
/// for a target in [`OVER_BUDGET`] its own factor.
pub fn allowed(target: &str, wire: usize) -> usize {
    match OVER_BUDGET.iter().find(|(t, _)| *t == target) {
        Some(&(_, per_byte)) => allowance(per_byte, wire),
        None => budget(wire),
    }
}

/// One input, measured: its size on the wire, the most it held while
/// decoded, and what it decoded to (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Measured {
    /// The decoder measured ([`targets`]' names).
    pub target: &'static str,
    /// Bytes on the wire.
    pub wire: usize,
    /// The most held at once while it was decoded.
    pub peak: usize,
    /// What became of it: `ok`, or the poison class or failure.
    pub outcome: String,
}

impl Measured {
    /// Held bytes per wire byte.
    pub fn ratio(&self) -> f64 {
        self.peak as f64 / self.wire.max(1) as f64
    }

    /// `Err` naming the target, `shape` (the input in a few words) and the
    /// bytes when the input held more than [`allowed`].
    pub fn check(&self, shape: &str) -> Result<(), String> {
        let allowed = allowed(self.target, self.wire);
        if self.peak <= allowed {
            return Ok(());
        }
        Err(format!(
            "{}: {shape} ({} bytes on the wire, {}) held {} bytes ({:.1}x its size), over the {allowed} bytes it may \
             ({} per wire byte + {MEMORY_PER_INPUT})",
            self.target,
            self.wire,
            self.outcome,
            self.peak,
            self.ratio(),
            OVER_BUDGET.iter().find(|(t, _)| *t == self.target).map_or(MEMORY_PER_WIRE_BYTE, |&(_, k)| k),
        ))
    }
}
