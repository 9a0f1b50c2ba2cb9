//! What a store is opened with, the limits on keys and namespaces, keys as the index and
//! the slot records hold them (their own bytes), and the digests that stand for
//! namespaces and for keys in slot handles.

use crate::error::{bail, Result};
use crate::layout::LayoutConfig;
use crate::shared::SharedConfig;

/// Longest key, in bytes (a key is 1 to 64 bytes).
pub const MAX_KEY_BYTES: usize = 64;
/// Longest namespace, in bytes.
pub const MAX_NAMESPACE_BYTES: usize = 256;
/// The most blocks a store holds. Opening keeps about 150 bytes a slot in memory (its
/// index entry, and the records file while it is scanned), so a larger capacity would
/// make `open` ask for more memory than a host has and abort the process rather than
/// fail; 64 Mi blocks are 4 TiB even of 64 KiB blocks.
pub const MAX_CAPACITY_BLOCKS: u64 = 1 << 26;

/// How a store is opened (`KVX_STORE_*` at the C ABI).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreFlags(u32);

impl StoreFlags {
    pub const NONE: StoreFlags = StoreFlags(0);
    /// Make the directory and its files where no store is there yet; without it, opening a
    /// directory that holds no store is refused.
    pub const CREATE: StoreFlags = StoreFlags(1);
    /// Survive power loss: every put is synced (data, checksums, record) before its key
    /// reports success, and every removal's record before `remove` returns.
    pub const DURABLE: StoreFlags = StoreFlags(2);
    /// Page-cache I/O for the data files instead of `O_DIRECT` (a tmpfs or page-cache tier).
    pub const BUFFERED: StoreFlags = StoreFlags(4);
    /// On open, drop every entry whose record's seal is not its block's current seal (one
    /// small read per entry, still no data read).
    pub const VERIFY_ON_OPEN: StoreFlags = StoreFlags(8);
    /// Open a store another process owns, to move the slots its owner hands out
    /// (`SlotHandle`s): no lock, nothing written but those slots' data, `CREATE` ignored.
    pub const DATA_ONLY: StoreFlags = StoreFlags(16);

    pub const fn contains(self, f: StoreFlags) -> bool {
        self.0 & f.0 == f.0
    }

    pub const fn bits(self) -> u32 {
        self.0
    }
}

impl std::ops::BitOr for StoreFlags {
    type Output = StoreFlags;
    fn bitor(self, o: StoreFlags) -> StoreFlags {
        StoreFlags(self.0 | o.0)
    }
}

/// A store's settings. The geometry, capacity, shard count and namespace are fixed when
/// the store is made; reopening with others is refused with the reason.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// The geometry of one block (its `num_blocks` is ignored: `capacity_blocks` sets it).
    pub block: LayoutConfig,
    pub capacity_blocks: u64,
    /// Everything that makes two blocks with equal keys differ (model, dtype, layout,
    /// rank…), at most 256 bytes.
    pub namespace: Vec<u8>,
    pub flags: StoreFlags,
    /// Data files; a slot `s` lives in file `s % shards`.
    pub shards: u32,
    /// A shared tier under the store (`crate::shared`): many processes and hosts share
    /// its blocks. Not fixed when the store is made: each open may name another, or none.
    pub shared: Option<SharedConfig>,
}

impl StoreConfig {
    pub fn new(block: LayoutConfig, capacity_blocks: u64, namespace: &[u8]) -> StoreConfig {
        StoreConfig { block, capacity_blocks, namespace: namespace.to_vec(), flags: StoreFlags::CREATE, shards: 1, shared: None }
    }

    /// Blocks in each data file: the capacity spread over the shards, rounded up.
    pub(super) fn blocks_per_shard(&self) -> u64 {
        self.capacity_blocks.div_ceil(self.shards as u64)
    }

    /// The block geometry with `num_blocks` set to one shard's.
    pub(super) fn shard_geometry(&self) -> LayoutConfig {
        LayoutConfig { num_blocks: self.blocks_per_shard(), ..self.block }
    }

    pub(super) fn validate(&self) -> Result<()> {
        if self.capacity_blocks == 0 {
            bail!(InvalidArg, "store capacity_blocks is 0; a store holds at least one block");
        }
        if self.capacity_blocks > MAX_CAPACITY_BLOCKS {
            bail!(InvalidArg, "store capacity_blocks is {}; at most {MAX_CAPACITY_BLOCKS} blocks", self.capacity_blocks);
        }
        if self.shards == 0 || self.shards as u64 > self.capacity_blocks {
            bail!(InvalidArg, "store shards is {}; use 1 to capacity_blocks ({}) data files", self.shards, self.capacity_blocks);
        }
        if self.namespace.len() > MAX_NAMESPACE_BYTES {
            bail!(InvalidArg, "the namespace is {} bytes; at most {MAX_NAMESPACE_BYTES} (hash a longer one)", self.namespace.len());
        }
        if self.shared.is_some() && self.flags.contains(StoreFlags::DATA_ONLY) {
            bail!(InvalidArg, "a DATA_ONLY open moves the slots its owner hands out; open the shared tier with the owner, not here");
        }
        self.shard_geometry().validate()?;
        Ok(())
    }
}

/// A 128-bit digest: of a namespace, or of a key in a slot handle.
pub type Digest = u128;

