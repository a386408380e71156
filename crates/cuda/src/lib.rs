//! braid-cuda: braid's CUDA driver layer. It knows devices, memory, streams
//! and kernels, and nothing about transports: the GPU links live in
//! `braid-transport-nvlink` (the CUDA IPC device-slot ring) and
//! `braid-transport-pcie` (that ring, or rings staged through shared host
//! memory), which build on the safe types here.
//!
//! - [`driver`]: raw FFI (cudarc, loaded at run time) → `Result` wrappers
//!   → safe types: the probe, [`Device`], [`DeviceBuffer`], [`HostFlag`],
//!   [`CudaStream`], [`Event`], CUDA IPC ([`DeviceBuffer::ipc_handle`],
//!   [`IpcMapping`]) and the NVRTC-compiled [`Kernels`].
//! - [`nvml`]: NVML (`libnvidia-ml.so.1`, loaded at run time): the answers
//!   braid-core's NVML topology logic asks for (GPUs, NVLinks, NVSwitches).
//!   With `driver`, the only modules with `unsafe` code (the crate denies it
//!   elsewhere).
//! - [`kernels`]: the kernels' CUDA C source, generated from a table (pure).
//! - [`ipc`]: CUDA IPC memory handles as bytes (pure).
//! - [`schedule`]: a collective as one in-order list of stream commands
//!   with GPU-side synchronisation (stream memory operations on counters
//!   next to each slot ring), and an in-memory simulator for it (pure).
//!
//! The driver and NVRTC are loaded at run time (cudarc `dynamic-loading`,
//! bindings pinned to the CUDA 12.4 API): this crate builds and its tests
//! pass on machines without CUDA, where every entry point returns
//! [`CudaError::Unavailable`] ("CUDA unavailable: ...") instead of panicking.
//! `BRAID_CUDA_DISABLE=1` makes a machine with CUDA behave the same way.

#![deny(unsafe_code)]

#[allow(unsafe_code)]
pub mod driver;
pub mod error;
pub mod ipc;
pub mod kernels;
#[allow(unsafe_code)]
pub mod nvml;
pub mod schedule;

pub use driver::{
    d2d_copy_bandwidth, probe, CudaStream, Device, DeviceBuffer, Event, HostFlag, IpcMapping,
    Kernels, ProbeInfo,
};
pub use error::{CudaError, Result};

/// GPUs for topology detection: from NVML where `libnvidia-ml.so.1` loads
/// (bus id, index, compute capability, NVLinks and what they lead to, as
/// NCCL reads them), else from the CUDA driver (no context is created: bus
/// id, ordinal and compute capability; GPUs are then joined by their PCIe
/// paths only, and a `BRAID_TOPO_FILE` can carry the NVLinks). Without
/// either, or with `BRAID_CUDA_DISABLE`, it reports no GPUs (not an error),
/// as the topology contract asks; its name says why.
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaGpus;

fn cuda_disabled() -> bool {
    matches!(probe(), Err(CudaError::Unavailable(e)) if e.contains("BRAID_CUDA_DISABLE"))
}

impl braid_core::topo::GpuProvider for CudaGpus {
    fn name(&self) -> String {
        if cuda_disabled() {
            return "CUDA driver (CUDA unavailable: disabled by BRAID_CUDA_DISABLE)".into();
        }
        let cuda = match probe() {
            Ok(i) => format!(
                "CUDA driver {}.{}",
                i.driver_version / 1000,
                i.driver_version % 1000 / 10
            ),
            Err(e) => format!("CUDA driver ({e})"),
        };
        match nvml::Nvml::open() {
            Ok(n) => {
                use braid_core::topo::nvml::NvmlQueries;
                n.describe()
            }
            Err(e) => format!("{e}; {cuda}: NVLinks unknown"),
        }
    }

    fn gpus(
        &self,
    ) -> std::result::Result<Vec<braid_core::topo::sysfs::DetectedGpu>, braid_core::topo::TopoError>
    {
        if cuda_disabled() {
            return Ok(Vec::new());
        }
        if let Ok(n) = nvml::Nvml::open() {
            let (gpus, notes) = braid_core::topo::nvml::NvmlGpus { q: n }.read();
            for note in notes {
                tracing::info!("braid: topology: {note}");
            }
            if !gpus.is_empty() {
                return Ok(gpus);
            }
        }
        let list = match driver::list_gpus() {
            Ok(l) => l,
            Err(CudaError::Unavailable(_)) => return Ok(Vec::new()),
            Err(e) => return Err(braid_core::topo::TopoError::Invalid(e.to_string())),
        };
        Ok(list
            .into_iter()
            .map(
                |(ordinal, busid, sm, _name)| braid_core::topo::sysfs::DetectedGpu {
                    busid,
                    gpu: braid_core::topo::Gpu {
                        dev: Some(ordinal),
                        sm: Some(sm),
                        ..Default::default()
                    },
                },
            )
            .collect())
    }
}

/// The device this rank should use: `BRAID_CUDA_DEVICE` if set, else the
/// local rank modulo the number of devices.
pub fn device_for_rank(local_rank: u32, devices: u32) -> Result<u32> {
    device_from(std::env::var("BRAID_CUDA_DEVICE").ok(), local_rank, devices)
}

fn device_from(var: Option<String>, local_rank: u32, devices: u32) -> Result<u32> {
    if devices == 0 {
        return Err(CudaError::Unavailable("no CUDA device".into()));
    }
    match var.filter(|v| !v.trim().is_empty()) {
        Some(v) => {
            let d: u32 = v.trim().parse().map_err(|_| {
                CudaError::InvalidArgument(format!("BRAID_CUDA_DEVICE={v} is not a device number"))
            })?;
            if d >= devices {
                return Err(CudaError::InvalidArgument(format!(
                    "BRAID_CUDA_DEVICE={d}, but this process sees {devices} device(s)"
                )));
            }
            Ok(d)
        }
        None => Ok(local_rank % devices),
    }
}

#[cfg(test)]
mod provider_tests {
    use super::*;
    use braid_core::topo::GpuProvider;

    /// Without CUDA (this machine, or BRAID_CUDA_DISABLE) the provider
    /// reports no GPUs and says why in its name, never an error.
    #[test]
    fn no_cuda_means_no_gpus() {
        if probe().is_ok() {
            println!("skipping: CUDA is present here");
            return;
        }
        assert!(CudaGpus.gpus().unwrap().is_empty());
        assert!(
            CudaGpus.name().contains("CUDA driver ("),
            "{}",
            CudaGpus.name()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_choice() {
        assert_eq!(device_from(None, 5, 4).unwrap(), 1);
        assert_eq!(device_from(Some("2".into()), 5, 4).unwrap(), 2);
        assert_eq!(device_from(Some(" ".into()), 3, 1).unwrap(), 0);
        assert!(device_from(Some("4".into()), 0, 4).is_err());
        assert!(device_from(Some("x".into()), 0, 4).is_err());
        assert!(matches!(
            device_from(None, 0, 0),
            Err(CudaError::Unavailable(_))
        ));
    }
}
