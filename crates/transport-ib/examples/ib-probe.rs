//! What the IB transport sees on this machine: every RDMA port, and the
//! one braid would use with the current `BRAID_IB_*` environment. Exits 0
//! when IB is usable, 1 otherwise (with the reason, "IB unavailable: ...").

fn main() {
    match braid_transport_ib::ports() {
        Ok(ports) => {
            for p in &ports {
                println!(
                    "{}:{} active={} link_layer={:?} lid={} mtu_code={} numa={:?} gids={}",
                    p.device,
                    p.port,
                    p.active,
                    p.link_layer,
                    p.lid,
                    p.mtu,
                    p.numa_node,
                    p.gids.len()
                );
            }
        }
        Err(e) => {
            println!("{e}");
            std::process::exit(1);
        }
    }
    match braid_transport_ib::IbConfig::from_env().and_then(braid_transport_ib::IbTransport::new) {
        Ok(t) => {
            let c = t.chosen();
            println!(
                "braid would use {}:{} gid index {} fabric {}",
                c.device, c.port, c.gid_index, c.fabric
            );
        }
        Err(e) => {
            println!("{e}");
            std::process::exit(1);
        }
    }
}