/// The digest of a namespace (`xxh3-128`).
pub fn namespace_digest(ns: &[u8]) -> Digest {
    xxhash_rust::xxh3::xxh3_128_with_seed(ns, NAMESPACE_SEED)
}

/// A key's own bytes (1 to 64), which alone decide its identity: two keys are one key only
/// if their bytes are equal. A digest may index them, but no digest, however wide, stands
/// for a key, since keys can be chosen to collide in any non-cryptographic one.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Key {
    len: u8,
    /// The key's bytes, then zeros, so equal keys are equal arrays.
    bytes: [u8; MAX_KEY_BYTES],
}

impl Key {
    /// The key of `bytes`, after checking its length.
    pub fn new(bytes: &[u8]) -> Result<Key> {
        if bytes.is_empty() || bytes.len() > MAX_KEY_BYTES {
            bail!(InvalidArg, "a key is {} bytes; keys are 1 to {MAX_KEY_BYTES} bytes (hash a longer one)", bytes.len());
        }
        Ok(Key::of_checked(bytes))
    }

    /// The key of `bytes`, whose length (1 to 64) the caller checked.
    fn of_checked(bytes: &[u8]) -> Key {
        let mut k = Key { len: bytes.len() as u8, bytes: [0; MAX_KEY_BYTES] };
        k.bytes[..bytes.len()].copy_from_slice(bytes);
        k
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    pub fn len(&self) -> u32 {
        self.len as u32
    }

    /// The key's digest (`xxh3-128`), as a slot handle carries it: the handle names its
    /// slot and generation, and the digest lets a data-only process check that the slot's
    /// record is still the one handed out.
    pub fn digest(&self) -> Digest {
        xxhash_rust::xxh3::xxh3_128(self.as_bytes())
    }
}

impl std::hash::Hash for Key {
    /// A 64-bit hash under a seed drawn once per process, so that keys chosen to collide
    /// cannot crowd one bucket of the index's maps (equality still compares the bytes).
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        static SEED: std::sync::LazyLock<u64> = std::sync::LazyLock::new(super::fresh_epoch);
        state.write_u64(xxhash_rust::xxh3::xxh3_64_with_seed(self.as_bytes(), *SEED));
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key(")?;
        self.as_bytes().iter().try_for_each(|b| write!(f, "{b:02x}"))?;
        write!(f, ")")
    }
}

/// Every key of a call; the first bad key refuses the call, naming its index.
pub fn keys_of<K: AsRef<[u8]>>(keys: &[K]) -> Result<Vec<Key>> {
    if keys.is_empty() {
        bail!(InvalidArg, "no keys; a store call takes at least one key");
    }
    // Lengths first, then the keys built in place: a call's keys are a scheduler's hot path,
    // and a `Result` per 65-byte key costs more than the lookup of it.
    if let Some((i, k)) = keys.iter().enumerate().find(|(_, k)| !(1..=MAX_KEY_BYTES).contains(&k.as_ref().len())) {
        let e = Key::new(k.as_ref()).unwrap_err();
        return Err(crate::error::Error::new(e.status, format!("key {i}: {}", e.message)));
    }
    Ok(keys.iter().map(|k| Key::of_checked(k.as_ref())).collect())
}

/// Keeps the namespace digest apart from any key's digest, so a record can never take
/// one for the other.
const NAMESPACE_SEED: u64 = 0x6b76_7873_746f_7265;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;

    /// A capacity whose index could not fit in memory is refused before anything is
    /// allocated, not an abort of the process.
    #[test]
    fn a_capacity_past_the_most_a_store_indexes_is_refused() {
        let block = LayoutConfig { num_blocks: 0, num_layers: 1, outer_dim: 1, page_size: 1, inner_dim: 16, dtype_bytes: 1 };
        assert!(StoreConfig::new(block, MAX_CAPACITY_BLOCKS, b"ns").validate().is_ok());
        for capacity in [MAX_CAPACITY_BLOCKS + 1, u32::MAX as u64] {
            let err = StoreConfig::new(block, capacity, b"ns").validate().unwrap_err();
            assert_eq!(err.status, Status::InvalidArg, "{capacity}");
            assert!(err.message.contains("at most"), "{}", err.message);
        }
    }

    #[test]
    fn keys_of_1_to_64_bytes_are_taken_and_others_refused() {
        assert!(Key::new(b"k").is_ok());
        assert_eq!(Key::new(&[7u8; 64]).unwrap().as_bytes(), &[7u8; 64]);
        assert_eq!(Key::new(b"").unwrap_err().status, crate::error::Status::InvalidArg);
        assert_eq!(Key::new(&[7u8; 65]).unwrap_err().status, crate::error::Status::InvalidArg);
        let err = keys_of(&[&b"a"[..], &[0u8; 70][..]]).unwrap_err();
        assert!(err.message.starts_with("key 1:"), "{}", err.message);
    }

    /// Keys that differ only in trailing zeros, or in length, are different keys.
    #[test]
    fn keys_are_equal_only_when_their_bytes_are() {
        let k = |b: &[u8]| Key::new(b).unwrap();
        assert_eq!(k(b"ab"), k(b"ab"));
        assert_ne!(k(b"ab"), k(b"ab\0"));
        assert_ne!(k(b"\0"), k(b"\0\0"));
    }

    #[test]
    fn a_namespace_and_a_key_of_the_same_bytes_have_different_digests() {
        assert_ne!(namespace_digest(b"abc"), Key::new(b"abc").unwrap().digest());
    }
}
