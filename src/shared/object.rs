//! One block as a shared-tier object: a fixed 512-byte header naming what it holds (the
//! namespace's and the key's own bytes, the block's geometry, the payload's length and
//! checksum), then the payload. A reader serves the payload only if all of it is what it
//! asked for, so an object that is damaged, cut short, written under another namespace or
//! key, or left under another key's name is a miss with its reason, never wrong bytes.
//!
//! ```text
//!   0  magic "KVXSHOBJ"          8  format (u32)      12  header bytes (u32, 512)
//!  16  namespace length (u16)   18  key length (u8)  19  zero
//!  20  num_layers, outer_dim, page_size, inner_dim, dtype_bytes (u64 each)
//!  60  payload length (u64)     68  payload xxh3-64 (u64)
//!  76  namespace bytes, then key bytes, then zeros to 504
//! 504  header xxh3-64 over bytes 0..504
//! 512  payload
//! ```
//! All integers little-endian.

use crate::layout::LayoutConfig;
use xxhash_rust::xxh3::{xxh3_128_with_seed, xxh3_64, xxh3_64_with_seed};

pub const HEADER_BYTES: usize = 512;
const MAGIC: &[u8; 8] = b"KVXSHOBJ";
/// The format this code writes and reads; an object of another is a miss.
pub const FORMAT: u32 = 1;
const NAMES_AT: usize = 76;
const HEADER_SUM_AT: usize = 504;
/// Room for the namespace and the key together (the store's limits, 256 and 64, fit).
const NAMES_ROOM: usize = HEADER_SUM_AT - NAMES_AT;
/// Seeds the object names, so a name is no other hash of the same bytes.
const NAME_SEED: u64 = 0x6b76_7873_6861_7265;

/// What a header says about its object, checked against what a reader asked for.
pub struct Expected<'a> {
    pub namespace: &'a [u8],
    pub key: &'a [u8],
    pub block: &'a LayoutConfig,
}

impl Expected<'_> {
    fn geometry(&self) -> [u64; 5] {
        let b = self.block;
        [b.num_layers, b.outer_dim, b.page_size, b.inner_dim, b.dtype_bytes]
    }

    /// Bytes of one block's payload.
    pub fn payload_bytes(&self) -> u64 {
        self.geometry().iter().product()
    }
}

/// The object's name: a digest of the namespace and the key, in hex, under a two-letter
/// folder (so no folder of a shared directory holds more than 1/256 of the objects). The
/// name only places the object; its header says what it holds, so two keys whose names
/// collide overwrite each other's object and read as misses, never as each other.
pub fn name(namespace: &[u8], key: &[u8]) -> String {
    let mut bytes = Vec::with_capacity(2 + namespace.len() + key.len());
    bytes.extend_from_slice(&(namespace.len() as u16).to_le_bytes());
    bytes.extend_from_slice(namespace);
    bytes.extend_from_slice(key);
    let h = format!("{:032x}", xxh3_128_with_seed(&bytes, NAME_SEED));
    format!("{}/{h}", &h[..2])
}

/// The header of the object holding `payload` as `want`'s block.
pub fn header(want: &Expected, payload: &[u8]) -> [u8; HEADER_BYTES] {
    assert!(want.namespace.len() + want.key.len() <= NAMES_ROOM && want.key.len() <= u8::MAX as usize);
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&FORMAT.to_le_bytes());
    h[12..16].copy_from_slice(&(HEADER_BYTES as u32).to_le_bytes());
    h[16..18].copy_from_slice(&(want.namespace.len() as u16).to_le_bytes());
    h[18] = want.key.len() as u8;
    for (i, g) in want.geometry().iter().enumerate() {
        h[20 + 8 * i..28 + 8 * i].copy_from_slice(&g.to_le_bytes());
    }
    h[60..68].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    h[68..76].copy_from_slice(&xxh3_64(payload).to_le_bytes());
    let ns_end = NAMES_AT + want.namespace.len();
    h[NAMES_AT..ns_end].copy_from_slice(want.namespace);
    h[ns_end..ns_end + want.key.len()].copy_from_slice(want.key);
    let sum = xxh3_64_with_seed(&h[..HEADER_SUM_AT], NAME_SEED);
    h[HEADER_SUM_AT..].copy_from_slice(&sum.to_le_bytes());
    h
}

fn u64_at(h: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(h[at..at + 8].try_into().unwrap())
}

