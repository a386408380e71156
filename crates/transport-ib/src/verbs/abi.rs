//! The C types and constants of `<infiniband/verbs.h>` that braid passes to
//! or reads from libibverbs, written out by hand so that no rdma-core
//! header, library, cmake or clang is needed to build.
//!
//! libibverbs keeps these layouts stable (its ABI is versioned symbol by
//! symbol and has not changed them since rdma-core's first release; new
//! fields go into `_ex` structures braid does not use). Structures braid
//! only reads through pointers the library returns (the context, CQ, QP,
//! memory region, completion channel) are declared as their leading fields
//! only; the ones braid allocates and passes in are complete. The test
//! `layouts_match_rdma_core` (feature `abi-check`, built against rdma-core's
//! own headers by `ibverbs-sys`) checks every size and offset here.
//!
//! Names are verbs.h's, so a reader can hold one beside the other.

#![allow(non_camel_case_types)]

use std::os::raw::{c_int, c_uint, c_void};

/// `struct ibv_device` (opaque).
#[repr(C)]
pub(crate) struct ibv_device {
    _opaque: [u8; 0],
}

/// `struct ibv_pd` (opaque).
#[repr(C)]
pub(crate) struct ibv_pd {
    _opaque: [u8; 0],
}

/// A slot of `ibv_context_ops` braid never calls.
type Unused = Option<unsafe extern "C" fn()>;

/// `struct ibv_context_ops`: the provider's entry points that verbs.h's
/// inline functions (`ibv_poll_cq`, `ibv_req_notify_cq`, `ibv_post_send`,
/// `ibv_post_recv`) call through.
#[repr(C)]
pub(crate) struct ibv_context_ops {
    _compat_query_device: Unused,
    _compat_query_port: Unused,
    _compat_alloc_pd: Unused,
    _compat_dealloc_pd: Unused,
    _compat_reg_mr: Unused,
    _compat_rereg_mr: Unused,
    _compat_dereg_mr: Unused,
    alloc_mw: Unused,
    bind_mw: Unused,
    dealloc_mw: Unused,
    _compat_create_cq: Unused,
    pub(crate) poll_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int>,
    pub(crate) req_notify_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int>,
    _compat_cq_event: Unused,
    _compat_resize_cq: Unused,
    _compat_destroy_cq: Unused,
    _compat_create_srq: Unused,
    _compat_modify_srq: Unused,
    _compat_query_srq: Unused,
    _compat_destroy_srq: Unused,
    post_srq_recv: Unused,
    _compat_create_qp: Unused,
    _compat_query_qp: Unused,
    _compat_modify_qp: Unused,
    _compat_destroy_qp: Unused,
    pub(crate) post_send:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int>,
    pub(crate) post_recv:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int>,
    _compat_create_ah: Unused,
    _compat_destroy_ah: Unused,
    _compat_attach_mcast: Unused,
    _compat_detach_mcast: Unused,
    _compat_async_event: Unused,
}

/// `struct ibv_context`, its leading fields (read only).
#[repr(C)]
pub(crate) struct ibv_context {
    pub(crate) device: *mut ibv_device,
    pub(crate) ops: ibv_context_ops,
    pub(crate) cmd_fd: c_int,
    pub(crate) async_fd: c_int,
    pub(crate) num_comp_vectors: c_int,
}

/// `struct ibv_comp_channel` (read only).
#[repr(C)]
pub(crate) struct ibv_comp_channel {
    pub(crate) context: *mut ibv_context,
    pub(crate) fd: c_int,
    pub(crate) refcnt: c_int,
}

/// `struct ibv_cq`, its leading fields (read only).
#[repr(C)]
pub(crate) struct ibv_cq {
    pub(crate) context: *mut ibv_context,
    pub(crate) channel: *mut ibv_comp_channel,
    pub(crate) cq_context: *mut c_void,
    pub(crate) handle: u32,
    pub(crate) cqe: c_int,
}

