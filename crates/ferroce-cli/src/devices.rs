//! `ferroce devices`: like `ibv_devices` and `ibv_devinfo`.

use std::process::ExitCode;

/// Lists every device with its interface, MTUs and GID table.
pub fn run() -> Result<ExitCode, String> {
    let devices = ferroce::devices().map_err(|e| e.to_string())?;
    if devices.is_empty() {
        println!("no devices: no interface has an address");
        return Ok(ExitCode::SUCCESS);
    }
    for d in devices {
        let mtu = d.active_mtu();
        println!("hca_id: {}", d.name());
        println!("\ttransport:\t\tRoCE v2 over UDP (ferroce, userspace)");
        println!("\tnetdev:\t\t\t{}", d.ifname());
        println!("\tnetdev_mtu:\t\t{}", d.netdev_mtu());
        println!(
            "\tactive_mtu:\t\t{} ({})",
            mtu.bytes(),
            mtu.bytes().trailing_zeros() - 7
        );
        println!(
            "\tport:\t\t\t1 (PORT_ACTIVE), UDP {} by default",
            ferroce_wire::ROCE_V2_UDP_PORT
        );
        for g in d.gids() {
            println!("\tGID[{:>3}]:\t\t{}, RoCE v2 ({})", g.index, g.gid, g.ip);
        }
        println!();
    }
    Ok(ExitCode::SUCCESS)
}
