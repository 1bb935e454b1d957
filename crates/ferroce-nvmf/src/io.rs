//! The NVM command set's I/O commands on a namespace (NVMe NVM command set 1.0 §3): Read,
//! Write, Flush, Write Zeroes and Dataset Management (deallocate). Sans-IO as to the fabric:
//! the transport brings a Write's data (from the capsule or by RDMA READ) and carries a Read's
//! back (by RDMA WRITE); here each command is checked (namespace, range, the host buffer's
//! length) and done on the namespace's storage.

use crate::command::{io, Command};
use crate::completion::Status;
use crate::namespace::Namespace;

/// What a command produced: its status, its completion's result, and data for the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The status.
    pub status: Status,
    /// The completion's command-specific result.
    pub result: u64,
    /// Data to move to the host's buffer (controller-to-host commands).
    pub data: Vec<u8>,
}

impl Response {
    /// Success with `result` and `data`.
    pub fn ok(result: u64, data: Vec<u8>) -> Response {
        Response {
            status: Status::SUCCESS,
            result,
            data,
        }
    }

    /// A failure.
    pub fn fail(status: Status) -> Response {
        Response {
            status,
            result: 0,
            data: Vec::new(),
        }
    }
}

/// Flush's NSID for every namespace.
pub const ALL_NAMESPACES: u32 = 0xFFFF_FFFF;

/// Runs an I/O command on `ns` (the namespace its NSID names, if any), with `sgl_len` the
/// length of the host's buffer and `data` what the transport brought of it (a Write's blocks,
/// Dataset Management's ranges).
pub fn execute(ns: Option<&Namespace>, cmd: &Command, sgl_len: u32, data: &[u8]) -> Response {
    let Some(ns) = ns else {
        return Response::fail(Status::INVALID_NAMESPACE);
    };
    match cmd.opcode {
        io::READ | io::WRITE | io::WRITE_ZEROES => {
            let Some((offset, len)) = ns.byte_range(cmd.slba(), u64::from(cmd.nlb())) else {
                return Response::fail(Status::LBA_OUT_OF_RANGE);
            };
            match cmd.opcode {
                io::READ => {
                    if len > u64::from(sgl_len) {
                        return Response::fail(Status::SGL_LENGTH_INVALID);
                    }
                    match ns.backing.read_vec(offset, len as usize) {
                        Ok(buf) => Response::ok(0, buf),
                        Err(_) => Response::fail(Status::INTERNAL_ERROR),
                    }
                }
                io::WRITE => {
                    if len > u64::from(sgl_len) || (data.len() as u64) < len {
                        return Response::fail(Status::SGL_LENGTH_INVALID);
                    }
                    match ns.backing.write_at(offset, &data[..len as usize]) {
                        Ok(()) => Response::ok(0, Vec::new()),
                        Err(_) => Response::fail(Status::INTERNAL_ERROR),
                    }
                }
                _ => match ns.backing.zero(offset, len) {
                    Ok(()) => Response::ok(0, Vec::new()),
                    Err(_) => Response::fail(Status::INTERNAL_ERROR),
                },
            }
        }
        io::FLUSH => match ns.backing.flush() {
            Ok(()) => Response::ok(0, Vec::new()),
            Err(_) => Response::fail(Status::INTERNAL_ERROR),
        },
        io::DATASET_MANAGEMENT => dataset_management(ns, cmd, data),
        _ => Response::fail(Status::INVALID_OPCODE),
    }
}

