//! `ferroce nvmf-target` and `ferroce nvmf-perf`: an NVMe over Fabrics target serving files or
//! memory, and a fio-like initiator, over ferroce's RDMA (`ferroce_nvmf`).

pub mod perf;
pub mod target;

use std::net::IpAddr;
use std::sync::Arc;

use ferroce::{Context, ContextOptions};

/// Opens the ferroce device that holds `ip`.
fn open_context(ip: IpAddr) -> Result<Arc<Context>, String> {
    let (device, gid_index) = crate::route::device_for(None, ip)?;
    let ctx = device
        .open(&ContextOptions {
            gid_index,
            // The first free slot: 4791 if no other ferroce process of this host has it, so a
            // target and its hosts may share a host.
            host_slot: true,
            ..ContextOptions::default()
        })
        .map_err(|e| format!("opening the device of {ip}: {e}"))?;
    Ok(Arc::new(ctx))
}

/// The RC transport's own counters, in one line: how much was sent again and why, to tell a
/// slow peer from a lossy path.
fn transport_summary(ctx: &Context) -> String {
    let c = ctx.counters();
    format!(
        "packets sent {} received {}, retransmitted {} (timeouts {}), sequence NAKs received \
         {} sent {}, RNR NAKs received {}, kept out of order {}",
        c.tx_packets,
        c.rx_packets,
        c.qps.retransmits,
        c.qps.rto_fired + c.qps.completer_retry_err,
        c.qps.rcvd_seq_err,
        c.qps.send_seq_nak,
        c.qps.rcvd_rnr_err,
        c.qps.ooo_held,
    )
}
