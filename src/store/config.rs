//! What a store is opened with, the limits on keys and namespaces, and the digests that
//! stand for them in the index and in the slot records.

use crate::error::{bail, Result};
use crate::layout::LayoutConfig;

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
}

impl StoreConfig {
    pub fn new(block: LayoutConfig, capacity_blocks: u64, namespace: &[u8]) -> StoreConfig {
        StoreConfig { block, capacity_blocks, namespace: namespace.to_vec(), flags: StoreFlags::CREATE, shards: 1 }
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
        self.shard_geometry().validate()?;
        Ok(())
    }
}

/// A 128-bit digest: of a key, or of a namespace.
pub type Digest = u128;

/// The digest of a namespace (`xxh3-128`).
pub fn namespace_digest(ns: &[u8]) -> Digest {
    xxhash_rust::xxh3::xxh3_128_with_seed(ns, NAMESPACE_SEED)
}

/// The digest of a key (`xxh3-128`), after checking its length.
pub fn key_digest(key: &[u8]) -> Result<Digest> {
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        bail!(InvalidArg, "a key is {} bytes; keys are 1 to {MAX_KEY_BYTES} bytes (hash a longer one)", key.len());
    }
    Ok(xxhash_rust::xxh3::xxh3_128(key))
}

/// Digests of every key of a call; the first bad key refuses the call, naming its index.
pub fn key_digests<K: AsRef<[u8]>>(keys: &[K]) -> Result<Vec<Digest>> {
    if keys.is_empty() {
        bail!(InvalidArg, "no keys; a store call takes at least one key");
    }
    keys.iter()
        .enumerate()
        .map(|(i, k)| key_digest(k.as_ref()).map_err(|e| crate::error::Error::new(e.status, format!("key {i}: {}", e.message))))
        .collect()
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
        assert!(key_digest(b"k").is_ok());
        assert!(key_digest(&[7u8; 64]).is_ok());
        assert_eq!(key_digest(b"").unwrap_err().status, crate::error::Status::InvalidArg);
        assert_eq!(key_digest(&[7u8; 65]).unwrap_err().status, crate::error::Status::InvalidArg);
        let err = key_digests(&[&b"a"[..], &[0u8; 70][..]]).unwrap_err();
        assert!(err.message.starts_with("key 1:"), "{}", err.message);
    }

    #[test]
    fn a_namespace_and_a_key_of_the_same_bytes_have_different_digests() {
        assert_ne!(namespace_digest(b"abc"), key_digest(b"abc").unwrap());
    }
}
