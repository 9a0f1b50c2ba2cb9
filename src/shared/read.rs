//! A read's payload on its way: where it goes (`Dest`) and its check as it streams
//! (`Checked`). Each piece is hashed and placed while it is in the cache, so an object
//! crosses memory once, into staging or straight into the caller's blocks.
//!
//! Memory the caller owns (its destination blocks) is written under the caller's `Claim`,
//! and not at all once the caller withdrew it (its bound passed), so a read that outlives
//! its bound never writes memory the caller has taken back.

use super::backend::Sink;
use super::object::{self, Expected};
use std::sync::{Arc, Mutex};
use xxhash_rust::xxh3::Xxh3;

/// A caller's hold on a read into its memory: while it stands, the read may write there.
pub struct Claim(Mutex<bool>);

impl Claim {
    pub fn new() -> Arc<Claim> {
        Arc::new(Claim(Mutex::new(true)))
    }

    /// Ends the hold; returns once no piece is being written under it.
    pub fn withdraw(&self) {
        *self.0.lock().unwrap() = false;
    }
}

/// Spans of memory in payload order, and what guards them.
struct Target {
    spans: Vec<(*mut u8, usize)>,
    claim: Option<Arc<Claim>>,
    /// Where the next piece goes: span index, offset in it.
    at: (usize, usize),
}

/// Where one read's payload goes: one or more targets, each a list of spans that together
/// hold one payload, filled in order as the object arrives.
pub struct Dest {
    targets: Vec<Target>,
    _keep: Vec<Arc<dyn Send + Sync>>,
}

// SAFETY: a Dest is handed to one read at a time; its spans are valid while `_keep` lives
// (memory the tier's user keeps) or while their claim stands (the caller's memory), and no
// one else writes them until the read ends.
unsafe impl Send for Dest {}

impl Dest {
    pub fn new() -> Dest {
        Dest { targets: Vec::new(), _keep: Vec::new() }
    }

    /// Adds a target: `spans` hold one payload, in order.
    ///
    /// # Safety
    /// Without a claim, the spans stay valid while `keep` lives and no one else touches
    /// them until the read ends. With one, the same holds while the claim stands: the
    /// caller withdraws it before it reuses the memory.
    pub unsafe fn add(&mut self, spans: Vec<(*mut u8, usize)>, claim: Option<Arc<Claim>>, keep: Arc<dyn Send + Sync>) {
        self.targets.push(Target { spans, claim, at: (0, 0) });
        self._keep.push(keep);
    }

    /// The one span of memory of the tier user's own that takes the whole payload, when that
    /// is all there is: a read may fill it at once, with no claim to honour.
    fn whole(&mut self, len: usize) -> Option<&mut [u8]> {
        match self.targets.as_slice() {
            [Target { spans, claim: None, at: (0, 0) }] if spans.len() == 1 && spans[0].1 == len => {
                // SAFETY: the span is valid and this read's alone, as `add` requires.
                Some(unsafe { std::slice::from_raw_parts_mut(spans[0].0, len) })
            }
            _ => None,
        }
    }

    /// Writes the payload's next piece into every target; `false` when a claim was
    /// withdrawn (the caller stopped waiting, so nothing more is wanted).
    fn put(&mut self, piece: &[u8]) -> bool {
        for t in &mut self.targets {
            let guard = t.claim.as_ref().map(|c| c.0.lock().unwrap());
            if guard.as_ref().is_some_and(|g| !**g) {
                return false;
            }
            let mut rest = piece;
            while !rest.is_empty() && t.at.0 < t.spans.len() {
                let (ptr, len) = t.spans[t.at.0];
                let n = rest.len().min(len - t.at.1);
                // SAFETY: within span `at.0`, valid as `add` requires (its claim held here).
                unsafe { std::ptr::copy_nonoverlapping(rest.as_ptr(), ptr.add(t.at.1), n) };
                rest = &rest[n..];
                t.at.1 += n;
                if t.at.1 == len {
                    t.at = (t.at.0 + 1, 0);
                }
            }
        }
        true
    }
}

impl Default for Dest {
    fn default() -> Self {
        Dest::new()
    }
}

/// A read's sink: checks the header against what is wanted before any payload is placed,
/// then hashes and places each piece.
pub struct Checked<'a> {
    want: &'a Expected<'a>,
    object_bytes: u64,
    dest: Dest,
    hasher: Xxh3,
    got: u64,
    /// The header's payload checksum, once the header passed.
    sum: Option<u64>,
    /// Why the object is not the block wanted.
    bad: Option<String>,
    /// The caller withdrew its claim.
    withdrawn: bool,
}

