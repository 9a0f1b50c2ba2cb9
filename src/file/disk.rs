//! Disk storage: one file per layout, opened with `O_DIRECT` unless asked otherwise or
//! refused by the filesystem, plus a buffered descriptor for the few writes that cannot
//! be aligned (a layer range whose regions are not multiples of the alignment), and the
//! moves of a chunk's extents between the file and slot memory on an I/O port.

use super::checksum::WriteIds;
use super::place::{self, open_at, Found, Place};
use crate::error::{bail, Error, Result};
use crate::fault::power_cut;
use crate::host::{map_anonymous, unmap};
use crate::io::{posix, streamed, Extent, FileKey, Io, Port};
use crate::layout::Placement;
use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How a disk layout's file is opened and kept (`KVX_DISK_*` at the C ABI).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskFlags(u8);

impl DiskFlags {
    pub const NONE: DiskFlags = DiskFlags(0);
    /// Create the file, sized for the layout (a new file in place of one found at the
    /// path, or that one truncated: `place::found`); removed on destroy unless `KEEP`.
    pub const CREATE: DiskFlags = DiskFlags(1);
    /// Keep a created file when the layout is destroyed.
    pub const KEEP: DiskFlags = DiskFlags(2);
    /// Page-cache I/O instead of `O_DIRECT`.
    pub const BUFFERED: DiskFlags = DiskFlags(4);
    /// Every write to the file is durable when its request completes.
    pub const SYNC: DiskFlags = DiskFlags(8);
    /// Region hashes and block seals in a sidecar, verified on every read.
    pub const CHECKSUM: DiskFlags = DiskFlags(16);
    /// A tmpfs/hugetlbfs file mapped and pinned, moved as memory.
    pub const MAPPED: DiskFlags = DiskFlags(32);

    /// Whether every flag of `f` is set.
    pub const fn contains(self, f: DiskFlags) -> bool {
        self.0 & f.0 == f.0
    }
}

impl std::ops::BitOr for DiskFlags {
    type Output = DiskFlags;
    fn bitor(self, o: DiskFlags) -> DiskFlags {
        DiskFlags(self.0 | o.0)
    }
}

impl std::ops::BitOrAssign for DiskFlags {
    fn bitor_assign(&mut self, o: DiskFlags) {
        self.0 |= o.0;
    }
}

/// The alignment kvxfer uses for direct I/O unless the filesystem asks for more.
pub const DEFAULT_IO_ALIGN: u64 = 4096;

#[derive(Debug)]
pub struct DiskFile {
    path: PathBuf,
    direct: Option<File>,
    buffered: File,
    /// Block padding and I/O alignment. A property of the file, never of how it is
    /// opened: the alignment its file system reports, or the padding the file was
    /// written with where its sidecar records that (`use_align`).
    align: u64,
    /// The alignment the file system reports for direct I/O.
    reported: u64,
    /// The folder and name of a file this layout created, where it is removed.
    place: Option<Place>,
    /// Removed when dropped. Until `commit`: a file this call created, so a failed call
    /// leaves nothing behind. After: a file the layout created, unless `KEEP`.
    remove_on_drop: bool,
    /// What `remove_on_drop` becomes at `commit`.
    remove_when_done: bool,
    /// `CREATE` found a file at the path that `prepare` replaces by a new one (the found
    /// file's owner and mode).
    replace: Option<std::fs::Metadata>,
    /// `CREATE` found a file at the path that `prepare` truncates in place.
    truncate: bool,
    pub sync: bool,
    /// The first failed sync's error, held across syncs (which it serialises): the kernel
    /// reports a lost write-back once, to the sync that finds it, and a later sync would
    /// succeed over the lost pages. Every later sync fails with it, until the file is
    /// opened again.
    sync_failed: std::sync::Mutex<Option<Error>>,
    /// `KVX_DISK_CHECKSUM`: the sidecar of region hashes and block seals.
    pub checksum: Option<super::checksum::Sidecar>,
    /// This file's identity for the ports that register files (sized in `prepare`).
    key: Arc<FileKey>,
}

