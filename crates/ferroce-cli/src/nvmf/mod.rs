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