/// `struct ibv_qp`, its leading fields (read only).
#[repr(C)]
pub(crate) struct ibv_qp {
    pub(crate) context: *mut ibv_context,
    pub(crate) qp_context: *mut c_void,
    pub(crate) pd: *mut ibv_pd,
    pub(crate) send_cq: *mut ibv_cq,
    pub(crate) recv_cq: *mut ibv_cq,
    pub(crate) srq: *mut c_void,
    pub(crate) handle: u32,
    pub(crate) qp_num: u32,
    pub(crate) state: c_uint,
    pub(crate) qp_type: c_uint,
}

/// `struct ibv_mr` (read only).
#[repr(C)]
pub(crate) struct ibv_mr {
    pub(crate) context: *mut ibv_context,
    pub(crate) pd: *mut ibv_pd,
    pub(crate) addr: *mut c_void,
    pub(crate) length: usize,
    pub(crate) handle: u32,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
}

/// `struct ibv_device_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_device_attr {
    pub(crate) fw_ver: [u8; 64],
    pub(crate) node_guid: u64,
    pub(crate) sys_image_guid: u64,
    pub(crate) max_mr_size: u64,
    pub(crate) page_size_cap: u64,
    pub(crate) vendor_id: u32,
    pub(crate) vendor_part_id: u32,
    pub(crate) hw_ver: u32,
    pub(crate) max_qp: c_int,
    pub(crate) max_qp_wr: c_int,
    pub(crate) device_cap_flags: c_uint,
    pub(crate) max_sge: c_int,
    pub(crate) max_sge_rd: c_int,
    pub(crate) max_cq: c_int,
    pub(crate) max_cqe: c_int,
    pub(crate) max_mr: c_int,
    pub(crate) max_pd: c_int,
    pub(crate) max_qp_rd_atom: c_int,
    pub(crate) max_ee_rd_atom: c_int,
    pub(crate) max_res_rd_atom: c_int,
    pub(crate) max_qp_init_rd_atom: c_int,
    pub(crate) max_ee_init_rd_atom: c_int,
    pub(crate) atomic_cap: c_uint,
    pub(crate) max_ee: c_int,
    pub(crate) max_rdd: c_int,
    pub(crate) max_mw: c_int,
    pub(crate) max_raw_ipv6_qp: c_int,
    pub(crate) max_raw_ethy_qp: c_int,
    pub(crate) max_mcast_grp: c_int,
    pub(crate) max_mcast_qp_attach: c_int,
    pub(crate) max_total_mcast_qp_attach: c_int,
    pub(crate) max_ah: c_int,
    pub(crate) max_fmr: c_int,
    pub(crate) max_map_per_fmr: c_int,
    pub(crate) max_srq: c_int,
    pub(crate) max_srq_wr: c_int,
    pub(crate) max_srq_sge: c_int,
    pub(crate) max_pkeys: u16,
    pub(crate) local_ca_ack_delay: u8,
    pub(crate) phys_port_cnt: u8,
}

impl Default for ibv_device_attr {
    fn default() -> Self {
        ibv_device_attr {
            fw_ver: [0; 64],
            node_guid: 0,
            sys_image_guid: 0,
            max_mr_size: 0,
            page_size_cap: 0,
            vendor_id: 0,
            vendor_part_id: 0,
            hw_ver: 0,
            max_qp: 0,
            max_qp_wr: 0,
            device_cap_flags: 0,
            max_sge: 0,
            max_sge_rd: 0,
            max_cq: 0,
            max_cqe: 0,
            max_mr: 0,
            max_pd: 0,
            max_qp_rd_atom: 0,
            max_ee_rd_atom: 0,
            max_res_rd_atom: 0,
            max_qp_init_rd_atom: 0,
            max_ee_init_rd_atom: 0,
            atomic_cap: 0,
            max_ee: 0,
            max_rdd: 0,
            max_mw: 0,
            max_raw_ipv6_qp: 0,
            max_raw_ethy_qp: 0,
            max_mcast_grp: 0,
            max_mcast_qp_attach: 0,
            max_total_mcast_qp_attach: 0,
            max_ah: 0,
            max_fmr: 0,
            max_map_per_fmr: 0,
            max_srq: 0,
            max_srq_wr: 0,
            max_srq_sge: 0,
            max_pkeys: 0,
            local_ca_ack_delay: 0,
            phys_port_cnt: 0,
        }
    }
}

