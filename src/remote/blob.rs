//! The export blob: what a peer needs to reach the layouts an engine chose to share.
//!
//! ```text
//! "KVXBLOB\0" | abi major u32 | abi minor u32 | generation u64 | agent name (len u32, bytes)
//! | connection metadata (len u32, bytes) | layout count u32
//! | per layout: id u64, storage u32, mem u32, device u32, kind u32, 6 × u64 config,
//!   base count u32, bases u64…, NIXL metadata (len u32, bytes)
//! | crc32 of everything before it (u32)
//! ```
//! Little-endian throughout. Decoding trusts nothing: every length is bounded before it
//! is used, every layout's geometry is validated as a local one would be, its bases must
//! hold the whole layout without wrapping, and no byte may follow the checksum.

use super::Exported as StorageKind;
use crate::error::{bail, Error, Result, Status};
use crate::layout::{Geometry, LayoutConfig, LayoutKind, Placement};

const MAGIC: &[u8; 8] = b"KVXBLOB\0";
/// Bounds that keep a hostile length from allocating much: far above real use.
const MAX_NAME: usize = 256;
const MAX_METADATA: usize = 16 << 20;
const MAX_LAYOUTS: usize = 4096;

/// Where the peer's memory is, as NIXL registers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mem {
    /// Host memory (also the emulated device's): NIXL's DRAM.
    Dram,
    /// Memory of CUDA device `ordinal`: NIXL's VRAM.
    Vram(u32),
}

/// One exported layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shared {
    pub id: u64,
    pub storage: StorageKind,
    pub mem: Mem,
    pub kind: LayoutKind,
    pub cfg: LayoutConfig,
    pub bases: Vec<u64>,
    /// The agent's partial metadata for this layout's registrations.
    pub metadata: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blob {
    pub abi_major: u32,
    pub abi_minor: u32,
    /// Raised by every export of one engine, so a newer blob replaces an older one.
    pub generation: u64,
    pub agent: String,
    pub connection: Vec<u8>,
    pub layouts: Vec<Shared>,
}

fn storage_code(s: StorageKind) -> u32 {
    match s {
        StorageKind::Device => 0,
        StorageKind::Pinned => 1,
        StorageKind::Host => 2,
    }
}

fn kind_code(k: LayoutKind) -> u32 {
    match k {
        LayoutKind::FullyContiguous => 0,
        LayoutKind::LayerSeparate { block_first: true } => 1,
        LayoutKind::LayerSeparate { block_first: false } => 2,
    }
}

impl Blob {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::new();
        w.extend_from_slice(MAGIC);
        put32(&mut w, self.abi_major);
        put32(&mut w, self.abi_minor);
        put64(&mut w, self.generation);
        put_bytes(&mut w, self.agent.as_bytes());
        put_bytes(&mut w, &self.connection);
        put32(&mut w, self.layouts.len() as u32);
        for l in &self.layouts {
            put64(&mut w, l.id);
            put32(&mut w, storage_code(l.storage));
            let (mem, dev) = match l.mem {
                Mem::Dram => (0, 0),
                Mem::Vram(d) => (1, d),
            };
            put32(&mut w, mem);
            put32(&mut w, dev);
            put32(&mut w, kind_code(l.kind));
            let c = &l.cfg;
            for v in [c.num_blocks, c.num_layers, c.outer_dim, c.page_size, c.inner_dim, c.dtype_bytes] {
                put64(&mut w, v);
            }
            put32(&mut w, l.bases.len() as u32);
            l.bases.iter().for_each(|&b| put64(&mut w, b));
            put_bytes(&mut w, &l.metadata);
        }
        let crc = crc32fast::hash(&w);
        put32(&mut w, crc);
        w
    }

    /// Parses and validates a blob; `InvalidArg` (or `Version` for another ABI major)
    /// with the reason otherwise.
    pub fn decode(bytes: &[u8], abi_major: u32) -> Result<Blob> {
        if bytes.len() < MAGIC.len() + 8 || &bytes[..MAGIC.len()] != MAGIC {
            bail!(InvalidArg, "not a kvxfer export blob (no KVXBLOB header); pass the bytes kvx_engine_export produced, unchanged");
        }
        let mut r = Reader { bytes, at: MAGIC.len() };
        let major = r.u32("ABI major")?;
        if major != abi_major {
            bail!(
                InvalidArg,
                "the blob was exported by kvxfer ABI {major}, this library is ABI {abi_major}; both sides need the same major version"
            );
        }
        if bytes.len() < r.at + 4 {
            bail!(InvalidArg, "the blob is truncated ({} bytes)", bytes.len());
        }
        let (body, tail) = bytes.split_at(bytes.len() - 4);
        if crc32fast::hash(body) != u32::from_le_bytes(tail.try_into().unwrap()) {
            bail!(InvalidArg, "the blob's checksum does not match: it was truncated, extended or altered on the way");
        }
        let mut r = Reader { bytes: body, at: r.at };
        let abi_minor = r.u32("ABI minor")?;
        let generation = r.u64("generation")?;
        let agent = String::from_utf8(r.bytes("agent name", MAX_NAME)?.to_vec())
            .map_err(|_| Error::new(Status::InvalidArg, "the blob's agent name is not UTF-8"))?;
        if agent.is_empty() {
            bail!(InvalidArg, "the blob's agent name is empty");
        }
        let connection = r.bytes("connection metadata", MAX_METADATA)?.to_vec();
        let n = r.u32("layout count")? as usize;
        if n == 0 || n > MAX_LAYOUTS {
            bail!(InvalidArg, "the blob lists {n} layouts; an export holds 1 to {MAX_LAYOUTS}");
        }
        let layouts = (0..n)
            .map(|i| r.layout().map_err(|e| Error::new(e.status, format!("exported layout {i}: {}", e.message))))
            .collect::<Result<_>>()?;
        if r.at != body.len() {
            bail!(InvalidArg, "{} unexpected bytes after the last layout", body.len() - r.at);
        }
        Ok(Blob { abi_major: major, abi_minor, generation, agent, connection, layouts })
    }
}