/// How a streamed read ended.
pub enum Outcome {
    /// The object is the block wanted, whole, in every target.
    Good,
    /// It is not (the reason).
    Bad(String),
    /// The caller withdrew before the read ended.
    Withdrawn,
}

impl<'a> Checked<'a> {
    /// A sink for an object that is `object_bytes` long (as the backend found it).
    pub fn new(want: &'a Expected<'a>, object_bytes: u64, dest: Dest) -> Self {
        Checked { want, object_bytes, dest, hasher: Xxh3::new(), got: 0, sum: None, bad: None, withdrawn: false }
    }

    /// What the read found, once the backend returned.
    pub fn outcome(self) -> Outcome {
        if let Some(why) = self.bad {
            return Outcome::Bad(why);
        }
        if self.withdrawn {
            return Outcome::Withdrawn;
        }
        let Some(sum) = self.sum else { return Outcome::Bad("it ended before its header".into()) };
        if self.got != self.want.payload_bytes() {
            return Outcome::Bad(format!("it ended after {} of its {} payload bytes", self.got, self.want.payload_bytes()));
        }
        if self.hasher.digest() != sum {
            return Outcome::Bad("its payload is damaged (checksum mismatch)".into());
        }
        Outcome::Good
    }
}

impl Sink for Checked<'_> {
    fn header(&mut self, h: &[u8]) -> bool {
        match object::check_header(h, self.object_bytes, self.want) {
            Ok(sum) => self.sum = Some(sum),
            Err(why) => self.bad = Some(why),
        }
        self.sum.is_some()
    }

    fn payload(&mut self, piece: &[u8]) -> bool {
        self.hasher.update(piece);
        self.got += piece.len() as u64;
        self.withdrawn = !self.dest.put(piece);
        !self.withdrawn
    }

    fn whole(&mut self) -> Option<&mut [u8]> {
        self.dest.whole(self.want.payload_bytes() as usize)
    }

    fn filled(&mut self) -> bool {
        let len = self.want.payload_bytes() as usize;
        let whole = self.dest.whole(len).expect("filled only what `whole` gave");
        self.hasher.update(whole);
        self.got += len as u64;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(v: &mut [Vec<u8>]) -> Vec<(*mut u8, usize)> {
        v.iter_mut().map(|b| (b.as_mut_ptr(), b.len())).collect()
    }

    #[test]
    fn pieces_fill_every_target_in_order_across_spans() {
        let (mut a, mut b) = (vec![vec![0u8; 3], vec![0u8; 5]], vec![vec![0u8; 8]]);
        let mut d = Dest::new();
        unsafe {
            d.add(spans(&mut a), Some(Claim::new()), Arc::new(()));
            d.add(spans(&mut b), None, Arc::new(()));
        }
        assert!(d.put(&[1, 2]) && d.put(&[3, 4, 5]) && d.put(&[6, 7, 8]));
        assert_eq!(a, vec![vec![1, 2, 3], vec![4, 5, 6, 7, 8]]);
        assert_eq!(b[0], [1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn nothing_is_written_once_the_claim_is_withdrawn() {
        let mut a = vec![vec![0u8; 4]];
        let claim = Claim::new();
        let mut d = Dest::new();
        unsafe { d.add(spans(&mut a), Some(claim.clone()), Arc::new(())) };
        assert!(d.put(&[1, 2]));
        claim.withdraw();
        assert!(!d.put(&[3, 4]));
        assert_eq!(a[0], [1, 2, 0, 0]);
    }

    #[test]
    fn only_one_unclaimed_span_of_the_payloads_length_is_filled_whole() {
        let mut a = vec![vec![0u8; 8]];
        let mut d = Dest::new();
        unsafe { d.add(spans(&mut a), None, Arc::new(())) };
        assert_eq!(d.whole(8).map(|w| w.len()), Some(8));
        assert!(d.whole(9).is_none());
        let mut claimed = Dest::new();
        unsafe { claimed.add(spans(&mut a), Some(Claim::new()), Arc::new(())) };
        assert!(claimed.whole(8).is_none(), "the caller's memory is written under its claim, piece by piece");
        let mut split = vec![vec![0u8; 4], vec![0u8; 4]];
        let mut two = Dest::new();
        unsafe { two.add(spans(&mut split), None, Arc::new(())) };
        assert!(two.whole(8).is_none());
    }
}