/// A file's block padding and I/O alignment: the alignment its file system reports for
/// direct I/O (whatever the descriptor), at least 4096.
fn file_align(f: &File) -> u64 {
    let reported = posix::dio_align(f.as_fd()).unwrap_or(0);
    reported.max(DEFAULT_IO_ALIGN).next_power_of_two().min(crate::layout::MAX_IO_ALIGN)
}

impl DiskFile {
    /// Opens (or with `DiskFlags::CREATE` creates) `path`; a file found there is not
    /// changed before `prepare`. The caller then asks `align()` for the block padding, calls `prepare`
    /// with the layout's byte size, and `commit` once the layout is made.
    pub fn open(path: &Path, flags: DiskFlags) -> Result<DiskFile> {
        let cpath = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| Error::new(crate::error::Status::InvalidArg, "disk path contains a NUL byte"))?;
        let create = flags.contains(DiskFlags::CREATE);
        let shown = path.display();
        let opening = |e| Error::io(format_args!("opening {shown}"), e);
        // A file it creates is opened by its name in its folder, where it is removed.
        let place = if create { Some(Place::of(path)?) } else { None };
        let (dir, name) = match &place {
            Some(p) => (Some(p.dir()), p.name()),
            None => (None, cpath.as_c_str()),
        };
        let (buffered, found) = if create {
            match power_cut::create(path, || open_at(dir, name, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL)) {
                Ok(f) => (f, None),
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    let f = open_at(dir, name, libc::O_RDWR | libc::O_CREAT).map_err(opening)?;
                    let found = place::found(path, &f).map_err(opening)?;
                    (f, Some(found))
                }
                Err(e) => return Err(opening(e)),
            }
        } else {
            (open_at(dir, name, libc::O_RDWR).map_err(opening)?, None)
        };
        let created = create && found.is_none();
        let truncate = matches!(found, Some(Found::InPlace));
        let direct = if flags.contains(DiskFlags::BUFFERED) {
            None
        } else {
            match open_at(dir, name, libc::O_RDWR | libc::O_DIRECT) {
                Ok(f) => Some(f),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    log::warn!("{shown}: the filesystem refuses O_DIRECT; using buffered I/O");
                    None
                }
                Err(e) => return Err(Error::io(format_args!("opening {shown} with O_DIRECT"), e)),
            }
        };
        let align = file_align(&buffered);
        Ok(DiskFile {
            path: path.to_path_buf(),
            direct,
            buffered,
            align,
            reported: align,
            place,
            replace: match found {
                Some(Found::Replace(old)) => Some(old),
                _ => None,
            },
            truncate,
            remove_on_drop: created,
            remove_when_done: create && !truncate && !flags.contains(DiskFlags::KEEP),
            sync: flags.contains(DiskFlags::SYNC),
            sync_failed: Default::default(),
            checksum: None,
            key: FileKey::new(0),
        })
    }

    /// Sizes a created file to `bytes` (fallocate, else ftruncate): a new file, one in
    /// place of a file found at the path (`replace_file`), or a found file truncated; or
    /// checks that an existing one is large enough; then proves that direct I/O really
    /// works here.
    pub fn prepare(&mut self, bytes: u64, create: bool) -> Result<()> {
        use std::os::fd::AsRawFd;
        self.key = FileKey::new(bytes);
        if let Some(old) = self.replace.take() {
            self.replace_file(&old)?;
        }
        let shown = self.path.display();
        if create {
            let (fd, at) = (self.buffered.as_raw_fd(), self.buffered.as_fd());
            // SAFETY: plain syscalls on an owned descriptor.
            if self.truncate && power_cut::resize(at, 0, || unsafe { libc::ftruncate(fd, 0) }) != 0 {
                return Err(Error::io(format_args!("truncating {shown}"), std::io::Error::last_os_error()));
            }
            if power_cut::resize(at, bytes, || unsafe { libc::fallocate(fd, 0, 0, bytes as libc::off_t) }) != 0 {
                let err = std::io::Error::last_os_error();
                if !matches!(err.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)) {
                    return Err(Error::io(format_args!("reserving {bytes} bytes for {shown}"), err));
                }
                if power_cut::resize(at, bytes, || unsafe { libc::ftruncate(fd, bytes as libc::off_t) }) != 0 {
                    return Err(Error::io(format_args!("sizing {shown} to {bytes} bytes"), std::io::Error::last_os_error()));
                }
            }
        } else {
            let len = self.buffered.metadata().map_err(|e| Error::io(format_args!("stat {shown}"), e))?.len();
            if len < bytes {
                bail!(
                    InvalidArg,
                    "{shown} is {len} bytes but the layout needs {bytes}; pass KVX_DISK_CREATE to create it, or check the geometry"
                );
            }
        }
        self.probe_direct()
    }

    /// Puts a new, empty file at the path in place of the one found there (`old` its
    /// owner and mode), which goes as a truncation would have emptied it. Whatever still
    /// has the old one open keeps it intact (a request of a destroyed layout of that
    /// file, say), and that layout's removal, finding the path naming another file,
    /// leaves the new one alone. A folder that refuses the unlink leaves the file to be
    /// truncated in place.
    fn replace_file(&mut self, old: &std::fs::Metadata) -> Result<()> {
        let place = self.place.as_ref().expect("only a file being created is replaced");
        let shown = self.path.display();
        match place.unlink_if_names(place.name(), &self.buffered) {
            Err(e) if place::refused(&e) => {
                log::info!("{shown}: cannot be replaced ({e}); truncated in place");
                self.truncate = true;
                self.remove_when_done = false;
                return Ok(());
            }
            Err(e) => return Err(Error::io(format_args!("replacing {shown}"), e)),
            // Named another file by now: the exclusive create below refuses it.
            Ok(_) => {}
        }
        let (dir, name) = (Some(place.dir()), place.name());
        // Exclusive: a file someone put at the path meanwhile is theirs.
        self.buffered = power_cut::create(&self.path, || open_at(dir, name, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL))
            .map_err(|e| Error::io(format_args!("creating {shown}"), e))?;
        self.remove_on_drop = true;
        place::take_over(&self.buffered, old, &self.path)?;
        if self.direct.is_some() {
            self.direct = Some(
                open_at(dir, name, libc::O_RDWR | libc::O_DIRECT)
                    .map_err(|e| Error::io(format_args!("opening {shown} with O_DIRECT"), e))?,
            );
        }
        Ok(())
    }

    /// Some filesystems accept `O_DIRECT` at open and refuse it at the first read.
    fn probe_direct(&mut self) -> Result<()> {
        let Some(f) = &self.direct else { return Ok(()) };
        let buf = map_anonymous(self.align)?;
        // SAFETY: `buf` is a fresh mapping of `align` bytes.
        let res = unsafe { posix::read_exact_at(f.as_fd(), buf, self.align, 0) };
        unsafe { unmap(buf, self.align) };
        if let Err(e) = res {
            log::warn!("{}: O_DIRECT read failed ({}); using buffered I/O", self.path.display(), e.message);
            self.direct = None;
        }
        Ok(())
    }

    /// The layout is made: from now on a file it created goes with it unless `KEEP`.
    pub fn commit(&mut self) {
        self.remove_on_drop = self.remove_when_done;
    }

    /// Block padding and I/O alignment of this file.
    pub fn align(&self) -> u64 {
        self.align
    }

    /// The file's blocks are padded to `align` (as its sidecar records), whatever this
    /// file system reports. Padding below what direct I/O needs here leaves the file to
    /// buffered I/O.
    pub fn use_align(&mut self, align: u64) {
        if align != self.reported {
            log::info!("{}: blocks padded to {align} bytes as written (this file system reports {})", self.path.display(), self.reported);
        }
        if align < self.reported && self.direct.take().is_some() {
            log::info!("{}: O_DIRECT needs {}-byte alignment here; using buffered I/O", self.path.display(), self.reported);
        }
        self.align = align;
    }

    /// For a file whose block padding nothing records: the blocks of `block_bytes` are
    /// padded to 4096, not to what this file system reports, where the file is exactly
    /// `blocks` blocks at the one padding and not at the other. kvxfer 1.3 and older
    /// padded to 4096 whenever the file was not opened with `O_DIRECT`, and a file
    /// written where 4096 is reported moves; kvxfer sizes every file it creates exactly.
    pub fn find_align(&mut self, block_bytes: u64, blocks: u64) -> Result<()> {
        if self.align == DEFAULT_IO_ALIGN {
            return Ok(());
        }
        let len = self.buffered.metadata().map_err(|e| Error::io(format_args!("stat {}", self.path.display()), e))?.len();
        let fits = |align| crate::layout::align_up(block_bytes, align).and_then(|stride| stride.checked_mul(blocks)) == Some(len);
        if fits(DEFAULT_IO_ALIGN) && !fits(self.align) {
            self.use_align(DEFAULT_IO_ALIGN);
        }
        Ok(())
    }

    /// The file's length now (a file cut short since it was opened is shorter).
    pub fn file_len(&self) -> Result<u64> {
        Ok(self.buffered.metadata().map_err(|e| Error::io(format_args!("stat {}", self.path.display()), e))?.len())
    }

    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The descriptor for aligned I/O (direct when available).
    pub fn aligned_fd(&self) -> BorrowedFd<'_> {
        self.direct.as_ref().unwrap_or(&self.buffered).as_fd()
    }

    /// The descriptor for I/O at any offset and length.
    pub fn buffered_fd(&self) -> BorrowedFd<'_> {
        self.buffered.as_fd()
    }

    /// The descriptor for an I/O that is (`aligned`) or is not aligned in file, memory and
    /// length.
    pub fn fd_for(&self, aligned: bool) -> BorrowedFd<'_> {
        if aligned {
            self.aligned_fd()
        } else {
            self.buffered_fd()
        }
    }

    /// This file's identity for the ports that register files (NIXL, cuFile).
    pub fn key(&self) -> &Arc<FileKey> {
        &self.key
    }

    /// `e` as an I/O, on the descriptor its alignment allows.
    fn io(&self, e: &Extent) -> Io {
        use std::os::fd::AsRawFd;
        Io { fd: self.fd_for(e.aligned).as_raw_fd(), addr: e.addr, len: e.len, off: e.file_off }
    }

    /// A failure of an I/O on this file, naming it.
    pub(super) fn in_file(&self, err: Error) -> Error {
        Error::new(err.status, format!("{}: {}", self.path.display(), err.message))
    }

    /// Whether extent `e` goes through `port`: `O_DIRECT` I/O does, and all I/O of a
    /// port whose caller asked for it (NIXL). Page-cache I/O is a copy the kernel makes
    /// on the calling thread either way, so it goes by `pread`/`pwrite`: io_uring would
    /// only add its round trip: per-layer requests from a hot file cost a fifth more CPU
    /// through the ring (`docs/decisions.md#io_uring-for-page-cache-io`).
    pub(crate) fn on_port(&self, port: &Port, e: &Extent) -> bool {
        port.makes_all_io() || (e.aligned && self.is_direct())
    }

    /// Moves `extents` between this file and slot memory: on `port`, or by
    /// `pread`/`pwrite` here for page-cache I/O (`on_port`). With `stream`, page-cache
    /// reads go by `io::streamed`, which leaves the slot's lines in memory instead of
    /// modified in this core's cache: a DMA that reads the slot right away reads them
    /// twice as fast there.
    ///
    /// # Safety
    /// The extents must lie in slot memory the caller owns.
    pub(super) unsafe fn move_extents(&self, port: &mut Port, write: bool, stream: bool, extents: &[Extent]) -> Result<()> {
        let (mut ported, mut cached) = (Vec::with_capacity(extents.len()), Vec::new());
        for e in extents {
            let side = if self.on_port(port, e) { &mut ported } else { &mut cached };
            side.push(self.io(e));
        }
        if !ported.is_empty() {
            port.run(write, &self.key, &ported).map_err(|e| self.in_file(e))?;
        }
        if stream && !write {
            return cached
                .iter()
                .try_for_each(|io| streamed::read_exact_at(BorrowedFd::borrow_raw(io.fd), io.addr as *mut u8, io.len, io.off))
                .map_err(|e| self.in_file(e));
        }
        Port::Posix.run(write, &self.key, &cached).map_err(|e| self.in_file(e))
    }

    /// Reads `extents` into slot memory on `port`; a checksummed file checks every
    /// region it returns against its checksum and its block's seal. `stream`: as
    /// for `move_extents`.
    ///
    /// # Safety
    /// The extents must lie in slot memory the caller owns; `pl` is this file's placement.
    pub unsafe fn read_extents(&self, port: &mut Port, pl: &Placement, extents: &[Extent], stream: bool) -> Result<()> {
        match &self.checksum {
            None => self.move_extents(port, false, stream, extents),
            Some(sums) => sums.read_verified(self, port, pl, extents),
        }
    }

    /// Writes `extents` from slot memory on `port`, zeroing the block padding that
    /// aligned writes carry; a checksummed file stores each region's checksum after it,
    /// tagged with the write's identity for the blocks `ids` names.
    ///
    /// # Safety
    /// As for `read_extents`; the padding after each extent's data is the caller's too.
    pub unsafe fn write_extents(&self, port: &mut Port, pl: &Placement, extents: &[Extent], ids: Option<&WriteIds>) -> Result<()> {
        for e in extents.iter().filter(|e| e.zero_tail > 0) {
            std::ptr::write_bytes((e.addr + e.len - e.zero_tail) as *mut u8, 0, e.zero_tail as usize);
        }
        match &self.checksum {
            None => self.move_extents(port, true, false, extents),
            Some(sums) => sums.write_hashed(self, port, pl, extents, ids),
        }
    }

    /// Makes everything written so far durable (both descriptors share the inode), and
    /// the checksums with it. After a failed sync, fails with its error (`sync_failed`).
    pub fn sync_data(&self) -> Result<()> {
        let mut failed = self.sync_failed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = failed.as_ref() {
            let why = format!(
                "{}: an earlier sync of this file failed ({}), so what was written since may be lost too: nothing written to it is durable until it is opened again",
                self.path.display(),
                e.message
            );
            return Err(Error::new(e.status, why));
        }
        let synced = posix::sync_data(self.buffered.as_fd())
            .map_err(|e| Error::new(e.status, format!("{}: {}", self.path.display(), e.message)))
            .and_then(|()| self.checksum.as_ref().map_or(Ok(()), |s| s.sync()));
        if let Err(e) = &synced {
            *failed = Some(e.clone());
        }
        synced
    }

    /// Makes a file this layout created durable as a name (`SYNC`): its size and its
    /// sidecar's header, then its folder, whose entries for both are durable only once
    /// the folder itself is synced (where the folder can be read: `Place::sync`).
    pub fn sync_created(&self) -> Result<()> {
        self.sync_data()?;
        match &self.place {
            Some(place) => place.sync(&self.path),
            None => Ok(()),
        }
    }
}