impl Shared {
    pub fn geometry(&self) -> Result<Geometry> {
        self.cfg.validate()
    }
}

fn put32(w: &mut Vec<u8>, v: u32) {
    w.extend_from_slice(&v.to_le_bytes());
}

fn put64(w: &mut Vec<u8>, v: u64) {
    w.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(w: &mut Vec<u8>, b: &[u8]) {
    put32(w, b.len() as u32);
    w.extend_from_slice(b);
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        match self.bytes.get(self.at..self.at.saturating_add(n)) {
            Some(s) if self.at.checked_add(n).is_some() => {
                self.at += n;
                Ok(s)
            }
            _ => bail!(InvalidArg, "the blob ends inside its {what} (at byte {})", self.at),
        }
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }

    fn bytes(&mut self, what: &str, max: usize) -> Result<&'a [u8]> {
        let n = self.u32(what)? as usize;
        if n > max {
            bail!(InvalidArg, "the blob's {what} is {n} bytes, more than the {max} an export writes");
        }
        self.take(n, what)
    }

    fn layout(&mut self) -> Result<Shared> {
        let id = self.u64("layout id")?;
        let storage = match self.u32("storage")? {
            0 => StorageKind::Device,
            1 => StorageKind::Pinned,
            2 => StorageKind::Host,
            s => bail!(InvalidArg, "unknown storage code {s}"),
        };
        let (mem, dev) = (self.u32("memory type")?, self.u32("device")?);
        let mem = match mem {
            0 => Mem::Dram,
            1 if storage == StorageKind::Device => Mem::Vram(dev),
            m => bail!(InvalidArg, "memory type {m} does not fit storage code {}", storage_code(storage)),
        };
        let kind = match self.u32("layout kind")? {
            0 => LayoutKind::FullyContiguous,
            1 => LayoutKind::LayerSeparate { block_first: true },
            2 => LayoutKind::LayerSeparate { block_first: false },
            k => bail!(InvalidArg, "unknown layout kind {k}"),
        };
        let mut v = [0u64; 6];
        for x in &mut v {
            *x = self.u64("layout config")?;
        }
        let cfg = LayoutConfig { num_blocks: v[0], num_layers: v[1], outer_dim: v[2], page_size: v[3], inner_dim: v[4], dtype_bytes: v[5] };
        let placement = Placement::memory(kind, cfg.validate()?);
        let n = self.u32("base count")? as u64;
        if n != placement.num_bases() {
            bail!(InvalidArg, "{n} bases listed; a layout of this kind and {} layers has {}", cfg.num_layers, placement.num_bases());
        }
        let bytes = placement.base_bytes();
        let bases = (0..n).map(|_| self.u64("bases")).collect::<Result<Vec<_>>>()?;
        if let Some(b) = bases.iter().find(|&&b| b == 0 || b.checked_add(bytes).is_none()) {
            bail!(InvalidArg, "base {b:#x} cannot hold the layout's {bytes} bytes");
        }
        let metadata = self.bytes("layout metadata", MAX_METADATA)?.to_vec();
        Ok(Shared { id, storage, mem, kind, cfg, bases, metadata })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Blob {
        let cfg = LayoutConfig { num_blocks: 8, num_layers: 3, outer_dim: 2, page_size: 16, inner_dim: 64, dtype_bytes: 2 };
        Blob {
            abi_major: 1,
            abi_minor: 3,
            generation: 2,
            agent: "kvxfer-test".into(),
            connection: vec![1, 2, 3],
            layouts: vec![
                Shared {
                    id: 7,
                    storage: StorageKind::Pinned,
                    mem: Mem::Dram,
                    kind: LayoutKind::FullyContiguous,
                    cfg,
                    bases: vec![0x1000],
                    metadata: vec![9; 40],
                },
                Shared {
                    id: 8,
                    storage: StorageKind::Device,
                    mem: Mem::Vram(1),
                    kind: LayoutKind::LayerSeparate { block_first: false },
                    cfg,
                    bases: vec![0x10000, 0x20000, 0x30000],
                    metadata: vec![4; 12],
                },
            ],
        }
    }

    #[test]
    fn a_blob_decodes_to_what_was_encoded() {
        let b = sample();
        assert_eq!(Blob::decode(&b.encode(), 1).unwrap(), b);
    }

    #[test]
    fn another_abi_major_is_refused_with_the_reason() {
        let e = Blob::decode(&sample().encode(), 2).unwrap_err();
        assert_eq!(e.status, Status::InvalidArg);
        assert!(e.message.contains("ABI 1, this library is ABI 2"), "{}", e.message);
    }

    #[test]
    fn truncated_extended_and_altered_blobs_are_refused() {
        let good = sample().encode();
        for n in 0..good.len() {
            assert_eq!(Blob::decode(&good[..n], 1).unwrap_err().status, Status::InvalidArg, "truncated to {n}");
        }
        let mut longer = good.clone();
        longer.push(0);
        assert_eq!(Blob::decode(&longer, 1).unwrap_err().status, Status::InvalidArg);
        for i in 8..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x40;
            assert!(Blob::decode(&bad, 1).is_err(), "byte {i} flipped was accepted");
        }
    }

    /// What a hostile-field case does to a valid blob.
    type Corrupt = Box<dyn Fn(&mut Blob)>;

    /// A checksum-valid blob with hostile fields: each must be caught by a field check.
    #[test]
    fn hostile_fields_behind_a_valid_checksum_are_refused() {
        let cases: Vec<(&str, Corrupt)> = vec![
            ("0 bases listed", Box::new(|b| b.layouts[0].bases.clear())),
            ("bases listed", Box::new(|b| b.layouts[1].bases.push(0x40000))),
            ("cannot hold", Box::new(|b| b.layouts[0].bases[0] = u64::MAX - 10)),
            ("cannot hold", Box::new(|b| b.layouts[0].bases[0] = 0)),
            ("num_blocks is 0", Box::new(|b| b.layouts[0].cfg.num_blocks = 0)),
            ("overflow", Box::new(|b| b.layouts[0].cfg.num_blocks = u64::MAX / 2)),
            ("1 to 4096", Box::new(|b| b.layouts.clear())),
            ("name is empty", Box::new(|b| b.agent.clear())),
            ("more than", Box::new(|b| b.agent = "x".repeat(MAX_NAME + 1))),
        ];
        for (want, edit) in cases {
            let mut b = sample();
            edit(&mut b);
            let e = Blob::decode(&b.encode(), 1).expect_err(want);
            assert_eq!(e.status, Status::InvalidArg);
            assert!(e.message.contains(want), "wanted '{want}', got: {}", e.message);
        }
    }

    /// The held-in fuzzer of the import path: seeded mutations of a valid blob (byte
    /// flips, splices, length fields set to extremes, with the checksum fixed up so the
    /// field checks are reached) never panic and never decode to a layout whose bases
    /// cannot hold it.
    #[test]
    fn fuzzed_blobs_never_panic_or_pass_an_invalid_layout() {
        let good = sample().encode();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..20_000 {
            let mut b = good[..good.len() - 4].to_vec();
            for _ in 0..1 + next() % 4 {
                let i = 8 + (next() as usize) % (b.len() - 8);
                match next() % 4 {
                    0 => b[i] = next() as u8,
                    1 => {
                        let end = (i + 4).min(b.len());
                        b[i..end].iter_mut().for_each(|x| *x = 0xff)
                    }
                    2 => b.truncate(i),
                    _ => {
                        let extra: Vec<u8> = (0..next() % 16).map(|_| next() as u8).collect();
                        b.splice(i..i, extra).for_each(drop)
                    }
                }
                if b.len() <= 8 {
                    break;
                }
            }
            let crc = crc32fast::hash(&b);
            b.extend_from_slice(&crc.to_le_bytes());
            if let Ok(blob) = Blob::decode(&b, 1) {
                for l in &blob.layouts {
                    let p = Placement::memory(l.kind, l.geometry().expect("decoded geometry is valid"));
                    assert_eq!(l.bases.len() as u64, p.num_bases());
                    assert!(l.bases.iter().all(|&x| x != 0 && x.checked_add(p.base_bytes()).is_some()));
                }
            }
        }
    }
}