/// `struct ibv_port_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_port_attr {
    pub(crate) state: c_uint,
    pub(crate) max_mtu: c_uint,
    pub(crate) active_mtu: c_uint,
    pub(crate) gid_tbl_len: c_int,
    pub(crate) port_cap_flags: u32,
    pub(crate) max_msg_sz: u32,
    pub(crate) bad_pkey_cntr: u32,
    pub(crate) qkey_viol_cntr: u32,
    pub(crate) pkey_tbl_len: u16,
    pub(crate) lid: u16,
    pub(crate) sm_lid: u16,
    pub(crate) lmc: u8,
    pub(crate) max_vl_num: u8,
    pub(crate) sm_sl: u8,
    pub(crate) subnet_timeout: u8,
    pub(crate) init_type_reply: u8,
    pub(crate) active_width: u8,
    pub(crate) active_speed: u8,
    pub(crate) phys_state: u8,
    pub(crate) link_layer: u8,
    pub(crate) flags: u8,
    pub(crate) port_cap_flags2: u16,
    /// rdma-core 50 and later; older libraries leave it alone.
    pub(crate) active_speed_ex: u32,
}

/// An [`ibv_port_attr`] with room behind it: `ibv_query_port` is given
/// this, so a library whose structure grows again never writes past
/// braid's memory.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct PortAttrRoom {
    pub(crate) attr: ibv_port_attr,
    pub(crate) _room: [u64; 8],
}

/// `union ibv_gid`, as its raw bytes (8-byte aligned, as its other arm
/// holds two `__be64`: the structures that embed it depend on that).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_gid {
    pub(crate) raw: [u8; 16],
}