impl Drop for DiskFile {
    /// Removes the file (and its sidecar) if the layout created it, where it created
    /// it, and only while the path still names it: a file created at the path since is
    /// the caller's.
    fn drop(&mut self) {
        let Some(place) = self.place.as_ref().filter(|_| self.remove_on_drop) else { return };
        place.remove(place.name(), &self.buffered, &self.path);
        if let Some(sidecar) = &self.checksum {
            place.remove(&place.beside(super::checksum::SUFFIX), sidecar.file(), sidecar.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(aligned: bool) -> Extent {
        Extent { file_off: 0, addr: 0, len: 4096, aligned, zero_tail: 0, payload: (0, 0, 4096) }
    }

    #[test]
    fn page_cache_io_goes_by_pread_and_direct_io_through_the_port() {
        // The rule is the same for every port but NIXL's, so the POSIX port stands for io_uring.
        let port = Port::Posix;
        let path = std::env::temp_dir().join(format!("kvx-unit-{}-on-port", std::process::id()));
        let buffered = DiskFile::open(&path, DiskFlags::CREATE | DiskFlags::BUFFERED).unwrap();
        for e in [extent(true), extent(false)] {
            assert!(!buffered.on_port(&port, &e), "a buffered file's I/O is page-cache I/O");
        }
        drop(buffered);
        // O_DIRECT where the file system takes it; else every I/O is page-cache I/O.
        let file = DiskFile::open(&path, DiskFlags::CREATE).unwrap();
        assert_eq!(file.on_port(&port, &extent(true)), file.is_direct(), "aligned I/O goes through the port exactly when O_DIRECT is open");
        assert!(!file.on_port(&port, &extent(false)), "unaligned I/O goes to the page cache");
    }
}