/// Checks an object's header, its first `HEADER_BYTES` (`h`), for an object `object_bytes`
/// long: `Err` says why it is not `want`'s block, else its payload's checksum (xxh3-64),
/// which the payload read after it must match.
pub fn check_header(h: &[u8], object_bytes: u64, want: &Expected) -> Result<u64, String> {
    if h.len() != HEADER_BYTES || &h[..8] != MAGIC {
        return Err("not a kvxfer object (its magic is wrong)".into());
    }
    if u64_at(h, HEADER_SUM_AT) != xxh3_64_with_seed(&h[..HEADER_SUM_AT], NAME_SEED) {
        return Err("its header is damaged (checksum mismatch)".into());
    }
    let format = u32::from_le_bytes(h[8..12].try_into().unwrap());
    if format != FORMAT || u32::from_le_bytes(h[12..16].try_into().unwrap()) as usize != HEADER_BYTES {
        return Err(format!("object format {format}; this kvxfer reads format {FORMAT}"));
    }
    let ns_len = u16::from_le_bytes(h[16..18].try_into().unwrap()) as usize;
    let key_len = h[18] as usize;
    if ns_len + key_len > NAMES_ROOM {
        return Err("its header names a namespace or key longer than any".into());
    }
    let ns = &h[NAMES_AT..NAMES_AT + ns_len];
    let key = &h[NAMES_AT + ns_len..NAMES_AT + ns_len + key_len];
    if ns != want.namespace {
        return Err("it was written under another namespace".into());
    }
    if key != want.key {
        return Err("it holds another key's block (a name collision or a renamed object)".into());
    }
    let geometry: Vec<u64> = (0..5).map(|i| u64_at(h, 20 + 8 * i)).collect();
    if geometry != want.geometry() {
        return Err(format!("its block geometry {geometry:?} is not this tier's {:?}", want.geometry()));
    }
    let len = u64_at(h, 60);
    if len != want.payload_bytes() {
        return Err(format!("its payload is {len} bytes; a block is {}", want.payload_bytes()));
    }
    if object_bytes != HEADER_BYTES as u64 + len {
        return Err(format!("it is {object_bytes} bytes; header and payload are {}", HEADER_BYTES as u64 + len));
    }
    Ok(u64_at(h, 68))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An object read whole, checked as a read checks it.
    fn check(h: &[u8], payload: &[u8], object_bytes: u64, want: &Expected) -> Result<(), String> {
        let sum = check_header(h, object_bytes, want)?;
        match xxh3_64(payload) == sum && payload.len() as u64 == want.payload_bytes() {
            true => Ok(()),
            false => Err("its payload is damaged (checksum mismatch)".into()),
        }
    }

    fn block() -> LayoutConfig {
        LayoutConfig { num_blocks: 1, num_layers: 2, outer_dim: 2, page_size: 4, inner_dim: 8, dtype_bytes: 2 }
    }

    #[test]
    fn an_object_reads_back_only_as_the_block_it_was_written_for() {
        let b = block();
        let want = Expected { namespace: b"model-a", key: b"key-1", block: &b };
        let payload: Vec<u8> = (0..want.payload_bytes()).map(|i| i as u8).collect();
        let h = header(&want, &payload);
        let total = (HEADER_BYTES + payload.len()) as u64;
        assert_eq!(check(&h, &payload, total, &want), Ok(()));

        let other_ns = Expected { namespace: b"model-b", ..want };
        assert!(check(&h, &payload, total, &other_ns).unwrap_err().contains("namespace"));
        let other_key = Expected { key: b"key-2", ..want };
        assert!(check(&h, &payload, total, &other_key).unwrap_err().contains("another key"));
        let b2 = LayoutConfig { page_size: 8, ..b };
        let other_geometry = Expected { block: &b2, ..want };
        assert!(check(&h, &payload, total, &other_geometry).is_err());

        let mut damaged = payload.clone();
        damaged[7] ^= 1;
        assert!(check(&h, &damaged, total, &want).unwrap_err().contains("payload is damaged"));
        assert!(check(&h, &payload, total - 1, &want).is_err(), "an object cut short is a miss");
        assert!(check(&h, &payload, total + 1, &want).is_err(), "an object grown is a miss");
        let mut bad = h;
        bad[NAMES_AT] ^= 1;
        assert!(check(&bad, &payload, total, &want).unwrap_err().contains("header is damaged"));
        assert!(check(&[0u8; HEADER_BYTES], &payload, total, &want).is_err());
    }

    #[test]
    fn names_differ_by_namespace_and_key_and_never_hold_their_bytes() {
        let a = name(b"ns", b"key");
        assert_ne!(a, name(b"ns2", b"key"));
        assert_ne!(a, name(b"ns", b"key2"));
        // The namespace's length is hashed too: ("ns", "key") is not ("nsk", "ey").
        assert_ne!(a, name(b"nsk", b"ey"));
        assert_eq!(a, name(b"ns", b"key"));
        assert!(name(b"../..", b"/etc/passwd").chars().all(|c| c.is_ascii_hexdigit() || c == '/'));
        assert_eq!(&a[..2], &a[3..5]);
    }
}