/// `struct ibv_gid_entry`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_gid_entry {
    pub(crate) gid: ibv_gid,
    pub(crate) gid_index: u32,
    pub(crate) port_num: u32,
    pub(crate) gid_type: u32,
    pub(crate) ndev_ifindex: u32,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_qp_cap {
    pub(crate) max_send_wr: u32,
    pub(crate) max_recv_wr: u32,
    pub(crate) max_send_sge: u32,
    pub(crate) max_recv_sge: u32,
    pub(crate) max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub(crate) struct ibv_qp_init_attr {
    pub(crate) qp_context: *mut c_void,
    pub(crate) send_cq: *mut ibv_cq,
    pub(crate) recv_cq: *mut ibv_cq,
    pub(crate) srq: *mut c_void,
    pub(crate) cap: ibv_qp_cap,
    pub(crate) qp_type: c_uint,
    pub(crate) sq_sig_all: c_int,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_global_route {
    pub(crate) dgid: ibv_gid,
    pub(crate) flow_label: u32,
    pub(crate) sgid_index: u8,
    pub(crate) hop_limit: u8,
    pub(crate) traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_ah_attr {
    pub(crate) grh: ibv_global_route,
    pub(crate) dlid: u16,
    pub(crate) sl: u8,
    pub(crate) src_path_bits: u8,
    pub(crate) static_rate: u8,
    pub(crate) is_global: u8,
    pub(crate) port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_qp_attr {
    pub(crate) qp_state: c_uint,
    pub(crate) cur_qp_state: c_uint,
    pub(crate) path_mtu: c_uint,
    pub(crate) path_mig_state: c_uint,
    pub(crate) qkey: u32,
    pub(crate) rq_psn: u32,
    pub(crate) sq_psn: u32,
    pub(crate) dest_qp_num: u32,
    pub(crate) qp_access_flags: c_uint,
    pub(crate) cap: ibv_qp_cap,
    pub(crate) ah_attr: ibv_ah_attr,
    pub(crate) alt_ah_attr: ibv_ah_attr,
    pub(crate) pkey_index: u16,
    pub(crate) alt_pkey_index: u16,
    pub(crate) en_sqd_async_notify: u8,
    pub(crate) sq_draining: u8,
    pub(crate) max_rd_atomic: u8,
    pub(crate) max_dest_rd_atomic: u8,
    pub(crate) min_rnr_timer: u8,
    pub(crate) port_num: u8,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) alt_port_num: u8,
    pub(crate) alt_timeout: u8,
    pub(crate) rate_limit: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_sge {
    pub(crate) addr: u64,
    pub(crate) length: u32,
    pub(crate) lkey: u32,
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub(crate) struct ibv_recv_wr {
    pub(crate) wr_id: u64,
    pub(crate) next: *mut ibv_recv_wr,
    pub(crate) sg_list: *mut ibv_sge,
    pub(crate) num_sge: c_int,
}

/// The `rdma` arm of `ibv_send_wr`'s `wr` union, padded to the union's
/// size (its largest arm, `atomic`, is 32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_send_wr_rdma {
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) _rest: [u32; 5],
}

/// `struct ibv_send_wr`, with its unions as the arm braid uses (RDMA
/// WRITE [WITH IMMEDIATE]) and the others as padding of their size.
#[repr(C)]
pub(crate) struct ibv_send_wr {
    pub(crate) wr_id: u64,
    pub(crate) next: *mut ibv_send_wr,
    pub(crate) sg_list: *mut ibv_sge,
    pub(crate) num_sge: c_int,
    pub(crate) opcode: c_uint,
    pub(crate) send_flags: c_uint,
    /// `imm_data` (network byte order) / `invalidate_rkey`.
    pub(crate) imm_data: u32,
    /// `wr.rdma`.
    pub(crate) rdma: ibv_send_wr_rdma,
    /// `qp_type.xrc.remote_srqn`.
    pub(crate) remote_srqn: u32,
    /// The `bind_mw` / `tso` union (48 bytes, pointer-aligned).
    pub(crate) _bind_mw: [u64; 6],
}

impl Default for ibv_send_wr {
    fn default() -> Self {
        ibv_send_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            imm_data: 0,
            rdma: ibv_send_wr_rdma::default(),
            remote_srqn: 0,
            _bind_mw: [0; 6],
        }
    }
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct ibv_wc {
    pub(crate) wr_id: u64,
    pub(crate) status: c_uint,
    pub(crate) opcode: c_uint,
    pub(crate) vendor_err: u32,
    pub(crate) byte_len: u32,
    /// `imm_data` (network byte order) / `invalidated_rkey`.
    pub(crate) imm_data: u32,
    pub(crate) qp_num: u32,
    pub(crate) src_qp: u32,
    pub(crate) wc_flags: c_uint,
    pub(crate) pkey_index: u16,
    pub(crate) slid: u16,
    pub(crate) sl: u8,
    pub(crate) dlid_path_bits: u8,
}

// enum ibv_port_state
pub(crate) const IBV_PORT_ACTIVE: c_uint = 4;
// enum ibv_link_layer
pub(crate) const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub(crate) const IBV_LINK_LAYER_ETHERNET: u8 = 2;
// enum ibv_gid_type
pub(crate) const IBV_GID_TYPE_ROCE_V2: u32 = 2;
// enum ibv_wc_status
pub(crate) const IBV_WC_SUCCESS: c_uint = 0;
pub(crate) const IBV_WC_WR_FLUSH_ERR: c_uint = 5;
pub(crate) const IBV_WC_RETRY_EXC_ERR: c_uint = 12;
// enum ibv_wc_flags
pub(crate) const IBV_WC_WITH_IMM: c_uint = 1 << 1;
// enum ibv_access_flags
pub(crate) const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub(crate) const IBV_ACCESS_REMOTE_WRITE: c_int = 1 << 1;
// enum ibv_qp_type
pub(crate) const IBV_QPT_RC: c_uint = 2;
// enum ibv_qp_state
pub(crate) const IBV_QPS_INIT: c_uint = 1;
pub(crate) const IBV_QPS_RTR: c_uint = 2;
pub(crate) const IBV_QPS_RTS: c_uint = 3;
pub(crate) const IBV_QPS_ERR: c_uint = 6;
// enum ibv_wr_opcode
pub(crate) const IBV_WR_RDMA_WRITE: c_uint = 0;
pub(crate) const IBV_WR_RDMA_WRITE_WITH_IMM: c_uint = 1;
// enum ibv_send_flags
pub(crate) const IBV_SEND_SIGNALED: c_uint = 1 << 1;
// enum ibv_qp_attr_mask
pub(crate) const IBV_QP_STATE: c_int = 1 << 0;
pub(crate) const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub(crate) const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub(crate) const IBV_QP_PORT: c_int = 1 << 5;
pub(crate) const IBV_QP_AV: c_int = 1 << 7;
pub(crate) const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub(crate) const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub(crate) const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub(crate) const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub(crate) const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub(crate) const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub(crate) const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub(crate) const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub(crate) const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub(crate) const IBV_QP_DEST_QPN: c_int = 1 << 20;

/// The layouts above against rdma-core's own headers (bindgen's output in
/// `ibverbs-sys`, which vendors rdma-core): every size, alignment and
/// offset braid relies on. `cargo test -p braid-transport-ib --features
/// abi-check` (CI runs it).
#[cfg(all(test, feature = "abi-check"))]
mod tests {
    use std::mem::{align_of, offset_of, size_of};

    use ibverbs_sys as c;

    /// Same size and alignment (complete structures), same offsets
    /// (`ours = theirs` where bindgen names a field otherwise).
    macro_rules! same {
        (whole $ours:ident = $theirs:ty; $($f:ident $(= $g:ident)?),* $(,)?) => {{
            assert_eq!(size_of::<super::$ours>(), size_of::<$theirs>(), "size of {}", stringify!($ours));
            assert_eq!(align_of::<super::$ours>(), align_of::<$theirs>(), "alignment of {}", stringify!($ours));
            same!(prefix $ours = $theirs; $($f $(= $g)?),*);
        }};
        (prefix $ours:ident = $theirs:ty; $($f:ident $(= $g:ident)?),* $(,)?) => {{
            $( same!(@field $ours, $theirs, $f $(= $g)?); )*
        }};
        (@field $ours:ident, $theirs:ty, $f:ident = $g:ident) => {
            assert_eq!(
                offset_of!(super::$ours, $f),
                offset_of!($theirs, $g),
                "offset of {}::{}", stringify!($ours), stringify!($f)
            )
        };
        (@field $ours:ident, $theirs:ty, $f:ident) => {
            same!(@field $ours, $theirs, $f = $f)
        };
    }

    #[test]
    fn layouts_match_rdma_core() {
        same!(whole ibv_context_ops = c::ibv_context_ops;
            poll_cq, req_notify_cq, post_send, post_recv, _compat_async_event);
        same!(prefix ibv_context = c::ibv_context; device, ops, cmd_fd, async_fd, num_comp_vectors);
        same!(whole ibv_comp_channel = c::ibv_comp_channel; context, fd, refcnt);
        same!(prefix ibv_cq = c::ibv_cq; context, channel, cq_context, handle, cqe);
        same!(prefix ibv_qp = c::ibv_qp;
            context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num, state, qp_type);
        same!(whole ibv_mr = c::ibv_mr; context, pd, addr, length, handle, lkey, rkey);
        same!(whole ibv_device_attr = c::ibv_device_attr;
            fw_ver, node_guid, max_mr_size, vendor_id, max_qp, atomic_cap, max_srq_sge,
            max_pkeys, local_ca_ack_delay, phys_port_cnt);
        same!(whole ibv_port_attr = c::ibv_port_attr;
            state, max_mtu, active_mtu, gid_tbl_len, port_cap_flags, max_msg_sz,
            pkey_tbl_len, lid, sm_lid, lmc, active_width, active_speed, phys_state,
            link_layer, flags, port_cap_flags2, active_speed_ex);
        same!(whole ibv_gid = c::ibv_gid; raw);
        same!(whole ibv_gid_entry = c::ibv_gid_entry;
            gid, gid_index, port_num, gid_type, ndev_ifindex);
        same!(whole ibv_qp_cap = c::ibv_qp_cap;
            max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data);
        same!(whole ibv_qp_init_attr = c::ibv_qp_init_attr;
            qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all);
        same!(whole ibv_global_route = c::ibv_global_route;
            dgid, flow_label, sgid_index, hop_limit, traffic_class);
        same!(whole ibv_ah_attr = c::ibv_ah_attr;
            grh, dlid, sl, src_path_bits, static_rate, is_global, port_num);
        same!(whole ibv_qp_attr = c::ibv_qp_attr;
            qp_state, cur_qp_state, path_mtu, path_mig_state, qkey, rq_psn, sq_psn,
            dest_qp_num, qp_access_flags, cap, ah_attr, alt_ah_attr, pkey_index,
            alt_pkey_index, en_sqd_async_notify, sq_draining, max_rd_atomic,
            max_dest_rd_atomic, min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry,
            alt_port_num, alt_timeout, rate_limit);
        same!(whole ibv_sge = c::ibv_sge; addr, length, lkey);
        same!(whole ibv_recv_wr = c::ibv_recv_wr; wr_id, next, sg_list, num_sge);
        same!(whole ibv_send_wr = c::ibv_send_wr;
            wr_id, next, sg_list, num_sge, opcode, send_flags,
            imm_data = __bindgen_anon_1, rdma = wr, remote_srqn = qp_type,
            _bind_mw = __bindgen_anon_2);
        assert_eq!(
            size_of::<super::ibv_send_wr_rdma>(),
            size_of::<c::ibv_send_wr__bindgen_ty_2>()
        );
        same!(prefix ibv_send_wr_rdma = c::ibv_send_wr__bindgen_ty_2__bindgen_ty_1;
            remote_addr, rkey);
    }

    /// ibverbs-sys keeps `ibv_wc`'s fields private: a completion written
    /// through braid's layout must read back the same through its
    /// accessors.
    #[test]
    fn work_completion_reads_back_through_rdma_cores_layout() {
        assert_eq!(size_of::<super::ibv_wc>(), size_of::<c::ibv_wc>());
        assert_eq!(align_of::<super::ibv_wc>(), align_of::<c::ibv_wc>());
        let ours = super::ibv_wc {
            wr_id: 0x0123_4567_89ab_cdef,
            status: super::IBV_WC_RETRY_EXC_ERR,
            vendor_err: 0x51,
            byte_len: 4093,
            imm_data: 0xdead_beef,
            wc_flags: super::IBV_WC_WITH_IMM,
            ..Default::default()
        };
        // SAFETY: same size and alignment (checked above), plain data.
        let theirs: c::ibv_wc = unsafe { std::mem::transmute(ours) };
        assert_eq!(theirs.wr_id(), ours.wr_id);
        assert_eq!(theirs.len(), 4093);
        assert_eq!(
            theirs.error(),
            Some((c::ibv_wc_status::IBV_WC_RETRY_EXC_ERR, 0x51))
        );
        let ok = super::ibv_wc {
            status: super::IBV_WC_SUCCESS,
            ..ours
        };
        // SAFETY: as above.
        let theirs: c::ibv_wc = unsafe { std::mem::transmute(ok) };
        assert_eq!(theirs.imm_data(), Some(0xdead_beef));
    }

    #[test]
    fn constants_match_rdma_core() {
        use c::ibv_qp_attr_mask as m;
        assert_eq!(super::IBV_PORT_ACTIVE, c::ibv_port_state::IBV_PORT_ACTIVE);
        assert_eq!(
            u32::from(super::IBV_LINK_LAYER_INFINIBAND),
            c::IBV_LINK_LAYER_INFINIBAND
        );
        assert_eq!(
            u32::from(super::IBV_LINK_LAYER_ETHERNET),
            c::IBV_LINK_LAYER_ETHERNET
        );
        assert_eq!(super::IBV_GID_TYPE_ROCE_V2, c::IBV_GID_TYPE_ROCE_V2);
        assert_eq!(super::IBV_WC_SUCCESS, c::ibv_wc_status::IBV_WC_SUCCESS);
        assert_eq!(
            super::IBV_WC_WR_FLUSH_ERR,
            c::ibv_wc_status::IBV_WC_WR_FLUSH_ERR
        );
        assert_eq!(
            super::IBV_WC_RETRY_EXC_ERR,
            c::ibv_wc_status::IBV_WC_RETRY_EXC_ERR
        );
        assert_eq!(super::IBV_WC_WITH_IMM, c::ibv_wc_flags::IBV_WC_WITH_IMM.0);
        assert_eq!(
            super::IBV_ACCESS_LOCAL_WRITE as u32,
            c::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
        );
        assert_eq!(
            super::IBV_ACCESS_REMOTE_WRITE as u32,
            c::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
        );
        assert_eq!(super::IBV_QPT_RC, c::ibv_qp_type::IBV_QPT_RC);
        assert_eq!(super::IBV_QPS_INIT, c::ibv_qp_state::IBV_QPS_INIT);
        assert_eq!(super::IBV_QPS_RTR, c::ibv_qp_state::IBV_QPS_RTR);
        assert_eq!(super::IBV_QPS_RTS, c::ibv_qp_state::IBV_QPS_RTS);
        assert_eq!(super::IBV_QPS_ERR, c::ibv_qp_state::IBV_QPS_ERR);
        assert_eq!(
            super::IBV_WR_RDMA_WRITE,
            c::ibv_wr_opcode::IBV_WR_RDMA_WRITE
        );
        assert_eq!(
            super::IBV_WR_RDMA_WRITE_WITH_IMM,
            c::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
        );
        assert_eq!(
            super::IBV_SEND_SIGNALED,
            c::ibv_send_flags::IBV_SEND_SIGNALED.0
        );
        for (ours, theirs) in [
            (super::IBV_QP_STATE, m::IBV_QP_STATE),
            (super::IBV_QP_ACCESS_FLAGS, m::IBV_QP_ACCESS_FLAGS),
            (super::IBV_QP_PKEY_INDEX, m::IBV_QP_PKEY_INDEX),
            (super::IBV_QP_PORT, m::IBV_QP_PORT),
            (super::IBV_QP_AV, m::IBV_QP_AV),
            (super::IBV_QP_PATH_MTU, m::IBV_QP_PATH_MTU),
            (super::IBV_QP_TIMEOUT, m::IBV_QP_TIMEOUT),
            (super::IBV_QP_RETRY_CNT, m::IBV_QP_RETRY_CNT),
            (super::IBV_QP_RNR_RETRY, m::IBV_QP_RNR_RETRY),
            (super::IBV_QP_RQ_PSN, m::IBV_QP_RQ_PSN),
            (super::IBV_QP_MAX_QP_RD_ATOMIC, m::IBV_QP_MAX_QP_RD_ATOMIC),
            (super::IBV_QP_MIN_RNR_TIMER, m::IBV_QP_MIN_RNR_TIMER),
            (super::IBV_QP_SQ_PSN, m::IBV_QP_SQ_PSN),
            (
                super::IBV_QP_MAX_DEST_RD_ATOMIC,
                m::IBV_QP_MAX_DEST_RD_ATOMIC,
            ),
            (super::IBV_QP_DEST_QPN, m::IBV_QP_DEST_QPN),
        ] {
            assert_eq!(ours as u32, theirs.0);
        }
    }
}
