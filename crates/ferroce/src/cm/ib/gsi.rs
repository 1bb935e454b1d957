//! A [`MadPort`] on ferroce's own verbs: QP1 of a [`Context`], for Rust programs that connect
//! with IB CM (the drop-in librdmacm drives QP1 through the C verbs instead).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Mutex;
use std::time::Duration;

use ferroce_proto::{Access, QpCaps, RecvWr, WcOpcode, WcStatus};
use ferroce_wire::deth::GSI_QKEY;
use ferroce_wire::mad::MAD_LEN;

use super::agent::MadPort;
use crate::verbs::ud::{UdQueuePair, UdSendWr, GRH_LEN};
use crate::{
    CompletionChannel, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpInitAttr,
};

/// Receives kept posted on QP1.
const RECEIVES: usize = 64;
const SLOT: usize = GRH_LEN + MAD_LEN;

/// QP1 of a context, with its receive buffers.
pub struct GsiPort {
    // Field order is drop order: the QP goes before its CQs and buffers.
    qp: UdQueuePair,
    recv_cq: CompletionQueue,
    _send_cq: CompletionQueue,
    channel: CompletionChannel,
    buffers: MemoryRegion,
    pd: ProtectionDomain,
    /// Serialises receivers (the agent has one thread; this keeps `recv` sound for any caller).
    recv_lock: Mutex<()>,
}

impl std::fmt::Debug for GsiPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GsiPort").finish_non_exhaustive()
    }
}

/// The source GID of a UD receive, from the 40 bytes of GRH it starts with (the IPv4 header
/// in the last 20 over IPv4, the IPv6 header over IPv6).
pub fn source_gid(grh: &[u8; GRH_LEN]) -> [u8; 16] {
    // An IPv6 GRH starts with its version (6); over IPv4 the first 20 bytes are zero.
    let ip: IpAddr = if grh[0] >> 4 != 6 && grh[20] >> 4 == 4 {
        IpAddr::V4(Ipv4Addr::new(grh[32], grh[33], grh[34], grh[35]))
    } else {
        let mut a = [0u8; 16];
        a.copy_from_slice(&grh[8..24]);
        IpAddr::V6(Ipv6Addr::from(a))
    };
    super::ip::gid_of(ip)
}

impl GsiPort {
    /// Creates QP1 on `ctx` (which must not have one yet) and posts its receives.
    pub fn open(ctx: &Context) -> crate::Result<GsiPort> {
        let pd = ctx.alloc_pd()?;
        let channel = ctx.create_comp_channel()?;
        let recv_cq = ctx.create_cq(RECEIVES, Some(&channel))?;
        let send_cq = ctx.create_cq(16, None)?;
        let caps = QpCaps {
            max_send_wr: 64,
            max_recv_wr: RECEIVES as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: MAD_LEN as u32,
        };
        let qp = pd.create_gsi_qp(&QpInitAttr {
            send_cq: &send_cq,
            recv_cq: &recv_cq,
            caps,
            srq: None,
        })?;
        qp.modify_to_init(GSI_QKEY)?;
        qp.modify_to_rtr()?;
        qp.modify_to_rts(ferroce_wire::Psn::new(0))?;
        let buffers = pd.alloc_mr(RECEIVES * SLOT, Access::LOCAL_WRITE)?;
        let port = GsiPort {
            qp,
            recv_cq,
            _send_cq: send_cq,
            channel,
            buffers,
            pd,
            recv_lock: Mutex::new(()),
        };
        for i in 0..RECEIVES {
            port.post(i)?;
        }
        port.recv_cq.req_notify(false)?;
        Ok(port)
    }

    fn post(&self, slot: usize) -> crate::Result<()> {
        let sge = self.buffers.sge(slot * SLOT, SLOT)?;
        self.qp.post_recv(RecvWr {
            wr_id: slot as u64,
            sgl: vec![sge],
        })
    }
}

fn io_err(e: crate::Error) -> io::Error {
    io::Error::other(e.to_string())
}

impl MadPort for GsiPort {
    fn send(&self, dest_gid: [u8; 16], mad: &[u8; MAD_LEN]) -> io::Result<()> {
        let ah = self
            .pd
            .create_ah(Ipv6Addr::from(dest_gid))
            .map_err(io_err)?;
        self.qp
            .post_send(&UdSendWr {
                wr_id: 0,
                ah,
                remote_qpn: 1,
                remote_qkey: GSI_QKEY,
                imm_data: None,
                sgl: Vec::new(),
                inline_data: Some(mad.to_vec()),
                signaled: false,
                solicited: false,
            })
            .map_err(io_err)
    }

    fn recv(&self, timeout: Duration) -> io::Result<Option<([u8; 16], Vec<u8>)>> {
        let _one = self.recv_lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(wc) = self.recv_cq.poll_one().map_err(io_err)? {
                let slot = wc.wr_id as usize;
                let got = if wc.status == WcStatus::Success
                    && wc.opcode == WcOpcode::Recv
                    && wc.byte_len as usize >= GRH_LEN + MAD_LEN
                {
                    let bytes = self.buffers.to_vec(slot * SLOT, SLOT).map_err(io_err)?;
                    let mut grh = [0u8; GRH_LEN];
                    grh.copy_from_slice(&bytes[..GRH_LEN]);
                    Some((source_gid(&grh), bytes[GRH_LEN..].to_vec()))
                } else {
                    None
                };
                if slot < RECEIVES {
                    self.post(slot).map_err(io_err)?;
                }
                if got.is_some() {
                    return Ok(got);
                }
                continue;
            }
            if !self.channel.get_event(Some(timeout)).map_err(io_err)? {
                return Ok(None);
            }
            self.recv_cq.req_notify(false).map_err(io_err)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_of_an_ipv4_and_of_an_ipv6_grh() {
        let mut v4 = [0u8; GRH_LEN];
        v4[20] = 0x45;
        v4[32..36].copy_from_slice(&[10, 1, 2, 3]);
        let want: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(source_gid(&v4), super::super::ip::gid_of(want));
        // An IPv6 source whose 13th byte looks like an IPv4 header's first.
        let src: Ipv6Addr = "2001:db8::4a00:1".parse().unwrap();
        let mut v6 = [0u8; GRH_LEN];
        v6[0] = 0x60;
        v6[8..24].copy_from_slice(&src.octets());
        assert_eq!(source_gid(&v6), src.octets());
    }
}