/// Dataset Management: `NR + 1` ranges of 16 bytes (context attributes, length in blocks,
/// starting LBA); with the Deallocate attribute each range reads back as zeroes. Every range is
/// checked before any is touched.
fn dataset_management(ns: &Namespace, cmd: &Command, data: &[u8]) -> Response {
    const DEALLOCATE: u32 = 1 << 2;
    let count = (cmd.cdw(10) & 0xFF) as usize + 1;
    if data.len() < count * 16 {
        return Response::fail(Status::SGL_LENGTH_INVALID);
    }
    let mut ranges = Vec::with_capacity(count);
    for r in data[..count * 16].chunks_exact(16) {
        let blocks = u64::from(crate::le::u32_at(r, 4));
        let slba = crate::le::u64_at(r, 8);
        match ns.byte_range(slba, blocks) {
            Some(range) => ranges.push(range),
            None => return Response::fail(Status::LBA_OUT_OF_RANGE),
        }
    }
    if cmd.cdw(11) & DEALLOCATE != 0 {
        for (offset, len) in ranges {
            if ns.backing.zero(offset, len).is_err() {
                return Response::fail(Status::INTERNAL_ERROR);
            }
        }
    }
    Response::ok(0, Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::namespace::MemoryBacking;
    use crate::sgl::Sgl;

    fn ns() -> Namespace {
        Namespace {
            nsid: 1,
            block_shift: 9,
            backing: Box::new(MemoryBacking::new(64 * 512)),
            nguid: [1; 16],
        }
    }

    fn rw(opcode: u8, slba: u64, blocks: u32) -> Command {
        let mut c = Command::new(
            opcode,
            1,
            1,
            Sgl::Keyed {
                addr: 0,
                len: blocks * 512,
                key: 1,
                invalidate: false,
            },
        )
        .unwrap();
        c.cdw[0] = slba as u32;
        c.cdw[1] = (slba >> 32) as u32;
        c.cdw[2] = blocks - 1;
        c
    }

    #[test]
    fn writes_read_back_byte_for_byte() {
        let n = ns();
        let data: Vec<u8> = (0..4 * 512).map(|i| (i * 7 % 251) as u8).collect();
        let w = execute(Some(&n), &rw(io::WRITE, 10, 4), 4 * 512, &data);
        assert_eq!(w.status, Status::SUCCESS);
        let r = execute(Some(&n), &rw(io::READ, 10, 4), 4 * 512, &[]);
        assert_eq!(r.status, Status::SUCCESS);
        assert_eq!(r.data, data);
        assert_eq!(
            execute(Some(&n), &rw(io::FLUSH, 0, 1), 0, &[]).status,
            Status::SUCCESS
        );
    }

    #[test]
    fn out_of_range_short_buffers_and_unknown_namespaces_get_their_status() {
        let n = ns();
        assert_eq!(
            execute(Some(&n), &rw(io::READ, 63, 2), 1024, &[]).status,
            Status::LBA_OUT_OF_RANGE
        );
        assert_eq!(
            execute(Some(&n), &rw(io::READ, u64::MAX, 2), 1024, &[]).status,
            Status::LBA_OUT_OF_RANGE
        );
        assert_eq!(
            execute(Some(&n), &rw(io::READ, 0, 4), 1024, &[]).status,
            Status::SGL_LENGTH_INVALID
        );
        assert_eq!(
            execute(Some(&n), &rw(io::WRITE, 0, 4), 2048, &[0; 100]).status,
            Status::SGL_LENGTH_INVALID
        );
        assert_eq!(
            execute(None, &rw(io::READ, 0, 1), 512, &[]).status,
            Status::INVALID_NAMESPACE
        );
        assert_eq!(
            execute(Some(&n), &rw(0x7E, 0, 1), 512, &[]).status,
            Status::INVALID_OPCODE
        );
    }

    #[test]
    fn write_zeroes_and_deallocate_clear_their_blocks_only() {
        let n = ns();
        let ones = vec![0xFFu8; 8 * 512];
        execute(Some(&n), &rw(io::WRITE, 0, 8), 8 * 512, &ones);
        let z = execute(Some(&n), &rw(io::WRITE_ZEROES, 1, 1), 0, &[]);
        assert_eq!(z.status, Status::SUCCESS);
        let mut dsm = rw(io::DATASET_MANAGEMENT, 0, 1);
        dsm.cdw = [0, 1 << 2, 0, 0, 0, 0]; // one range, deallocate
        let mut range = [0u8; 16];
        range[4..8].copy_from_slice(&2u32.to_le_bytes());
        range[8..16].copy_from_slice(&5u64.to_le_bytes());
        assert_eq!(execute(Some(&n), &dsm, 16, &range).status, Status::SUCCESS);
        let r = execute(Some(&n), &rw(io::READ, 0, 8), 8 * 512, &[]).data;
        for (block, chunk) in r.chunks(512).enumerate() {
            let zero = matches!(block, 1 | 5 | 6);
            assert!(
                chunk.iter().all(|&b| b == if zero { 0 } else { 0xFF }),
                "block {block}"
            );
        }
        range[8..16].copy_from_slice(&63u64.to_le_bytes());
        assert_eq!(
            execute(Some(&n), &dsm, 16, &range).status,
            Status::LBA_OUT_OF_RANGE
        );
    }
}
