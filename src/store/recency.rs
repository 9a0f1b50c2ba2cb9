//! The eviction order kept across a restart: the file `order` lists the live slots from
//! the least to the most recently used, each with its entry's generation, so a reopened
//! store evicts what was used least before it closed, not what was written first.
//!
//! ```text
//! 0..8  magic "KVXORDR1"   8..16  count n   16..16+12n  (slot u32, generation u64)…   CRC-32
//! ```
//! It is written whole at every clean close, and while the store is open every minute in
//! which a get or a lease used an entry (to a temporary name, then renamed), so after a
//! crash the order is the one of the last write, and entries written since are the newest.
//! A slot listed with another generation than its record's is someone else's entry by
//! now and is ignored; a file that fails its CRC is ignored whole (the write order is used).

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"KVXORDR1";
const ENTRY: usize = 12;

pub fn path(dir: &Path) -> PathBuf {
    dir.join("order")
}

/// Writes `order` (slot, generation), least recently used first, in place of the last.
pub fn write(dir: &Path, order: &[(u32, u64)]) -> Result<()> {
    let mut b = Vec::with_capacity(16 + order.len() * ENTRY + 4);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&(order.len() as u64).to_le_bytes());
    for (slot, generation) in order {
        b.extend_from_slice(&slot.to_le_bytes());
        b.extend_from_slice(&generation.to_le_bytes());
    }
    b.extend_from_slice(&crc32fast::hash(&b).to_le_bytes());
    let (tmp, to) = (dir.join("order.tmp"), path(dir));
    std::fs::write(&tmp, &b).map_err(|e| Error::io(format_args!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, &to).map_err(|e| Error::io(format_args!("renaming {} to {}", tmp.display(), to.display()), e))
}

/// The order last written, or nothing where there is none or it is damaged.
pub fn read(dir: &Path) -> Vec<(u32, u64)> {
    let p = path(dir);
    let Ok(b) = std::fs::read(&p) else { return Vec::new() };
    let parsed = (|| {
        let body = b.get(..b.len().checked_sub(4)?)?;
        let crc = u32::from_le_bytes(b[body.len()..].try_into().ok()?);
        let n = u64::from_le_bytes(body.get(8..16)?.try_into().ok()?) as usize;
        if &body[..8] != MAGIC || crc != crc32fast::hash(body) || body.len() != 16 + n.checked_mul(ENTRY)? {
            return None;
        }
        let entry = |e: &[u8]| (u32::from_le_bytes(e[..4].try_into().unwrap()), u64::from_le_bytes(e[4..].try_into().unwrap()));
        Some(body[16..].chunks_exact(ENTRY).map(entry).collect())
    })();
    parsed.unwrap_or_else(|| {
        log::warn!("{} is damaged; entries are ordered by when they were written", p.display());
        Vec::new()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_order_round_trips_and_a_damaged_one_reads_as_none() {
        let dir = std::env::temp_dir().join(format!("kvx-order-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let order = vec![(3, 9), (0, 12), (7, 1)];
        write(&dir, &order).unwrap();
        assert_eq!(read(&dir), order);
        let mut b = std::fs::read(path(&dir)).unwrap();
        b[20] ^= 1;
        std::fs::write(path(&dir), &b).unwrap();
        assert!(read(&dir).is_empty());
        std::fs::write(path(&dir), &b[..10]).unwrap();
        assert!(read(&dir).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
