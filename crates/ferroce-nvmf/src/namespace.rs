//! A namespace's storage: a file, a block device (also a file to the kernel) or memory. The
//! controller checks every range against the namespace's size before it reaches here.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

/// Where a namespace's blocks live.
pub trait Backing: Send + Sync {
    /// Its size in bytes.
    fn len(&self) -> u64;
    /// Whether it holds nothing.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Reads `buf.len()` bytes at `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// The `len` bytes at `offset`, in a new buffer (a Read's data on its way to the host).
    fn read_vec(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read_at(offset, &mut v)?;
        Ok(v)
    }
    /// Writes `buf` at `offset`.
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()>;
    /// Makes what was written durable (Flush).
    fn flush(&self) -> io::Result<()>;
    /// Sets `len` bytes at `offset` to zero (Write Zeroes, and Dataset Management's
    /// deallocate, which reads back as zeroes here).
    fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        const CHUNK: u64 = 1 << 20;
        let zeroes = vec![0u8; CHUNK.min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = CHUNK.min(len - done) as usize;
            self.write_at(offset + done, &zeroes[..n])?;
            done += n as u64;
        }
        Ok(())
    }
}

/// A namespace in memory (`--memory SIZE`).
pub struct MemoryBacking {
    bytes: Mutex<Vec<u8>>,
}

impl MemoryBacking {
    /// `len` bytes of zeroes.
    pub fn new(len: usize) -> MemoryBacking {
        MemoryBacking {
            bytes: Mutex::new(vec![0; len]),
        }
    }
}

impl Backing for MemoryBacking {
    fn len(&self) -> u64 {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner()).len() as u64
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let b = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        let at = range(offset, buf.len(), b.len())?;
        buf.copy_from_slice(&b[at]);
        Ok(())
    }

    /// One copy, where the default zeroes the buffer first and then copies into it.
    fn read_vec(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let b = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        let at = range(offset, len, b.len())?;
        Ok(b[at].to_vec())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        let mut b = self.bytes.lock().unwrap_or_else(|e| e.into_inner());
        let at = range(offset, buf.len(), b.len())?;
        b[at].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
}

/// The byte range `offset..offset + len` of something `size` bytes long, or an error.
fn range(offset: u64, len: usize, size: usize) -> io::Result<std::ops::Range<usize>> {
    let start = usize::try_from(offset).map_err(|_| io::ErrorKind::InvalidInput)?;
    let end = start.checked_add(len).ok_or(io::ErrorKind::InvalidInput)?;
    if end > size {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(start..end)
}

/// A namespace over a file or a block device.
pub struct FileBacking {
    file: File,
    len: u64,
}

impl FileBacking {
    /// The file at `path`, opened for reading and writing; its size now is the namespace's.
    pub fn open(path: &std::path::Path) -> io::Result<FileBacking> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        // A block device's size is where seeking to its end lands (its metadata says 0).
        let len = {
            use std::io::Seek;
            let mut f = &file;
            f.seek(io::SeekFrom::End(0))?
        };
        Ok(FileBacking { file, len })
    }
}

impl Backing for FileBacking {
    fn len(&self) -> u64 {
        self.len
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }

    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

/// A namespace: its ID, block size and storage.
pub struct Namespace {
    /// Its ID (1 and up).
    pub nsid: u32,
    /// log2 of the logical block size (9: 512 bytes, 12: 4096).
    pub block_shift: u8,
    /// Its storage.
    pub backing: Box<dyn Backing>,
    /// A globally unique identifier (Identify's NGUID and the descriptor list).
    pub nguid: [u8; 16],
}

impl Namespace {
    /// The number of logical blocks (whole blocks of the backing).
    pub fn blocks(&self) -> u64 {
        self.backing.len() >> self.block_shift
    }

    /// The byte range of `count` blocks from `slba`, if the namespace holds them all.
    pub fn byte_range(&self, slba: u64, count: u64) -> Option<(u64, u64)> {
        let end = slba.checked_add(count)?;
        if end > self.blocks() {
            return None;
        }
        Some((slba << self.block_shift, count << self.block_shift))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_reads_what_was_written_and_refuses_past_its_end() {
        let m = MemoryBacking::new(8192);
        m.write_at(4096, &[7u8; 512]).unwrap();
        let mut b = [0u8; 512];
        m.read_at(4096, &mut b).unwrap();
        assert_eq!(b, [7u8; 512]);
        assert!(m.read_at(8000, &mut b).is_err());
        assert!(m.write_at(u64::MAX, &b).is_err());
        m.zero(4096, 512).unwrap();
        m.read_at(4096, &mut b).unwrap();
        assert_eq!(b, [0u8; 512]);
    }

    #[test]
    fn a_file_namespace_is_the_file() {
        let path = std::env::temp_dir().join(format!("ferroce-nvmf-ns-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 1 << 16]).unwrap();
        let f = FileBacking::open(&path).unwrap();
        assert_eq!(f.len(), 1 << 16);
        f.write_at(512, b"ferroce").unwrap();
        f.flush().unwrap();
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!(&on_disk[512..519], b"ferroce");
        let ns = Namespace {
            nsid: 1,
            block_shift: 9,
            backing: Box::new(f),
            nguid: [1; 16],
        };
        assert_eq!(ns.blocks(), 128);
        assert_eq!(ns.byte_range(127, 1), Some((127 * 512, 512)));
        assert_eq!(ns.byte_range(127, 2), None);
        assert_eq!(ns.byte_range(u64::MAX, 2), None);
        std::fs::remove_file(&path).unwrap();
    }
}
