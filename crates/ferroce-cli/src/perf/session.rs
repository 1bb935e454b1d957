//! One side's resources: the device it picks, the context, PD, CQ and QPs it sets up and
//! connects over the TCP exchange, and the small helpers every round uses on them.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ferroce::cm::{self, EndpointInfo, Listener, RemoteRegion};
use ferroce::{
    Access, CompletionQueue, ConnectOptions, Context, ContextOptions, Device, MemoryRegion,
    ProtectionDomain, Psn, QpCaps, QpInitAttr, QueuePair, SendFlags, WcStatus, WorkCompletion,
};

use super::*;

/// The device to use: named, holding `--bind`'s address, or the one that routes to `peer`
/// (loopback when there is neither).
pub(super) fn pick_device(args: &PerfArgs, peer: Option<IpAddr>) -> Res<(Device, usize)> {
    let ip = match (args.bind, peer) {
        (Some(ip), _) => ip,
        (None, Some(p)) => crate::route::source_for(p)?,
        (None, None) => IpAddr::from([127, 0, 0, 1]),
    };
    crate::route::device_for(args.device.as_deref(), ip)
}

/// One side's resources, connected.
pub(super) struct Session {
    pub(super) ctx: Context,
    pub(super) _pd: ProtectionDomain,
    pub(super) cq: CompletionQueue,
    pub(super) qps: Vec<QueuePair>,
    pub(super) buf: MemoryRegion,
    /// Bytes of buffer per QP: a receive area then a send area, each `area` long.
    pub(super) slot: usize,
    /// The largest message size rounded up to whole pairs of cache lines, so the area the peer
    /// writes and the one this side writes never share a line (or an adjacent-line prefetch
    /// pair): a latency test's flag bytes would otherwise bounce one line between the cores.
    pub(super) area: usize,
    pub(super) remote: RemoteRegion,
    pub(super) conn: cm::Connection,
    pub(super) mtu: ferroce::PathMtu,
    pub(super) local: Vec<EndpointInfo>,
    /// `--wait-like-perftest`.
    pub(super) wait_like_perftest: bool,
    /// The CQ's completion channel, with `--events`.
    pub(super) channel: Option<ferroce::CompletionChannel>,
    /// How many times this side slept on the channel (reported with `--counters`).
    pub(super) event_waits: std::cell::Cell<u64>,
}

impl Session {
    pub(super) fn recv_off(&self, q: usize) -> usize {
        q * self.slot
    }
    pub(super) fn send_off(&self, q: usize) -> usize {
        q * self.slot + self.area
    }
    pub(super) fn counter_off(&self) -> usize {
        self.qps.len() * self.slot
    }
    pub(super) fn remote_addr(&self, off: usize) -> u64 {
        self.remote.addr + off as u64
    }
    pub(super) fn sync(&mut self, t: Duration) -> Res<()> {
        self.conn.sync(t).map_err(|e| e.to_string())
    }
}

pub(super) fn initial_psn(qpn: u32) -> Psn {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let x = (t ^ u64::from(qpn).wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_mul(0xbf58_476d_1ce4_e5b9);
    Psn::new((x >> 40) as u32)
}

pub(super) fn setup(
    args: &PerfArgs,
    listener: Option<&Listener>,
    server_addr: Option<SocketAddr>,
) -> Res<Session> {
    let (device, gid_index) = pick_device(args, server_addr.map(|a| a.ip()))?;
    let opts = ContextOptions {
        gid_index,
        port: args.roce_port,
        hand_back_at_completion: args.wait_like_perftest,
        ..ContextOptions::default()
    };
    let ctx = device.open(&opts).map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let nq = usize::from(args.qps);
    let depth = args.tx_depth.max(512) as usize;
    let channel = if args.events {
        Some(ctx.create_comp_channel().map_err(|e| e.to_string())?)
    } else {
        None
    };
    let cq = ctx
        .create_cq(depth * nq * 2 + 1024, channel.as_ref())
        .map_err(|e| e.to_string())?;
    let caps = QpCaps {
        max_send_wr: depth as u32 * 2,
        max_recv_wr: depth as u32 * 2,
        ..QpCaps::default()
    };
    let qps = (0..nq)
        .map(|_| pd.create_qp(&QpInitAttr::new(&cq, caps)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let max_size = args.sizes().into_iter().max().unwrap_or(8).max(8) as usize;
    let area = max_size.div_ceil(128) * 128;
    let slot = 2 * area;
    let buf = pd
        .alloc_mr(slot * nq + 64, Access::ALL)
        .map_err(e("allocating buffers"))?;
    let region = RemoteRegion {
        addr: buf.addr(),
        rkey: buf.rkey(),
        len: buf.len() as u64,
    };
    let mut local: Vec<EndpointInfo> = qps
        .iter()
        .map(|q| q.endpoint_info(initial_psn(q.qpn()), Some(region)))
        .collect();
    if let Some(m) = args.mtu {
        let m = ferroce::PathMtu::from_bytes(m).map_err(|e| e.to_string())?;
        for l in &mut local {
            l.mtu = l.mtu.min(m);
        }
    }
    let conn = match (listener, server_addr) {
        (Some(l), _) => l.accept_many(&local, Duration::from_secs(600)),
        (None, Some(addr)) => cm::connect_many(addr, &local, args.timeout()),
        (None, None) => return Err("internal: setup needs a listener or a server address".into()),
    }
    .map_err(|e| e.to_string())?;
    let copts = ConnectOptions {
        min_rnr_timer: 1,
        timeout: args.qp_timeout,
        ..ConnectOptions::default()
    };
    for ((q, l), p) in qps.iter().zip(&local).zip(&conn.peers) {
        q.connect(l, p, &copts)
            .map_err(|e| format!("connecting QP 0x{:x}: {e}", q.qpn()))?;
    }
    let remote = conn
        .peer
        .region
        .ok_or("the peer offered no memory region")?;
    if remote.len < (slot * nq + 8) as u64 {
        return Err("the peer's buffer is smaller than this side's: run both sides with the same --size/--all/--qps".into());
    }
    let mtu = conn.mtu(&local[0]);
    let mut s = Session {
        ctx,
        _pd: pd,
        cq,
        qps,
        buf,
        slot,
        area,
        remote,
        conn,
        mtu,
        local,
        wait_like_perftest: args.wait_like_perftest,
        channel,
        event_waits: std::cell::Cell::new(0),
    };
    s.sync(args.timeout())?;
    Ok(s)
}

pub(super) fn pattern(size: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u64)
                .wrapping_mul(131)
                .wrapping_add(size.wrapping_mul(7)) as u8
                ^ (i >> 10) as u8
        })
        .collect()
}

pub(super) fn check_wc(wc: &WorkCompletion) -> Res<()> {
    if wc.status == WcStatus::Success {
        Ok(())
    } else {
        Err(format!(
            "work request {:#x} on QP 0x{:x} failed: {}",
            wc.wr_id, wc.qp_num, wc.status
        ))
    }
}

pub(super) fn sge(s: &Session, off: usize, len: u64) -> Res<Vec<ferroce::Sge>> {
    if len == 0 {
        Ok(vec![])
    } else {
        Ok(vec![s
            .buf
            .sge(off, len as usize)
            .map_err(|e| e.to_string())?])
    }
}

pub(super) fn unsignaled() -> SendFlags {
    SendFlags::default()
}
